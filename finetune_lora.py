"""Fine-tune GPT-2 with LoRA: the base model frozen, a low-rank update B @ A trained on chosen layers.

    python finetune_lora.py                                         # train.py's out/train on the stdlib's tests, CPU
    python finetune_lora.py --init-from gpt2 --data my_text --steps 500
    python finetune_lora.py --adapter out/finetune_lora --steps 0 --merge --out-dir out/merged_lora  # evaluate, merge

Every adapted linear computes W x + (alpha / r) B A x with W frozen; only A and B (a fraction of a
percent of the parameters) get gradients and AdamW moments. The adapter is saved in the Hugging Face
PEFT layout; --merge folds it into the base and writes a plain GPT-2 directory. finetune_qlora.py is
this file with the base held in 4-bit NF4, and the two scripts read each other's adapters. Read top to
bottom: arguments, device, base model configuration, data, model, optimiser, training loop, save,
report. The idea and the arithmetic: docs/qlora_explained.md; the code path: docs/qlora_code_walkthrough.md.
"""

import argparse
import math
import os
import signal
import sys

import torch

from lib import checkpoint, data, finetune, guards, lora, memory, metrics, optim, tokenizer
from lib import device as devices
from lib.errors import UserError, report_and_exit


# --- arguments ------------------------------------------------------------------------------------
def make_parser():
    p = argparse.ArgumentParser(
        description="Fine-tune GPT-2 with LoRA adapters on a frozen base (PEFT-layout adapters, optional merge).",
        formatter_class=guards.HelpFormatter,
    )
    finetune.add_arguments(p, out_dir="out/finetune_lora", dtype_help=(
        "autocast dtype; auto = bf16 on CUDA (fp16 + GradScaler without bf16), fp32 on CPU/MPS. Under 16-bit "
        "autocast the frozen block weights are stored in that dtype (LoRA's A and B stay fp32)"))
    return p


def main(argv=None):
    parser = make_parser()
    args = parser.parse_args(argv)  # a bad value ends here: one usage line, exit 2
    try:
        return run(args, parser, argv)
    except UserError as e:
        report_and_exit(e)


