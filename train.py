"""Pretrain a GPT-2 from scratch (or continue from a checkpoint), built from the pieces in lib/.

    python train.py                                   # tiny GPT on the Python stdlib, CPU, minutes
    python train.py --model-size gpt2 --compile       # GPT-2 124M on a GPU
    torchrun --standalone --nproc_per_node=2 train.py # DDP: one process per device

This is the same training as onefile_train.py, which inlines everything imported here; with the
same seed and flags both print the same loss at every step. Read this file top to bottom:
arguments, device and distributed setup, model, data, optimiser, training loop, save, report.
"""

import argparse
import contextlib
import json
import math
import os
import signal
import sys

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from lib import checkpoint, data, distributed, gpt, hub, memory, metrics, optim, tokenizer
from lib import device as devices
from lib.errors import UserError, report_and_exit


# --- arguments ----------------------------------------------------------------------------------
def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description="Pretrain GPT-2 from scratch with lib/ (see onefile_train.py for the one-file version).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    g = p.add_argument_group("data")
    g.add_argument("--data", default="stdlib", help="a text file, a directory of text files, a prepared token-shard "
                   "directory, or 'stdlib' (the running Python's standard library, tests left out)")
    g.add_argument("--cache-dir", default=data.default_cache_dir(), help="where prepared shards and hub downloads are kept")
    g = p.add_argument_group("model")
    g.add_argument("--model-size", default="tiny", choices=list(gpt.MODEL_SIZES), help="a GPT-2 shape")
    g.add_argument("--n-layer", type=int, help="override the shape's layer count")
    g.add_argument("--n-head", type=int, help="override the shape's head count")
    g.add_argument("--n-embd", type=int, help="override the shape's width")
    g.add_argument("--block-size", type=int, help="sequence length (default: the shape's, or the checkpoint's)")
    g.add_argument("--dropout", type=float, default=0.0)
    g.add_argument("--init-from", help="start from a Hugging Face GPT-2: a local directory, or a hub id "
                   "(gpt2, gpt2-medium, gpt2-large, gpt2-xl, org/name), which is downloaded")
    g = p.add_argument_group("optimisation")
    g.add_argument("--steps", type=int, default=300, help="optimizer steps in total")
    g.add_argument("--batch-size", type=int, default=8, help="sequences per micro-batch per process")
    g.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    g.add_argument("--lr", type=float, default=2e-3, help="peak learning rate")
    g.add_argument("--min-lr-ratio", type=float, default=0.1, help="final learning rate as a fraction of --lr")
    g.add_argument("--warmup-steps", type=int, default=30)
    g.add_argument("--weight-decay", type=float, default=0.1)
    g.add_argument("--beta1", type=float, default=0.9)
    g.add_argument("--beta2", type=float, default=0.95)
    g.add_argument("--grad-clip", type=float, default=1.0, help="clip the global gradient norm (0: off)")
    g = p.add_argument_group("run")
    g.add_argument("--device", help="cuda, mps or cpu (default: the first available, in that order)")
    g.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16", "fp16"],
                   help="autocast dtype; auto = bf16 on CUDA (fp16 + GradScaler without bf16), fp32 on CPU/MPS")
    g.add_argument("--compile", action="store_true", help="torch.compile the model")
    g.add_argument("--seed", type=int, default=1337)
    g.add_argument("--out-dir", default="out/train", help="checkpoint (HF layout), training state and metrics.jsonl")
    g.add_argument("--resume", action="store_true", help="continue the run saved in --out-dir")
    g.add_argument("--eval-interval", type=int, default=100, help="steps between validation losses")
    g.add_argument("--eval-batches", type=int, default=10, help="batches per validation loss")
    g.add_argument("--save-interval", type=int, default=100, help="steps between checkpoints (and one at the end)")
    g.add_argument("--log-interval", type=int, default=10, help="steps between progress lines")
    g.add_argument("--peak-flops", type=float, help="peak FLOP/s of the device, for MFU where it is not in the table")
    g.add_argument("--estimate-memory", action="store_true", help="print the predicted memory breakdown and exit")
    g = p.add_argument_group("sample")
    g.add_argument("--sample-tokens", type=int, default=200, help="tokens to generate at the end (0: none)")
    g.add_argument("--prompt", default="", help="sample prompt (default: start a new file after <|endoftext|>)")
    g.add_argument("--temperature", type=float, default=0.8)
    g.add_argument("--top-k", type=int, default=200)
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    try:
        return run(args)
    except UserError as e:
        report_and_exit(e)


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


def save(out_dir, raw_model, optimizer, step, args):
    """Weights in the HF layout, then the state --resume needs. step = the next step to run."""
    checkpoint.save_hf(out_dir, raw_model.config, gpt.to_hf_state_dict(raw_model), step=step)
    state = {
        "step": step,
        "optimizer": optimizer.state_dict(),
        "rng_cpu": torch.get_rng_state(),
        "rng_cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "data_position": step,  # batches are a function of (seed, step): the step is the position
        "args": json.dumps(vars(args)),
    }
    checkpoint.save_training_state(out_dir, state)


