"""Train a WPO-SGM score model (arXiv 2402.06162) whose memory need not grow with the centres.

    python train_wpo_sgm_memory_efficient.py                                  # 8gaussians, CPU, under a minute
    python train_wpo_sgm_memory_efficient.py --data cifar10 --data-dir DIR --train_kernel_size 1000 --dry-run
    python train_wpo_sgm_memory_efficient.py --strategy chunked --chunk_size 16 --train_kernel_size 2000
    torchrun --standalone --nproc_per_node=2 train_wpo_sgm_memory_efficient.py --strategy model_parallel

The model is a mixture of K Gaussians centred on K training samples, p(x) = (1/K) sum_k N(x; mu_k, P_k^-1);
a small MLP (factornet) maps each centre to the Cholesky-like factor L_k of its precision,
P_k = L_k L_k^T + eps I. It is trained by implicit score matching, whose loss has a closed form for a
mixture. Memory is the lesson: everything that depends on a centre costs D x D floats, so K centres
cost K x D x D, 37.7 GB at K = 1000 on CIFAR-10. Four strategies make it fit, and each computes exactly
the same loss and gradients (docs/wpo_sgm_memory.md derives why):
  single_gpu             all K centres at once (any one device, CPU included)
  chunked                --chunk_size centres at a time, combined with an online log-sum-exp, each
                         chunk recomputed in backward: memory O(chunk x D^2) instead of O(K x D^2)
  model_parallel         the centres split across torchrun ranks; partial statistics combined by collectives
  gradient_accumulation  the data batch split into --accumulation_steps micro-batches
  auto                   picks one from a memory estimate and the device's free memory (--dry-run shows it)
Sampling draws exactly from the mixture, one Cholesky factorisation per centre. Read top to bottom:
arguments, the mixture and its loss, the strategies, the memory plan, data, sampling, then run():
checks, the memory plan, device setup, data, model, optimiser, training loop, save, samples, report.

Nothing saved is lost (lib/rundir.py, the contract every script here follows): a fresh run refuses
an --out-dir holding a saved run (--resume or --overwrite); --resume keeps the saved run's flags and
refuses ones that contradict it (the strategy may change: all compute the same loss); a damaged
saved file is one error line; non-finite weights are never saved; Ctrl-C saves and exits 130.
"""

import argparse
import math
import os
import signal
import sys
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch.utils.checkpoint import checkpoint as recompute_in_backward

from lib import checkpoint, distributed, exercise, guards, memory, metrics, png, rundir
from lib import device as devices
from lib.errors import UserError, report_and_exit
from lib.memory import format_table

TOY_DATA = ["8gaussians", "swissroll", "2spirals", "checkerboard", "circles", "moons", "pinwheel", "rings",
            "swissroll_6D_xy1"]
STRATEGIES = ["auto", "single_gpu", "chunked", "model_parallel", "gradient_accumulation"]
SCRIPT = "train_wpo_sgm_memory_efficient"


# --- arguments ----------------------------------------------------------------------------------
def build_parser():
    # The original script's snake_case names come first (its users' commands keep working); the
    # repository's kebab-case names are aliases in the same add_argument call.
    p = argparse.ArgumentParser(
        description="WPO-SGM score-model training with exact memory strategies (single_gpu, chunked, "
                    "model_parallel, gradient_accumulation, auto).",
        formatter_class=guards.HelpFormatter,
    )
    g = p.add_argument_group("data")
    g.add_argument("--data", default="8gaussians", choices=TOY_DATA + ["cifar10"],
                   help="a toy set generated from --seed, or CIFAR-10 (binary version) from --data-dir")
    g.add_argument("--data-dir", "--data_dir", dest="data_dir",
                   help="cifar-10-batches-bin: data_batch_N.bin and test_batch.bin")
    g.add_argument("--image-size", "--image_size", dest="image_size", type=int, default=32, choices=[32, 16, 8],
                   help="CIFAR-10 images average-pooled to this side (D = 3 x side^2): 8 makes CIFAR fit a CPU")
    g.add_argument("--train_samples_size", "--train-samples-size", dest="train_samples_size", type=guards.positive_int,
                   default=2000, help="training samples (toy: generated; CIFAR: the first N images read)")
    g.add_argument("--test_samples_size", "--test-samples-size", dest="test_samples_size", type=guards.nonneg_int,
                   default=500, help="held-out samples for the test loss (CIFAR: from test_batch.bin); 0: none")
    g = p.add_argument_group("model")
    g.add_argument("--train_kernel_size", "--train-kernel-size", dest="train_kernel_size", type=guards.positive_int,
                   default=200, help="K, the number of mixture centres: the first K training samples")
    g.add_argument("--depth", type=guards.positive_int, default=5, help="hidden layers of factornet")
    g.add_argument("--hiddenunits", "--hidden-units", dest="hiddenunits", type=guards.positive_int, default=64,
                   help="width of factornet's hidden layers")
    g.add_argument("--stability", type=guards.positive_float, default=0.01,
                   help="eps in P = L L^T + eps I: every precision eigenvalue is at least eps")
    g = p.add_argument_group("optimisation")
    g.add_argument("--niters", "--steps", dest="niters", type=guards.nonneg_int, default=600,
                   help="optimizer steps in total")
    g.add_argument("--batch_size", "--batch-size", dest="batch_size", type=guards.positive_int, default=128,
                   help="training samples per step")
    g.add_argument("--lr", type=guards.positive_float, default=3e-3, help="peak learning rate")
    g.add_argument("--weight_decay", "--weight-decay", dest="weight_decay", type=guards.nonneg_float, default=1e-4,
                   help="AdamW weight decay")
    g.add_argument("--scheduler_type", "--scheduler-type", dest="scheduler_type", default="one_cycle",
                   choices=["one_cycle", "cosine", "none"], help="learning-rate schedule")
    g.add_argument("--grad_clip", "--grad-clip", dest="grad_clip", type=guards.nonneg_float, default=1.0,
                   help="clip the global gradient norm (0: off)")
    g = p.add_argument_group("memory strategy")
    g.add_argument("--strategy", default="auto", choices=STRATEGIES, help="how the K centres are fitted into memory")
    g.add_argument("--chunk_size", "--chunk-size", dest="chunk_size", type=guards.positive_int,
                   help="centres per chunk (chunked: 50 if not given; auto: the largest that fits; "
                        "model_parallel and gradient_accumulation: chunk within a rank / micro-batch)")
    g.add_argument("--accumulation_steps", "--accumulation-steps", dest="accumulation_steps", type=guards.positive_int,
                   help="micro-batches per step for gradient_accumulation (4 if not given)")
    g.add_argument("--dry-run", "--dry_run", dest="dry_run", action="store_true",
                   help="print the memory table and the strategy plan, then exit")
    g.add_argument("--estimate-memory", "--estimate_memory", dest="estimate_memory", action="store_true",
                   help="print the predicted memory breakdown (same table as --dry-run) and exit")
    g = p.add_argument_group("run")
    g.add_argument("--device", help="cuda, mps or cpu (default: the first available, in that order)")
    g.add_argument("--seed", type=guards.nonneg_int, default=0,
                   help="seeds the data, the initial weights and the batches")
    g.add_argument("--save", "--out-dir", dest="out_dir", default=f"out/{SCRIPT}",
                   help="config.json, model.safetensors, training state, metrics.jsonl, samples and picture")
    g.add_argument("--resume", action="store_true", help="continue the run saved in --out-dir")
    g.add_argument("--log-interval", "--log_interval", dest="log_interval", type=guards.positive_int, default=100,
                   help="steps between progress lines")
    g.add_argument("--eval-interval", "--eval_interval", dest="eval_interval", type=guards.positive_int, default=500,
                   help="steps between test losses")
    g.add_argument("--save-interval", "--save_interval", dest="save_interval", type=guards.positive_int, default=500,
                   help="steps between checkpoints (and one at the end)")
    g.add_argument("--num-samples", "--num_samples", dest="num_samples", type=guards.nonneg_int, default=2000,
                   help="samples drawn at the end into samples.npy and the picture (CIFAR: 64 in the picture)")
    guards.add_safety_flags(p, snake=True)
    return p


