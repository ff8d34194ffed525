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
state into the logits, where quantisation error costs the most. Adapters have the same format as
finetune_lora.py's, so each script reads the other's. --merge dequantises, adds B @ A * scale and
writes a full-precision Hugging Face directory. Read top to bottom: arguments, device, base model
configuration, data, model, optimiser, training loop, save, report. The idea and the arithmetic:
docs/qlora_explained.md; the code path: docs/qlora_code_walkthrough.md.
"""

import argparse
import math
import os
import sys
import time

import torch

from lib import checkpoint, data, finetune, guards, lora, memory, metrics, nf4, optim, rundir
from lib import device as devices
from lib.errors import UserError, report_and_exit


def pick_cpu_dtype(model, x, y):
    """--dtype auto on a CPU: time one forward + backward of this model on one training micro-batch in
    fp32 and under bf16 autocast (each after a warm-up call) and return the faster (None = fp32; bf16
    must win by 10%) and the timings. Which one wins depends on the CPU (AMX or AVX512-BF16 units make bf16 matmuls fast)
    and on the model: measured on a 2-core Xeon with AMX, bf16 was 2-4x faster for a gpt2-sized model
    and slower for train.py's tiny one (docs/qlora_explained.md). RNG state and gradients are kept."""
    seconds = {}
    with torch.random.fork_rng(devices=[]):
        for dtype in (None, torch.bfloat16):
            for _ in range(2):  # the first call warms up the kernels, the second is timed
                t0 = time.perf_counter()
                with devices.autocast(x.device, dtype):
                    loss = model(x, y)[1]
                loss.backward()
                seconds[dtype] = time.perf_counter() - t0
    model.zero_grad(set_to_none=True)
    # bf16 only when clearly faster: in a near tie keep fp32, the exact one and the CPU default.
    return (torch.bfloat16 if seconds[torch.bfloat16] < 0.9 * seconds[None] else None), seconds


# --- arguments ------------------------------------------------------------------------------------
def make_parser():
    p = argparse.ArgumentParser(
        description="Fine-tune GPT-2 with QLoRA: NF4 base, LoRA adapters (PEFT layout, shared with finetune_lora.py).",
        formatter_class=guards.HelpFormatter,
    )
    finetune.add_arguments(p, out_dir="out/finetune_qlora", dtype_help=(
        "compute dtype: NF4 weights are dequantised to it and autocast runs in it; auto = bf16 on CUDA (fp16 + "
        "GradScaler without bf16), fp32 on MPS, and on a CPU whichever of fp32 and bf16 runs a step of this model "
        "faster (timed before training)"))
    g = p.add_argument_group("QLoRA")
    g.add_argument("--lora-dtype", default="auto", choices=["auto", "fp32", "bf16"],
                   help="dtype of A and B and their AdamW moments; auto = bf16 on CUDA when computing in bf16 (as "
                   "the QLoRA paper), else fp32")
    g.add_argument("--nf4-block-size", type=guards.positive_int, default=64,
                   help="weights sharing one absmax (even: two 4-bit codes share a byte)")
    g.add_argument("--no-double-quant", action="store_true", help="keep the absmaxes in fp32 instead of int8")
    return p


# The run directory (lib/rundir.py): finetune_lora.py's, plus the NF4 settings and the dtype of A and B, which
# make the run what it is too.
RUN = rundir.Spec(saved=finetune.SAVED, optional=finetune.OPTIONAL, written=finetune.WRITTEN,
                  fixed=(*finetune.FIXED, "nf4_block_size", "no_double_quant", "lora_dtype"),
                  changeable=finetune.CHANGEABLE, data=("data",))


def main(argv=None):
    parser = make_parser()
    args = parser.parse_args(argv)  # a bad value ends here: one usage line, exit 2
    try:
        return run(args, parser, sys.argv[1:] if argv is None else list(argv))
    except UserError as e:
        report_and_exit(e)


