"""Guards every script runs so that a user mistake costs one line, never a traceback or lost work.

Used by every training script. The one idea: check before you spend. Flags are validated when
they are parsed, paths before anything is written, memory before anything is allocated, and
weights before they are saved. Each failure is a UserError: one line, `error: <what>, <where>;
<what to do>`, exit 2. What a saved run directory may and may not become (--resume, --overwrite,
damaged files, Ctrl-C) is the run contract's, in lib/rundir.py, which uses these checks.
"""

import argparse
import math
import os
import sys

import torch

from lib.errors import UserError
from lib.metrics import format_bytes

# --- argparse types: a bad value ends in argparse's own one-line usage error (exit 2) -------------
def _number(kind, test, what):
    def parse(text):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None
        if kind is float and not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
        if not test(value):
            raise argparse.ArgumentTypeError(f"{text!r} must be {what}")
        return value

    parse.__name__ = f"{kind.__name__} ({what})"  # argparse names the type in some messages
    return parse


positive_int = _number(int, lambda v: v >= 1, "at least 1")
nonneg_int = _number(int, lambda v: v >= 0, "0 or more")
positive_float = _number(float, lambda v: v > 0, "greater than 0")
nonneg_float = _number(float, lambda v: v >= 0, "0 or more")
finite_float = _number(float, lambda v: True, "finite")
probability = _number(float, lambda v: 0 <= v < 1, "at least 0 and below 1")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """--help with each flag's default shown once: argparse's "(default: X)", except for a flag whose
    default is None or a switch (its help says what happens when it is not given) and a flag whose
    help already names its default."""

    def _get_help_string(self, action):
        if action.default is None or action.nargs == 0 or "(default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def add_safety_flags(parser, snake: bool = False):
    """--overwrite and --force; --auto-resume and --keep-last (lib/rundir.py). snake: also accept
    --auto_resume and --keep_last, in the scripts whose flags keep snake_case spellings."""
    parser.add_argument("--overwrite", action="store_true",
                        help="start a fresh run even if --out-dir already holds a saved one (it is replaced)")
    parser.add_argument("--force", action="store_true",
                        help="run even when the memory estimate exceeds what the device has free")
    parser.add_argument("--auto-resume", *(["--auto_resume"] if snake else []), dest="auto_resume",
                        action="store_true",
                        help="continue the run saved in the output directory if there is one (as --resume), else "
                             "start one: the command line for torchrun --max-restarts and requeued jobs")
    parser.add_argument("--keep-last", *(["--keep_last"] if snake else []), dest="keep_last", type=positive_int,
                        default=1, help="complete checkpoints kept in OUT/checkpoints (the newest ones)")


def check_schedule_and_seed(args, seed_limit: int = 2**32):
    """The flag checks every GPT training script shares: --min-lr-ratio a fraction, --seed within what
    numpy accepts (seed_limit lower where seed + 1 is used too)."""
    if args.min_lr_ratio > 1:
        raise UserError(f"--min-lr-ratio {args.min_lr_ratio} is above 1 (the final learning rate would exceed --lr); "
                        f"use a value from 0 to 1")
    if args.seed >= seed_limit:
        raise UserError(f"--seed {args.seed} is too large; use a seed from 0 to {seed_limit - 1}")


# --- paths --------------------------------------------------------------------------------------
def check_output_dir(path: str, flag: str = "--out-dir"):
    """Make sure `path` can become (or already is) a writable directory, without creating it."""
    path = os.path.abspath(path)
    if os.path.exists(path) and not os.path.isdir(path):
        raise UserError(f"{flag} {path} is an existing file, not a directory; pick another {flag}")
    parent = path
    while not os.path.exists(parent):  # the nearest part of the path that exists decides
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise UserError(f"{flag} {path} lies under {parent}, which is a file; pick another {flag}")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UserError(f"{flag} {path}: {parent} is not writable; pick a directory you can write to")


def check_cache_dir(path: str, flag: str = "--cache-dir"):
    check_output_dir(path, flag)


# --- finite weights -----------------------------------------------------------------------------
def nonfinite(named_tensors) -> list:
    """Names of the floating-point tensors that hold a NaN or an infinity."""
    items = named_tensors.items() if isinstance(named_tensors, dict) else named_tensors
    bad = []
    for name, t in items:
        if torch.is_tensor(t) and t.is_floating_point() and not bool(torch.isfinite(t).all()):
            bad.append(name)
    return bad


def last_finite_text(last_finite, out_dir: str) -> str:
    if last_finite is None:
        return "no finite checkpoint was saved in this run"
    return f"the last finite checkpoint is step {last_finite} in {out_dir}"


def check_finite_weights(named_tensors, step: int, last_finite, out_dir: str):
    """Refuse to save weights that hold NaN or inf: a checkpoint is only good if it is finite."""
    bad = nonfinite(named_tensors)
    if bad:
        raise UserError(f"weights are not finite at step {step} ({len(bad)} tensors, e.g. {bad[0]}); nothing was "
                        f"saved, {last_finite_text(last_finite, out_dir)}; lower --lr or check the data")


# --- memory -------------------------------------------------------------------------------------
def available_memory(device: torch.device):
    """(bytes the device can still give, how that was measured), or (None, reason) when unknown."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return free, "free CUDA memory"
    if device.type == "mps":
        return torch.mps.recommended_max_memory(), "MPS recommended maximum"
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024, "available RAM"
    except OSError:
        pass
    try:  # macOS and other POSIX systems: physical memory is the best figure the stdlib has
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "physical RAM"
    except (ValueError, OSError, AttributeError):
        return None, "unknown"


MARGIN = 1.25  # estimates are within about 10-20%; only stop when the run clearly cannot fit


def check_memory(estimate_bytes: int, device: torch.device, force: bool, hint: str):
    """Stop before allocating when the predicted peak clearly exceeds what the device has."""
    if force:
        return
    available, what = available_memory(device)
    if available is not None and estimate_bytes > MARGIN * available:
        raise UserError(f"the memory estimate ({format_bytes(estimate_bytes)}) exceeds the {format_bytes(available)} "
                        f"of {what} on {device}; {hint}, or pass --force to try anyway (--estimate-memory shows the "
                        "breakdown)")


# --- resume ---------------------------------------------------------------------------------------
def explicit_flags(args, parser, argv=None) -> set:
    """The flags the user asked for: named on the command line, or set to something not the default."""
    argv = sys.argv[1:] if argv is None else argv
    named = {parser._option_string_actions[a.split("=", 1)[0]].dest for a in argv
             if a.startswith("-") and a.split("=", 1)[0] in parser._option_string_actions}
    return named | {k for k, v in vars(args).items() if v != parser.get_default(k)}


# --- creating the output directory -------------------------------------------------------------------
def make_output_dir(path: str, flag: str = "--out-dir"):
    """check_output_dir, then create the directory and write a probe file in it: a read-only mount or a
    directory only permissions stop (root passes os.access everywhere) fails here, before any work."""
    import tempfile

    check_output_dir(path, flag)
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as e:
        raise UserError(f"{flag} {os.path.abspath(path)} cannot be written ({e.strerror}); pick a directory "
                        f"you can write to") from None
