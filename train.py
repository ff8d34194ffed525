"""Pretrain a GPT-2 from scratch (or continue from a checkpoint), built from the pieces in lib/.

    python train.py                                   # tiny GPT on the Python stdlib, CPU, minutes
    python train.py --model-size gpt2 --compile       # GPT-2 124M on a GPU
    torchrun --standalone --nproc_per_node=2 train.py # DDP: one process per device

onefile_train.py is the core of this training written out in one file (DDP too, but no --init-from,
no sample, no commit folders; its docstring lists the rest); for the flags both have, with the same seed, both record
the same loss at every step. Read this
file top to bottom: arguments, then run(): device and distributed setup, model configuration and memory,
data, model, optimiser, training loop, save, report (the helpers above run() are its bookkeeping).

Nothing saved is lost: a fresh run refuses an --out-dir holding a saved run (--resume or --overwrite);
--resume refuses flags that contradict the saved run; an update whose gradient norm is not finite is
skipped; non-finite weights are never saved; a run whose memory estimate clearly exceeds the device's
free memory stops before allocating (--force). Ctrl-C saves and exits 130; under torchrun, torchrun
itself then ends with its own traceback (last line `...SignalException: Process <pid> got signal: 2`,
status 1), which no worker can prevent (README, "Ctrl-C under torchrun").
"""

import argparse
import contextlib
import math
import os
import signal
import sys

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from lib import checkpoint, data, distributed, gpt, guards, hub, memory, metrics, optim, rundir, tokenizer
from lib import device as devices
from lib.errors import UserError, report_and_exit


# --- arguments ----------------------------------------------------------------------------------
def make_parser():
    p = argparse.ArgumentParser(
        description="Pretrain GPT-2 from scratch with lib/ (see onefile_train.py for the one-file version).",
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
    g.add_argument("--init-from", help="start from a Hugging Face GPT-2: a local directory, or a hub id "
                   "(gpt2, gpt2-medium, gpt2-large, gpt2-xl, org/name), which is downloaded")
    g = p.add_argument_group("optimisation")
    g.add_argument("--steps", type=guards.nonneg_int, default=300, help="optimizer steps in total")
    g.add_argument("--batch-size", type=guards.positive_int, default=8, help="sequences per micro-batch per process")
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
    g = p.add_argument_group("run")
    g.add_argument("--device", help="cuda, cuda:N, mps or cpu; if unset, the first available of cuda, mps, cpu")
    g.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16", "fp16"],
                   help="autocast dtype; auto = bf16 on CUDA (fp16 + GradScaler without bf16) and on a CPU with native "
                   "bf16 (AVX512-BF16 or AMX), else fp32")
    g.add_argument("--compile", action="store_true", help="torch.compile the model")
    g.add_argument("--seed", type=guards.nonneg_int, default=1337, help="seeds the weights, the data order and dropout")
    g.add_argument("--out-dir", default="out/train", help="checkpoint (HF layout), training state and metrics.jsonl")
    g.add_argument("--resume", action="store_true", help="continue the run saved in --out-dir")
    guards.add_safety_flags(g)
    g.add_argument("--eval-interval", type=guards.positive_int, default=100, help="steps between validation losses")
    g.add_argument("--eval-batches", type=guards.positive_int, default=10, help="batches per validation loss")
    g.add_argument("--save-interval", type=guards.positive_int, default=100,
                   help="steps between checkpoints (and one at the end)")
    g.add_argument("--log-interval", type=guards.positive_int, default=10, help="steps between progress lines")
    g.add_argument("--peak-flops", type=guards.positive_float,
                   help="peak FLOP/s of the device, for MFU where it is not in the table")
    g.add_argument("--estimate-memory", action="store_true", help="print the predicted memory breakdown and exit")
    g = p.add_argument_group("sample")
    g.add_argument("--sample-tokens", type=guards.nonneg_int, default=200,
                   help="tokens to generate at the end (0: none)")
    g.add_argument("--prompt", default="", help="sample prompt; if empty, start a new file after <|endoftext|>")
    g.add_argument("--temperature", type=guards.nonneg_float, default=0.8,
                   help="sampling temperature (0: always the most likely token)")
    g.add_argument("--top-k", type=guards.positive_int, default=200, help="sample from the k most likely tokens only")
    return p


