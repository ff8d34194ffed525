"""Pretrain a GPT-2 with its parameters, gradients and optimizer state sharded across ranks (FSDP2).

    torchrun --standalone --nproc_per_node=2 train_fsdp.py                        # tiny GPT, CPU (gloo)
    torchrun --standalone --nproc_per_node=8 train_fsdp.py --model-size gpt2-xl   # 1.5B on 8 GPUs
    torchrun --standalone --nproc_per_node=2 train_fsdp.py --model-size gpt2-xl --estimate-memory
    python train_fsdp.py                                                          # FSDP with one rank

The same training as train.py (same data windows, same initial weights, same loss at every step for
the same global batch and seed); only where the tensors live differs. With DDP every rank holds the
whole model, its gradients and both AdamW moments (16 bytes per parameter). Here each of N ranks
holds 1/N of each, and the full weights of a block exist only while that block computes: fully_shard
all-gathers them before its forward and backward and frees them after (reshards), and reduce-scatters
the gradients so each rank keeps the slice of the mean gradient that its optimizer slice updates.
docs/fsdp2_explained.md walks through the idea, the arithmetic and the measured numbers.

--init-from loads a Hugging Face GPT-2 (a directory or a hub id) into the sharded model one tensor at a
time, so each rank keeps only its shards. The guards are train.py's (no silent overwrite, --resume flag
checks, skipped non-finite updates, finite checkpoints only, the memory pre-check). Ctrl-C: the ranks
agree to stop after the step, save and exit 130; torchrun itself then ends with its own traceback (last
line `...SignalException: Process <pid> got signal: 2`, status 1), which no worker can prevent.

Reading order: arguments, device and distributed setup, model configuration, data, model, optimiser,
training loop, save, report. The helpers above run() are the FSDP-specific steps they call.
"""

import argparse
import functools
import math
import os
import shutil
import sys
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                     set_state_dict)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor
from safetensors import SafetensorError, safe_open
from torch.utils.checkpoint import checkpoint as recompute

import train
from lib import checkpoint, data, distributed, gpt, guards, hub, memory, metrics, optim, rundir
from lib import device as devices
from lib.errors import UserError, report_and_exit

SHARDED = "sharded"  # OUT/sharded/step-000050/ holds one .distcp file per rank; latest.json names the newest
LATEST = "latest.json"
TIED = "lm_head.weight"  # is transformer.wte.weight


