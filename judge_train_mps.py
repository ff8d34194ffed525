"""Fine-tune an instruct LLM as a translation judge with LoRA on an fp32 base: the laptop version.

    python judge_train_mps.py --model tiny                 # offline demo: tiny base, embedded judge set, minutes on CPU
    python judge_train_mps.py --epochs 3                   # Qwen/Qwen2-1.5B-Instruct from the hub, MPS (CPU fallback)
    python judge_train_mps.py --model meta-llama/Llama-3.2-1B-Instruct --epochs 1 --max_samples 50 --test_samples 20
    python judge_train_mps.py --model Qwen/Qwen2-1.5B-Instruct --estimate-memory

Given a source sentence, a translation and a reference, the judge answers `Score: X/10` and then
`Feedback: ...`. The recipe, decided here: the Qwen2 / Llama 3 base (lib/llama.py) is frozen in
fp32, LoRA adapters (lib/lora.py) train on q_proj, k_proj, v_proj and o_proj with the original
scripts' rank (16, alpha 32, for 1-3B parameters; 8/16 otherwise), dropout 0.05, plain AdamW at
lr 1e-4, gradient clipping at 1.0. fp32 because MPS's 16-bit autocast is slow and fragile and a
CPU gains nothing from it; on MPS the allocator's cache is emptied every 5 steps, and there is no
pinned memory and no data-loader worker (tokenised conversations are batched in the loop).

Everything that does not depend on those decisions is in lib/judge.py and shared with
judge_train_cuda.py, which holds the same base in NF4 and adds mixed precision, gradient
checkpointing and 8-bit AdamW: the chat-template data with the loss on the answer only, the
embedded judge set, warmup + cosine decay, validation loss every --eval_steps with the best adapter
saved (PEFT layout, readable by either script and by PEFT), early stopping (patience 3, min_delta
0.005), exact --resume, and the test evaluation (greedy decoding; MAE, RMSE, Cohen's kappa, Pearson
r, ROUGE-L F1, unparseable answers) into test_predictions.json and metrics.jsonl.

--model tiny builds (once, cached) a 2-layer Qwen2-shaped base with its own small tokenizer,
pretrained on judge conversations whose scores ignore the errors, so the untrained judge writes the
format but grades at random; the demo then shows what fine-tuning adds (lib/judge.tiny_base).
Comparing the two scripts: docs/judge_mps_vs_cuda.md.
"""

import argparse
import sys

import torch

from lib import device as devices
from lib import guards, judge
from lib.errors import UserError, report_and_exit

SCRIPT = "judge_train_mps"


# --- arguments ------------------------------------------------------------------------------------
def build_parser():
    p = argparse.ArgumentParser(description="Fine-tune a LoRA translation judge on an fp32 base (Apple MPS or CPU).",
                                formatter_class=guards.HelpFormatter)
    judge.add_arguments(p, SCRIPT, model="Qwen/Qwen2-1.5B-Instruct", lr=1e-4, batch_size=1, accumulation=2)
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
    judge.resolve_defaults(args, lr=1e-4, batch_size=1, accumulation=2)

    # --- device: MPS, else CPU (CUDA only when asked for: that is judge_train_cuda.py's job) ----------
    if args.device:
        device = devices.pick_device(args.device)
    elif torch.backends.mps.is_available():
        device = torch.device("mps")
    else:
        device = torch.device("cpu")
        if args.model != judge.TINY and not args.estimate_memory:
            print("warning: MPS is not available; training on the CPU (slow for a 1.5B model)", file=sys.stderr)
    devices.seed_everything(args.seed)

    # --- the recipe: fp32 base, fp32 LoRA, AdamW; the loop, saving and report are lib/judge.run -----
    variant = judge.Variant(script=SCRIPT, device=device, amp=None, base="fp32", base_dtype=torch.float32,
                            optimizer="adamw", max_grad_norm=1.0, checkpointing=False, empty_cache_every=5)
    return judge.run(args, variant, parser, argv)


if __name__ == "__main__":
    main()