# The run directory (lib/rundir.py): what a saved run is, and which flags --resume may change. The fixed
# ones make the run what it is (the model, the data, the windows a step reads): given again they must
# match, and when not given the saved values are used, so that resuming stays exact. The changeable ones
# are reported when changed and otherwise keep the saved run's values.
RUN = rundir.Spec(
    saved={checkpoint.CONFIG: "json", checkpoint.WEIGHTS: "safetensors", checkpoint.STATE: "state"},
    same_step=(checkpoint.WEIGHTS,),
    fixed=("model_size", "n_layer", "n_head", "n_embd", "block_size", "dropout", "init_from", "data", "seed",
           "batch_size"),
    # grad_accum may change on --resume only with the world size, keeping batch x grad_accum x world the same
    # (resume_global_batch): that product, the global batch, is what the run is.
    changeable=("grad_accum", "steps", "lr", "min_lr_ratio", "warmup_steps", "weight_decay", "beta1", "beta2",
                "grad_clip", "eval_interval", "eval_batches", "save_interval", "log_interval", "dtype", "compile",
                "sample_tokens", "prompt", "temperature", "top_k", "peak_flops"),
    data=("data",),
)


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


def check_args(args):
    """Everything about the flags and paths that can be checked before any work starts."""
    guards.check_schedule_and_seed(args)
    devices.pick_device(args.device)  # a --device that is not here fails now, not after other checks
    guards.check_output_dir(args.out_dir)
    guards.check_cache_dir(args.cache_dir)
    if not args.estimate_memory:  # a run writes both; find out now whether it can
        if args.init_from or not data.is_prepared(args.data):
            guards.make_output_dir(args.cache_dir, "--cache-dir")


@torch.no_grad()
def evaluate(model, batches, n_batches, device, amp, dist_info):
    """Mean loss over the same n_batches validation batches every time, however many ranks share them."""
    model.eval()
    total = torch.zeros((), device=device)
    for i in range(dist_info.rank, n_batches, dist_info.world_size):  # rank r takes batches r, r+N, ...
        x, y = batches.get(i, 0, device)
        with devices.autocast(device, amp):
            loss = model(x, y)[1]
        total += loss.float()
    model.train()
    return distributed.all_reduce_sum(total, dist_info).item() / n_batches


def save(run_dir, raw_model, optimizer, step, args, first_val, updates, dist_info):
    """Weights in the HF layout, then the state --resume needs (step = the next step to run). Weights
    holding NaN or inf are never saved: the run stops instead, naming the last finite checkpoint."""
    guards.check_finite_weights(raw_model.named_parameters(), step, updates.last_saved, run_dir.out_dir)
    if dist_info.is_main:
        checkpoint.save_hf(run_dir.out_dir, raw_model.config, gpt.to_hf_state_dict(raw_model), step=step)
        rundir.save_state(run_dir, args, {
            "step": step,
            "optimizer": optimizer.state_dict(),
            **devices.rng_states(),
            "data_position": step,  # batches are a function of (seed, step): the step is the position
            "world_size": dist_info.world_size,  # with grad_accum, the global batch a resume keeps
            "first_val_loss": first_val,  # so a resumed run reports where the whole run started
        })
    updates.saved(step)


def model_config(args, parser, argv, dist_info, log):
    """The model's shape: the saved run's, a pretrained GPT-2's or --model-size's with the shape flags. Only
    config.json is read: the memory check comes before any weight is read or downloaded. The shape the run
    really has is recorded in args, so a later --resume compares against it. Returns (cfg, block_size)."""
    if args.resume:
        cfg = checkpoint.load_config(args.out_dir)
    elif args.init_from:
        model_dir = distributed.local_rank_0_first(dist_info, lambda: hub.resolve_pretrained(
            args.init_from, args.cache_dir, ("config.json",), log=log))
        cfg = checkpoint.load_config(model_dir)
        cfg.dropout = args.dropout
        checkpoint.check_shape_flags(cfg, args, guards.explicit_flags(args, parser, argv))
    else:
        shape = dict(gpt.MODEL_SIZES[args.model_size])
        for key in ("n_layer", "n_head", "n_embd", "block_size"):
            if getattr(args, key) is not None:
                shape[key] = getattr(args, key)
        if shape["n_embd"] % shape["n_head"]:
            raise UserError(f"--n-embd {shape['n_embd']} is not divisible by --n-head {shape['n_head']}; "
                            f"pick a width that is a multiple of the head count")
        cfg = gpt.GPTConfig(**shape, dropout=args.dropout)
    block_size = args.block_size or cfg.block_size
    if block_size > cfg.block_size:
        raise UserError(f"--block-size {block_size} exceeds the model's {cfg.block_size} positions; use at most "
                        f"{cfg.block_size}")
    if cfg.vocab_size < tokenizer.VOCAB_SIZE:
        raise UserError(f"vocabulary mismatch: the checkpoint has vocab_size {cfg.vocab_size}, the GPT-2 tokenizer "
                        f"needs {tokenizer.VOCAB_SIZE}; use a GPT-2 checkpoint")
    args.n_layer, args.n_head, args.n_embd, args.block_size = cfg.n_layer, cfg.n_head, cfg.n_embd, block_size
    return cfg, block_size