# --- arguments ----------------------------------------------------------------------------------
def make_parser():
    p = argparse.ArgumentParser(
        description="Pretrain GPT-2 with FSDP2 (fully_shard): parameters, gradients and AdamW state sharded "
                    "across the ranks torchrun starts. Plain `python train_fsdp.py` runs one rank.",
        formatter_class=guards.HelpFormatter,
    )
    g = p.add_argument_group("data")
    g.add_argument("--data", default="stdlib", help="a text file, a directory of text files, a token directory "
                   "(prepared here, nanoGPT's train.bin + val.bin, or llm.c's *_train_*.bin + *_val_*.bin shards), "
                   "or 'stdlib' (the running Python's standard library, tests left out)")
    g.add_argument("--cache-dir", default=data.default_cache_dir(), help="where prepared shards and hub downloads are "
                   "kept ($BYHAND_CACHE, else ~/.cache/byhand)")
    g = p.add_argument_group("model")
    g.add_argument("--model-size", default="tiny", choices=list(gpt.MODEL_SIZES), help="a GPT-2 shape")
    g.add_argument("--n-layer", type=guards.positive_int, help="override the shape's layer count")
    g.add_argument("--n-head", type=guards.positive_int, help="override the shape's head count")
    g.add_argument("--n-embd", type=guards.positive_int, help="override the shape's width")
    g.add_argument("--block-size", type=guards.positive_int,
                   help="sequence length; if unset, the shape's, or the checkpoint's with --init-from")
    g.add_argument("--dropout", type=guards.probability, default=0.0, help="dropout probability (GPT-2 used 0.1)")
    g.add_argument("--init-from", help="start from a Hugging Face GPT-2: a local directory, or a hub id (gpt2, "
                   "gpt2-medium, gpt2-large, gpt2-xl, org/name), which is downloaded; each rank keeps only its shards")
    g = p.add_argument_group("optimisation")
    g.add_argument("--steps", type=guards.nonneg_int, default=300, help="optimizer steps in total")
    g.add_argument("--batch-size", type=guards.positive_int, default=8, help="sequences per micro-batch per rank")
    g.add_argument("--grad-accum", type=guards.positive_int, default=1, help="micro-batches per optimizer step")
    g.add_argument("--lr", type=guards.positive_float, default=2e-3, help="peak learning rate")
    g.add_argument("--min-lr-ratio", type=guards.nonneg_float, default=0.1,
                   help="final learning rate as a fraction of --lr (0 to 1)")
    g.add_argument("--warmup-steps", type=guards.nonneg_int, default=30, help="steps of linear learning-rate warmup")
    g.add_argument("--weight-decay", type=guards.nonneg_float, default=0.1,
                   help="AdamW weight decay (matrices and embeddings only)")
    g.add_argument("--beta1", type=guards.probability, default=0.9, help="AdamW beta1 (0 to below 1)")
    g.add_argument("--beta2", type=guards.probability, default=0.95, help="AdamW beta2 (0 to below 1)")
    g.add_argument("--grad-clip", type=guards.nonneg_float, default=1.0, help="clip the global gradient norm (0: off)")
    g = p.add_argument_group("FSDP2")
    g.add_argument("--reshard-after-forward", action=argparse.BooleanOptionalAction, default=True,
                   help="free each block's gathered weights after its forward and gather them again for backward "
                   "(ZeRO-3); --no-reshard-after-forward keeps them until backward (ZeRO-2: more memory, less traffic)")
    g.add_argument("--cpu-offload", action="store_true",
                   help="keep the parameter, gradient and optimizer shards in host RAM (CPUOffloadPolicy); CUDA only")
    g.add_argument("--activation-checkpointing", action="store_true",
                   help="keep only each block's input in forward and recompute the rest during backward")
    g = p.add_argument_group("run")
    g.add_argument("--device", help="cuda, cuda:N, mps or cpu; if unset, the first available of cuda, mps, cpu")
    # --mixed-precision (auto, bf16, off) is this flag's older name.
    g.add_argument("--dtype", "--mixed-precision", default="auto", choices=["auto", "fp32", "bf16", "fp16"],
                   type=lambda v: {"off": "fp32"}.get(v, v),
                   help="compute dtype: bf16 computes with bf16 copies of the weights and reduces gradients in fp32 "
                   "(MixedPrecisionPolicy); auto = bf16 on CUDA GPUs and CPUs that have it natively, else fp32; "
                   "fp16 is refused (it would need a sharded GradScaler)")
    g.add_argument("--seed", type=guards.nonneg_int, default=1337, help="the same on every rank: weights, data order")
    g.add_argument("--out-dir", default="out/train_fsdp",
                   help="sharded checkpoints, metrics.jsonl and the exported model")
    g.add_argument("--resume", action="store_true", help="continue from the newest sharded checkpoint in --out-dir")
    guards.add_safety_flags(g)
    g.add_argument("--export", action=argparse.BooleanOptionalAction, default=True,
                   help="at the end, gather the full weights on rank 0 and write config.json + model.safetensors "
                   "(the Hugging Face GPT-2 layout train.py writes)")
    g.add_argument("--eval-interval", type=guards.positive_int, default=100, help="steps between validation losses")
    g.add_argument("--eval-batches", type=guards.positive_int, default=10, help="batches per validation loss")
    g.add_argument("--save-interval", type=guards.positive_int, default=100,
                   help="steps between sharded checkpoints (and one at the end)")
    g.add_argument("--log-interval", type=guards.positive_int, default=10, help="steps between progress lines")
    g.add_argument("--peak-flops", type=guards.positive_float,
                   help="peak FLOP/s of one device, for MFU where it is not in the table")
    g.add_argument("--estimate-memory", action="store_true",
                   help="print the predicted memory per rank for the ranks torchrun started, and exit (the model "
                   "is built on the meta device only)")
    g = p.add_argument_group("sample")
    g.add_argument("--sample-tokens", type=guards.nonneg_int, default=200,
                   help="tokens to generate at the end (0: none); every rank runs the sharded forwards, rank 0 prints")
    g.add_argument("--prompt", default="", help="sample prompt; if empty, start a new file after <|endoftext|>")
    g.add_argument("--temperature", type=guards.nonneg_float, default=0.8,
                   help="sampling temperature (0: always the most likely token)")
    g.add_argument("--top-k", type=guards.positive_int, default=200, help="sample from the k most likely tokens only")
    return p


def check_shards(path):
    """sharded/latest.json and the shard files it names, checked before anything is written (on every rank, so
    all of them stop with the same line): the DCP .metadata readable, every .distcp file as long as the largest
    offset + length it must hold, every rank's RNG state readable."""
    latest = rundir.read_json(path)
    if not isinstance(latest, dict) or not {"step", "checkpoint", "world_size", "config"} <= set(latest):
        raise rundir.damaged(path, "not a train_fsdp.py latest.json: it needs step, checkpoint, world_size, config")
    step_dir = os.path.join(os.path.dirname(path), latest["checkpoint"])

    def read(name, reader):
        file = os.path.join(step_dir, name)
        if not os.path.isfile(file):
            raise UserError(f"--resume: {file} is missing, so the sharded checkpoint {step_dir} is incomplete; start "
                            f"again with --overwrite")
        try:
            return reader(file)
        except Exception as e:  # a truncated pickle or zip: name the file, not where its reader failed
            raise rundir.damaged(file, type(e).__name__) from None

    # .metadata says, for every piece of every tensor, which file holds it, at which offset, how many bytes.
    storage = read(".metadata", lambda _: dcp.FileSystemReader(step_dir).read_metadata().storage_data)
    for rank in range(latest["world_size"]):
        read(f"rng-rank{rank}.pt", lambda file: torch.load(file, weights_only=True))
    needed = {}
    for piece in storage.values():
        needed[piece.relative_path] = max(needed.get(piece.relative_path, 0), piece.offset + piece.length)
    for name, end in sorted(needed.items()):
        size = read(name, os.path.getsize)
        if size < end:
            raise rundir.damaged(os.path.join(step_dir, name), f"truncated: its tensors end at byte {end:,}, the "
                                                               f"file has {size:,}")


