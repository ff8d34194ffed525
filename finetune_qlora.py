"""Fine-tune GPT-2 with QLoRA: the frozen base held in 4-bit NF4, LoRA adapters trained on top.

    python finetune_qlora.py                                        # train.py's out/train on the stdlib's tests, CPU
    python finetune_qlora.py --init-from gpt2-medium --data my_text --steps 500
    python finetune_qlora.py --adapter out/finetune_lora --steps 0  # evaluate a LoRA adapter on the NF4 base

This is finetune_lora.py with one change to the model: as the base is read, every linear inside the
transformer blocks is quantised to NF4 (lib/nf4.py: 16 codes at normal quantiles, one absmax per
64 weights, the absmaxes themselves in 8 bits), about 4.13 bits per weight instead of 32. Forward
and backward dequantise one layer at a time. The token and position embeddings, the LayerNorms and
the LM head (tied to the token embedding) stay fp32: they are a lookup table and a few vectors, not
matmuls whose weights dominate memory as the model grows, and the tied head turns the last hidden
state into the logits, where quantisation error costs the most.

The recipe itself (checks, data, LoRA, the optimiser, the training loop, saving and --resume, the
report) is finetune_lora.run, imported, not copied; adapters have the same format, so each script
reads the other's. What this file holds is that change and what follows from it, in reading order:
1. arguments: finetune_lora.py's, plus --lora-dtype, --nf4-block-size and --no-double-quant (fixed
   on --resume), its own --dtype help and out/finetune_qlora;
then, in recipe_for(), the finetune_lora.Recipe that run() follows (--dtype auto is lib/device.amp_dtype's, as in
every script: on a CPU, bf16 where it is native, else fp32):
2. the base quantised to NF4 as it is read (lib/nf4.LinearNF4), its block size, double quantisation;
3. A and B in bf16 on a GPU computing in bf16, as the QLoRA paper does (--lora-dtype);
4. the memory estimate for an NF4 base;
5. --merge dequantises the trained model, adds B @ A * scale and writes a full-precision directory.
The idea and the arithmetic: docs/qlora_explained.md; the code path: docs/qlora_code_walkthrough.md.
"""

import dataclasses
import sys

import torch

import finetune_lora
from lib import device as devices
from lib import guards
from lib.errors import UserError, report_and_exit
from lib.nf4 import LinearNF4


# --- 1. arguments: finetune_lora.py's, plus the QLoRA group ---------------------------------------
def make_parser():
    p = finetune_lora.make_parser(
        "Fine-tune GPT-2 with QLoRA: NF4 base, LoRA adapters (PEFT layout, shared with finetune_lora.py).",
        "out/finetune_qlora", dtype_help=(
            "compute dtype: NF4 weights are dequantised to it and autocast runs in it; auto = bf16 on CUDA (fp16 + "
            "GradScaler without bf16) and on a CPU with native bf16 (AVX512-BF16 or AMX), else fp32; a --resume "
            "keeps the saved run's"))
    g = p.add_argument_group("QLoRA")
    g.add_argument("--lora-dtype", default="auto", choices=["auto", "fp32", "bf16"],
                   help="dtype of A and B and their AdamW moments; auto = bf16 on CUDA when computing in bf16 (as "
                   "the QLoRA paper), else fp32")
    g.add_argument("--nf4-block-size", type=guards.positive_int, default=64,
                   help="weights sharing one absmax (even: two 4-bit codes share a byte)")
    g.add_argument("--no-double-quant", action="store_true", help="keep the absmaxes in fp32 instead of int8")
    return p


# The run directory: finetune_lora.py's, plus the NF4 settings and the dtype of A and B, which make the
# run what it is too.
RUN = dataclasses.replace(finetune_lora.RUN,
                          fixed=(*finetune_lora.RUN.fixed, "nf4_block_size", "no_double_quant", "lora_dtype"))


def main(argv=None):
    parser = make_parser()
    args = parser.parse_args(argv)  # a bad value ends here: one usage line, exit 2
    if argv is None:  # a command-line run: the heap gives back what it frees (lib/memory.py)
        devices.steady_cpu_heap()
    try:
        if args.nf4_block_size % 2:
            raise UserError(f"--nf4-block-size must be an even number (two codes share a byte), got "
                            f"{args.nf4_block_size}")
        return finetune_lora.run(args, parser, sys.argv[1:] if argv is None else list(argv), RUN, recipe_for)
    except (UserError, KeyboardInterrupt) as e:  # Ctrl-C or SIGTERM outside the loop: one line, 130 or 143
        report_and_exit(e)


# --- 2-5. how the base and A and B are held ----------------------------------------------------------
def recipe_for(args, device, amp) -> finetune_lora.Recipe:
    """The NF4 base, the LoRA dtype, the estimate and the merge; finetune_lora.run does the rest."""
    double_quant = not args.no_double_quant
    return finetune_lora.Recipe(
        # 2. Each block linear quantised to NF4 the moment it is read: no full-precision model ever exists.
        base="nf4",
        convert_linear=lambda name, linear: LinearNF4.from_linear(linear, args.nf4_block_size, double_quant),
        held=f"NF4 (blocks of {args.nf4_block_size}, double quantisation {'on' if double_quant else 'off'})",
        # 3. A and B in bf16 on a GPU computing in bf16, as the QLoRA paper does (half the optimizer bytes);
        # elsewhere fp32 master weights, which cost nothing measurable on a CPU and fp16 needs anyway.
        lora_dtype={"fp32": torch.float32, "bf16": torch.bfloat16}.get(
            args.lora_dtype, torch.bfloat16 if amp == torch.bfloat16 and device.type == "cuda" else torch.float32),
        # 4. The estimate's NF4 bytes: 4 bits per weight plus one absmax per block (in 8 bits when double).
        estimate_kwargs=dict(nf4_block_size=args.nf4_block_size, double_quant=double_quant),
        # 5. --merge folds A and B into the model that was trained, its NF4 weights dequantised to fp32 (the
        # base the adapter learnt against), not into a fresh fp32 copy of the original base.
        merge_in_place=True,
        memory_hint="lower --batch-size or --block-size, or pick a smaller base")


if __name__ == "__main__":
    main()