def initial_weights(args, dist_info, log):
    """The state dict to start from: the saved run's (checked finite) with --resume, a pretrained GPT-2's with
    --init-from (downloaded now, after the memory check, for a hub id), else None (a fresh initialisation)."""
    if args.resume:
        _, state_dict = checkpoint.load_hf(args.out_dir)
        bad = guards.nonfinite(state_dict)
        if bad:
            raise UserError(f"{args.out_dir}/{checkpoint.WEIGHTS} holds non-finite weights ({len(bad)} tensors, e.g. "
                            f"{bad[0]}), so it cannot be continued; start again with --overwrite and a lower --lr")
        return state_dict
    if args.init_from:
        model_dir = distributed.local_rank_0_first(dist_info, lambda: hub.resolve_pretrained(
            args.init_from, args.cache_dir, log=log))
        return checkpoint.load_hf(model_dir)[1]
    return None


def resume_global_batch(args, train_state, accum_given, log):
    """--resume under torchrun with another --nproc_per_node (or without torchrun): set args.grad_accum so that
    batch x grad_accum x world is the saved run's; the windows of a step then stay the same (lib/data.py)."""
    saved_accum = rundir.saved_args(train_state).get("grad_accum", args.grad_accum)
    world = int(os.environ.get("WORLD_SIZE", 1))
    args.grad_accum = data.keep_global_batch(args.batch_size, saved_accum, train_state.get("world_size", world), world,
                                             args.grad_accum if accum_given else None, log)


def restore(train_state, optimizer, args, log):
    """--resume: AdamW's moments and the RNG states (dropout draws from them) as saved. Returns (the step to
    continue from, the run's first validation loss)."""
    if train_state is None:
        return 0, None
    optimizer.load_state_dict(train_state["optimizer"])
    devices.restore_rng_states(train_state)
    start_step = train_state["step"]
    if args.steps < start_step:
        raise UserError(f"--resume: {args.out_dir} is already at step {start_step}; pass --steps {start_step} or more")
    log(f"resuming from step {start_step} in {args.out_dir}" + ("" if args.steps > start_step else
        f"; it already ran its --steps {args.steps}, pass a larger --steps to train further"))
    return start_step, train_state.get("first_val_loss")