# The run directory (lib/rundir.py). What a saved run is: the newest sharded checkpoint, which latest.json names
# (the training state: step, config, the run's flags), and the exported model. The fixed flags make the run what
# it is (the model, the data, the windows a step reads); the changeable ones may differ on --resume, and are
# reported when they do. How the tensors are sharded is changeable too: DCP reshards on load.
RUN = rundir.Spec(
    saved={os.path.join(SHARDED, LATEST): check_shards, checkpoint.CONFIG: "json", checkpoint.WEIGHTS: "safetensors"},
    products=(checkpoint.CONFIG, checkpoint.WEIGHTS),  # the export, written at the end (not with --no-export)
    written=(rundir.METRICS, SHARDED),
    state_file=os.path.join(SHARDED, LATEST),
    checkpoint=(SHARDED,),  # a commit takes the whole sharded/ folder
    fixed=("model_size", "n_layer", "n_head", "n_embd", "block_size", "dropout", "init_from", "data", "seed",
           "batch_size"),
    # grad_accum may change only with the number of ranks, so that batch x grad_accum x world, the global batch, stays
    # the run's (train.resume_global_batch).
    changeable=("grad_accum", "steps", "lr", "min_lr_ratio", "warmup_steps", "weight_decay", "beta1", "beta2",
                "grad_clip", "eval_interval", "eval_batches", "save_interval", "log_interval", "dtype",
                "reshard_after_forward", "cpu_offload", "activation_checkpointing", "export", "sample_tokens", "prompt",
                "temperature", "top_k", "peak_flops"),
    data=("data",),
)


def check_args(args):
    """Everything about the flags and paths that can be checked before any work starts."""
    guards.check_schedule_and_seed(args)
    if args.dtype == "fp16":
        raise UserError("--dtype fp16 would need a sharded GradScaler (fp16 gradients underflow), which this script "
                        "leaves out; use --dtype bf16 on a GPU that has it, or fp32")
    devices.pick_device(args.device)  # a --device that is not here fails now, not after other checks
    guards.check_cache_dir(args.cache_dir)
    if not args.estimate_memory and (args.init_from or not data.is_prepared(args.data)):
        guards.make_output_dir(args.cache_dir, "--cache-dir")  # a run writes there; find out now whether it can


def main(argv=None):
    parser = make_parser()
    args = parser.parse_args(argv)
    # a command-line run: the heap gives back what it frees, so the peak is the tensors (lib/memory.py)
    if argv is None:
        devices.steady_cpu_heap()
    try:
        return run(args, parser, sys.argv[1:] if argv is None else list(argv))
    except (UserError, KeyboardInterrupt) as e:  # Ctrl-C or SIGTERM outside the loop: one line, 130 or 143
        report_and_exit(e)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


# --- the FSDP steps run() calls, in the order it calls them -------------------------------------
def join_process_group(device):
    """torchrun's ranks join one group; a plain `python` run makes a group of one, because fully_shard
    needs a process group even when there is nobody to share with (an in-process store needs no port)."""
    info = distributed.setup(device.type)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=dist.HashStore(), rank=0,
                                world_size=1)
    return info


def build_sharded_model(cfg, mesh, args, mp_dtype, offload):
    """The GPT on the meta device (shapes, no memory), sharded block by block, then the root.

    Each fully_shard call makes one unit whose weights are all-gathered together. The root unit takes
    what no block owns: wte, wpe, ln_f and lm_head; lm_head.weight IS wte.weight (tied), and a tied
    weight lives in one unit, which is gathered at both ends of the forward (the embedding and the head).
    """
    with torch.device("meta"):
        model = gpt.GPT(cfg)
    kw = dict(mesh=mesh, reshard_after_forward=args.reshard_after_forward)
    if mp_dtype is not None:
        # Compute in bf16; reduce-scatter gradients in fp32 so averaging N ranks loses no precision.
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=mp_dtype, reduce_dtype=torch.float32)
    if offload:
        kw["offload_policy"] = CPUOffloadPolicy()
    for block in model.transformer.h:
        if args.activation_checkpointing:
            # An instance attribute wins over Block.forward, so module names (and checkpoints) stay the same.
            block.forward = functools.partial(recompute, block.forward, use_reentrant=False)
        fully_shard(block, **kw)
    fully_shard(model, **kw)
    return model