def run(args, parser, argv=None):
    finetune.check_arguments(args)
    log = print

    # --- device -----------------------------------------------------------------------------------
    device = devices.pick_device(args.device)
    devices.seed_everything(args.seed)
    amp = devices.amp_dtype(device, args.dtype)
    if amp is not None and device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    # The frozen block weights are never updated, so they need no fp32 master copy: under 16-bit
    # autocast they are stored in that dtype (half the bytes, and nothing for autocast to copy).
    # A and B are updated by tiny steps, so they stay fp32.
    base_dtype = amp or torch.float32
    base_name = finetune.dtype_name(amp)
    lora_dtype = torch.float32

    # --- base model configuration, and every check that needs no work ------------------------------
    # Paths, the run saved in --out-dir (--resume continues it, nothing replaces it without
    # --overwrite), the base's config.json, --resume's flags, the --adapter files: all before any work.
    state, settings, cfg = finetune.resolve_run(args, parser, argv, log)
    block_size = args.block_size or cfg.block_size
    if block_size > cfg.block_size:
        raise UserError(f"--block-size {block_size} exceeds the base model's {cfg.block_size} positions; use at most {cfg.block_size}")
    if cfg.vocab_size < tokenizer.VOCAB_SIZE:
        raise UserError(f"vocabulary mismatch: the base has vocab_size {cfg.vocab_size}, the GPT-2 tokenizer needs "
                        f"{tokenizer.VOCAB_SIZE}; use a GPT-2 checkpoint")
    tokens_per_step = args.batch_size * block_size * args.grad_accum
    log(f"base: {state['base'] if state else args.init_from or finetune.DEFAULT_BASE} ({cfg.n_layer} layers, "
        f"{cfg.n_head} heads, {cfg.n_embd} wide), block weights in {base_name}; LoRA r={settings['r']} "
        f"alpha={settings['alpha']:g} on {', '.join(settings['targets'])}; device {device}, "
        f"{finetune.dtype_name(amp)}{' autocast' if amp else ''}; {tokens_per_step:,} tokens per step")
    estimate = memory.estimate_lora_finetuning(cfg, args.batch_size, block_size, device.type, amp is not None, base_name,
                                               settings["targets"], settings["r"], lora_bytes=4, lora_dropout=settings["dropout"])
    if args.estimate_memory:
        log(memory.format_table(estimate))
        return estimate
    guards.check_memory(sum(estimate.values()), device, args.force, "lower --batch-size or --block-size, adapt fewer "
                        "--lora-targets, or hold the base in 4 bits with finetune_qlora.py")
    model_dir = finetune.base_weights(args, state, cfg, log)  # a hub id's weights are downloaded now

    # --- data -------------------------------------------------------------------------------------
    data_dir = data.prepare(args.data, args.cache_dir, log=log)
    train_batches = data.Batches(data.TokenSplit(data_dir, "train"), args.batch_size, block_size, args.grad_accum, seed=args.seed)
    val_batches = data.Batches(data.TokenSplit(data_dir, "val"), args.batch_size, block_size, 1, seed=args.seed + 1)

    # --- model: the frozen base, then LoRA on the chosen layers -----------------------------------
    devices.reset_peak_memory(device)  # count fine-tuning, not tokenisation
    model = finetune.load_base(model_dir, device, convert_linear=lambda name, linear: linear.to(base_dtype))
    torch.manual_seed(args.seed)  # A's random initialisation (B starts at zero)
    if args.adapter:
        finetune.load_adapter(model, args.adapter, dtype=lora_dtype)
        log(f"loaded the adapter in {args.adapter}")
    else:
        lora.apply_lora(model, settings["targets"], settings["r"], settings["alpha"], settings["dropout"],
                        settings["rslora"], dtype=lora_dtype)
    if state is not None:
        finetune.restore_trainable(model, state["trainable"], os.path.join(args.out_dir, checkpoint.STATE))
    n_lora, n_total = lora.count_parameters(model)
    log(f"trainable parameters: {n_lora:,} of {n_total:,} ({100 * n_lora / n_total:.3f}%)")

    # --- optimiser: only the LoRA matrices ---------------------------------------------------------
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = optim.make_adamw(params, args.lr, args.weight_decay, (args.beta1, args.beta2), device.type)
    scaler = torch.amp.GradScaler(device.type, enabled=amp == torch.float16)
    start_step, first_val = 0, None
    if state is not None:
        optimizer.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["rng_cpu"])
        if state["rng_cuda"] and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["rng_cuda"])
        start_step, first_val = state["step"], state["first_val_loss"]
        log(f"resuming from step {start_step} in {args.out_dir}")

    # --- training loop ----------------------------------------------------------------------------
    metrics_path = os.path.join(args.out_dir, "metrics.jsonl")
    guards.start_metrics(metrics_path, args.resume)  # a fresh run's log starts empty; --resume appends
    metrics_log = metrics.MetricsLog(metrics_path)
    metrics_log.log(event="start", seed=args.seed, step=start_step, device=str(device), dtype=finetune.dtype_name(amp),
                    base=model_dir, lora=settings,
                    n_params=n_total, n_trainable=n_lora, config=vars(cfg), args=vars(args))
    sample_before = None
    if args.sample_tokens > 0:
        sample_before = finetune.sample(model, args, device, amp)
        log(f"sample before fine-tuning (step {start_step}):\n" + "-" * 40 + "\n" + sample_before + "\n" + "-" * 40)
    peak_flops = metrics.peak_flops_for(device, args.peak_flops)
    flops_per_step = finetune.flops_per_token(n_total, n_lora, cfg.n_layer, cfg.n_embd, block_size) * tokens_per_step
    speed = metrics.Throughput(args.steps, start_step)
    # next_step moves only once optimizer.step() has run: an interrupt anywhere in a step saves a
    # state that --resume continues without repeating or skipping an update.
    step = next_step = start_step
    # The last step saved with finite weights: what a stop for NaN names (None: nothing saved yet).
    last_finite = start_step if state is not None else None
    val_loss = None
    try:
        for step in range(start_step, args.steps):
            if step % args.eval_interval == 0:
                val_loss = finetune.evaluate(model, val_batches, args.eval_batches, device, amp)
                first_val = val_loss if first_val is None else first_val
                log(f"step {step}: held-out loss {val_loss:.4f}")
                metrics_log.log(step=step, val_loss=val_loss)

            lr = optim.lr_at(step, args.lr, args.warmup_steps, args.steps, args.min_lr_ratio)
            for group in optimizer.param_groups:
                group["lr"] = lr
            loss_sum = torch.zeros((), device=device)
            for micro in range(args.grad_accum):
                x, y = train_batches.get(step, micro, device)
                with devices.autocast(device, amp):
                    loss = model(x, y)[1]  # not `_, loss =`: holding the logits would keep B x T x vocab alive
                loss = loss / args.grad_accum  # so the accumulated gradient is the batch mean
                scaler.scale(loss).backward()  # reaches A and B only: nothing else requires grad
                loss_sum += loss.detach()
            loss_value = loss_sum.item()
            if not math.isfinite(loss_value):
                raise UserError(f"loss became {loss_value} at step {step}; stopped before the update, "
                                f"{guards.last_finite_text(last_finite, args.out_dir)}; lower --lr or check the data")
            scaler.unscale_(optimizer)
            grad_norm = torch.nn.utils.clip_grad_norm_(params, args.grad_clip or float("inf")).item()
            skipped = not math.isfinite(grad_norm)
            if skipped:  # as GradScaler does: a NaN or inf gradient never reaches A and B
                log(f"step {step}: gradient norm is {grad_norm}; update skipped")
            else:
                scaler.step(optimizer)
            next_step = step + 1
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            speed.add(tokens_per_step)

            record = dict(step=step, loss=loss_value, lr=lr, grad_norm=None if skipped else grad_norm, skipped=skipped)
            if step % args.log_interval == 0 or step == args.steps - 1:
                devices.synchronize(device)
                tok_s, sec_per_step, eta = speed.report(step + 1)
                mfu = flops_per_step / sec_per_step / peak_flops if peak_flops else None
                mem = devices.peak_memory_bytes(device)
                record.update(tokens_per_s=round(tok_s), mfu=mfu, peak_memory=mem)
                log(metrics.progress_line(step, args.steps, loss_value, lr, tok_s, mfu, mem, eta))
            metrics_log.log(**record)

            if (step + 1) % args.save_interval == 0 and step + 1 < args.steps:
                last_finite = finetune.save(args.out_dir, model, optimizer, step + 1, model_dir, settings, first_val,
                                            amp, args, last_finite)
        step = max(args.steps, start_step)
    except KeyboardInterrupt:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut the save short
        finetune.save(args.out_dir, model, optimizer, next_step, model_dir, settings, first_val, amp, args, last_finite)
        print(f"\ninterrupted: saved step {next_step} to {args.out_dir}; continue with --resume", file=sys.stderr)
        sys.exit(130)

    # --- save -------------------------------------------------------------------------------------
    val_loss = finetune.evaluate(model, val_batches, args.eval_batches, device, amp)
    first_val = val_loss if first_val is None else first_val
    metrics_log.log(step=step, val_loss=val_loss)
    trained = step > start_step
    if trained:
        finetune.save(args.out_dir, model, optimizer, step, model_dir, settings, first_val, amp, args, last_finite)
        log(f"saved the adapter to {args.out_dir}/{lora.CONFIG_NAME} and {lora.WEIGHTS_NAME} (PEFT layout), "
            f"and {checkpoint.STATE} for --resume")

    # --- report -----------------------------------------------------------------------------------
    peak = devices.peak_memory_bytes(device)
    log(memory.format_table(estimate, peak, f"measured ({devices.memory_label(device)})"))
    log(f"held-out loss on {args.data}: {first_val:.4f} before, {val_loss:.4f} after ({val_loss - first_val:+.4f})"
        if trained else f"held-out loss on {args.data}: {val_loss:.4f} (no training steps run)")
    sample_after = None
    if args.sample_tokens > 0 and trained:
        sample_after = finetune.sample(model, args, device, amp)
        log("sample after fine-tuning (same prompt, same seed):\n" + "-" * 40 + "\n" + sample_after + "\n" + "-" * 40)
    merged_dir = None
    if args.merge:
        # A fresh fp32 copy of the base (the training copy may be 16-bit) with this adapter folded in.
        merged = finetune.load_base(model_dir, "cpu")
        lora.apply_lora(merged, settings["targets"], settings["r"], settings["alpha"], 0.0, settings["rslora"])
        finetune.restore_trainable(merged, finetune.trainable_state(model), "the trained model")
        merged_dir = finetune.save_merged(merged, cfg, args.out_dir)
        log(f"merged base + adapter into {merged_dir} (Hugging Face GPT-2 layout; python train.py --init-from {merged_dir})")
    metrics_log.log(event="end", step=step, val_loss=val_loss, first_val_loss=first_val, peak_memory=peak,
                    memory_estimate=sum(estimate.values()), sample_before=sample_before, sample_after=sample_after)
    return {"val_loss": val_loss, "first_val_loss": first_val, "peak_memory": peak, "estimate": estimate,
            "n_trainable": n_lora, "merged_dir": merged_dir, "model": model}


if __name__ == "__main__":
    main()