def run(args):
    # --- device and distributed setup -----------------------------------------------------------
    device = devices.pick_device(args.device)
    dist_info = distributed.setup(device.type)
    device = distributed.device_for(dist_info, device)
    log = print if dist_info.is_main else (lambda *a, **k: None)
    devices.seed_everything(args.seed)  # the same seed on every rank: identical initial weights
    amp = devices.amp_dtype(device, args.dtype)
    if amp is not None and device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True  # fp32 matmuls outside autocast use TF32
    if min(args.batch_size, args.grad_accum, args.eval_interval, args.save_interval, args.log_interval) < 1 or args.steps < 0:
        raise UserError("--batch-size, --grad-accum and the --*-interval flags must be at least 1, --steps at least 0")

    # --- model configuration --------------------------------------------------------------------
    state_dict, train_state = None, None
    if args.resume:
        train_state = checkpoint.load_training_state(args.out_dir)
        cfg, state_dict = checkpoint.load_hf(args.out_dir)
        saved_step = checkpoint.weights_step(os.path.join(args.out_dir, checkpoint.WEIGHTS))
        if saved_step != train_state["step"]:
            raise UserError(f"{args.out_dir}: weights are from step {saved_step} but the training state from "
                            f"step {train_state['step']}; the save was interrupted, start again without --resume")
    elif args.init_from:
        model_dir = hub.resolve_pretrained(args.init_from, args.cache_dir, log=log)
        cfg, state_dict = checkpoint.load_hf(model_dir)
        cfg.dropout = args.dropout
    else:
        shape = dict(gpt.MODEL_SIZES[args.model_size])
        for key in ("n_layer", "n_head", "n_embd", "block_size"):
            if getattr(args, key) is not None:
                shape[key] = getattr(args, key)
        if shape["n_embd"] % shape["n_head"]:
            raise UserError(f"--n-embd {shape['n_embd']} is not divisible by --n-head {shape['n_head']}")
        cfg = gpt.GPTConfig(**shape, dropout=args.dropout)
    block_size = args.block_size or cfg.block_size
    if block_size > cfg.block_size:
        raise UserError(f"--block-size {block_size} exceeds the model's {cfg.block_size} positions; use at most {cfg.block_size}")
    if cfg.vocab_size < tokenizer.VOCAB_SIZE:
        raise UserError(f"vocabulary mismatch: the checkpoint has vocab_size {cfg.vocab_size}, the GPT-2 tokenizer "
                        f"needs {tokenizer.VOCAB_SIZE}; use a GPT-2 checkpoint")
    with torch.device("meta"):
        n_params = gpt.GPT(cfg).num_params()
    tokens_per_step = args.batch_size * block_size * args.grad_accum * dist_info.world_size
    log(f"model: {cfg.n_layer} layers, {cfg.n_head} heads, {cfg.n_embd} wide, {n_params:,} parameters; "
        f"device {device}{f' x {dist_info.world_size} ranks' if dist_info.enabled else ''}, "
        f"{'fp32' if amp is None else str(amp).replace('torch.', '') + ' autocast'}; {tokens_per_step:,} tokens per step")

    estimate = memory.estimate_gpt_training(cfg, n_params, args.batch_size, block_size, device.type, amp is not None,
                                            ddp=dist_info.enabled)
    if args.estimate_memory:
        log(memory.format_table(estimate))
        distributed.cleanup(dist_info)
        return estimate

    # --- data -------------------------------------------------------------------------------------
    # One process per machine tokenises (once, cached); the others wait and then find the cache.
    if dist_info.local_rank == 0:
        data_dir = data.prepare(args.data, args.cache_dir, log=log)
    distributed.barrier(dist_info)
    if dist_info.local_rank != 0:
        data_dir = data.prepare(args.data, args.cache_dir, log=log)
    train_batches = data.Batches(data.TokenSplit(data_dir, "train"), args.batch_size, block_size,
                                 args.grad_accum, dist_info.rank, dist_info.world_size, seed=args.seed)
    # Validation batches are one fixed list, split between ranks inside evaluate().
    val_batches = data.Batches(data.TokenSplit(data_dir, "val"), args.batch_size, block_size, seed=args.seed + 1)

    # --- model ------------------------------------------------------------------------------------
    devices.reset_peak_memory(device)  # count training, not tokenisation
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
    optimizer = optim.make_adamw(raw_model.parameters(), args.lr, args.weight_decay, (args.beta1, args.beta2), device.type)
    # fp16 gradients underflow; the scaler multiplies the loss up and divides the gradients back.
    scaler = torch.amp.GradScaler(device.type, enabled=amp == torch.float16)
    start_step = 0
    if train_state is not None:
        optimizer.load_state_dict(train_state["optimizer"])
        torch.set_rng_state(train_state["rng_cpu"])
        if train_state["rng_cuda"] and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(train_state["rng_cuda"])
        start_step = train_state["step"]
        if args.steps < start_step:
            raise UserError(f"--resume: {args.out_dir} is already at step {start_step}; pass --steps {start_step} or more")
        log(f"resuming from step {start_step} in {args.out_dir}")

    # --- training loop ----------------------------------------------------------------------------
    metrics_log = metrics.MetricsLog(os.path.join(args.out_dir, "metrics.jsonl"), enabled=dist_info.is_main)
    metrics_log.log(event="start", seed=args.seed, step=start_step, world_size=dist_info.world_size,
                    device=str(device), n_params=n_params, config=vars(cfg), args=vars(args))
    peak_flops = metrics.peak_flops_for(device, args.peak_flops)
    flops_per_step = metrics.flops_per_token(n_params, cfg.n_layer, cfg.n_embd, block_size) * tokens_per_step
    speed = metrics.Throughput(args.steps, start_step)
    # next_step is what a checkpoint records: it moves only once optimizer.step() has run, so an
    # interrupt anywhere in a step saves a state that --resume continues without repeating work.
    next_step = start_step
    last_saved = start_step if args.resume else None
    val_loss = first_val = None
    try:
        for step in range(start_step, args.steps):
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
                sync = model.no_sync() if dist_info.enabled and micro < args.grad_accum - 1 else contextlib.nullcontext()
                with sync:
                    with devices.autocast(device, amp):
                        loss = model(x, y)[1]  # drop the logits now: holding them costs B x T x vocab floats
                    loss = loss / args.grad_accum  # so the accumulated gradient is the batch mean
                    scaler.scale(loss).backward()
                loss_sum += loss.detach()
            loss_value = distributed.all_reduce_mean(loss_sum, dist_info).item()
            if not math.isfinite(loss_value):
                kept = f"the last good checkpoint (step {last_saved}) in {args.out_dir} is kept" if last_saved is not None \
                    else "no checkpoint was saved yet"
                raise UserError(f"loss became {loss_value} at step {step}; stopped before the update, {kept}; "
                                f"lower --lr or check the data")
            scaler.unscale_(optimizer)  # clip the true gradients, not the scaled ones
            grad_norm = torch.nn.utils.clip_grad_norm_(raw_model.parameters(), args.grad_clip or float("inf")).item()
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            next_step = step + 1
            speed.add(tokens_per_step)

            record = dict(step=step, loss=loss_value, lr=lr, grad_norm=grad_norm)
            if step % args.log_interval == 0 or step == args.steps - 1:
                devices.synchronize(device)
                tok_s, sec_per_step, eta = speed.report(step + 1)
                mfu = flops_per_step / sec_per_step / peak_flops if peak_flops else None
                mem = devices.peak_memory_bytes(device)
                record.update(tokens_per_s=round(tok_s), mfu=mfu, peak_memory=mem)
                log(metrics.progress_line(step, args.steps, loss_value, lr, tok_s, mfu, mem, eta))
            metrics_log.log(**record)

            if next_step % args.save_interval == 0 and next_step < args.steps:
                if dist_info.is_main:
                    save(args.out_dir, raw_model, optimizer, next_step, args)
                last_saved = next_step
    except KeyboardInterrupt:
        # torchrun forwards a second Ctrl-C to its workers; ignore it so it cannot cut the save short.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        if dist_info.is_main:
            save(args.out_dir, raw_model, optimizer, next_step, args)
            print(f"\ninterrupted: saved step {next_step} to {args.out_dir}; continue with --resume", file=sys.stderr)
        distributed.cleanup(dist_info, wait=False)  # a rank that was not interrupted must not hang us
        sys.exit(130)
    step = next_step

    # --- save -------------------------------------------------------------------------------------
    if args.steps > start_step or not args.resume:
        val_loss = evaluate(model, val_batches, args.eval_batches, device, amp, dist_info)
        log(f"step {step}: val loss {val_loss:.4f}" + (f" (started at {first_val:.4f})" if first_val else ""))
        metrics_log.log(step=step, val_loss=val_loss)
    if dist_info.is_main:
        save(args.out_dir, raw_model, optimizer, step, args)
        log(f"saved {args.out_dir}/{checkpoint.CONFIG}, {checkpoint.WEIGHTS} (Hugging Face GPT-2 layout) and {checkpoint.STATE}")

    # --- report -----------------------------------------------------------------------------------
    peak = devices.peak_memory_bytes(device)
    log(memory.format_table(estimate, peak, f"measured ({devices.memory_label(device)})"))
    sample = None
    if args.sample_tokens > 0 and dist_info.is_main:
        raw_model.eval()
        prompt = tokenizer.encode(args.prompt) if args.prompt else [tokenizer.EOT]
        idx = torch.tensor([prompt], device=device)
        g = torch.Generator(device=device).manual_seed(args.seed)
        with devices.autocast(device, amp):
            out = raw_model.generate(idx, args.sample_tokens, args.temperature, args.top_k, generator=g)
        sample = tokenizer.decode(t for t in out[0].tolist() if t != tokenizer.EOT)
        log("sample:\n" + "-" * 40 + "\n" + sample + "\n" + "-" * 40)
    metrics_log.log(event="end", step=step, val_loss=val_loss, peak_memory=peak, memory_estimate=sum(estimate.values()),
                    sample=sample)
    distributed.cleanup(dist_info)
    return {"val_loss": val_loss, "first_val_loss": first_val, "peak_memory": peak}


if __name__ == "__main__":
    main()