@torch.no_grad()
def init_like_train_py(model, cfg):
    """Give the sharded model exactly the weights gpt.GPT(cfg) gets in train.py, never holding more than
    one full layer: each rank draws every layer's full tensors with the CPU RNG and keeps its own slice.

    Why not torch.nn.init.normal_ on the sharded DTensors? On CPU each rank then fills only its local
    slice from its own generator: with the same seed every rank draws the same numbers, so rank 1's rows
    are a copy of rank 0's (DTensor's RNG that avoids this exists for CUDA only, and draws a different
    stream from train.py's anyway). train.py's weights come from one stream in a fixed order: first every
    layer's constructor (nn.Linear's kaiming_uniform_, nn.Embedding's normal_), then GPT.init_weights
    over the modules in the same order. Both passes are replayed here, layer by layer.
    """
    # named_modules() lists the layers in the order GPT.__init__ built them: the order of the draws.
    layers = [(n, m) for n, m in model.named_modules() if isinstance(m, (nn.Linear, nn.Embedding, nn.LayerNorm))]
    for _, m in layers:  # pass 1: what each layer's constructor draws (values discarded)
        cpu_twin(m, on="cpu")
    for name, m in layers:  # pass 2: GPT.init_weights, run on a one-layer stand-in so its rules stay in lib/gpt.py
        twin = cpu_twin(m, on="meta").to_empty(device="cpu")
        holder = nn.Module()
        holder.config = cfg
        holder.add_module(name.rsplit(".", 1)[-1], twin)  # init_weights picks the std by the name's ending
        gpt.GPT.init_weights(holder)
        for pname, p in m.named_parameters(recurse=False):
            full = getattr(twin, pname).to(p.device_mesh.device_type)
            # src_data_rank=None: every rank already holds the same full tensor, so no communication;
            # distribute_tensor only cuts out this rank's slice, exactly as fully_shard cut the shapes.
            mine = distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None).to_local()
            p.to_local().copy_(mine)  # into the shard's storage, wherever it lives (GPU, or host with offload)
            # The tied wte/lm_head weight is written twice, the lm_head draw last, as in train.py.


def cpu_twin(m, on):
    """A layer of m's full (unsharded) shape; built on "cpu" its constructor draws from the RNG, on "meta" not."""
    with torch.device(on):
        if isinstance(m, nn.Linear):
            return nn.Linear(m.in_features, m.out_features, bias=m.bias is not None)
        if isinstance(m, nn.Embedding):
            return nn.Embedding(m.num_embeddings, m.embedding_dim)
        return nn.LayerNorm(m.normalized_shape, eps=m.eps, bias=m.bias is not None)


@torch.no_grad()
def load_pretrained_shards(model, cfg, model_dir):
    """--init-from: copy a Hugging Face GPT-2 into the sharded model, one tensor at a time.

    safetensors memory-maps the file, so get_tensor reads one full tensor; each rank cuts out its own
    slice (distribute_tensor with src_data_rank=None: every rank read the same bytes, nothing is sent)
    and drops the rest. Each rank ends up holding only its shards, and never more than one full tensor.
    """
    path = os.path.join(model_dir, checkpoint.WEIGHTS)
    if not os.path.isfile(path):
        raise UserError(f"{path} is missing; point --init-from at a directory holding a GPT-2 config.json and "
                        f"model.safetensors")
    try:
        with safe_open(path, framework="pt") as f:
            # Our names for the file's tensors (GPT2Model files lack the "transformer." prefix; old ones carry masks).
            names = {(k if k.startswith(("transformer.", "lm_head.")) else "transformer." + k): k for k in f.keys()
                     if not k.endswith((".attn.bias", ".attn.masked_bias"))}
            names.setdefault(TIED, names.get("transformer.wte.weight", TIED))  # tied: HF files leave lm_head out
            shapes = {}
            for ours, theirs in names.items():
                shape = tuple(f.get_slice(theirs).get_shape()) if theirs in f.keys() else (0,)
                shapes[ours] = torch.empty(shape[::-1] if ours.endswith(gpt.CONV1D_NAMES) else shape, device="meta")
            checkpoint.check_state_dict(shapes, cfg, path)  # names and shapes first: a wrong file fails at once
            for name, p in model.named_parameters():  # the tied weight is listed once, as transformer.wte.weight
                full = f.get_tensor(names[name])
                full = full.t() if name.endswith(gpt.CONV1D_NAMES) else full
                full = full.to(p.device_mesh.device_type, torch.float32)
                p.to_local().copy_(distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None).to_local())
                del full
    except (SafetensorError, OSError) as e:
        raise UserError(f"{path} cannot be read as safetensors ({e}); download or save it again") from None


def check_finite_shards(model, step, last_finite, out_dir):
    """guards.check_finite_weights over the shards: every rank checks its own slices, and all of them
    learn the verdict, so they stop together instead of leaving one rank alone in the save's collectives."""
    bad = guards.nonfinite((n, local(p)) for n, p in model.named_parameters())
    count = torch.tensor(float(len(bad)), device=local(next(model.parameters())).device)
    dist.all_reduce(count, op=dist.ReduceOp.MAX)
    if count.item():
        raise UserError(f"weights are not finite at step {step} (e.g. {bad[0] if bad else 'on another rank'}); "
                        f"nothing was saved, {guards.last_finite_text(last_finite, out_dir)}; lower --lr or check "
                        f"the data")


def local(t):
    return t.to_local() if isinstance(t, DTensor) else t


def held_bytes(model, optimizer):
    """What this rank holds (the DTensors' local shards) and what the unsharded model would need."""
    params = list(model.parameters())  # the tied weight appears once
    opt_state = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    grads = [p.grad for p in params if p.grad is not None]
    return {
        "parameters": sum(local(p).nbytes for p in params),
        "gradients": sum(local(g).nbytes for g in grads),
        "optimizer": sum(local(v).nbytes for v in opt_state),
        "parameters_unsharded": sum(p.numel() * p.element_size() for p in params),
        "gradients_unsharded": sum(g.numel() * g.element_size() for g in grads),
        "optimizer_unsharded": sum(v.numel() * v.element_size() for v in opt_state),
    }