def run(args, parser, argv):
    # --- checks before any work -------------------------------------------------------------------
    check_args(args)
    # The run directory: a saved run is never replaced without --overwrite; --resume validates every
    # saved file and takes the saved run's flags (lib/rundir.py).
    main_rank = int(os.environ.get("RANK", 0)) == 0  # torchrun's ranks all check; one of them reports
    accum_given = "grad_accum" in guards.explicit_flags(args, parser, argv)  # before the saved flags fill args
    run_dir = rundir.prepare(args, parser, argv, RUN, log=print if main_rank else (lambda *a: None),
                             writes=not args.estimate_memory)
    train_state = run_dir.state
    if run_dir.resumed:  # on another number of processes, the same global batch (or a one-line refusal)
        resume_global_batch(args, train_state, accum_given, log=print if main_rank else (lambda *a: None))

    # --- device and distributed setup -----------------------------------------------------------
    device = devices.pick_device(args.device)
    dist_info = distributed.setup(device.type)
    device = distributed.device_for(dist_info, device)
    log = print if dist_info.is_main else (lambda *a, **k: None)
    devices.seed_everything(args.seed)  # the same seed on every rank: identical initial weights
    amp = devices.amp_dtype(device, args.dtype)
    if amp is not None and device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True  # fp32 matmuls outside autocast use TF32

    # --- model configuration and memory --------------------------------------------------------------
    cfg, block_size = model_config(args, parser, argv, dist_info, log)
    with torch.device("meta"):
        n_params = gpt.GPT(cfg).num_params()
    tokens_per_step = args.batch_size * block_size * args.grad_accum * dist_info.world_size
    log(f"model: {cfg.n_layer} layers, {cfg.n_head} heads, {cfg.n_embd} wide, {n_params:,} parameters; "
        f"device {device}{f' x {dist_info.world_size} ranks' if dist_info.enabled else ''}, "
        f"{'fp32' if amp is None else str(amp).replace('torch.', '') + ' autocast'}; "
        f"{tokens_per_step:,} tokens per step")
    log(devices.dtype_line(device, args.dtype, amp))

    estimate = memory.estimate_gpt_training(cfg, n_params, args.batch_size, block_size, device.type, amp is not None,
                                            ddp=dist_info.enabled, runtime=memory.cpu_runtime_bytes(device.type))
    if args.estimate_memory:
        log(memory.format_table(estimate))
        distributed.cleanup(dist_info)
        return estimate
    # On a CPU the ranks of one machine share its RAM.
    per_machine = int(os.environ.get("LOCAL_WORLD_SIZE", 1)) if device.type == "cpu" else 1
    guards.check_memory(sum(estimate.values()) * per_machine, device, args.force,
                        "lower --batch-size or --block-size, or pick a smaller model")

    # --- data -------------------------------------------------------------------------------------
    # One process per machine tokenises (once, cached); the others wait and then find the cache.
    data_dir = distributed.local_rank_0_first(dist_info, lambda: data.prepare(args.data, args.cache_dir, log=log))
    log(data.describe(data_dir))  # the token counts read, and the format (this project's, nanoGPT's or llm.c's)
    train_batches = data.Batches(data.TokenSplit(data_dir, "train"), args.batch_size, block_size,
                                 args.grad_accum, dist_info.rank, dist_info.world_size, seed=args.seed)
    # Validation batches are one fixed list, split between ranks inside evaluate().
    val_batches = data.Batches(data.TokenSplit(data_dir, "val"), args.batch_size, block_size, seed=args.seed + 1)

    # --- model ------------------------------------------------------------------------------------
    devices.reset_peak_memory(device)  # count training, not tokenisation
    state_dict = initial_weights(args, dist_info, log)
    raw_model = gpt.GPT(cfg)
    if state_dict is not None:
        raw_model.load_state_dict(state_dict)
        del state_dict  # the model holds its own copy now
    raw_model.to(device)
    model = torch.compile(raw_model) if args.compile else raw_model
    if dist_info.enabled:
        # DDP averages gradients across ranks during backward, overlapping communication with compute.
        model = DDP(model, device_ids=[dist_info.local_rank] if device.type == "cuda" else None)

    # --- optimiser --------------------------------------------------------------------------------
    optimizer = optim.make_adamw(raw_model.parameters(), args.lr, args.weight_decay, (args.beta1, args.beta2),
                                 device.type)
    # fp16 gradients underflow; the scaler multiplies the loss up and divides the gradients back.
    scaler = torch.amp.GradScaler(device.type, enabled=amp == torch.float16)
    start_step, first_val = restore(train_state, optimizer, args, log)  # with --resume: where it stopped

    # --- training loop ----------------------------------------------------------------------------
    metrics_log = rundir.begin(run_dir, args, dist_info.is_main)  # the first write; --overwrite clears only now
    metrics_log.log(event="start", seed=args.seed, step=start_step, world_size=dist_info.world_size,
                    device=str(device), dtype={None: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[amp],
                    n_params=n_params, config=vars(cfg), args=vars(args))
    peak_flops = metrics.peak_flops_for(device, args.peak_flops)
    flops_per_step = metrics.flops_per_token(n_params, cfg.n_layer, cfg.n_embd, block_size) * tokens_per_step
    speed = metrics.Throughput(args.steps, start_step)
    if args.compile:
        log("torch.compile: the first step compiles the model, which takes a minute or more (longer on a CPU)")
    # next_step is what a checkpoint records: it moves in the same whole_update() block as the update, so
    # an interrupt anywhere in a step saves a state that --resume continues without repeating work.
    next_step = start_step
    rng_at_step = None  # (step, its random states as it began): the ones a save in a step that did not count holds
    # Only finite weights are ever saved, so every checkpoint this run wrote (or resumed from) is finite.
    updates = rundir.Updates(args.out_dir, last_saved=start_step if args.resume else None)
    val_loss = None
    previous_handler = signal.getsignal(signal.SIGINT)
    ctrl_c = distributed.catch_ctrl_c(dist_info)
    try:
        for step in range(start_step, args.steps):
            rng_at_step = step, devices.rng_states()  # before this step draws (dropout; evaluate draws nothing)
            if step % args.eval_interval == 0:
                val_loss = evaluate(model, val_batches, args.eval_batches, device, amp, dist_info)
                first_val = val_loss if first_val is None else first_val
                log(f"step {step}: val loss {val_loss:.4f}")
                metrics_log.log(step=step, val_loss=val_loss)

            lr = optim.lr_at(step, args.lr, args.warmup_steps, args.steps, args.min_lr_ratio)
            for group in optimizer.param_groups:
                group["lr"] = lr
            loss_sum = torch.zeros((), device=device)
            for micro in range(args.grad_accum):
                x, y = train_batches.get(step, micro, device)
                # Under DDP, skip the gradient all-reduce on every micro-step but the last.
                last_micro = micro == args.grad_accum - 1
                with model.no_sync() if dist_info.enabled and not last_micro else contextlib.nullcontext():
                    with devices.autocast(device, amp):
                        loss = model(x, y)[1]  # (None, loss): with targets no logits are made
                    loss = loss / args.grad_accum  # so the accumulated gradient is the batch mean
                    scaler.scale(loss).backward()
                loss_sum += loss.detach()
            loss_value = distributed.all_reduce_mean(loss_sum, dist_info).item()
            updates.check_loss(step, loss_value)
            scaler.unscale_(optimizer)  # clip the true gradients, not the scaled ones
            grad_norm = torch.nn.utils.clip_grad_norm_(raw_model.parameters(), args.grad_clip or float("inf")).item()
            # A NaN or infinite gradient would turn every weight it touches into NaN: skip that update.
            # (Under fp16 the GradScaler skips it by itself and lowers its scale: its way of finding one.)
            skipped = not math.isfinite(grad_norm)
            with rundir.whole_update():  # Ctrl-C or SIGTERM waits for the update and its counting, then stops
                if scaler.is_enabled() or not skipped:
                    scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad(set_to_none=True)
                next_step = step + 1
                speed.add(tokens_per_step)
                if skipped:
                    log(f"step {step}: gradient norm {grad_norm}, update skipped")
                updates.record(step, skipped and not scaler.is_enabled())  # stops after 10 skipped in a row

            record = dict(step=step, loss=loss_value, lr=lr, grad_norm=grad_norm)
            if skipped:
                record["skipped"] = True
            if step % args.log_interval == 0 or step == args.steps - 1:
                devices.synchronize(device)
                tok_s, sec_per_step, eta = speed.report(step + 1)
                mfu = flops_per_step / sec_per_step / peak_flops if peak_flops else None
                mem = devices.peak_memory_bytes(device)
                record.update(tokens_per_s=round(tok_s), mfu=mfu, peak_memory=mem)
                log(metrics.progress_line(step, args.steps, loss_value, lr, tok_s, mfu, mem, eta))
            metrics_log.log(**record)

            if distributed.stop_requested(ctrl_c, dist_info, device):
                raise KeyboardInterrupt  # on every rank, after the same finished step
            if next_step % args.save_interval == 0 and next_step < args.steps:
                save(run_dir, raw_model, optimizer, next_step, args, first_val, updates, dist_info)
    except KeyboardInterrupt:  # save exactly the updates made so far, then exit 130
        rundir.save_on_interrupt(lambda: save(run_dir, raw_model, optimizer, next_step, args, first_val, updates,
                                              dist_info), next_step, args.out_dir, dist_info.is_main,
                                 cleanup=lambda: distributed.cleanup(dist_info), rng_at_step=rng_at_step)
    finally:
        signal.signal(signal.SIGINT, previous_handler)
    step = next_step
    updates.finish()  # a run whose every update was skipped trained nothing: it says so and exits 2

    # --- save -------------------------------------------------------------------------------------
    if args.steps > start_step or not args.resume:
        val_loss = evaluate(model, val_batches, args.eval_batches, device, amp, dist_info)
        log(f"step {step}: val loss {val_loss:.4f}" + (f" (started at {first_val:.4f})" if first_val else ""))
        metrics_log.log(step=step, val_loss=val_loss)
    save(run_dir, raw_model, optimizer, step, args, first_val, updates, dist_info)
    if dist_info.is_main:
        log(f"saved {args.out_dir}/{checkpoint.CONFIG}, {checkpoint.WEIGHTS} (Hugging Face GPT-2 layout) and "
            f"{checkpoint.STATE}")

    # --- report -----------------------------------------------------------------------------------
    peak = devices.peak_memory_bytes(device)
    log(memory.format_table(estimate, peak, f"measured ({devices.memory_label(device)})"))
    text = gpt.sample(raw_model, args, device, amp) if args.sample_tokens > 0 and dist_info.is_main else None
    if text is not None:
        log("sample:\n" + "-" * 40 + "\n" + text + "\n" + "-" * 40)
    metrics_log.log(event="end", step=step, val_loss=val_loss, peak_memory=peak,
                    memory_estimate=sum(estimate.values()), sample=text)
    distributed.cleanup(dist_info)
    return {"val_loss": val_loss, "first_val_loss": first_val, "peak_memory": peak}


if __name__ == "__main__":
    main()
