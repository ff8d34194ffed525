"""Fine-tune an instruct LLM as a translation judge with QLoRA: judge_train_mps.py for an NVIDIA GPU.

    python judge_train_cuda.py --epochs 3                  # Qwen/Qwen2.5-3B-Instruct, NF4 + LoRA, 8-bit AdamW
    python judge_train_cuda.py --no_4bit --batch_size 1 --gradient_accumulation 4
    python judge_train_cuda.py --paged                     # optimizer state in pinned host memory
    python judge_train_cuda.py --model tiny                # the offline demo, on CPU when there is no GPU

Everything else (the data and the loss on the answer only, LoRA, the schedule, the training loop
with validation and early stopping, saving and --resume, the test metrics) is judge_train_mps.py's,
imported, not copied; the adapters are interchangeable between the two scripts. What this file
changes, all in recipe_for() below:
1. The frozen base is held in NF4 with double quantisation (lib/nf4.py): every decoder linear is
   quantised as it is read from the safetensors file, 4.13 bits per weight; --no_4bit keeps it in
   16 bits instead. Embeddings and norms stay in the compute dtype.
2. Mixed precision: bf16 autocast where the GPU supports it, else fp16 autocast with a GradScaler
   (fp16 gradients underflow without the scaling; judge_train_mps.py's loop scales the loss, unscales
   before clipping and lets the scaler skip an overflowing step whenever recipe.amp is fp16). The
   LoRA matrices stay fp32 master weights.
3. Gradient checkpointing: each decoder layer keeps only its input; its insides are recomputed in
   backward, trading about a third more compute for activations that no longer grow with depth.
4. 8-bit AdamW, by hand (lib/adam8bit.py): both moments in one byte per parameter with bitsandbytes'
   block-wise dynamic quantisation; --paged keeps that state in pinned CPU memory and streams it to
   the GPU for each parameter's update. Gradients are clipped at 0.3 and the learning rate is 2e-4,
   as in the original.
Without CUDA it warns and runs on the CPU in fp32 (NF4 dequantises to fp32 there), slowly.
"""

import dataclasses
import sys

import torch

import judge_train_mps as mps
from lib import device as devices
from lib import guards
from lib.adam8bit import AdamW8bit
from lib.errors import UserError, report_and_exit
from lib.nf4 import LinearNF4

SCRIPT = "judge_train_cuda"
DEFAULTS = dict(model="Qwen/Qwen2.5-3B-Instruct", lr=2e-4, batch_size=2, gradient_accumulation=2)


# --- arguments: the MPS script's, plus the quantisation and paging switches ----------------------------
def build_parser():
    p = mps.build_parser(SCRIPT, "Fine-tune a QLoRA translation judge (NF4 base, mixed precision, 8-bit AdamW, "
                         "gradient checkpointing) on an NVIDIA GPU.", DEFAULTS)
    g = p.add_argument_group("CUDA recipe")
    g.add_argument("--no_4bit", "--no-4bit", action="store_true",
                   help="keep the base in 16 bits (bf16, or fp16 without bf16 support) instead of NF4")
    g.add_argument("--paged", action="store_true",
                   help="8-bit AdamW state in pinned CPU memory, streamed to the GPU per parameter update")
    g.add_argument("--no_gradient_checkpointing", "--no-gradient-checkpointing", action="store_true",
                   help="keep every layer's activations instead of recomputing them in backward")
    g.add_argument("--max_grad_norm", "--max-grad-norm", type=guards.positive_float, default=0.3,
                   help="clip the gradient norm to this (low: 4-bit bases give spikier gradients)")
    return p


# The run contract: the MPS script's, plus these flags. How the base is held changes what the run is;
# paging, checkpointing and clipping may change on --resume (the state is the same either way).
RUN = dataclasses.replace(mps.RUN, fixed=(*mps.RUN.fixed, "no_4bit"),
                          changeable=(*mps.RUN.changeable, "paged", "no_gradient_checkpointing", "max_grad_norm"))


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return mps.run(args, parser, argv, spec=RUN, defaults=DEFAULTS, recipe_for=recipe_for)
    except (UserError, KeyboardInterrupt) as e:  # Ctrl-C or SIGTERM outside the loop: one line, 130 or 143
        report_and_exit(e)


# --- the four differences ----------------------------------------------------------------------------
def nf4_linear(name, linear):
    """1. NF4: 16 levels at the normal distribution's quantiles, one absmax per 64 weights, the absmaxes
    themselves in 8 bits (double quantisation); forward and backward dequantise one layer at a time."""
    return LinearNF4.from_linear(linear, block_size=64, double_quant=True)


def recipe_for(args) -> mps.Recipe:
    """CUDA, else the CPU with a warning; then the four choices that make this QLoRA."""
    device = devices.pick_device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type != "cuda" and not args.estimate_memory:
        print(f"warning: CUDA is not available; running on {device.type} in fp32 (NF4 and 8-bit AdamW work there, "
              f"slowly)", file=sys.stderr)
    # 2. Mixed precision: bf16 where the GPU has it, else fp16 (whose GradScaler the loop turns on).
    amp = devices.amp_dtype(device) if device.type == "cuda" else None
    compute = amp or torch.float32
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True  # fp32 matmuls outside autocast use TF32
    # 1. The base in NF4, or with --no_4bit in the 16-bit compute dtype.
    base = "nf4" if not args.no_4bit else {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(compute, "fp32")
    return mps.Recipe(
        device=device, base=base, base_dtype=compute, amp=amp,
        convert_linear=nf4_linear if base == "nf4" else None,
        # 3. Gradient checkpointing: lib/llama.py recomputes each decoder layer in backward.
        checkpointing=not args.no_gradient_checkpointing,
        # 4. 8-bit AdamW (paged: its state in pinned host memory), with the original's clipping.
        optimizer="paged_adamw8bit" if args.paged else "adamw8bit",
        make_optimizer=lambda params, lr: AdamW8bit(params, lr=lr, weight_decay=0.01, paged=args.paged),
        max_grad_norm=args.max_grad_norm,
        # On a CPU: NF4 dequantises every linear in each forward and recompute, small temporaries whose holes
        # glibc's heap cannot reuse; mapping blocks from 128 KiB keeps the peak at the tensors (lib/memory.py).
        cpu_heap_threshold=128 * 1024)


if __name__ == "__main__":
    main()
