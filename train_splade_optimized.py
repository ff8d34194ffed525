"""train_splade_unified.py for small machines: exact gradient accumulation, device forcing, memory tools.

    python train_splade_optimized.py --train-file data/training.json --output-dir out/splade \\
        --device cpu --force-device --batch-size 2 --gradient-accumulation-steps 8 --memory-efficient --memory-tracking
    python train_splade_optimized.py --batch-size 4 --gradient-accumulation-steps 4  # the stdlib demo, batch 16

Everything else (data, model, the SPLADE loss, validation, saving, search) is train_splade_unified.py's,
imported, not copied. What this file adds, in reading order:

- --device with --force-device: an unavailable device falls back to the best available one with a
  warning, unless forced, when it is an error.
- --gradient-accumulation-steps N with GradCache (Gao et al., 2021): in-batch negatives stay exact
  across the whole effective batch of N x --batch-size queries. Naive accumulation
  (train_splade_unified.py --grad-accum, accumulating as the original trainer did) gives each query
  only its micro-batch's documents as negatives; GradCache computes the same loss and gradient as one big batch while
  holding only one micro-batch's activations (docs/memory_optimization.md has the numbers).
- --memory-tracking: resident memory and CUDA/MPS allocated memory every N steps, and the peak.
- --memory-efficient: per-layer gradient checkpointing, garbage collection every step, and on CUDA
  or MPS the AdamW moments (with an fp32 master copy of the weights) in CPU memory.
- --mixed-precision: bf16 autocast where the device has it, fp16 + GradScaler on CUDA without it;
  refused on CPU.
- out of memory: stop, keep the last checkpoint, name the flags to try.
"""

import dataclasses
import gc
import math
import os
import sys

import torch

import train_splade_unified as unified
from lib import checkpoint, exercise, guards, metrics, optim, rundir
from lib import device as devices
from lib.errors import UserError, report_and_exit


# --- arguments: the unified script's, plus the memory and device flags --------------------------
def build_parser():
    p = unified.build_parser("Train SPLADE on a small machine: train_splade_unified.py plus exact gradient "
                             "accumulation (GradCache), device forcing and memory tools.", "out/train_splade_optimized")
    g = p.add_argument_group("device and memory")
    g.add_argument("--force-device", action="store_true",
                   help="an unavailable --device is an error instead of a fallback to the best available device")
    # Replaces the unified script's naive --grad-accum (the parser resolves the clash in our favour).
    g.add_argument("--gradient-accumulation-steps", "--grad-accum", dest="grad_accum", type=guards.positive_int,
                   default=1, help="micro-batches per update, accumulated exactly with GradCache: every query sees "
                   "every document of the effective batch (--batch-size x this) as a negative")
    g.add_argument("--memory-tracking", action="store_true", help="log resident and device memory every few steps")
    g.add_argument("--memory-tracking-interval", type=guards.positive_int, default=10,
                   help="steps between memory readings with --memory-tracking")
    g.add_argument("--memory-efficient", action="store_true",
                   help="gradient checkpointing per layer, garbage collection every step, AdamW moments in CPU "
                   "memory on CUDA/MPS: less memory, about a third more time")
    g.add_argument("--mixed-precision", action="store_true",
                   help="bf16 autocast (fp16 + GradScaler on CUDA without bf16); not on CPU")
    return p


# The run directory: the unified script's, and these flags may change on --resume (--force-device is
# about this invocation only).
RUN = dataclasses.replace(unified.RUN, local=(*unified.RUN.local, "force_device"), changeable=(
    *unified.RUN.changeable, "memory_tracking", "memory_tracking_interval", "memory_efficient", "mixed_precision"))


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    if argv is None:  # a command-line run: the heap gives back what it frees (lib/device.py)
        devices.steady_cpu_heap()
    try:
        if args.search or args.query:
            return unified.search_cli(args)
        run_dir = rundir.prepare(args, parser, sys.argv[1:] if argv is None else list(argv), RUN,
                                 writes=not args.estimate_memory)  # first: --resume takes the saved run's flags
        return run(args, run_dir)
    except (UserError, KeyboardInterrupt) as e:  # Ctrl-C or SIGTERM outside the loop: one line, 130 or 143
        report_and_exit(e)


# --- device: fall back, or insist -----------------------------------------------------------------
def choose_device(name, force):
    if name is None:
        return devices.pick_device(None)
    available = {"cuda": torch.cuda.is_available, "mps": torch.backends.mps.is_available, "cpu": lambda: True}[name]()
    if available:
        return torch.device(name)
    if force:
        raise UserError(f"--device {name} with --force-device, but {name} is not available on this machine; "
                        f"drop --force-device to fall back, or pick --device cpu")
    fallback = devices.pick_device(None)
    print(f"warning: --device {name} is not available on this machine; using {fallback} instead "
          f"(--force-device makes this an error)", file=sys.stderr)
    return fallback