def memory_report(when, held, device):
    """Every rank's held bytes and peak, gathered to every rank; the lines for rank 0 to print."""
    mine = dict(held, peak=devices.peak_memory_bytes(device))
    ranks = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, mine)
    fb = metrics.format_bytes
    lines = [f"memory per rank {when} (local DTensor shards; unsharded model in brackets; peak = "
             f"{devices.memory_label(device)}):"]
    for r, m in enumerate(ranks):
        cells = "  ".join(f"{k} {fb(m[k]):>10} [{fb(m[k + '_unsharded'])}]"
                          for k in ("parameters", "gradients", "optimizer"))
        lines.append(f"  rank {r}: {cells}  peak {fb(m['peak'])}")
    return ranks, "\n".join(lines)


@torch.no_grad()
def evaluate(model, batches, n_batches, device):
    """Mean loss over one fixed list of validation batches, split between the ranks (as train.py does).

    Every rank runs the same number of forwards, even when n_batches does not divide evenly: each forward
    all-gathers weights, and a rank that skipped one would leave the others waiting for it.
    """
    model.eval()
    world, rank = dist.get_world_size(), dist.get_rank()
    total = torch.zeros((), device=device)
    for i in range(rank, math.ceil(n_batches / world) * world, world):  # rank r: batches r, r+N, ...
        x, y = batches.get(min(i, n_batches - 1), 0, device)
        loss = model(x, y)[1].float()
        total += loss if i < n_batches else 0.0  # the padding forward counts for nothing
    model.train()
    dist.all_reduce(total)
    return total.item() / n_batches


def save_sharded(run_dir, model, optimizer, step, cfg, args, first_val, updates):
    """Every rank writes its own shard of the weights and AdamW state (torch.distributed.checkpoint);
    then rank 0 points latest.json at the new directory, removes the older ones and commits. step = the
    next step to run. Shards holding NaN or inf are never saved: every rank stops, naming the last
    finite save.

    The shards go to sharded/step-N.tmp and are renamed step-N only once every rank has written all of
    its files, so a folder half-written is never named like a whole one; latest.json follows, and
    rundir.commit makes the save one checkpoint (OUT/checkpoints/step-N), so a save cut short at any
    instant leaves the previous checkpoint whole.
    """
    root = os.path.join(run_dir.out_dir, SHARDED)
    check_finite_shards(model, step, updates.last_saved, root)
    name = f"step-{step:06d}"
    path, staging = os.path.join(root, name), os.path.join(root, f"{name}.tmp")
    if dist.get_rank() == 0 and os.path.isdir(staging):
        shutil.rmtree(staging)  # left by a save cut short
    dist.barrier()
    model_sd, optim_sd = get_state_dict(model, optimizer)  # DTensors: each rank's slice plus where it sits
    del model_sd[TIED]  # the same tensor as transformer.wte.weight; store it once
    checkpoint.fault_point(f"write {name} shards")
    dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=staging)
    # Each rank's generators (CPU, and CUDA's) draw its own dropout masks; the data order needs no state (it is
    # the step).
    checkpoint.fault_point(f"write rng-rank{dist.get_rank()}.pt")
    torch.save(devices.rng_states(), os.path.join(staging, f"rng-rank{dist.get_rank()}.pt"))
    dist.barrier()  # every rank's files are written
    if dist.get_rank() == 0:
        if os.path.isdir(path):
            shutil.rmtree(path)  # the same step saved before: its files live on in OUT/checkpoints
        checkpoint.fault_point(f"rename {name}.tmp")
        os.replace(staging, path)
        checkpoint.save_json(os.path.join(root, LATEST), {
            "step": step, "checkpoint": name, "world_size": dist.get_world_size(), "config": vars(cfg),
            "args": vars(args), "data_sha256": run_dir.fingerprints, "first_val_loss": first_val})
        for old in os.listdir(root):
            if old.startswith("step-") and old != name:
                shutil.rmtree(os.path.join(root, old), ignore_errors=True)
        rundir.commit(run_dir, args, step)
    updates.saved(step)


def load_sharded(args, model, optimizer, latest, log):
    """Each rank reads the slices it owns now; DCP reshards, so the saving run may have had another N.
    Returns (the step to continue from, the run's first validation loss)."""
    if args.steps < latest["step"]:
        raise UserError(f"--resume: {args.out_dir} is already at step {latest['step']}; pass --steps "
                        f"{latest['step']} or more")
    path = os.path.join(args.out_dir, SHARDED, latest["checkpoint"])
    model_sd, optim_sd = get_state_dict(model, optimizer)
    del model_sd[TIED]
    state = {"model": model_sd, "optimizer": optim_sd}
    dcp.load(state, checkpoint_id=path)  # in place, into this rank's shards
    state["model"][TIED] = state["model"]["transformer.wte.weight"]
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    rng = os.path.join(path, f"rng-rank{dist.get_rank()}.pt")
    if os.path.isfile(rng):
        saved = torch.load(rng, weights_only=True)  # a lone tensor: the CPU state, as saves before CUDA's held
        devices.restore_rng_states(saved if isinstance(saved, dict) else {"rng_cpu": saved, "rng_cuda": []})
    log(f"resuming from step {latest['step']} in {args.out_dir} (saved by {latest['world_size']} ranks)" +
        ("" if args.steps > latest["step"] else f"; it already ran its --steps {args.steps}, pass a larger --steps"))
    return latest["step"], latest.get("first_val_loss")


