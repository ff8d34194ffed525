"""Fine-tune GPT-2 with LoRA: the base model frozen, a low-rank update B @ A trained on chosen layers.

    python finetune_lora.py                                         # train.py's out/train on the stdlib's tests, CPU
    python finetune_lora.py --init-from gpt2 --data my_text --steps 500
    python finetune_lora.py --adapter out/finetune_lora --steps 0 --merge --out-dir out/merged_lora  # evaluate, merge

Every adapted linear computes W x + (alpha / r) B A x with W frozen; only A and B (a fraction of a
percent of the parameters) get gradients and AdamW moments. The adapter is saved in the Hugging Face
PEFT layout; --merge folds it into the base and writes a plain GPT-2 directory. Read top to bottom:
arguments, device, base model configuration, data, model, optimiser, training loop, save, report.
finetune_qlora.py imports this file and changes only how the frozen base and A and B are held (its
own recipe_for(): the base in 4-bit NF4); the two scripts read each other's adapters. The idea and
the arithmetic: docs/qlora_explained.md; the code path: docs/qlora_code_walkthrough.md.
"""

import argparse
import dataclasses
import math
import os
import sys
from typing import Callable

import torch

from lib import checkpoint, data, finetune, gpt, guards, lora, memory, metrics, optim, rundir
from lib import device as devices
from lib.errors import UserError, report_and_exit


# --- arguments ------------------------------------------------------------------------------------
def make_parser(description="Fine-tune GPT-2 with LoRA adapters on a frozen base (PEFT-layout adapters, optional "
                "merge).", out_dir="out/finetune_lora", dtype_help=(
                    "autocast dtype; auto = bf16 on CUDA (fp16 + GradScaler without bf16) and on a CPU with native "
                    "bf16 (AVX512-BF16 or AMX), else fp32; a --resume keeps the saved run's. Under 16-bit autocast "
                    "the frozen block weights are stored in that dtype (LoRA's A and B stay fp32)")):
    p = argparse.ArgumentParser(description=description, formatter_class=guards.HelpFormatter)
    finetune.add_arguments(p, out_dir, dtype_help)  # finetune_qlora.py passes its own three and adds its flags
    return p


# The run directory (lib/rundir.py, declared in lib/finetune.py for both fine-tuning scripts): the adapter, the
# training state and OUT/merged; the flags that make the run what it is, and those a --resume may change.
RUN = rundir.Spec(saved=finetune.SAVED, products=finetune.PRODUCTS, written=finetune.WRITTEN, fixed=finetune.FIXED,
                  changeable=finetune.CHANGEABLE, data=("data",))


def main(argv=None):
    parser = make_parser()
    args = parser.parse_args(argv)  # a bad value ends here: one usage line, exit 2
    # a command-line run: the heap gives back what it frees, so the peak is the tensors (lib/memory.py)
    if argv is None:
        devices.steady_cpu_heap()
    try:
        return run(args, parser, sys.argv[1:] if argv is None else list(argv))
    except (UserError, KeyboardInterrupt) as e:  # Ctrl-C or SIGTERM outside the loop: one line, 130 or 143
        report_and_exit(e)


# --- the recipe: how the frozen base and the LoRA matrices are held ----------------------------------
@dataclasses.dataclass
class Recipe:
    """How the frozen base and A and B are held. recipe_for() below is this script's choice;
    finetune_qlora.py makes its own (NF4 base, --lora-dtype). Everything else in
    this file is the same for both."""
    base: str                                 # how the block weights are stored: fp32, bf16, fp16 or nf4
    convert_linear: Callable                  # (name, nn.Linear) -> module, as each block linear is read
    held: str = None                          # how the first log line describes them; None: `base`
    lora_dtype: torch.dtype = torch.float32   # A and B and their AdamW moments
    estimate_kwargs: dict = dataclasses.field(default_factory=dict)  # more for memory.estimate_lora_finetuning
    merge_in_place: bool = False              # --merge folds A and B into the trained model, not a fresh fp32 base
    memory_hint: str = ("lower --batch-size or --block-size, adapt fewer --lora-targets, or hold the base in 4 bits "
                        "with finetune_qlora.py")


def recipe_for(args, device, amp) -> Recipe:
    """This script's choice. The frozen block weights are never updated, so they need no fp32 master
    copy: under 16-bit autocast they are stored in that dtype (half the bytes, and nothing for autocast
    to copy). A and B are updated by tiny steps, so they stay fp32."""
    base_dtype = amp or torch.float32
    return Recipe(base=finetune.dtype_name(amp), convert_linear=lambda name, linear: linear.to(base_dtype))