def choose_amp(device, args):
    """--mixed-precision: bf16 where the device has it, else fp16 (with GradScaler); refused on CPU."""
    if not args.mixed_precision:
        return devices.amp_dtype(device, args.dtype)
    if device.type == "cpu":
        raise UserError("--mixed-precision is for GPUs; on the CPU --dtype auto computes in bf16 where the CPU "
                        "has it natively (--dtype bf16 forces it); drop --mixed-precision, or train on --device cuda "
                        "or mps")
    if device.type == "cuda":  # bf16 in hardware (Ampere and newer), not emulated: lib/device.amp_dtype
        return torch.bfloat16 if torch.cuda.is_bf16_supported(including_emulation=False) else torch.float16
    return torch.bfloat16 if torch.backends.mps.is_macos_or_newer(14, 0) else torch.float16


# --- GradCache: exact in-batch negatives across micro-batches -------------------------------------
def rng_state(device):
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else (
        torch.mps.get_rng_state() if device.type == "mps" else torch.get_rng_state())


def set_rng_state(device, state):
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    elif device.type == "mps":
        torch.mps.set_rng_state(state)
    else:
        torch.set_rng_state(state)


def gradcache_step(model, micro_batches, lam_q, lam_d, amp, scaler):
    """Loss and gradient of the whole effective batch, one micro-batch of activations at a time.

    1. Encode every micro-batch without building a graph; keep only the [rows, vocab] representations
       (and the random-number state each micro-batch started from, so its dropout can be replayed).
    2. Compute the loss of the whole batch on those representations and backpropagate it to them:
       d loss / d rep for every query and document, exactly as one big batch would get.
    3. Encode each micro-batch again, with a graph and the same dropout masks, and backpropagate its
       slice of those gradients into the weights. By the chain rule the sum over micro-batches is the
       full-batch gradient.
    """
    device = micro_batches[0].q_ids.device
    states, q_parts, d_parts = [], [], []
    with torch.no_grad():
        for mb in micro_batches:
            states.append(rng_state(device))
            q_parts.append(unified.encode_batch(model, mb.q_ids, mb.q_mask, amp).float())
            d_parts.append(unified.encode_batch(model, mb.d_ids, mb.d_mask, amp).float())
    end_state = rng_state(device)
    # Documents are laid out micro-batch by micro-batch, each one's positives first.
    q_sizes, d_sizes = [len(q) for q in q_parts], [len(d) for d in d_parts]
    positives = [torch.arange(n, device=device) + sum(d_sizes[:i]) for i, n in enumerate(q_sizes)]
    q_all = torch.cat(q_parts).requires_grad_()
    d_all = torch.cat(d_parts).requires_grad_()
    del q_parts, d_parts  # one copy of the representations at a time
    loss, stats = unified.splade_loss(q_all, d_all, lam_q, lam_d, torch.cat(positives))
    scaler.scale(loss).backward()  # fills q_all.grad and d_all.grad, nothing in the model yet
    q_grads, d_grads = q_all.grad.split(q_sizes), d_all.grad.split(d_sizes)
    # Step 3 needs only those gradients: drop the representations (the loss's graph refers to them too).
    loss, q_all, d_all = loss.detach(), None, None
    for mb, state, gq, gd in zip(micro_batches, states, q_grads, d_grads):
        set_rng_state(device, state)  # the same dropout masks as in step 1
        q = unified.encode_batch(model, mb.q_ids, mb.q_mask, amp).float()
        d = unified.encode_batch(model, mb.d_ids, mb.d_mask, amp).float()
        torch.autograd.backward([q, d], [gq, gd])
    set_rng_state(device, end_state)
    return {"loss": loss.item(), **{key: value.item() for key, value in stats.items()}}


gradcache_step = exercise.swap("gradcache", gradcache_step)  # BYHAND_EXERCISE=gradcache: yours (exercises/)


# --- memory-efficient mode: AdamW moments in CPU memory -------------------------------------------
class OffloadedAdamW:
    """AdamW whose moments and fp32 master weights live in CPU memory (what the original's "offloading" flag named).

    The device keeps only the weights and their gradients: each step copies the gradients to the CPU,
    updates there, and copies the new weights back. 8 bytes per parameter leave the GPU, at the cost
    of two transfers of the model per step.
    """

    def __init__(self, params, lr, weight_decay):
        self.params = params
        self.cpu_params = [p.detach().to("cpu", copy=True).requires_grad_() for p in params]
        self.inner = optim.make_adamw(self.cpu_params, lr, weight_decay, (0.9, 0.999), "cpu")
        self.param_groups = self.inner.param_groups  # the training loop sets the learning rate here

    def step(self):
        for p, c in zip(self.params, self.cpu_params):
            c.grad = None if p.grad is None else p.grad.detach().to("cpu")
        self.inner.step()
        with torch.no_grad():
            for p, c in zip(self.params, self.cpu_params):
                p.copy_(c, non_blocking=True)

    def zero_grad(self, set_to_none=True):
        for p in self.params:
            p.grad = None

    def state_dict(self):
        return self.inner.state_dict()

    def load_state_dict(self, state):
        self.inner.load_state_dict(state)