def export_hf(out_dir, model, cfg, step):
    """Gather the full weights, one tensor at a time, onto rank 0's CPU and write train.py's HF layout."""
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() == 0:
        with torch.device("meta"):
            plain = gpt.GPT(cfg)
        plain.load_state_dict(full, assign=True)  # a plain GPT around the gathered tensors, for to_hf_state_dict
        checkpoint.save_hf(out_dir, cfg, gpt.to_hf_state_dict(plain), step=step)
    dist.barrier()


def print_estimate(cfg, n_params, block_size, estimate, args, mesh, mp_dtype, device, log):
    """--estimate-memory: the per-rank estimate beside the unsharded (DDP) one, and each rank's parameter count
    from a meta model sharded for real (the local shards without their padding, with no memory used)."""
    world = mesh.size()
    sharded = build_sharded_model(cfg, mesh, args, mp_dtype, offload=False)
    counts = [None] * world
    dist.all_gather_object(counts, sum(local(p).numel() for p in sharded.parameters()))
    # The DDP column is train.py on the same ranks: with more than one, DDP's gradient buckets too.
    unsharded = memory.estimate_gpt_training(cfg, n_params, args.batch_size, block_size, device.type,
                                             mp_dtype is not None, ddp=world > 1,
                                             checkpointing=args.activation_checkpointing)
    log("parameters per rank: " + ", ".join(f"rank {r} {c:,}" for r, c in enumerate(counts))
        + f" (of {n_params:,}; {n_params / world:,.0f} = 1/{world} each)")
    log(memory.format_columns({f"FSDP2, 1 of {world}": estimate, "DDP / unsharded": unsharded},
                              f"memory estimate per rank (lib/memory.py, batch {args.batch_size} x {block_size}, "
                              f"{'bf16' if mp_dtype else 'fp32'}):"))
    log("activations and the loss's chunk of logits belong to each rank's own micro-batch and are never sharded: lower "
        "--batch-size, add --activation-checkpointing (and --mixed-precision bf16 on a GPU) to shrink them")
    return {"estimate": estimate, "unsharded": unsharded, "params_per_rank": counts, "n_params": n_params}