def run(args, parser, argv):
    # --- checks before any work: the flags, the run directory, the base and the adapter ------------
    finetune.check_arguments(args)
    if args.nf4_block_size % 2:
        raise UserError(f"--nf4-block-size must be an even number (two codes share a byte), got {args.nf4_block_size}")
    # A saved run is never replaced without --overwrite; --resume validates every saved file and takes the
    # saved run's flags (lib/rundir.py). Then the base's config.json and the --adapter files are checked.
    run_dir = rundir.prepare(args, parser, argv, RUN, writes=not args.estimate_memory)
    state, settings, cfg = finetune.resolve_run(args, run_dir)
    log = print

    # --- device -----------------------------------------------------------------------------------
    device = devices.pick_device(args.device)
    devices.seed_everything(args.seed)
    amp = devices.amp_dtype(device, args.dtype)  # auto on a CPU: fp32 until pick_cpu_dtype has timed both
    probe_cpu_dtype = args.dtype == "auto" and device.type == "cpu"
    if amp is not None and device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    # A and B in bf16 on a GPU computing in bf16, as the QLoRA paper does (half the optimizer bytes);
    # elsewhere fp32 master weights, which cost nothing measurable on a CPU and fp16 needs anyway.
    lora_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}.get(
        args.lora_dtype, torch.bfloat16 if amp == torch.bfloat16 and device.type == "cuda" else torch.float32)
    double_quant = not args.no_double_quant

    # --- memory: the estimate, and the check before anything is allocated or downloaded --------------
    tokens_per_step = args.batch_size * args.block_size * args.grad_accum
    compute = "fp32 or bf16 (timed before training)" if probe_cpu_dtype else \
        finetune.dtype_name(amp) + (" autocast" if amp else "")
    log(f"base: {state['base'] if state else args.init_from} ({cfg.n_layer} layers, {cfg.n_head} heads, "
        f"{cfg.n_embd} wide), block weights in NF4 (blocks of {args.nf4_block_size}, double quantisation "
        f"{'on' if double_quant else 'off'}); LoRA r={settings['r']} alpha={settings['alpha']:g} on "
        f"{', '.join(settings['targets'])} in {'bf16' if lora_dtype == torch.bfloat16 else 'fp32'}; "
        f"device {device}, {compute}; {tokens_per_step:,} tokens per step")

    def estimate_for(amp):  # called again once --dtype auto has picked the CPU's dtype
        return memory.estimate_lora_finetuning(cfg, args.batch_size, args.block_size, device.type, amp is not None,
                                               "nf4", settings["targets"], settings["r"], lora_dtype.itemsize,
                                               settings["dropout"], args.nf4_block_size, double_quant)
    if args.estimate_memory:
        note = "\n(for fp32; on a CPU --dtype auto times bf16 against fp32 before training)" if probe_cpu_dtype else ""
        log(memory.format_table(estimate_for(amp)) + note)
        return estimate_for(amp)
    # fp32's estimate when --dtype auto has not timed the CPU yet: the larger of the two.
    guards.check_memory(sum(estimate_for(amp).values()), device, args.force,
                        "lower --batch-size or --block-size, or pick a smaller base")
    model_dir = finetune.base_weights(args, state, cfg, log)  # a hub id's weights are downloaded now

    # --- data -------------------------------------------------------------------------------------
    data_dir = data.prepare(args.data, args.cache_dir, log=log)
    train_batches = data.Batches(data.TokenSplit(data_dir, "train"), args.batch_size, args.block_size,
                                 args.grad_accum, seed=args.seed)
    val_batches = data.Batches(data.TokenSplit(data_dir, "val"), args.batch_size, args.block_size, 1,
                               seed=args.seed + 1)

    # --- model: the base quantised to NF4 as it is read, then LoRA on the chosen layers ------------
    devices.reset_peak_memory(device)  # count fine-tuning, not tokenisation
    model = finetune.load_base(model_dir, device, convert_linear=lambda name, linear: nf4.LinearNF4.from_linear(
        linear, args.nf4_block_size, double_quant))
    torch.manual_seed(args.seed)  # A's random initialisation (B starts at zero)
    if args.adapter and state is None:
        finetune.load_adapter(model, args.adapter, dtype=lora_dtype)
        log(f"loaded the adapter in {args.adapter}")
    else:
        lora.apply_lora(model, settings["targets"], settings["r"], settings["alpha"], settings["dropout"],
                        settings["rslora"], dtype=lora_dtype)
    if state is not None:  # --resume: A and B as they were saved
        finetune.restore_trainable(model, state["trainable"], os.path.join(args.out_dir, checkpoint.STATE))
    n_lora, n_total = lora.count_parameters(model)
    log(f"trainable parameters: {n_lora:,} of {n_total:,} ({100 * n_lora / n_total:.3f}%)")
    if probe_cpu_dtype and state is not None:  # a resumed run keeps the dtype it timed
        amp = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[state["compute_dtype"]]
    elif probe_cpu_dtype:
        amp, seconds = pick_cpu_dtype(model, *train_batches.get(0, 0, device))
        log(f"compute dtype: {'bf16 autocast' if amp else 'fp32'}, timed here (one step: fp32 "
            f"{seconds[None]:.3f} s, bf16 {seconds[torch.bfloat16]:.3f} s)")
    estimate = estimate_for(amp)

    # --- optimiser: only the LoRA matrices ---------------------------------------------------------
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = optim.make_adamw(params, args.lr, args.weight_decay, (args.beta1, args.beta2), device.type)
    # fp16 gradients underflow; the scaler multiplies the loss up and divides the gradients back.
    scaler = torch.amp.GradScaler(device.type, enabled=amp == torch.float16)
    start_step, first_val = finetune.restore_optimizer(state, optimizer) if state else (0, None)
    if state is not None:
        log(f"resuming from step {start_step} in {args.out_dir}")

    # --- training loop ----------------------------------------------------------------------------
    metrics_log = rundir.begin(run_dir, args)  # the first write; --overwrite clears the old run only now
    metrics_log.log(event="start", seed=args.seed, step=start_step, device=str(device), dtype=finetune.dtype_name(amp),
                    base=model_dir, lora=settings, n_params=n_total, n_trainable=n_lora, config=vars(cfg),
                    args=vars(args))
    sample_before = None
    if args.sample_tokens > 0:
        sample_before = finetune.sample(model, args, device, amp)
        log(f"sample before fine-tuning (step {start_step}):\n" + "-" * 40 + "\n" + sample_before + "\n" + "-" * 40)
    peak_flops = metrics.peak_flops_for(device, args.peak_flops)
    flops_per_token = finetune.flops_per_token(n_total, n_lora, cfg.n_layer, cfg.n_embd, args.block_size)
    flops_per_step = flops_per_token * tokens_per_step
    speed = metrics.Throughput(args.steps, start_step)
    # next_step moves only once the update has been applied: an interrupt anywhere in a step saves a
    # state that --resume continues without repeating or skipping an update.
    next_step = start_step
    updates = rundir.Updates(args.out_dir, last_saved=start_step if state else None)  # skipped ones, the last save

    def save(step):  # the adapter and the training state after `step` updates (the next step to run)
        finetune.save(run_dir, model, optimizer, step, model_dir, settings, first_val, amp, args, updates)

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
                scaler.scale(loss).backward()  # through the NF4 layers (dequantised again) to A and B
                loss_sum += loss.detach()
            loss_value = loss_sum.item()
            updates.check_loss(step, loss_value)  # a NaN loss stops the run before its update
            scaler.unscale_(optimizer)
            grad_norm = torch.nn.utils.clip_grad_norm_(params, args.grad_clip or float("inf")).item()
            # A NaN or inf gradient never reaches A and B: the update is skipped (fp16's GradScaler does that
            # by itself, and lowers its scale).
            skipped = not math.isfinite(grad_norm)
            if scaler.is_enabled() or not skipped:
                scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            next_step = step + 1
            speed.add(tokens_per_step)
            if skipped:
                log(f"step {step}: gradient norm is {grad_norm}; update skipped")
            updates.record(step, skipped and not scaler.is_enabled())  # stops after 10 skipped in a row

            record = dict(step=step, loss=loss_value, lr=lr, grad_norm=None if skipped else grad_norm, skipped=skipped)
            if step % args.log_interval == 0 or step == args.steps - 1:
                devices.synchronize(device)
                tok_s, sec_per_step, eta = speed.report(step + 1)
                mfu = flops_per_step / sec_per_step / peak_flops if peak_flops else None
                mem = devices.peak_memory_bytes(device)
                record.update(tokens_per_s=round(tok_s), mfu=mfu, peak_memory=mem)
                log(metrics.progress_line(step, args.steps, loss_value, lr, tok_s, mfu, mem, eta))
            metrics_log.log(**record)
            if next_step % args.save_interval == 0 and next_step < args.steps:
                save(next_step)
    except KeyboardInterrupt:  # save exactly the updates made so far, then exit 130
        rundir.save_on_interrupt(lambda: save(next_step), next_step, args.out_dir)
    step = next_step
    updates.finish()  # a run whose every update was skipped trained nothing: it says so and exits 2

    # --- save -------------------------------------------------------------------------------------
    val_loss = finetune.evaluate(model, val_batches, args.eval_batches, device, amp)
    first_val = val_loss if first_val is None else first_val
    metrics_log.log(step=step, val_loss=val_loss)
    trained = step > start_step
    if trained:
        save(step)
        log(f"saved the adapter to {args.out_dir}/{lora.CONFIG_NAME} and {lora.WEIGHTS_NAME} (PEFT layout, "
            f"loadable by finetune_lora.py --adapter), and {checkpoint.STATE} for --resume")

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
        # The model that was trained: NF4 weights dequantised to fp32, B @ A * scale added, in place.
        merged_dir = finetune.save_merged(model, cfg, args.out_dir)
        log(f"merged dequantised base + adapter into {merged_dir} (Hugging Face GPT-2 layout, fp32; "
            f"python train.py --init-from {merged_dir})")
    metrics_log.log(event="end", step=step, val_loss=val_loss, first_val_loss=first_val, peak_memory=peak,
                    memory_estimate=sum(estimate.values()), sample_before=sample_before, sample_after=sample_after)
    return {"val_loss": val_loss, "first_val_loss": first_val, "peak_memory": peak, "estimate": estimate,
            "n_trainable": n_lora, "merged_dir": merged_dir, "model": model}


if __name__ == "__main__":
    main()