# The run directory (lib/rundir.py): what a saved run is, and which flags --resume may change. The
# fixed ones make the run what it is (the data, the mixture's shape, the batches): given again they
# must match, not given they take the saved values. The changeable ones keep the saved values unless
# given; the strategy is among them, because every strategy computes the same loss and gradients.
RUN = rundir.Spec(
    saved={checkpoint.CONFIG: "json", checkpoint.WEIGHTS: "safetensors", rundir.STATE: "state"},
    same_step=(checkpoint.WEIGHTS,),
    written=(rundir.METRICS, "samples.npy", "samples.png"),
    fixed=("data", "data_dir", "image_size", "train_samples_size", "test_samples_size", "train_kernel_size", "depth",
           "hiddenunits", "stability", "batch_size", "seed"),
    changeable=("niters", "lr", "weight_decay", "scheduler_type", "grad_clip", "strategy", "chunk_size",
                "accumulation_steps", "log_interval", "eval_interval", "save_interval", "num_samples"),
    data=("data_dir",),
    local=("dry_run",),
)


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    threads = torch.get_num_threads()
    try:
        return run(args, parser, sys.argv[1:] if argv is None else list(argv))
    except (UserError, KeyboardInterrupt) as e:  # Ctrl-C or SIGTERM outside the loop: one line, 130 or 143
        report_and_exit(e)
    finally:
        torch.set_num_threads(threads)  # run() lowers it for toy sets; a caller (a test) keeps its own


# --- the mixture: factornet, the factors L_k, and the closed-form score-matching loss ------------
def tril_size(dim):
    return dim * (dim + 1) // 2


class FactorNet(nn.Module):
    """Centre mu_k (D) -> the D(D+1)/2 entries of a lower-triangular L_k, row by row."""

    def __init__(self, dim, depth, hidden):
        super().__init__()
        layers, width = [], dim
        for _ in range(depth):
            layers += [nn.Linear(width, hidden), nn.GELU()]
            width = hidden
        self.hidden = nn.Sequential(*layers)
        # Start every centre at L = I (softplus(0.5413) = 1), i.e. P = (1 + eps) I, as the original
        # starts from an identity-like factor; the hidden layers learn once out.weight moves off zero.
        # (skip_init: no random draws for a layer set just below; on CIFAR-10 it is 64 x 4.7 M.)
        self.out = nn.utils.skip_init(nn.Linear, width, tril_size(dim))
        rows, cols = torch.tril_indices(dim, dim)
        with torch.no_grad():
            self.out.weight.zero_()
            self.out.bias.copy_(torch.where(rows == cols, math.log(math.e - 1), 0.0))

    def forward(self, centres):
        return self.out(self.hidden(centres))


def factor_matrices(vec, dim):
    """[c, D(D+1)/2] -> [c, D, D] lower-triangular L with a softplus (so positive) diagonal."""
    rows, cols = torch.tril_indices(dim, dim, device=vec.device)
    values = torch.where(rows == cols, F.softplus(vec), vec)
    L = vec.new_zeros(vec.shape[0], dim, dim)
    L[:, rows, cols] = values
    return L


def log_det_precision(L, eps):
    """log det(L L^T + eps I) = 2 sum_i log C_ii, C the Cholesky factor of P. The only place P is formed
    in training. P is positive definite in exact arithmetic; a factor that overflowed (a diverging run)
    can make it fail in floating point, and then its log det is NaN, so the loss is, and the run stops."""
    eye = torch.eye(L.shape[-1], dtype=L.dtype, device=L.device)
    C, info = torch.linalg.cholesky_ex(L @ L.mT + eps * eye)
    log_det = 2 * torch.log(torch.diagonal(C, dim1=-2, dim2=-1)).sum(-1)
    return torch.where(info == 0, log_det, float("nan"))


def chunk_stats(factornet, x, centres, eps):
    """The log-sum-exp statistics of samples x [B, D] against a chunk of centres [c, D].

    With a_k = log N(x; mu_k, P_k^-1) and m = max_k a_k (a constant shift, detached):
      s = sum_k e^(a_k - m),  G = sum_k e^(a_k - m) P_k r_k,  H = sum_k e^(a_k - m) (|P_k r_k|^2 - tr P_k)
    where r_k = x - mu_k. The responsibilities are w_k = e^(a_k - m) / s, so grad log p = -G / s and
    (laplacian p) / p = H / s. P_k is never formed for these: P r = L (L^T r) + eps r, tr P = |L|_F^2 + eps D.
    """
    dim = x.shape[1]
    L = factor_matrices(factornet(centres), dim)                       # [c, D, D]
    r = x[:, None, :] - centres[None, :, :]                            # [B, c, D]
    u = torch.einsum("kji,bkj->bki", L, r)                             # L^T r
    Pr = torch.einsum("kij,bkj->bki", L, u) + eps * r                  # P r
    quad = (u * u).sum(-1) + eps * (r * r).sum(-1)                     # r^T P r = |L^T r|^2 + eps |r|^2
    trace = (L * L).sum((-2, -1)) + eps * dim                          # [c]
    a = 0.5 * (log_det_precision(L, eps) - quad) - 0.5 * dim * math.log(2 * math.pi)  # [B, c]
    m = a.max(1).values.detach()
    e = torch.exp(a - m[:, None])
    s = e.sum(1)
    G = torch.einsum("bk,bki->bi", e, Pr)
    H = (e * ((Pr * Pr).sum(-1) - trace)).sum(1)
    return m, s, G, H


def combine(first, second):
    """Merge two chunks' statistics exactly: rescale both to the larger shift (the flash-attention trick)."""
    m1, s1, G1, H1 = first
    m2, s2, G2, H2 = second
    m = torch.maximum(m1, m2)
    f1, f2 = torch.exp(m1 - m), torch.exp(m2 - m)
    return m, s1 * f1 + s2 * f2, G1 * f1[:, None] + G2 * f2[:, None], H1 * f1 + H2 * f2


combine = exercise.swap("wpo_lse", combine)  # BYHAND_EXERCISE=wpo_lse: yours (exercises/wpo_lse.py)


def mixture_stats(factornet, x, centres, eps, chunk_size=None):
    """Statistics over all the given centres: at once, or chunk_size at a time with an online log-sum-exp.

    With gradients on, each chunk runs under activation checkpointing: its forward keeps only the
    chunk's outputs ([B, D + 3]), and backward recomputes the chunk's L (c x D x D) when it gets there,
    so only one chunk's factors exist at any moment.
    """
    if chunk_size is None or chunk_size >= len(centres):
        return chunk_stats(factornet, x, centres, eps)
    total = None
    for start in range(0, len(centres), chunk_size):
        part = centres[start:start + chunk_size]
        if torch.is_grad_enabled():
            stats = recompute_in_backward(chunk_stats, factornet, x, part, eps, use_reentrant=False)
        else:
            stats = chunk_stats(factornet, x, part, eps)
        total = stats if total is None else combine(total, stats)
    return total