def run(args, parser, argv, spec=RUN, recipe_for=recipe_for):
    """The whole recipe, stage by stage; finetune_qlora.py calls it with its own spec and recipe_for."""
    # --- checks before any work: the flags, the run directory, the base and the adapter ------------
    finetune.check_arguments(args)
    # A saved run is never replaced without --overwrite; --resume validates every saved file and takes the
    # saved run's flags (lib/rundir.py). Then the base's config.json and the --adapter files are checked.
    run_dir = rundir.prepare(args, parser, argv, spec, writes=not args.estimate_memory)
    state, settings, cfg = finetune.resolve_run(args, run_dir)
    log = print

    # --- device, and how the base and A and B are held ----------------------------------------------
    device = devices.pick_device(args.device)
    devices.seed_everything(args.seed)
    amp = devices.amp_dtype(device, args.dtype)
    kept = state is not None and args.dtype == "auto"  # --resume: auto is the dtype the run was saved with
    if kept:
        amp = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[state["compute_dtype"]]
    if amp is not None and device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    recipe = recipe_for(args, device, amp)  # this file's, or finetune_qlora.py's (NF4)

    # --- memory: the estimate, and the check before anything is allocated or downloaded --------------
    tokens_per_step = args.batch_size * args.block_size * args.grad_accum
    compute = finetune.dtype_name(amp) + (" autocast" if amp else "")
    log(f"base: {state['base'] if state else args.init_from} ({cfg.n_layer} layers, {cfg.n_head} heads, "
        f"{cfg.n_embd} wide), block weights in {recipe.held or recipe.base}; LoRA r={settings['r']} "
        f"alpha={settings['alpha']:g} on {', '.join(settings['targets'])} in {finetune.dtype_name(recipe.lora_dtype)}; "
        f"device {device}, {compute}; {tokens_per_step:,} tokens per step")
    log(f"dtype: {compute} (the resumed run's)" if kept else devices.dtype_line(device, args.dtype, amp))

    def estimate_for(amp, runtime):  # again once the data are read
        return memory.estimate_lora_finetuning(cfg, args.batch_size, args.block_size, device.type, amp is not None,
                                               recipe.base, settings["targets"], settings["r"],
                                               recipe.lora_dtype.itemsize, settings["dropout"],
                                               checkpointing=args.grad_checkpoint, runtime=runtime,
                                               **recipe.estimate_kwargs)
    # On a CPU the peak is the whole process's resident set: what it holds already is measured, not assumed.
    runtime = memory.cpu_runtime_bytes(device.type)
    estimate = estimate_for(amp, runtime)
    if args.estimate_memory:
        log(memory.format_table(estimate))
        return estimate
    guards.check_memory(sum(estimate.values()), device, args.force, recipe.memory_hint)
    model_dir = finetune.base_weights(args, state, cfg, log)  # a hub id's weights are downloaded now

    # --- data -------------------------------------------------------------------------------------
    data_dir = data.prepare(args.data, args.cache_dir, log=log)
    train_batches = data.Batches(data.TokenSplit(data_dir, "train"), args.batch_size, args.block_size,
                                 args.grad_accum, seed=args.seed)
    val_batches = data.Batches(data.TokenSplit(data_dir, "val"), args.batch_size, args.block_size, 1,
                               seed=args.seed + 1)

    # --- model: the frozen base, then LoRA on the chosen layers -----------------------------------
    runtime = memory.cpu_runtime_bytes(device.type)  # now with the data, and what reading them left
    estimate = estimate_for(amp, runtime)
    devices.reset_peak_memory(device)  # count fine-tuning, not tokenisation
    model = finetune.load_base(model_dir, device, recipe.convert_linear)
    torch.manual_seed(args.seed)  # A's random initialisation (B starts at zero)
    if args.adapter and state is None:
        finetune.load_adapter(model, args.adapter, dtype=recipe.lora_dtype)
        log(f"loaded the adapter in {args.adapter}")
    else:
        lora.apply_lora(model, settings["targets"], settings["r"], settings["alpha"], settings["dropout"],
                        settings["rslora"], dtype=recipe.lora_dtype)
    if state is not None:  # --resume: A and B as they were saved
        finetune.restore_trainable(model, state["trainable"], os.path.join(args.out_dir, checkpoint.STATE))
    # --grad-checkpoint: each block runs under torch.utils.checkpoint (lib/gpt.GPT.hidden_states), so
    # forward keeps only the blocks' inputs and backward recomputes one block at a time.
    model.gradient_checkpointing = args.grad_checkpoint
    n_lora, n_total = lora.count_parameters(model)
    log(f"trainable parameters: {n_lora:,} of {n_total:,} ({100 * n_lora / n_total:.3f}%)")

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
        sample_before = gpt.sample(model, args, device, amp)
        log(f"sample before fine-tuning (step {start_step}):\n" + "-" * 40 + "\n" + sample_before + "\n" + "-" * 40)
    peak_flops = metrics.peak_flops_for(device, args.peak_flops)
    flops_per_token = finetune.flops_per_token(n_total, n_lora, cfg.n_layer, cfg.n_embd, args.block_size)
    flops_per_step = flops_per_token * tokens_per_step
    speed = metrics.Throughput(args.steps, start_step)
    # next_step moves only once the update has been applied: an interrupt anywhere in a step saves a
    # state that --resume continues without repeating or skipping an update.
    next_step = start_step
    rng_at_step = None  # (step, its random states as it began): the ones a save in a step that did not count holds
    updates = rundir.Updates(args.out_dir, last_saved=start_step if state else None)  # skipped ones, the last save

    def save(step):  # the adapter and the training state after `step` updates (the next step to run)
        finetune.save(run_dir, model, optimizer, step, model_dir, settings, first_val, amp, args, updates)

    val_loss = None
    try:
        for step in range(start_step, args.steps):
            rng_at_step = step, devices.rng_states()  # before this step draws (LoRA dropout; evaluate draws nothing)
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
                    loss = model(x, y)[1]  # (None, loss): with targets no logits are made
                loss = loss / args.grad_accum  # so the accumulated gradient is the batch mean
                scaler.scale(loss).backward()  # reaches A and B only: nothing else requires grad
                loss_sum += loss.detach()
            loss_value = loss_sum.item()
            updates.check_loss(step, loss_value)  # a NaN loss stops the run before its update
            scaler.unscale_(optimizer)
            grad_norm = torch.nn.utils.clip_grad_norm_(params, args.grad_clip or float("inf")).item()
            # A NaN or inf gradient never reaches A and B: the update is skipped (fp16's GradScaler does that
            # by itself, and lowers its scale).
            skipped = not math.isfinite(grad_norm)
            with rundir.whole_update():  # Ctrl-C or SIGTERM waits for the update and its counting
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
        rundir.save_on_interrupt(lambda: save(next_step), next_step, args.out_dir, rng_at_step=rng_at_step)
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
            f"loadable by finetune_lora.py and finetune_qlora.py --adapter), and {checkpoint.STATE} for --resume")

    # --- report -----------------------------------------------------------------------------------
    peak = devices.peak_memory_bytes(device)
    log(memory.format_table(estimate, peak, f"measured ({devices.memory_label(device)})"))
    log(f"held-out loss on {args.data}: {first_val:.4f} before, {val_loss:.4f} after ({val_loss - first_val:+.4f})"
        if trained else f"held-out loss on {args.data}: {val_loss:.4f} (no training steps run)")
    sample_after = None
    if args.sample_tokens > 0 and trained:
        sample_after = gpt.sample(model, args, device, amp)
        log("sample after fine-tuning (same prompt, same seed):\n" + "-" * 40 + "\n" + sample_after + "\n" + "-" * 40)
    merged_dir = None
    if args.merge:
        merged = model  # finetune_qlora.py: the model that was trained, its NF4 weights dequantised
        if not recipe.merge_in_place:
            # A fresh fp32 copy of the base (the training copy may be 16-bit) with this adapter folded in.
            merged = finetune.load_base(model_dir, "cpu")
            lora.apply_lora(merged, settings["targets"], settings["r"], settings["alpha"], 0.0, settings["rslora"])
            finetune.restore_trainable(merged, finetune.trainable_state(model), "the trained model")
        merged_dir = finetune.save_merged(merged, cfg, args.out_dir)
        log(f"merged base + adapter into {merged_dir} (Hugging Face GPT-2 layout, fp32; python train.py --init-from "
            f"{merged_dir})")
    metrics_log.log(event="end", step=step, val_loss=val_loss, first_val_loss=first_val, peak_memory=peak,
                    memory_estimate=sum(estimate.values()), sample_before=sample_before, sample_after=sample_after)
    return {"val_loss": val_loss, "first_val_loss": first_val, "peak_memory": peak, "estimate": estimate,
            "n_trainable": n_lora, "merged_dir": merged_dir, "model": model}


if __name__ == "__main__":
    main()
