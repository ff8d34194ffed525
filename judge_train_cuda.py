"""Fine-tune an instruct LLM as a translation judge with QLoRA: judge_train_mps.py for an NVIDIA GPU.

    python judge_train_cuda.py --epochs 3                  # Qwen/Qwen2.5-3B-Instruct, NF4 + LoRA, 8-bit AdamW
    python judge_train_cuda.py --no_4bit --batch_size 1 --gradient_accumulation 4
    python judge_train_cuda.py --paged                     # optimizer state in pinned host memory
    python judge_train_cuda.py --model tiny                # the offline demo, on CPU when there is no GPU

This is judge_train_mps.py with four changes, all made in this file; the data, the loop, the
adapters, early stopping, --resume and the test metrics are the same code (lib/judge.py), and the
adapters are interchangeable between the two scripts.
1. The frozen base is held in NF4 with double quantisation (lib/nf4.py): every decoder linear is
   quantised as it is read from the safetensors file, 4.13 bits per weight; --no_4bit keeps it in
   16 bits instead. Embeddings and norms stay in the compute dtype.
2. Mixed precision: bf16 autocast where the GPU supports it, else fp16 autocast with a GradScaler
   (fp16 gradients underflow without the scaling). The LoRA matrices stay fp32 master weights.
3. Gradient checkpointing: each decoder layer keeps only its input; its insides are recomputed in
   backward, trading about a third more compute for activations that no longer grow with depth.
4. 8-bit AdamW, by hand (lib/adam8bit.py): both moments in one byte per parameter with bitsandbytes'
   block-wise dynamic quantisation; --paged keeps that state in pinned CPU memory and streams it to
   the GPU for each parameter's update. Gradients are clipped at 0.3 and the learning rate is 2e-4,
   as in the original.
Without CUDA it warns and runs on the CPU in fp32 (NF4 dequantises to fp32 there), slowly.
"""

import argparse
import sys

import torch

from lib import device as devices
from lib import guards, judge
from lib.errors import UserError, report_and_exit

SCRIPT = "judge_train_cuda"


# --- arguments: the MPS script's, plus the quantisation and paging switches -------------------------
def build_parser():
    p = argparse.ArgumentParser(description="Fine-tune a QLoRA translation judge (NF4 base, mixed precision, "
                                "8-bit AdamW, gradient checkpointing) on an NVIDIA GPU.",
                                formatter_class=guards.HelpFormatter)
    judge.add_arguments(p, SCRIPT, model="Qwen/Qwen2.5-3B-Instruct", lr=2e-4, batch_size=2, accumulation=2)
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


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return run(args, parser, argv)
    except UserError as e:
        report_and_exit(e)
    except KeyboardInterrupt:  # before the training loop, which saves and exits 130 itself
        print("\ninterrupted before training started; nothing was saved", file=sys.stderr)
        sys.exit(130)


def run(args, parser=None, argv=None):
    judge.resolve_defaults(args, lr=2e-4, batch_size=2, accumulation=2)

    # --- device: CUDA; without it the CPU, with a warning ---------------------------------------------
    device = devices.pick_device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type != "cuda" and not args.estimate_memory:
        print(f"warning: CUDA is not available; running on {device.type} in fp32 (NF4 and 8-bit AdamW work there, "
              f"slowly)", file=sys.stderr)
    devices.seed_everything(args.seed)

    # --- precision: bf16 where supported, else fp16 + GradScaler; fp32 off the GPU ----------------------
    amp = devices.amp_dtype(device) if device.type == "cuda" else None
    base_dtype = amp or torch.float32
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True

    # --- the recipe: NF4 (or 16-bit) base, checkpointing, 8-bit AdamW; the loop is lib/judge.run ------
    variant = judge.Variant(
        script=SCRIPT, device=device, amp=amp, base_dtype=base_dtype,
        base="nf4" if not args.no_4bit else {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(base_dtype, "fp32"),
        optimizer="paged_adamw8bit" if args.paged else "adamw8bit",
        max_grad_norm=args.max_grad_norm, checkpointing=not args.no_gradient_checkpointing)
    return judge.run(args, variant, parser, argv)


if __name__ == "__main__":
    main()