def loss_from_stats(s, G, H):
    """Implicit score matching, E_x[ laplacian log p + 1/2 |grad log p|^2 ], from the statistics."""
    grad_log_p = -G / s[:, None]
    sq = (grad_log_p * grad_log_p).sum(1)
    laplacian_log_p = H / s - sq                                      # (lap p)/p - |grad log p|^2
    return (laplacian_log_p + 0.5 * sq).mean()


def score_and_laplacian(factornet, x, centres, eps):
    """grad log p and laplacian log p at x [B, D] (the closed forms; tests compare them with autograd)."""
    _, s, G, H = chunk_stats(factornet, x, centres, eps)
    grad_log_p = -G / s[:, None]
    return grad_log_p, H / s - (grad_log_p * grad_log_p).sum(1)


# --- the strategies: four ways to compute the same loss and gradients -----------------------------
class SumOverRanks(torch.autograd.Function):
    """all_reduce(SUM) forward; backward passes the gradient through unchanged.

    Every rank computes the same loss from the summed statistics, so the gradient arriving here is
    already the whole gradient; each rank sends it into its own centres, and summing the factornet
    gradients over ranks afterwards (once) completes it. (torch.distributed.nn's all_reduce would sum
    the identical upstream gradients as well, W times too much.)
    """

    @staticmethod
    def forward(ctx, t):
        t = t.clone()
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t

    @staticmethod
    def backward(ctx, grad):
        return grad


def distributed_stats(factornet, x, local_centres, eps, chunk_size):
    """model_parallel: this rank's partial statistics, combined over ranks by two collectives."""
    m, s, G, H = mixture_stats(factornet, x, local_centres, eps, chunk_size)
    shift = m.clone()
    dist.all_reduce(shift, op=dist.ReduceOp.MAX)                      # the global max: no gradient needed
    f = torch.exp(m - shift)
    packed = torch.cat([(s * f)[:, None], G * f[:, None], (H * f)[:, None]], 1)   # [B, D + 2], one message
    packed = SumOverRanks.apply(packed)
    return shift, packed[:, 0], packed[:, 1:-1], packed[:, -1]


def score_matching_loss(factornet, x, centres, eps, chunk_size=None, model_parallel=False):
    if model_parallel:
        return loss_from_stats(*distributed_stats(factornet, x, centres, eps, chunk_size)[1:])
    return loss_from_stats(*mixture_stats(factornet, x, centres, eps, chunk_size)[1:])


def forward_backward(factornet, x, centres, eps, plan):
    """One step's loss and gradients (left in .grad) under the plan's strategy; returns the loss."""
    mp = plan.strategy == "model_parallel"
    if plan.strategy == "gradient_accumulation":
        # The batch mean is the size-weighted mean of the micro-batch means: the same gradient, exactly.
        total = 0.0
        for xb in x.tensor_split(min(plan.accumulation_steps, len(x))):
            loss = score_matching_loss(factornet, xb, centres, eps, plan.chunk_size)
            (loss * (len(xb) / len(x))).backward()
            total += loss.item() * len(xb) / len(x)
        return total
    loss = score_matching_loss(factornet, x, centres, eps, plan.chunk_size, model_parallel=mp)
    loss.backward()
    if mp:
        # One flat buffer, one all-reduce: factornet is replicated, its gradient is the sum over ranks.
        grads = [p.grad for p in factornet.parameters()]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()
    return loss.item()


# --- the memory plan: estimate each strategy, pick one ---------------------------------------------
# Bytes autograd and the kernels hold per chunk, counted from chunk_stats (docs/wpo_sgm_memory.md
# lists them) and checked against measured peaks on CPU (bench/wpo_sgm.py):
#   per centre and D x D:  L, P = L L^T + eps I, its Cholesky factor C (kept for backward), L*L for
#                          the trace, then in backward dL, dP, dC and the Cholesky backward's workspace
#   per sample, centre and dim: r, L^T r, P r, their einsum copies, products and gradients
#   per centre and D(D+1)/2: factornet's output, the softplus values and their gradients
FLOATS_PER_CENTRE_D2 = 6
FLOATS_PER_SAMPLE_CENTRE_D = 5
FLOATS_PER_CENTRE_TRIL = 3
# Sampling, one centre at a time: factornet's D(D+1)/2 outputs with their int64 row and column indices
# and L (about 4 D x D floats while L is filled), then L, P and C; measured 4.1-4.4 x D^2 for D = 1024-3072.
FLOATS_SAMPLING_D2 = 4.25
FP32 = 4
# On CPU the first forward and backward also touch kernel libraries, thread pools and autograd's
# engine, and AdamW imports torch._dynamo: the figure every script's CPU estimate uses (lib/memory.py,
# where the runtime is measured with torch._dynamo already imported). CUDA's max_memory_allocated
# counts tensors only, so nothing is added there.
CPU_STEP_OVERHEAD = memory.CPU_FIRST_STEP
FREE_FRACTION = 0.8  # plan to use at most 80% of what the device reports free: allocator slack, fragmentation


@dataclass
class Shape:
    dim: int
    centres: int       # K
    batch: int         # B
    train_samples: int
    depth: int
    hidden: int
    test_samples: int = 0
    num_samples: int = 0  # drawn at the end

    @property
    def n_params(self):
        h, d = self.hidden, self.dim
        return (d * h + h) + (self.depth - 1) * (h * h + h) + (h * tril_size(d) + tril_size(d))


@dataclass
class Plan:
    strategy: str
    chunk_size: int = None          # None: all of the centres (of this rank) at once
    accumulation_steps: int = 1
    world_size: int = 1
    reason: str = ""


def estimate_memory(shape: Shape, plan: Plan, baseline: int = 0) -> dict:
    """Predicted peak bytes per component on one device (one rank) for the plan: what the run holds
    throughout, plus the largest of what its moments add: a step's forward and backward, AdamW's
    update, sampling. (The test loss goes a batch at a time with no graph kept: less than a step.)"""
    return {**held_memory(shape, baseline), **max(moments(shape, plan).values(), key=lambda m: sum(m.values()))}


def moments(shape: Shape, plan: Plan) -> dict:
    """What each moment of the run needs on top of what is held, by component."""
    p = shape.n_params
    return {"a step's forward and backward": step_memory(shape, plan),
            # AdamW's update on CPU (torch's per-tensor loop) computes sqrt(v) / bias correction into
            # two new tensors of a parameter's size; a GPU's multi-tensor update does so for all at once.
            "AdamW's update": {"update: gradients": p * FP32, "update: two parameter-sized temporaries": 2 * p * FP32},
            "sampling": sampling_memory(shape)}


def held_memory(shape: Shape, baseline: int = 0) -> dict:
    p = shape.n_params
    held = {
        "training and test data (N x D)": (shape.train_samples + shape.test_samples) * shape.dim * FP32,
        "factornet parameters": p * FP32,
        "AdamW moments (2 x fp32)": 2 * p * FP32,
    }
    if baseline:  # the CPU's runtime, measured, and the first step's kernels and threads (lib/memory.py)
        held.update(memory.runtime_terms("cpu", baseline, "runtime (measured: Python, torch)"))
    return held