# --- memory tracking ------------------------------------------------------------------------------
def device_allocated(device):
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device)
    if device.type == "mps":
        return torch.mps.current_allocated_memory()
    return None


def make_after_step(args, device):
    def after_step(step, record):
        note = ""
        if args.memory_efficient:
            # Drop this step's reference cycles before the next step allocates. Generations 0 and 1 take
            # milliseconds; a full collection walks every object torch created and took 1.8 s here.
            gc.collect(1)
            if device.type == "cuda":
                torch.cuda.empty_cache()
            elif device.type == "mps":
                torch.mps.empty_cache()
        if args.memory_tracking and step % args.memory_tracking_interval == 0:
            rss, alloc, peak = devices.resident_bytes(), device_allocated(device), devices.peak_memory_bytes(device)
            record.update(rss=rss, device_allocated=alloc, peak_memory=peak)
            note = f" (rss {metrics.format_bytes(rss)}" + (
                f", {device.type} {metrics.format_bytes(alloc)}" if alloc is not None else "") + ")"
        return note
    return after_step


# --- out of memory: stop, keep the last checkpoint, say what to try -------------------------------
def is_out_of_memory(err):
    """A GPU's out-of-memory error, or the CPU allocator's ("DefaultCPUAllocator: can't allocate memory")."""
    return isinstance(err, torch.OutOfMemoryError) or (isinstance(err, RuntimeError) and (
        "out of memory" in str(err) or "can't allocate memory" in str(err)))


def out_of_memory_advice(args, device, amp):
    path = os.path.join(args.output_dir, checkpoint.WEIGHTS)
    step = checkpoint.weights_step(path) if os.path.isfile(path) else None
    kept = ("no checkpoint was saved yet" if step is None else
            f"the last checkpoint (step {step}) in {args.output_dir} is kept: --resume continues it (with the same "
            f"--batch-size and --gradient-accumulation-steps, fixed flags of a run; changing them is a new run)")
    return f"out of memory on {device}; {kept}; try {memory_advice(args, device, amp)}"


def memory_advice(args, device, amp):
    """The flags that make a step fit, cheapest first: the same result in smaller pieces, then less memory."""
    tries = []
    # Smaller micro-batches, the same effective batch: batch size and accumulation by its smallest factor
    # (2 when even). A batch of 1 cannot be split so.
    b = args.batch_size
    factor = next((f for f in range(2, math.isqrt(b) + 1) if b % f == 0), b if b > 1 else None)
    if factor:
        tries.append(f"--batch-size {b // factor} --gradient-accumulation-steps {args.grad_accum * factor} "
                     f"(the same effective batch, with GradCache)")
    if not args.memory_efficient:
        tries.append("--memory-efficient")
    if device.type != "cpu" and amp is None:  # not autocasting yet (CUDA's --dtype auto already does)
        tries.append("--mixed-precision")
    if args.max_length > 64:
        tries.append(f"--max-length {args.max_length // 2}")
    return ", ".join(tries) or "a smaller model, or a machine with more memory"


# --- run: the unified training with this file's choices ---------------------------------------------
def run(args, run_dir):
    device = choose_device(args.device, args.force_device)
    amp = choose_amp(device, args)
    # GradScaler needs the real optimizer
    offload = args.memory_efficient and device.type != "cpu" and amp != torch.float16
    variant = unified.Variant(
        device=device,
        amp=amp,
        step_fn=gradcache_step if args.grad_accum > 1 else unified.naive_step,  # one micro-batch: nothing to cache
        prepare_model=(lambda model: setattr(model, "gradient_checkpointing", True)) if args.memory_efficient else None,
        make_optimizer=(lambda params, lr, wd, dev: OffloadedAdamW(params, lr, wd)) if offload else None,
        after_step=make_after_step(args, device) if args.memory_efficient or args.memory_tracking else None,
        estimate_kwargs=dict(checkpointing=args.memory_efficient, optimizer_on_cpu=offload,
                             cached_batch=args.batch_size * args.grad_accum if args.grad_accum > 1 else 0),
        memory_hint=f"try {memory_advice(args, device, amp)}",
    )
    try:
        result = unified.run(args, run_dir, variant)
    except (torch.OutOfMemoryError, RuntimeError) as err:
        if not is_out_of_memory(err):
            raise
        raise UserError(out_of_memory_advice(args, device, amp)) from None
    if args.memory_tracking and not args.estimate_memory:
        print(f"memory: peak {metrics.format_bytes(devices.peak_memory_bytes(device))} "
              f"({devices.memory_label(device)}), resident now {metrics.format_bytes(devices.resident_bytes())}")
    return result


if __name__ == "__main__":
    main()