def run(args, parser, argv):
    # --- checks before any work -------------------------------------------------------------------
    check_args(args)
    # The run directory: a saved run is never replaced without --overwrite; --resume validates latest.json and
    # every shard file it names, and takes the saved run's flags (lib/rundir.py). Every rank checks.
    main_rank = int(os.environ.get("RANK", 0)) == 0
    accum_given = "grad_accum" in guards.explicit_flags(args, parser, argv)  # before the saved flags fill args
    run_dir = rundir.prepare(args, parser, argv, RUN, log=print if main_rank else (lambda *a: None),
                             writes=not args.estimate_memory)
    latest = run_dir.state  # sharded/latest.json of the run being resumed, or None
    if latest is not None:  # on another number of ranks (DCP reshards), the same global batch
        train.resume_global_batch(args, latest, accum_given, log=print if main_rank else (lambda *a: None))

    # --- device and distributed setup -----------------------------------------------------------
    device = devices.pick_device(args.device)
    dist_info = join_process_group(device)
    device = distributed.device_for(dist_info, device)
    world, rank, is_main = dist.get_world_size(), dist.get_rank(), dist_info.is_main
    log = print if is_main else (lambda *a, **k: None)
    devices.seed_everything(args.seed)  # the same seed on every rank; init_like_train_py relies on it
    mesh = init_device_mesh(device.type, (world,))  # one dimension: shard over all ranks
    # auto: bf16 on a GPU or CPU that has it natively (lib/device.amp_dtype), else fp32 (fp16 was refused above)
    mp_dtype = torch.bfloat16 if devices.amp_dtype(device, args.dtype) == torch.bfloat16 else None
    if args.cpu_offload and device.type != "cuda":
        raise UserError(f"--cpu-offload moves shards from GPU memory to host RAM, but the device is {device.type} "
                        f"(already host memory); drop --cpu-offload or run on CUDA")

    # --- model configuration and memory -------------------------------------------------------------
    if latest is not None:  # the resumed run's shape, from latest.json (its export may not be written yet)
        cfg, block_size = gpt.GPTConfig(**latest["config"]), args.block_size
    else:  # train.py's rules: --model-size and the shape flags, or a pretrained GPT-2's config.json only
        cfg, block_size = train.model_config(args, parser, argv, dist_info, log)
    with torch.device("meta"):
        n_params = gpt.GPT(cfg).num_params()  # the tied wte/lm_head weight counted once
    tokens_per_step = args.batch_size * block_size * args.grad_accum * world
    log(f"model: {cfg.n_layer} layers, {cfg.n_head} heads, {cfg.n_embd} wide, {n_params:,} parameters; "
        f"FSDP2 over {world} rank{'s' if world > 1 else ''} ({device.type}, {dist.get_backend()}), "
        f"{'bf16 compute, fp32 reduce' if mp_dtype else 'fp32'}, "
        f"{'ZeRO-3 (reshard after forward)' if args.reshard_after_forward else 'ZeRO-2 (no reshard after forward)'}"
        f"{', CPU offload' if args.cpu_offload else ''}"
        f"{', activation checkpointing' if args.activation_checkpointing else ''}; "
        f"{tokens_per_step:,} tokens per step")
    log(devices.dtype_line(device, args.dtype, mp_dtype))
    estimate = memory.estimate_fsdp_training(cfg, n_params, args.batch_size, block_size, world, device.type,
                                             mp_dtype is not None, args.reshard_after_forward, args.grad_accum,
                                             args.activation_checkpointing, memory.cpu_runtime_bytes(device.type))
    if args.estimate_memory:
        return print_estimate(cfg, n_params, block_size, estimate, args, mesh, mp_dtype, device, log)
    # On a CPU the ranks of one machine share its RAM.
    per_machine = int(os.environ.get("LOCAL_WORLD_SIZE", 1)) if device.type == "cpu" else 1
    guards.check_memory(sum(estimate.values()) * per_machine, device, args.force,
                        "lower --batch-size or --block-size, add --activation-checkpointing, use more ranks, "
                        "or pick a smaller model")

    # --- data -------------------------------------------------------------------------------------
    # One process per machine tokenises (once, cached); the others wait and then find the cache.
    data_dir = distributed.local_rank_0_first(dist_info, lambda: data.prepare(args.data, args.cache_dir, log=log))
    log(data.describe(data_dir))  # the token counts read, and the format (this project's, nanoGPT's or llm.c's)
    # Rank r takes slice [micro, r] of each step's windows: N ranks see what one process sees with N x --grad-accum.
    train_batches = data.Batches(data.TokenSplit(data_dir, "train"), args.batch_size, block_size,
                                 args.grad_accum, rank, world, seed=args.seed)
    val_batches = data.Batches(data.TokenSplit(data_dir, "val"), args.batch_size, block_size, seed=args.seed + 1)

    # --- model ------------------------------------------------------------------------------------
    devices.reset_peak_memory(device)  # count training, not tokenisation
    model = build_sharded_model(cfg, mesh, args, mp_dtype, args.cpu_offload)
    # Allocate only this rank's shards (uninitialised), on the GPU, or in host RAM under --cpu-offload.
    model.to_empty(device="cpu" if args.cpu_offload else device)
    if latest is None and args.init_from:
        model_dir = distributed.local_rank_0_first(dist_info, lambda: hub.resolve_pretrained(
            args.init_from, args.cache_dir, log=log))
        load_pretrained_shards(model, cfg, model_dir)
    elif latest is None:
        init_like_train_py(model, cfg)
    params_per_rank = [None] * world
    dist.all_gather_object(params_per_rank, sum(local(p).numel() for p in model.parameters()))

    # --- optimiser --------------------------------------------------------------------------------
    # Built on the sharded parameters, so each rank's AdamW keeps moments for its slice only.
    optimizer = optim.make_adamw(model.parameters(), args.lr, args.weight_decay, (args.beta1, args.beta2),
                                 "cpu" if args.cpu_offload else device.type)
    start_step, first_val = 0, None
    if latest is not None:  # each rank reads the slices of the weights and AdamW moments it owns now
        start_step, first_val = load_sharded(args, model, optimizer, latest, log)
    _, text = memory_report("at start", held_bytes(model, optimizer), device)
    log(text)

    # --- training loop ----------------------------------------------------------------------------
    metrics_log = rundir.begin(run_dir, args, is_main)  # the first write; --overwrite clears only now
    metrics_log.log(event="start", seed=args.seed, step=start_step, world_size=world, device=str(device),
                    n_params=n_params, params_per_rank=params_per_rank, config=vars(cfg), args=vars(args))
    peak_flops = metrics.peak_flops_for(device, args.peak_flops)
    flops_per_step = metrics.flops_per_token(n_params, cfg.n_layer, cfg.n_embd, block_size) * tokens_per_step
    speed = metrics.Throughput(args.steps, start_step)
    # Under torchrun, Ctrl-C only raises a flag: the ranks agree at the end of each step to stop, so all of
    # them reach the collective save together instead of one leaving while the others wait in an all-gather.
    ctrl_c = distributed.catch_ctrl_c(dist_info)
    # next_step is what a checkpoint records: it moves with the step's update, in one whole_update() block.
    next_step = start_step
    rng_at_step = None  # (step, its random states as it began): the ones a save in a step that did not count holds
    # Only finite weights are ever saved, so every checkpoint this run wrote (or resumed from) is finite.
    updates = rundir.Updates(os.path.join(args.out_dir, SHARDED), last_saved=start_step if run_dir.resumed else None)
    held = held_bytes(model, optimizer)
    val_loss = None
    timed_tokens, timed_seconds = 0, 0.0
    try:
        for step in range(start_step, args.steps):
            rng_at_step = step, devices.rng_states()  # this rank's, before this step draws (evaluate draws nothing)
            t0 = time.perf_counter()
            if step % args.eval_interval == 0:
                val_loss = evaluate(model, val_batches, args.eval_batches, device)
                first_val = val_loss if first_val is None else first_val
                log(f"step {step}: val loss {val_loss:.4f}")
                metrics_log.log(step=step, val_loss=val_loss)
                t0 = time.perf_counter()

            lr = optim.lr_at(step, args.lr, args.warmup_steps, args.steps, args.min_lr_ratio)
            for group in optimizer.param_groups:
                group["lr"] = lr
            loss_sum = torch.zeros((), device=device)
            for micro in range(args.grad_accum):
                x, y = train_batches.get(step, micro, device)
                # Reduce-scatter only after the last micro-batch; until then each rank adds into unsharded
                # gradients (memory for the whole model's gradients, but one reduce-scatter per step).
                model.set_requires_gradient_sync(micro == args.grad_accum - 1)
                loss = model(x, y)[1]  # (None, loss): with targets no logits are made
                loss = loss / args.grad_accum  # so the accumulated gradient is the batch mean
                loss.backward()
                loss_sum += loss.detach()
            loss_value = distributed.all_reduce_mean(loss_sum, dist_info).item()
            updates.check_loss(step, loss_value)
            # The gradients are DTensors: the norm of each local slice is summed over ranks inside.
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip or float("inf"))
            grad_norm = (grad_norm.full_tensor() if isinstance(grad_norm, DTensor) else grad_norm).item()
            # A NaN or infinite gradient would turn every weight it touches into NaN: skip that update. The
            # norm is the global one, so every rank makes the same choice.
            skipped = not math.isfinite(grad_norm)
            with rundir.whole_update():  # Ctrl-C or SIGTERM waits for the update and its counting
                if not skipped:
                    optimizer.step()
                if step == args.steps - 1:
                    held = held_bytes(model, optimizer)  # the only moment gradients and AdamW state both exist
                optimizer.zero_grad(set_to_none=True)
                next_step = step + 1
                speed.add(tokens_per_step)
                if step > start_step:  # the first step pays for warm-up; leave it out of the average
                    timed_tokens += tokens_per_step
                    timed_seconds += time.perf_counter() - t0
                if skipped:
                    log(f"step {step}: gradient norm {grad_norm}, update skipped")
                updates.record(step, skipped)  # stops after 10 skipped in a row

            record = dict(step=step, loss=loss_value, lr=lr, grad_norm=grad_norm)
            if skipped:
                record["skipped"] = True
            if step % args.log_interval == 0 or step == args.steps - 1:
                devices.synchronize(device)
                tok_s, sec_per_step, eta = speed.report(step + 1)
                mfu = flops_per_step / sec_per_step / (peak_flops * world) if peak_flops else None
                mem = devices.peak_memory_bytes(device)
                record.update(tokens_per_s=round(tok_s), mfu=mfu, peak_memory=mem)
                log(metrics.progress_line(step, args.steps, loss_value, lr, tok_s, mfu, mem, eta, " (rank 0)"))
            metrics_log.log(**record)

            if distributed.stop_requested(ctrl_c, dist_info, device):
                raise KeyboardInterrupt  # on every rank, after the same finished step
            if next_step % args.save_interval == 0 and next_step < args.steps:
                save_sharded(run_dir, model, optimizer, next_step, cfg, args, first_val, updates)
    except KeyboardInterrupt:  # save exactly the updates made so far (collectively), then exit 130
        rundir.save_on_interrupt(lambda: save_sharded(run_dir, model, optimizer, next_step, cfg, args, first_val,
                                                      updates), next_step, args.out_dir, is_main,
                                 cleanup=lambda: distributed.cleanup(dist_info), rng_at_step=rng_at_step)
    step = next_step
    updates.finish()  # a run whose every update was skipped trained nothing: it says so and exits 2

    # --- save -------------------------------------------------------------------------------------
    if args.steps > start_step or not args.resume:
        val_loss = evaluate(model, val_batches, args.eval_batches, device)
        log(f"step {step}: val loss {val_loss:.4f}" + (f" (started at {first_val:.4f})" if first_val else ""))
        metrics_log.log(step=step, val_loss=val_loss)
    if updates.last_saved != step:
        save_sharded(run_dir, model, optimizer, step, cfg, args, first_val, updates)
        log(f"saved sharded checkpoint {args.out_dir}/{SHARDED}/step-{step:06d} ({world} shard file"
            f"{'s' if world > 1 else ''})")
    if args.export:
        export_hf(args.out_dir, model, cfg, step)
        log(f"exported {args.out_dir}/{checkpoint.CONFIG} and {checkpoint.WEIGHTS} (Hugging Face GPT-2 layout)")

    # --- report -----------------------------------------------------------------------------------
    ranks, text = memory_report("at end (after the last optimizer step)", held, device)
    log(text)
    peak = ranks[0]["peak"]
    log(memory.format_table(estimate, peak, f"measured (rank 0 {devices.memory_label(device)})"))
    tokens_per_s = timed_tokens / timed_seconds if timed_seconds else None
    text = gpt.sample(model, args, device) if args.sample_tokens > 0 else None
    if text is not None:
        log("sample:\n" + "-" * 40 + "\n" + text + "\n" + "-" * 40)
    metrics_log.log(event="end", step=step, val_loss=val_loss, peak_memory=peak, memory_per_rank=ranks,
                    tokens_per_s=tokens_per_s, memory_estimate=sum(estimate.values()), sample=text)
    dist.barrier()  # leave together: a gloo rank tearing down while rank 0 still writes can abort the job
    return {"val_loss": val_loss, "first_val_loss": first_val, "peak_memory": peak, "memory_per_rank": ranks,
            "params_per_rank": params_per_rank, "tokens_per_s": tokens_per_s, "world_size": world,
            "memory_estimate": estimate}


if __name__ == "__main__":
    main()