def step_memory(shape: Shape, plan: Plan) -> dict:
    """A training step: the gradients, and what autograd and the kernels hold per chunk of centres."""
    local = -(-shape.centres // plan.world_size)                 # this rank's centres
    chunk = min(plan.chunk_size or local, local)
    micro = -(-shape.batch // plan.accumulation_steps)
    n_chunks = -(-local // chunk)
    d = shape.dim
    step = {
        "step: gradients": shape.n_params * FP32,
        f"step: factors L, P, Cholesky ({chunk} x D x D)": FLOATS_PER_CENTRE_D2 * chunk * d * d * FP32,
        f"step: factornet output ({chunk} x D(D+1)/2)": FLOATS_PER_CENTRE_TRIL * chunk * tril_size(d) * FP32,
        f"step: per-sample terms ({micro} x {chunk} x D)": FLOATS_PER_SAMPLE_CENTRE_D * micro * chunk * d * FP32,
        "step: factornet hidden activations": 4 * chunk * shape.depth * shape.hidden * FP32,
    }
    if n_chunks > 1:  # what the running combine keeps per chunk for backward: its rescaling factors
        step[f"step: combine factors ({n_chunks} chunks x B)"] = 3 * n_chunks * micro * FP32
    return step


def sampling_memory(shape: Shape) -> dict:
    """sample(): the draws and their noise, one centre's share of them, and one centre's factors."""
    n, d = shape.num_samples, shape.dim
    if not n:
        return {}
    share = -(-n // shape.centres)
    return {f"sampling: {n} draws, noise, indices": (2 * n * d + 3 * share * d) * FP32 + 2 * n * 8,
            "sampling: one centre's L, P, Cholesky (D x D)": int(FLOATS_SAMPLING_D2 * d * d * FP32)}


def runtime_baseline(device):
    """What the process holds before the model exists: the CPU's resident set now (lib/memory's shared
    accounting); 0 for CUDA/MPS, whose figures count tensors (and the driver's pools) only."""
    return memory.cpu_runtime_bytes(device.type) or 0


def largest_chunk(shape, plan, budget, baseline):
    """A chunk size whose estimate fits the budget, or 0. The estimate first falls as chunks grow (the combine
    factors, a few per chunk, shrink), then rises (the chunk's [B, c, D] tensors grow): ternary search finds a
    point near its lowest, then bisection the largest chunk above it that fits. ceil(K / c) chunks make small
    steps in the curve, so the result may be a few centres short of the largest, or 0 for a budget within a
    hair of the lowest estimate."""
    def total(c):
        chunked = Plan(plan.strategy, c, plan.accumulation_steps, plan.world_size)
        return sum(estimate_memory(shape, chunked, baseline).values())
    local = -(-shape.centres // plan.world_size)
    lo, hi = 1, local
    while hi - lo > 2:
        m1, m2 = lo + (hi - lo) // 3, hi - (hi - lo) // 3
        lo, hi = (lo, m2) if total(m1) <= total(m2) else (m1, hi)
    lowest = min(range(lo, hi + 1), key=total)
    if total(lowest) > budget:
        return 0
    lo, hi = lowest, local
    while lo < hi:  # binary search
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if total(mid) <= budget else (lo, mid - 1)
    return lo


def choose_plan(args, shape, world_size, available, baseline):
    """--strategy as given, or auto's choice; the thresholds are docs/wpo_sgm_memory.md's."""
    if args.strategy != "auto":
        chunk = args.chunk_size if args.chunk_size or args.strategy != "chunked" else 50
        steps = (args.accumulation_steps or 4) if args.strategy == "gradient_accumulation" else 1
        return Plan(args.strategy, chunk, steps, world_size, "asked for with --strategy")
    budget = FREE_FRACTION * available if available else float("inf")
    have = f"{metrics.format_bytes(available)} free" if available else "free memory unknown"

    def fits(plan):
        return sum(estimate_memory(shape, plan, baseline).values()) <= budget

    if world_size > 1:
        plan = Plan("model_parallel", args.chunk_size, 1, world_size)
        if fits(plan):
            plan.reason = f"{world_size} ranks: each takes 1/{world_size} of the centres, and that fits ({have})"
        else:
            plan.chunk_size = max(1, largest_chunk(shape, plan, budget, baseline))
            plan.reason = (f"{world_size} ranks split the centres; a rank's share does not fit at once ({have}), "
                           "so each chunks it")
        return plan
    single = Plan("single_gpu", args.chunk_size if args.chunk_size else None)
    if args.chunk_size is None and fits(single):
        single.reason = f"all {shape.centres} centres at once fit within {FREE_FRACTION:.0%} of the {have}: the fastest"
        return single
    chunked = Plan("chunked", None)
    chunk = args.chunk_size or largest_chunk(shape, chunked, budget, baseline)
    if chunk:
        chunked.chunk_size = chunk
        chunked.reason = (f"--chunk_size {chunk} given ({have})" if args.chunk_size else
                          f"all {shape.centres} centres at once do not fit within {FREE_FRACTION:.0%} of the {have}; "
                          f"{chunk} centres per chunk is about the largest that does")
        return chunked
    fallback = Plan("chunked", 1, 1, 1, f"nothing fits within {FREE_FRACTION:.0%} of the {have}; chunks of 1 are shown")
    if not largest_chunk(shape, Plan("gradient_accumulation", None, shape.batch), budget, baseline):
        return fallback  # not even micro-batches of one sample fit: fewer, larger ones will not either
    for steps in range(2, shape.batch + 1):  # no chunk size fits for the whole batch
        plan = Plan("gradient_accumulation", None, steps)
        chunk = largest_chunk(shape, plan, budget, baseline)
        if chunk:
            plan.chunk_size = chunk if chunk < shape.centres else None
            per_chunk = f"{chunk} centres per chunk" if plan.chunk_size else f"all {shape.centres} centres at once"
            plan.reason = (f"no chunk size fits for the whole batch ({have}); "
                           f"{steps} micro-batches of {-(-shape.batch // steps)}, {per_chunk}")
            return plan
    return fallback


def print_plan(shape, plan, baseline, world, device_text, log):
    """--dry-run and --estimate-memory: the shape, what all centres at once would need, the plan, the table."""
    log(f"D = {shape.dim}, K = {shape.centres}, batch {shape.batch}, factornet {shape.n_params:,} parameters, "
        f"device {device_text}, {world} rank(s)")
    at_once = sum(estimate_memory(shape, Plan("single_gpu", None, 1, world), baseline).values())
    log(f"all {-(-shape.centres // world)} centres at once would need {metrics.format_bytes(at_once)}"
        + (" per rank" if world > 1 else ""))
    log(f"plan: {describe_plan(plan, shape)} ({plan.reason})")
    log(format_table(estimate_memory(shape, plan, baseline)))
    log("on top of what is held: " + ", ".join(f"{name} {metrics.format_bytes(sum(m.values()))}"
                                                for name, m in moments(shape, plan).items()) + "; the largest counts")


def describe_plan(plan, shape):
    parts = [plan.strategy]
    if plan.strategy == "model_parallel":
        parts.append(f"{plan.world_size} ranks x {-(-shape.centres // plan.world_size)} centres")
    if plan.chunk_size:
        parts.append(f"chunk {plan.chunk_size}")
    if plan.strategy == "gradient_accumulation":
        parts.append(f"{plan.accumulation_steps} micro-batches")
    return ", ".join(parts)


class Progress:
    """A line every few seconds while a long phase runs (reading data, the test loss, sampling), with
    what is done and an ETA; a phase that is over sooner prints nothing."""

    EVERY = 5.0  # seconds between lines

    def __init__(self, what, total, unit, log):
        self.what, self.total, self.unit, self.log, self.every = what, total, unit, log, self.EVERY
        self.start = self.last = time.perf_counter()

    def __call__(self, done):
        now = time.perf_counter()
        if now - self.last >= self.every and done < self.total:
            self.last = now
            eta = (now - self.start) / done * (self.total - done)
            self.log(f"{self.what}: {done:,}/{self.total:,} {self.unit}, {metrics.format_seconds(now - self.start)} "
                     f"so far, ETA {metrics.format_seconds(eta)}")
            sys.stdout.flush()  # seen now, also through a pipe or a log file


# --- data: toy sets generated from the seed, and CIFAR-10's binary files ----------------------------
def toy_data(name, n, rng):
    """n points of a named toy distribution (the ones FFJORD and the original script use), float32."""
    if name == "8gaussians":
        s = 4.0 / math.sqrt(2)
        modes = np.array([(5, 0), (-5, 0), (0, 5), (0, -5), (5 / math.sqrt(2), 5 / math.sqrt(2)),
                          (5 / math.sqrt(2), -5 / math.sqrt(2)), (-5 / math.sqrt(2), 5 / math.sqrt(2)),
                          (-5 / math.sqrt(2), -5 / math.sqrt(2))]) * s
        x = modes[rng.integers(0, 8, n)] + rng.standard_normal((n, 2)) * 0.5 / math.sqrt(2)
    elif name in ("swissroll", "swissroll_6D_xy1"):
        t = 1.5 * math.pi * (1 + 2 * rng.random(n))
        x = np.stack([t * np.cos(t), t * np.sin(t)], 1) + rng.standard_normal((n, 2))  # noise 1.0, as sklearn's
        x /= 5
        if name == "swissroll_6D_xy1":  # four more coordinates, three of them linear in the first two
            a, b = x[:, 0], x[:, 1]
            x = np.stack([a, b, 2 * a + rng.standard_normal(n) * 0.1, a + b + rng.standard_normal(n) * 0.1,
                          a - 2 * b + rng.standard_normal(n) * 0.1, rng.standard_normal(n)], 1)
    elif name == "2spirals":
        t = np.sqrt(rng.random((n // 2, 1))) * 540 * (2 * math.pi) / 360
        d = np.hstack([-np.cos(t) * t + rng.random((n // 2, 1)) * 0.5, np.sin(t) * t + rng.random((n // 2, 1)) * 0.5])
        x = np.vstack([d, -d, d[: n - 2 * (n // 2)]]) / 3 + rng.standard_normal((n, 2)) * 0.1
    elif name == "checkerboard":
        x1 = rng.random(n) * 4 - 2
        x2 = rng.random(n) - rng.integers(0, 2, n) * 2 + np.floor(x1) % 2
        x = np.stack([x1, x2], 1) * 2
    elif name == "circles":
        outer = n - n // 2
        t = np.concatenate([np.linspace(0, 2 * math.pi, outer, endpoint=False),
                            np.linspace(0, 2 * math.pi, n // 2, endpoint=False)])
        radius = np.concatenate([np.ones(outer), np.full(n // 2, 0.5)])
        x = (np.stack([np.cos(t), np.sin(t)], 1) * radius[:, None] + rng.standard_normal((n, 2)) * 0.08) * 3
    elif name == "moons":
        outer = n - n // 2
        t1, t2 = np.linspace(0, math.pi, outer), np.linspace(0, math.pi, n // 2)
        x = np.concatenate([np.stack([np.cos(t1), np.sin(t1)], 1), np.stack([1 - np.cos(t2), 0.5 - np.sin(t2)], 1)])
        x = (x + rng.standard_normal((n, 2)) * 0.01) * 2 + np.array([-1, -0.2])
    elif name == "pinwheel":
        classes, per = 5, -(-n // 5)
        feats = rng.standard_normal((classes * per, 2)) * np.array([0.3, 0.1])
        feats[:, 0] += 1.0
        labels = np.repeat(np.arange(classes), per)
        ang = np.linspace(0, 2 * math.pi, classes, endpoint=False)[labels] + 0.25 * np.exp(feats[:, 0])
        rot = np.stack([np.cos(ang), -np.sin(ang), np.sin(ang), np.cos(ang)], 1).reshape(-1, 2, 2)
        x = 2 * np.einsum("ti,tij->tj", feats, rot)[:n]
    elif name == "rings":
        sizes = [n - 3 * (n // 4)] + [n // 4] * 3
        parts = [np.stack([np.cos(t), np.sin(t)], 1) * r for size, r in zip(sizes, [0.25, 0.5, 0.75, 1.0])
                 for t in [np.linspace(0, 2 * math.pi, size, endpoint=False)]]
        x = np.concatenate(parts) * 3 + rng.standard_normal((n, 2)) * 0.08
    else:
        raise ValueError(name)
    return rng.permutation(x).astype(np.float32)  # shuffled: the first K are a fair sample of centres


CIFAR_RECORD = 1 + 3 * 32 * 32  # one label byte, then 1024 red, 1024 green and 1024 blue bytes
CIFAR_TRAIN_FILES = [f"data_batch_{i}.bin" for i in range(1, 6)]
CIFAR_HINT = ("download the binary version, cifar-10-binary.tar.gz from https://www.cs.toronto.edu/~kriz/cifar.html, "
              "unpack it and pass --data-dir .../cifar-10-batches-bin")


def check_cifar_dir(data_dir):
    """Fail early and clearly: no directory, the Python (pickle) version, or no training file."""
    if not data_dir:
        raise UserError(f"--data cifar10 needs --data-dir; {CIFAR_HINT}")
    if not os.path.isdir(data_dir):
        raise UserError(f"--data-dir {data_dir} is not a directory; {CIFAR_HINT}")
    present = [f for f in CIFAR_TRAIN_FILES if os.path.isfile(os.path.join(data_dir, f))]
    if not present:
        pickled = [f for f in ("data_batch_1", "batches.meta", "cifar-10-batches-py")
                   if os.path.exists(os.path.join(data_dir, f))]
        if pickled:
            raise UserError(f"--data-dir {data_dir} holds the Python (pickle) version of CIFAR-10 ({pickled[0]}), "
                            f"which this script never reads because unpickling a file can run code; {CIFAR_HINT}")
        raise UserError(f"--data-dir {data_dir} has none of {', '.join(CIFAR_TRAIN_FILES)}; {CIFAR_HINT}")
    return present


def read_cifar_file(path, limit=None):
    """Images [n, 3072] floats in [0, 1], channel-major as stored, in file order; labels [n]."""
    size = os.path.getsize(path)
    if size == 0:
        raise UserError(f"{path} is empty; download it again ({CIFAR_HINT})")
    if size % CIFAR_RECORD:
        n = size // CIFAR_RECORD
        raise UserError(f"{path}, record {n}: the file ends {size % CIFAR_RECORD} bytes into it, a CIFAR-10 binary "
                        f"record is {CIFAR_RECORD} bytes (1 label + 3072 pixels); the file is truncated or not "
                        f"CIFAR-10, download it again ({CIFAR_HINT})")
    n = size // CIFAR_RECORD if limit is None else min(limit, size // CIFAR_RECORD)
    records = np.fromfile(path, dtype=np.uint8, count=n * CIFAR_RECORD).reshape(n, CIFAR_RECORD)
    labels = records[:, 0]
    bad = np.flatnonzero(labels > 9)
    if len(bad):
        raise UserError(f"{path}, record {bad[0]}, field label: {labels[bad[0]]} is not a class 0-9; "
                        f"this is not the CIFAR-10 binary format ({CIFAR_HINT})")
    return records[:, 1:].astype(np.float32) / 255.0, labels


def pool_images(images, side):
    """[n, 3072] -> [n, 3 * side * side] by averaging side x side blocks of each 32 x 32 channel."""
    if side == 32:
        return images
    f = 32 // side
    return images.reshape(-1, 3, side, f, side, f).mean((3, 5)).reshape(len(images), -1)


def load_cifar(data_dir, n_train, n_test, side, log):
    """The first n_train training images and the first n_test test images, pooled to side x side."""
    present = check_cifar_dir(data_dir)
    parts, read = [], []
    progress = Progress("data: reading CIFAR-10", len(present), "files", log)
    for name in present:
        if sum(len(p) for p in parts) >= n_train:
            break
        images, _ = read_cifar_file(os.path.join(data_dir, name), n_train - sum(len(p) for p in parts))
        parts.append(pool_images(images, side))  # pooled file by file: the full-size copy is one file's
        read.append(name)
        progress(len(read))
    train = np.concatenate(parts)
    test = None
    test_path = os.path.join(data_dir, "test_batch.bin")
    if n_test and os.path.isfile(test_path):
        test = pool_images(read_cifar_file(test_path, n_test)[0], side)
    log(f"data: CIFAR-10 from {data_dir}: {len(train)} training images from {', '.join(read)}"
        + (f", {len(test)} test images from test_batch.bin" if test is not None
           else ", no test_batch.bin (no test loss)")
        + ("" if len(train) >= n_train else f" (fewer than --train_samples_size {n_train}: that is all there is)"))
    return train, test


def data_dim(args):
    return 3 * args.image_size ** 2 if args.data == "cifar10" else (6 if args.data == "swissroll_6D_xy1" else 2)


def load_data(args, log):
    """(training samples, test samples or None) as float32 arrays [N, D]."""
    if args.data == "cifar10":
        return load_cifar(args.data_dir, args.train_samples_size, args.test_samples_size, args.image_size, log)
    train = toy_data(args.data, args.train_samples_size, np.random.default_rng(args.seed))
    test = None
    if args.test_samples_size:
        test = toy_data(args.data, args.test_samples_size, np.random.default_rng(args.seed + 1))
    log(f"data: {args.data}, {len(train)} training and {0 if test is None else len(test)} test samples "
        f"generated from seed {args.seed} (D = {train.shape[1]})")
    return train, test


# --- sampling: exact draws from the mixture -----------------------------------------------------------
@torch.no_grad()
def sample(factornet, centres, eps, n, seed, log=print):
    """n exact draws: pick k uniformly, then x = mu_k + C_k^-T z with z ~ N(0, I) and C_k C_k^T = P_k,
    so Cov x = C^-T C^-1 = P_k^-1.

    There are only K distinct precisions, so the draws are grouped by centre: each P_k is formed and
    factorised once, O(D^3), and one triangular solve with all of that centre's z as right-hand sides
    gives its draws, O(n_k D^2): O(K D^3 + n D^2) in all, with one centre's D x D matrices in memory
    at a time. Every k and z is drawn first, so the grouping changes no draw.
    """
    dim = centres.shape[1]
    g = torch.Generator().manual_seed(seed)
    k = torch.randint(len(centres), (n,), generator=g)
    z = torch.randn(n, dim, generator=g)
    out = centres.new_empty(n, dim)
    progress = Progress(f"sampling {n:,} draws", len(centres), "centres", log)
    by_centre = torch.argsort(k, stable=True).split(torch.bincount(k, minlength=len(centres)).tolist())
    for j, rows in enumerate(by_centre):
        if len(rows):
            out[rows.to(out.device)] = draws_around(factornet, centres[j], z[rows].to(out.device), eps, j)
        progress(j + 1)
    return out


def draws_around(factornet, centre, z, eps, index):
    """centre + C^-T z for each row of z [m, D], C the Cholesky factor of this centre's precision."""
    dim = len(centre)
    L = factor_matrices(factornet(centre[None]), dim)[0]
    C, info = torch.linalg.cholesky_ex(L @ L.T + eps * torch.eye(dim, device=L.device))
    if info:  # positive definite in exact arithmetic; fp32 fails only when L's entries are huge
        raise UserError(f"sampling: the precision of centre {index} cannot be factorised in fp32 (its factor's "
                        f"largest entry is {float(L.abs().max()):.3g}); the saved model is kept; retrain with a "
                        f"lower --lr or a larger --stability")
    return centre + torch.linalg.solve_triangular(C.T, z.T, upper=True).T


def picture(path, data, samples, image_side=None):
    """Samples against data: a scatter of the first two coordinates, or two image grids (data | samples)."""
    if image_side is None:  # two panels on the data's scale: data (grey), samples (red)
        lo, hi = data[:, :2].min(0), data[:, :2].max(0)
        centre, half = (lo + hi) / 2, float((hi - lo).max()) / 2 * 1.15 + 1e-9
        bounds = (centre[0] - half, centre[0] + half, centre[1] - half, centre[1] + half)
        img = png.side_by_side(png.scatter([data[:, :2]], colors=(png.GREY,), size=400, bounds=bounds),
                               png.scatter([samples[:, :2]], colors=(png.RED,), size=400, bounds=bounds), gap=16)
    else:
        def grid(x):
            x = np.asarray(x[:64]).reshape(-1, 3, image_side, image_side).transpose(0, 2, 3, 1)
            return png.image_grid(x, ncols=8, scale=max(1, 64 // image_side))
        img = png.side_by_side(grid(data), grid(samples), gap=16)
    png.write_png(path, img)


# --- learning-rate schedules (pure functions of the step: a resume needs no scheduler state) --------
def lr_at(step, total, peak, kind):
    if kind == "none" or total <= 1:
        return peak
    if kind == "cosine":
        return peak * 0.5 * (1 + math.cos(math.pi * min(step, total) / total))
    # one_cycle as torch's OneCycleLR (cos anneal, pct_start 0.3): up from peak/25, down to peak/25e4.
    up = max(1, int(0.3 * total) - 1)
    start, end = peak / 25, peak / 25 / 1e4
    if step <= up:
        return start + (peak - start) * 0.5 * (1 - math.cos(math.pi * step / up))
    t = min(1.0, (step - up) / max(1, total - 1 - up))
    return end + (peak - end) * 0.5 * (1 + math.cos(math.pi * t))


# --- the test loss, saving and resuming ------------------------------------------------------------------
@torch.no_grad()
def test_loss(factornet, test_x, centres, eps, plan, batch_size, log):
    """The loss on the held-out samples, batch_size of them at a time against chunks of the centres
    (no graph is kept, so this needs less memory than a training step); under model_parallel every
    rank runs the same batches against its own centres."""
    mp, total = plan.strategy == "model_parallel", 0.0
    progress = Progress("test loss", len(test_x), "samples", log)
    for start in range(0, len(test_x), batch_size):
        xb = test_x[start:start + batch_size]
        loss = score_matching_loss(factornet, xb, centres, eps, plan.chunk_size or 256, model_parallel=mp)
        total += loss.item() * len(xb)
        progress(start + len(xb))
    return total / len(test_x)


def save(run_dir, factornet, centres, optimizer, step, args, updates, dist_info):
    """The model (factornet and its centres) in safetensors with config.json, then the state --resume
    needs (step = the next step to run). Weights holding NaN or inf are never saved."""
    named = {**{f"factornet.{k}": v for k, v in factornet.state_dict().items()}, "centres": centres}
    guards.check_finite_weights(named, step, updates.last_saved, run_dir.out_dir)
    if dist_info.is_main:
        tensors = {k: v.detach().to("cpu").contiguous() for k, v in named.items()}
        checkpoint.atomic_write(os.path.join(run_dir.out_dir, checkpoint.WEIGHTS),
                                lambda tmp: save_file(tensors, tmp, metadata={"format": "pt", "step": str(step)}))
        checkpoint.save_json(os.path.join(run_dir.out_dir, checkpoint.CONFIG), {
            "model_type": "wpo_sgm", "dim": centres.shape[1], "num_centres": len(centres), "depth": args.depth,
            "hidden_units": args.hiddenunits, "activation": "gelu", "stability": args.stability, "data": args.data,
            "image_size": args.image_size if args.data == "cifar10" else None,
            "factor": "lower-triangular L_k from factornet(centre_k), rows of torch.tril_indices, softplus diagonal; "
                      "precision P_k = L_k L_k^T + stability * I; p(x) = mean_k N(x; centre_k, P_k^-1)",
        })
        rundir.save_state(run_dir, args, {"step": step, "optimizer": optimizer.state_dict()})
    updates.saved(step)


def resume(run_dir, factornet, centres, optimizer, args, log):
    """Load the saved run's weights and optimizer state (validated by rundir.prepare); returns the
    step to continue from. The saved centres must be the ones the data gives now."""
    path = os.path.join(args.out_dir, checkpoint.WEIGHTS)
    tensors = load_file(path)
    try:
        factornet.load_state_dict({k[len("factornet."):]: v for k, v in tensors.items() if k.startswith("factornet.")})
    except RuntimeError as e:
        raise UserError(f"--resume: {path} does not hold this run's factornet ({str(e).splitlines()[-1].strip()}); "
                        f"restore it, or start again with --overwrite") from None
    if "centres" not in tensors or not torch.equal(tensors["centres"], centres.cpu()):
        raise UserError(f"--resume: the centres saved in {path} differ from the first --train_kernel_size samples "
                        f"of the data now read; the data changed since the run was saved: restore it, or start "
                        f"again with --overwrite")
    optimizer.load_state_dict(run_dir.state["optimizer"])
    step = run_dir.state["step"]
    if args.niters < step:
        raise UserError(f"--resume: {args.out_dir} is already at step {step}; pass --niters {step} or more")
    log(f"resuming from step {step} of {args.niters} in {args.out_dir}")
    return step


# --- the run ----------------------------------------------------------------------------------------
def check_args(args, world):
    """Every check on the flags (the saved run's, with --resume) that needs no data."""
    if args.data == "cifar10":
        check_cifar_dir(args.data_dir)
    elif args.data_dir:
        raise UserError(f"--data-dir is for --data cifar10, not --data {args.data} (toy sets are generated); drop "
                        "--data-dir")
    if args.seed >= 2**32:
        raise UserError(f"--seed {args.seed} is too large; use a seed from 0 to {2**32 - 1}")
    if world > 1 and args.strategy not in ("auto", "model_parallel"):
        raise UserError(f"--strategy {args.strategy} under torchrun ({world} ranks) would repeat the same work on "
                        f"every rank; use --strategy model_parallel (or auto), or launch with plain python")
    if world == 1 and args.strategy == "model_parallel":
        raise UserError("--strategy model_parallel splits the centres across torchrun ranks; launch with "
                        "torchrun --standalone --nproc_per_node=N, or use --strategy chunked on one device")
    if args.train_kernel_size > args.train_samples_size:
        raise UserError(f"--train_kernel_size {args.train_kernel_size} exceeds --train_samples_size "
                        f"{args.train_samples_size}: the centres are the first K training samples; lower K or raise N")
    if args.train_kernel_size < world:
        raise UserError(f"--train_kernel_size {args.train_kernel_size} is fewer than the {world} ranks; use at least "
                        f"{world} centres")
    if args.strategy == "gradient_accumulation" and (args.accumulation_steps or 4) > args.batch_size:
        raise UserError(f"--accumulation_steps {args.accumulation_steps or 4} exceeds --batch_size {args.batch_size}; "
                        f"a micro-batch needs at least one sample")


def run(args, parser, argv):
    # --- checks and the run directory: nothing is written until every check has passed ----------------
    # lib/rundir.py: a saved run is never replaced without --overwrite; --resume validates every saved
    # file and takes the saved run's flags, so the checks below see the values the run will use.
    world = int(os.environ.get("WORLD_SIZE", "1"))
    log = print if int(os.environ.get("RANK", "0")) == 0 else (lambda *a, **k: None)
    planning_only = args.dry_run or args.estimate_memory  # print the plan and exit: writes nothing
    run_dir = rundir.prepare(args, parser, argv, RUN, log=log, writes=not planning_only)
    check_args(args, world)
    device = devices.pick_device(args.device)

    # --- the memory plan ------------------------------------------------------------------------------
    dim = data_dim(args)
    shape = Shape(dim, args.train_kernel_size, args.batch_size, args.train_samples_size, args.depth, args.hiddenunits,
                  args.test_samples_size, args.num_samples)
    available, what = guards.available_memory(device)
    baseline = runtime_baseline(device)
    plan = choose_plan(args, shape, world, available, baseline)
    estimate = estimate_memory(shape, plan, baseline)
    if planning_only:
        print_plan(shape, plan, baseline, world,
                   f"{device} ({metrics.format_bytes(available) if available else 'unknown'} "
                                                 f"{what})", log)
        return {"plan": plan, "estimate": estimate}
    log(f"plan: {describe_plan(plan, shape)} ({plan.reason}); predicted peak "
        f"{metrics.format_bytes(sum(estimate.values()))}")
    guards.check_memory(sum(estimate.values()), device, args.force,
                        "lower --chunk_size or --batch_size, use --strategy chunked or more ranks")

    # --- device and distributed setup -----------------------------------------------------------------
    dist_info = distributed.setup(device.type) if world > 1 else distributed.DistInfo()
    device = distributed.device_for(dist_info, device)
    if device.type == "cpu" and dim <= 16 and "OMP_NUM_THREADS" not in os.environ:
        # Toy-set tensors are a few KB: splitting each op across threads costs more than it saves,
        # and on a busy machine waiting for a descheduled thread costs far more (set OMP_NUM_THREADS to choose).
        torch.set_num_threads(1)
    devices.seed_everything(args.seed)

    # --- data ---------------------------------------------------------------------------------------
    train_np, test_np = load_data(args, log)
    if len(train_np) < args.train_kernel_size:
        raise UserError(f"--train_kernel_size {args.train_kernel_size} exceeds the {len(train_np)} training images "
                        "found; lower it")
    train_x = torch.from_numpy(train_np).to(device)
    test_x = None if test_np is None else torch.from_numpy(test_np).to(device)
    centres = train_x[: args.train_kernel_size]  # the first K training samples, as in the original
    # model_parallel: this rank's slice of the centres; every rank still sees every sample.
    local_centres = centres
    if plan.strategy == "model_parallel":
        local_centres = centres.tensor_split(dist_info.world_size)[dist_info.rank]

    # --- model ----------------------------------------------------------------------------------------
    devices.reset_peak_memory(device)  # count training, not reading the data
    factornet = FactorNet(dim, args.depth, args.hiddenunits).to(device)  # same seed on every rank: identical replicas
    log(f"model: factornet {args.depth} x {args.hiddenunits} GELU -> {tril_size(dim)} factor entries, "
        f"{shape.n_params:,} parameters; K = {len(centres)} centres, eps = {args.stability}; fp32 on {device}"
        + (f" x {dist_info.world_size} ranks ({len(local_centres)} centres on this one)" if dist_info.enabled else ""))

    # --- optimiser -------------------------------------------------------------------------------------
    optimizer = torch.optim.AdamW(factornet.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    start_step = resume(run_dir, factornet, centres, optimizer, args, log) if run_dir.resumed else 0

    # --- training loop ---------------------------------------------------------------------------------
    metrics_log = rundir.begin(run_dir, args, dist_info.is_main)  # the first write; --overwrite clears only now
    metrics_log.log(event="start", seed=args.seed, step=start_step, device=str(device), world_size=dist_info.world_size,
                    strategy=plan.strategy, chunk_size=plan.chunk_size, accumulation_steps=plan.accumulation_steps,
                    n_params=shape.n_params, dim=dim, memory_estimate=sum(estimate.values()), args=vars(args))
    updates = rundir.Updates(args.out_dir, last_saved=start_step if run_dir.resumed else None)

    def save_now(step):
        save(run_dir, factornet, centres, optimizer, step, args, updates, dist_info)

    speed = metrics.Throughput(args.niters, start_step)
    next_step, first_loss, loss_value = start_step, None, None
    previous_handler = signal.getsignal(signal.SIGINT)
    ctrl_c = distributed.catch_ctrl_c(dist_info)  # under torchrun every rank stops after the same step
    t_start = time.perf_counter()
    try:
        for step in range(start_step, args.niters):
            if step % args.eval_interval == 0 and test_x is not None:
                tl = test_loss(factornet, test_x, local_centres, args.stability, plan, args.batch_size, log)
                log(f"step {step}: test loss {tl:.4f}")
                metrics_log.log(step=step, test_loss=tl)
            lr = lr_at(step, args.niters, args.lr, args.scheduler_type)
            for group in optimizer.param_groups:
                group["lr"] = lr
            # The batch is a function of (seed, step): the step is the data position, on every rank.
            g = torch.Generator().manual_seed(args.seed * 1_000_003 + step)
            x = train_x[torch.randint(len(train_x), (args.batch_size,), generator=g).to(device)]
            loss_value = forward_backward(factornet, x, local_centres, args.stability, plan)
            updates.check_loss(step, loss_value)  # a NaN or infinite loss stops the run before its update
            first_loss = loss_value if first_loss is None else first_loss
            grad_norm = torch.nn.utils.clip_grad_norm_(factornet.parameters(), args.grad_clip or float("inf")).item()
            skipped = not math.isfinite(grad_norm)
            with rundir.whole_update():  # Ctrl-C or SIGTERM waits for the update and its counting
                if skipped:  # a non-finite gradient would poison AdamW's moments: drop this update
                    log(f"step {step}: gradient norm {grad_norm}, update skipped")
                else:
                    optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                next_step = step + 1
            speed.add(args.batch_size)

            record = dict(step=step, loss=loss_value, lr=lr, grad_norm=grad_norm)
            if skipped:
                record["skipped"] = True
            if step % args.log_interval == 0 or step == args.niters - 1:
                devices.synchronize(device)
                per_s, _, eta = speed.report(step + 1)
                mem = devices.peak_memory_bytes(device)
                record.update(samples_per_s=round(per_s, 1), peak_memory=mem)
                log(f"step {step:5d}/{args.niters} | loss {loss_value:9.4f} | lr {lr:.2e} | {per_s:8,.0f} samples/s | "
                    f"mem {metrics.format_bytes(mem)} | ETA {metrics.format_seconds(eta)}")
            metrics_log.log(**record)
            updates.record(step, skipped)  # stops the run after 10 skipped updates in a row

            if distributed.stop_requested(ctrl_c, dist_info, device):
                raise KeyboardInterrupt  # on every rank, after the same finished step
            if next_step % args.save_interval == 0 and next_step < args.niters:
                save_now(next_step)
    except KeyboardInterrupt:  # save exactly the updates made so far, then exit 130
        rundir.save_on_interrupt(lambda: save_now(next_step), next_step, args.out_dir, dist_info.is_main,
                                 cleanup=lambda: distributed.cleanup(dist_info))
    finally:
        signal.signal(signal.SIGINT, previous_handler)
    train_seconds = time.perf_counter() - t_start
    updates.finish()  # a run whose every update was skipped trained nothing: it says so and exits 2

    # --- save, then the final test loss and the samples ------------------------------------------------
    save_now(next_step)
    log(f"saved {args.out_dir}/config.json, model.safetensors (factornet + centres) and {rundir.STATE}")
    final_test, samples, sample_seconds = None, None, 0.0
    try:  # the model is saved: Ctrl-C from here on loses nothing, and --resume redoes what follows
        if test_x is not None:
            final_test = test_loss(factornet, test_x, local_centres, args.stability, plan, args.batch_size, log)
            log(f"step {next_step}: test loss {final_test:.4f}")
            metrics_log.log(step=next_step, test_loss=final_test)
        if dist_info.is_main:
            t = time.perf_counter()
            samples = sample(factornet, centres, args.stability, args.num_samples, args.seed + 2, log).cpu().numpy()
            sample_seconds = time.perf_counter() - t
            np.save(os.path.join(args.out_dir, "samples.npy"), samples)
            picture(os.path.join(args.out_dir, "samples.png"), train_np, samples,
                    args.image_size if args.data == "cifar10" else None)
            log(f"saved samples.npy ({len(samples)} samples, {sample_seconds:.1f} s) and samples.png "
                f"(left: data, right: samples)")
    except KeyboardInterrupt:
        rundir.save_on_interrupt(lambda: None, next_step, args.out_dir, dist_info.is_main,
                                 cleanup=lambda: distributed.cleanup(dist_info, wait=False))

    # --- report -------------------------------------------------------------------------------------------
    peak = devices.peak_memory_bytes(device)
    log(format_table(estimate, peak, f"measured ({devices.memory_label(device)})"))
    log(f"trained {next_step - start_step} steps in {train_seconds:.1f} s; loss {first_loss} -> {loss_value}")
    metrics_log.log(event="end", step=next_step, loss=loss_value, test_loss=final_test, peak_memory=peak,
                    memory_estimate=sum(estimate.values()), train_seconds=round(train_seconds, 2),
                    sample_seconds=round(sample_seconds, 2))
    distributed.cleanup(dist_info)
    return {"loss": loss_value, "first_loss": first_loss, "test_loss": final_test, "peak_memory": peak,
            "estimate": estimate, "plan": plan, "samples": samples}


if __name__ == "__main__":
    # On CPU the resident set then follows the tensors, as estimated: glibc hands every freed block of
    # 128 KiB or more back at once (lib/device.py). Only for a run from the command line: a program that
    # imports this script (a test, a notebook) keeps its own allocator settings.
    devices.steady_cpu_heap(128 * 1024)
    main()
