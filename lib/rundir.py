"""The run contract: how every script that saves treats its output directory.

Used by every training script (onefile_train.py keeps a compact inline copy, as it imports nothing
from lib/). The one idea: check everything, then write. A run directory goes through the same
steps in every script, and each script only declares what is particular to it (a Spec: its saved
files, the flags that make the run what it is, the flags a resume may change, its data paths):

1. prepare(): the flags and --out-dir are checked; --resume and --overwrite together are refused; a
   fresh run into a directory that holds a saved run is refused unless --overwrite is given.
   --auto-resume is --resume when the directory holds a saved run and a fresh start when it holds
   none: the one command line for torchrun --max-restarts, a requeued SLURM job or a restarted pod.
   With --resume, the newest complete checkpoint is found and every one of its files validated first
   (a damaged one is skipped, with one line, for the previous complete one; none left is one line and
   exit 2, and nothing has been written); flags not given take the saved values; a flag that would
   change what the run is, given with another value, is refused; the others are reported as
   changed; a data file that moved may be given again when its contents are the same (their sha256
   is kept in the training state, not just the path).
2. begin(): only now, just before the first write, --overwrite removes the old run's files, and
   metrics.jsonl starts afresh (or, resumed, continues).
3. save_state() and commit(): every file is written to a temporary name and renamed (lib.checkpoint.
   atomic_write), so no file is ever torn; but a save is several files, and a crash between two renames
   would leave the weights of one step beside the state of another. So a save ends with one commit
   point: the files are hard-linked into OUT/checkpoints/.step-N.tmp, which one rename makes
   OUT/checkpoints/step-N. Until that rename the previous checkpoint is the complete one; after it, the
   new one is. Older ones are then removed (--keep-last, default 1). The top of OUT keeps the files
   where the scripts and transformers look for them; --resume puts back from the checkpoint it resumes
   any that is missing, truncated or replaced, one line each. Only a commit counts: files at the top
   with no commit are no saved run (--resume refuses them, a new run replaces them). What a run writes
   at its end, after its last commit (Spec.products: an export, merged weights, an index), is in no
   commit and never put back: the top keeps the newest, until the next end writes it again.
   guards.check_finite_weights comes first: weights holding NaN or inf are never saved.
4. save_on_interrupt(): Ctrl-C saves the updates made so far and exits 130; SIGTERM (what SLURM,
   Kubernetes and spot machines send before SIGKILL) does the same and exits 143. whole_update() holds
   either signal back while a step's update is applied and counted, so a save never holds half of one;
   a signal inside a step that did not count saves the random states that step began with (rng_at_step).
5. Updates: an update skipped for a non-finite gradient is counted; MAX_SKIPPED in a row stop the
   run with a clear message, and a run that applied no update at all says so and exits non-zero.
"""

import contextlib
import dataclasses
import filecmp
import hashlib
import json
import os
import shutil
import signal
import sys
import threading
from typing import Callable

import torch

from lib import device as devices
from lib import distributed, errors, guards, metrics
from lib.checkpoint import atomic_write, fault_point, fsync
from lib.errors import UserError

STATE = "training_state.pt"
METRICS = "metrics.jsonl"
CHECKPOINTS = "checkpoints"  # OUT/checkpoints/step-000100: one complete checkpoint per folder
MAX_SKIPPED = 10  # updates in a row skipped for a non-finite gradient before the run stops

# Flags that say how to run this invocation, not what the run is: they never come from the saved run.
PER_INVOCATION = ("out_dir", "output_dir", "resume", "auto_resume", "keep_last", "overwrite", "force",
                  "estimate_memory", "cache_dir", "device")


@dataclasses.dataclass
class Spec:
    """What a script declares about its run directory; the rules are the same for every script.

    saved: the files (paths relative to the directory) whose presence means "a run is saved here",
        each with how to check it: "state" (a torch training state, loaded with weights_only=True),
        "safetensors", "json", "exists", or a function(path) that raises UserError when the file is bad.
    optional: of `saved`, the ones a run may not have written (a best copy, an index); checked when present.
    written: everything else a run writes (files or directories): --overwrite removes these too.
    fixed: flags that make the run what it is (shape, data, seed, batch): refused when --resume gives
        another value; not given, they take the saved value.
    changeable: flags a resume may change (steps, learning rate, intervals): reported when changed;
        not given, they keep the saved value.
    data: of the fixed flags, those naming data files or directories: a moved file may be given again
        with --resume when its contents are the same.
    same_step: safetensors files whose metadata "step" must equal the training state's step.
    local: the script's own flags that say how to run this invocation rather than what the run is
        (with PER_INVOCATION: --out-dir, --resume, --device, ...): they never come from the saved run.
        Every flag of a script is fixed, changeable or local (tests/test_run_contract.py checks this).
    state_file: where the training state lives; its "args" holds the run's flags.
    out_flag: the flag that names the directory, for messages.
    checkpoint: the files and directories (relative paths) a commit takes into a checkpoint folder;
        by default the saved files. A directory is taken with every file under it (train_fsdp.py's
        sharded/: latest.json and the DCP folder it names).
    products: of the saved files, those a run writes at its end, after its last commit, from its final
        weights (train_fsdp.py's export, finetune's merged/, SPLADE's index): outputs, not resume state. A
        commit never takes them (it would take the previous end's copy) and --resume neither checks nor puts
        them back; the next end writes them again, and --overwrite removes them.
    """
    saved: dict
    fixed: tuple = ()
    changeable: tuple = ()
    data: tuple = ()
    optional: tuple = ()
    written: tuple = (METRICS,)
    same_step: tuple = ()
    local: tuple = ()
    state_file: str = STATE
    out_flag: str = "--out-dir"
    checkpoint: tuple = ()
    products: tuple = ()

    @property
    def out_dest(self) -> str:
        return self.out_flag.lstrip("-").replace("-", "_")

    def is_product(self, name: str) -> bool:
        return any(name == p or name.startswith((p + "/", p + os.sep)) for p in self.products)

    @property
    def committed_files(self) -> tuple:
        """What a commit takes and --resume puts back: spec.checkpoint, or the saved files; never a product."""
        return tuple(e for e in self.checkpoint or tuple(self.saved) if not self.is_product(e))


@dataclasses.dataclass
class Run:
    """What prepare() found: where the run lives, the saved state when resuming, the data fingerprints."""
    out_dir: str
    spec: Spec
    state: dict | None = None  # the saved training state (with --resume), already validated
    fingerprints: dict = dataclasses.field(default_factory=dict)
    checkpoint_dir: str | None = None  # the committed checkpoint folder the run resumed from

    @property
    def resumed(self) -> bool:
        return self.state is not None

    def fields(self, args) -> dict:
        """What every training state holds besides the script's own entries: the run's flags (the
        values it really used: record resolved values such as an automatic LoRA rank in args before
        saving) and the fingerprints of its data."""
        return {"args": json.dumps(vars(args)), "data_sha256": self.fingerprints}


def flag(key: str) -> str:
    return "--" + key.replace("_", "-")


# --- 1. prepare: check, then resume -------------------------------------------------------------------
def prepare(args, parser, argv, spec: Spec, log=print, writes: bool = True) -> Run:
    """Check the directory and the flags; with --resume, validate the saved run and take its flags.

    writes=False (for --estimate-memory, --dry-run) checks the paths but lets a run that will write
    nothing look at a saved directory. Nothing is written or removed here except that a missing
    --out-dir is created (with a probe file: a read-only mount fails now, not after an hour), and that
    a resumed run's files at the top of the directory are put back from the checkpoint it resumes
    (once every check has passed: a crash between two renames of a save leaves them mixed).
    """
    out_dir = getattr(args, spec.out_dest)
    resume, overwrite = getattr(args, "resume", False), getattr(args, "overwrite", False)
    auto = getattr(args, "auto_resume", False)
    if resume and overwrite:
        raise UserError(f"--resume continues the run in {spec.out_flag} and --overwrite replaces it; pass one of them")
    if auto and overwrite:
        raise UserError(f"--auto-resume continues the run in {spec.out_flag} and --overwrite replaces it; pass one of "
                        f"them")
    guards.check_output_dir(out_dir, spec.out_flag)
    if auto and not resume:
        # The command line for restarts: continue the saved run if there is one, else start one.
        resume = args.resume = holds_saved_run(out_dir, spec)
        log(f"--auto-resume: continuing the run saved in {out_dir}" if resume else
            f"--auto-resume: {out_dir} holds no saved run; starting a new one")
    if not writes and not resume:
        return Run(out_dir, spec)
    if not resume:
        if uncommitted(out_dir, spec) and not overwrite:
            log(f"{out_dir}: {', '.join(uncommitted(out_dir, spec))} at the top are in no commit (a first save cut "
                f"short); the new run replaces them")
        if holds_saved_run(out_dir, spec) and not overwrite:
            found = [name for name in spec.saved if os.path.exists(os.path.join(out_dir, name))] or [CHECKPOINTS]
            raise UserError(f"{out_dir} already holds a saved run ({', '.join(found)}); pass --resume (or "
                            f"--auto-resume) to continue it, --overwrite to replace it, or another {spec.out_flag}")
        if writes:
            guards.make_output_dir(out_dir, spec.out_flag)
        return Run(out_dir, spec)
    where, state = check_saved_run(out_dir, spec, log)
    run = Run(out_dir, spec, state, dict(state.get("data_sha256") or {}), checkpoint_dir=where)
    apply_saved_flags(run, args, parser, argv, log)
    if writes and where != out_dir:
        restore_top(out_dir, where, spec, log)
    return run


def committed(out_dir: str) -> list:
    """The committed checkpoint folders of OUT/checkpoints, newest first: step-000100 is step 100, and
    step-000100.2 a second save of the same step (a run resumed at 100 and interrupted before a step)."""
    root = os.path.join(out_dir, CHECKPOINTS)
    found = []
    for name in os.listdir(root) if os.path.isdir(root) else ():
        step, _, again = name.removeprefix("step-").partition(".")
        if name.startswith("step-") and step.isdigit() and (again == "" or again.isdigit()):
            found.append((int(step), int(again or 1), os.path.join(root, name)))
    return [path for _, _, path in sorted(found, reverse=True)]


def holds_saved_run(out_dir: str, spec: Spec) -> bool:
    """A committed checkpoint; or, in a directory saved before checkpoints/ existed, any saved file.
    Files without a commit (a first save cut short) are not a saved run: nothing there can be continued."""
    if os.path.isdir(os.path.join(out_dir, CHECKPOINTS)):
        return bool(committed(out_dir))
    return any(os.path.exists(os.path.join(out_dir, name)) for name in spec.saved)


def uncommitted(out_dir: str, spec: Spec) -> list:
    """The saved files at the top of a directory whose checkpoints/ holds no commit: a first save cut short."""
    if not os.path.isdir(os.path.join(out_dir, CHECKPOINTS)) or committed(out_dir):
        return []
    return [name for name in spec.saved if os.path.exists(os.path.join(out_dir, name))]


def check_saved_run(out_dir: str, spec: Spec, log=print):
    """The newest checkpoint whose every file is sound -> (its folder, its training state). A damaged one
    is skipped for the one before, with one line; when none is left, the newest one's fault is the error.
    A directory saved before checkpoints/ existed is its own one checkpoint."""
    folders = committed(out_dir)
    if not folders and uncommitted(out_dir, spec):  # only a commit counts, for --resume as for --auto-resume
        raise UserError(f"--resume: {out_dir} holds no committed checkpoint ({', '.join(uncommitted(out_dir, spec))} "
                        f"at the top are in no commit: a first save cut short); start again with --auto-resume or "
                        f"--overwrite")
    if not folders:
        return out_dir, check_checkpoint(out_dir, out_dir, spec)
    first = None
    for folder in folders:
        try:
            return folder, check_checkpoint(folder, out_dir, spec)
        except UserError as e:
            first = first or e
            log(f"--resume: skipping the checkpoint {folder}: {str(e).split(';')[0]}")
    raise first


def check_checkpoint(folder: str, out_dir: str, spec: Spec) -> dict:
    """Every saved file of one checkpoint validated before anything is written; returns the training state."""
    state_path = os.path.join(folder, spec.state_file)
    if not os.path.exists(state_path):
        raise UserError(f"--resume: {state_path} does not exist; run without --resume first, or pass the "
                        f"{spec.out_flag} of an earlier run")
    for name, check in spec.saved.items():
        path = os.path.join(folder, name)
        if spec.is_product(name):
            continue  # not resume state (an older checkpoint may hold a copy from an earlier end: it is ignored)
        if not os.path.exists(path):
            if name in spec.optional:
                continue
            raise UserError(f"--resume: {path} is missing, so the run in {out_dir} is incomplete; start again with "
                            f"--overwrite, or pass the {spec.out_flag} of a complete run")
        check_file(path, check)
    state = load_state(state_path)
    for name in spec.same_step:
        path = os.path.join(folder, name)
        if os.path.exists(path):
            step = safetensors_metadata(path).get("step")
            if step is not None and int(step) != state.get("step"):
                raise UserError(f"--resume: {path} is from step {step} but {state_path} from step {state.get('step')}; "
                                f"the save was interrupted: start again with --overwrite")
    return state


def files_under(top: str, entries) -> list:
    """The files (relative paths) of entries under top: a file as itself, a directory with every file in
    it. Temporary files of a write in progress (atomic_write's NAME.tmp-PID, a folder NAME.tmp) are left out."""
    found = []
    for entry in entries:
        path = os.path.join(top, entry)
        if os.path.isfile(path):
            found.append(entry)
        elif os.path.isdir(path):
            for root, dirs, names in os.walk(path):
                dirs[:] = sorted(d for d in dirs if ".tmp" not in d)
                found += [os.path.relpath(os.path.join(root, n), top) for n in sorted(names) if ".tmp" not in n]
    return found


def link_or_copy(src: str, dst: str):
    """dst becomes src by one rename: a hard link (no bytes copied, no disk used) where the file system
    has them, else a copy."""
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    tmp = f"{dst}.tmp-{os.getpid()}"
    if os.path.lexists(tmp):
        os.remove(tmp)
    try:
        os.link(src, tmp)
    except OSError:
        shutil.copy2(src, tmp)
    os.replace(tmp, dst)


def restore_top(out_dir: str, folder: str, spec: Spec, log=print):
    """--resume: the top of OUT made the checkpoint being resumed again (hard links to its files), where a
    save cut short left newer files there, or a file is missing, truncated or replaced: each file put back
    is said in one line. A directory entry (sharded/) loses the files the checkpoint has not (a DCP folder
    half-written). Products (Spec.products) are left as they are, even where an older checkpoint holds a
    copy. Every rank of a torchrun may do this at once: each step is a rename to the same file."""
    entries = spec.committed_files
    keep = set(files_under(folder, entries))
    for rel in sorted(keep):
        top, kept = os.path.join(out_dir, rel), os.path.join(folder, rel)
        if not (os.path.exists(top) and os.path.samefile(top, kept)):
            how = "missing" if not os.path.exists(top) else top_damage(top, kept, spec.saved.get(rel, "exists"))
            link_or_copy(kept, top)
            if how:  # a copy of the same bytes (a run directory copied elsewhere) is linked again, silently
                log(f"--resume: {rel} at the top of {out_dir} was {how}; put back from "
                    f"{os.path.relpath(folder, out_dir)}")
    for entry in entries:
        if os.path.isdir(os.path.join(out_dir, entry)):
            for root, dirs, names in os.walk(os.path.join(out_dir, entry), topdown=False):
                for name in names:
                    rel = os.path.relpath(os.path.join(root, name), out_dir)
                    if rel not in keep:
                        with contextlib.suppress(FileNotFoundError):
                            os.remove(os.path.join(root, name))
                for name in dirs:
                    rel = os.path.relpath(os.path.join(root, name), out_dir)
                    if not any(k.startswith(rel + os.sep) for k in keep):
                        with contextlib.suppress(OSError):
                            os.rmdir(os.path.join(root, name))  # only when empty


def top_damage(top: str, kept: str, check) -> str:
    """How a file at the top of OUT differs from the checkpoint's: truncated, damaged, or replaced (sound but
    another file: a newer save cut short before its commit, or a file copied there); None for the same bytes."""
    if os.path.getsize(top) == os.path.getsize(kept) and filecmp.cmp(top, kept, shallow=False):
        return None
    try:
        check_file(top, check)
    except UserError:
        return "truncated" if os.path.getsize(top) < os.path.getsize(kept) else "damaged"
    return "truncated" if check == "exists" and os.path.getsize(top) < os.path.getsize(kept) else "replaced"


def check_file(path: str, check) -> None:
    """One line naming the file when it cannot be what it should be (truncated, garbled, foreign)."""
    if callable(check):
        check(path)
    elif check == "state":
        load_state(path)
    elif check == "safetensors":
        safetensors_metadata(path)
    elif check == "json":
        read_json(path)
    elif check != "exists":
        raise ValueError(f"check_file: unknown check {check!r}")


def damaged(path: str, what: str) -> UserError:
    return UserError(f"{path} is damaged ({what}); it cannot be used: restore it, or start again with --overwrite "
                     f"(or another output directory)")


def load_state(path: str) -> dict:
    """A training state: torch.load with weights_only=True (tensors, numbers, strings, no code)."""
    try:
        if path.endswith(".json"):
            state = read_json(path)
        else:
            state = torch.load(path, map_location="cpu", weights_only=True)
    except UserError:
        raise
    except Exception as e:  # a truncated zip, a foreign pickle: say which file, not where torch failed
        raise damaged(path, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else 'unreadable'}") from None
    if not isinstance(state, dict) or "args" not in state:
        raise damaged(path, "not a byhand training state: no 'args'")
    return state


def read_json(path: str):
    try:
        with open(path, encoding="utf-8-sig") as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise damaged(path, f"invalid JSON at line {e.lineno} column {e.colno}: {e.msg}") from None
    except UnicodeDecodeError:
        raise damaged(path, "not UTF-8 text") from None


def safetensors_metadata(path: str) -> dict:
    """The header of a safetensors file, checked: readable, and every tensor's bytes inside the file."""
    try:
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if n <= 0 or n > os.path.getsize(path) - 8:
                raise ValueError("header length past the end of the file")
            header = json.loads(f.read(n))
        end = max((entry["data_offsets"][1] for key, entry in header.items() if key != "__metadata__"), default=0)
    except (ValueError, KeyError, TypeError, IndexError, AttributeError, OSError) as e:
        raise damaged(path, f"not a safetensors file: {type(e).__name__}") from None
    if 8 + n + end > os.path.getsize(path):
        raise damaged(path,
                      f"truncated: its tensors end at byte {8 + n + end:,}, the file has {os.path.getsize(path):,}")
    return header.get("__metadata__") or {}


def saved_args(state: dict) -> dict:
    a = state.get("args", {})
    return json.loads(a) if isinstance(a, str) else dict(a)


def apply_saved_flags(run: Run, args, parser, argv, log=print):
    """--resume continues the saved run: flags not given take its values; a fixed flag given with
    another value is refused; a changeable one given with another value is reported."""
    spec, saved = run.spec, saved_args(run.state)
    given = guards.explicit_flags(args, parser, argv)
    for key in spec.fixed:
        if key not in saved:
            continue
        if key in spec.data:
            resolve_data_path(run, args, key, saved[key], key in given, log)
        elif key in given and not same_value(getattr(args, key), saved[key]):
            raise UserError(f"--resume: {flag(key)} {getattr(args, key)} contradicts the saved run ({flag(key)} "
                            f"{saved[key]}); drop {flag(key)} to continue it, or start a new run with --overwrite or "
                            f"another {spec.out_flag}")
        else:
            setattr(args, key, saved[key])
    for key in spec.changeable:
        if key not in saved:
            continue
        if key not in given:
            setattr(args, key, saved[key])
        elif not same_value(getattr(args, key), saved[key]):
            log(f"--resume: {flag(key)} changed from {saved[key]} to {getattr(args, key)}")


def same_value(a, b) -> bool:
    """Equal as the saved JSON would have them (tuples are lists there), or two names of one existing path."""
    if isinstance(a, tuple):
        a = list(a)
    if a == b:
        return True
    return (isinstance(a, str) and isinstance(b, str) and os.path.exists(a) and os.path.exists(b)
            and os.path.samefile(a, b))


def resolve_data_path(run: Run, args, key: str, saved_path, given: bool, log=print):
    """The saved run's data: the same path, or a new path whose contents are the same (sha256)."""
    want = run.fingerprints.get(key)
    now = getattr(args, key)
    if not given or same_value(now, saved_path):
        if want is not None and not os.path.exists(saved_path):
            raise UserError(f"--resume: the run's {flag(key)} {saved_path} no longer exists; if it moved, pass its new "
                            f"path with {flag(key)} (its contents are checked against the saved run)")
        setattr(args, key, saved_path)
        return
    found = fingerprint(now) if want is not None else None
    if want is None or found != want:  # another data set (an embedded default has no fingerprint at all)
        why = " (the contents differ)" if found is not None else ""
        raise UserError(f"--resume: {flag(key)} {now} contradicts the saved run ({flag(key)} {saved_path}){why}; "
                        f"drop {flag(key)} to continue it (a moved file may be given again), or start a new run "
                        f"with --overwrite or another {run.spec.out_flag}")
    log(f"--resume: {flag(key)} moved from {saved_path} to {now} (same contents)")


def fingerprint(path) -> str | None:
    """sha256 of a data file's bytes, or of a directory's files (names and bytes, in sorted order);
    None for a value that names no file (an embedded data set such as 'stdlib')."""
    if not isinstance(path, str) or not os.path.exists(path):
        return None
    h = hashlib.sha256()
    files = [path] if os.path.isfile(path) else sorted(
        os.path.join(root, name) for root, _, names in os.walk(path) for name in names)
    for file in files:
        h.update(os.path.relpath(file, path).encode() + b"\0")
        with open(file, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()


# --- 2. begin: the first write ----------------------------------------------------------------------
def begin(run: Run, args, is_main: bool = True) -> metrics.MetricsLog:
    """Just before the first write: with --overwrite the old run's files go now (every check has
    passed); metrics.jsonl starts afresh for a new run and continues for a resumed one. A new run
    also takes the fingerprints of its data here, for a later --resume from another path. From here
    on SIGTERM saves like Ctrl-C (catch_sigterm)."""
    spec = run.spec
    if not run.resumed:
        run.fingerprints = {key: fingerprint(getattr(args, key, None)) for key in spec.data}
    if is_main:
        os.makedirs(run.out_dir, exist_ok=True)
        if not run.resumed:
            for name in (CHECKPOINTS, *spec.saved, *spec.checkpoint, *spec.written):
                path = os.path.join(run.out_dir, name)
                if os.path.isdir(path) and not os.path.islink(path):
                    shutil.rmtree(path)
                elif os.path.lexists(path):
                    os.remove(path)
        # checkpoints/ exists from the first write on: files at the top without a commit there are a
        # first save cut short, not a saved run (holds_saved_run).
        os.makedirs(os.path.join(run.out_dir, CHECKPOINTS), exist_ok=True)
    catch_sigterm()
    return metrics.MetricsLog(os.path.join(run.out_dir, METRICS), enabled=is_main)


# --- 3. save --------------------------------------------------------------------------------------------
def save_state(run: Run, args, state: dict, commit_now: bool = True):
    """The training state, with the run's flags and data fingerprints, in one atomic file; then, as the
    state is the last file of most saves, the commit (commit_now=False where more files follow)."""
    full = {**state, **run.fields(args)}
    path = os.path.join(run.out_dir, run.spec.state_file)
    atomic_write(path, lambda tmp: torch.save(full, tmp))
    if commit_now:
        commit(run, args, state["step"])


def commit(run: Run, args, step: int):
    """Make the files of the save just written one checkpoint, OUT/checkpoints/step-N, in one rename.

    1. every file of the checkpoint (spec.checkpoint, or the saved files; never a product: the top's copy
       is the previous end's, older than this state) is hard-linked into a staging folder, .step-N.tmp-PID:
       no bytes are copied, and a link keeps its file whole when the top of OUT is later replaced, rename
       by rename, by the next save;
    2. the staging folder is synced, then renamed to step-N: the commit point. A crash before it leaves
       the previous checkpoint the newest complete one; a crash after it, this one;
    3. only then are older checkpoints removed, all but the newest --keep-last (default 1).

    Called on the main rank once every file of the save is written (train_fsdp.py: after every rank's
    shards). The top of OUT stays what transformers and the other tools load."""
    root = os.path.join(run.out_dir, CHECKPOINTS)
    os.makedirs(root, exist_ok=True)
    name, again = f"step-{step:06d}", 1
    while os.path.exists(os.path.join(root, name if again == 1 else f"{name}.{again}")):
        again += 1  # the same step saved again (resumed there and stopped before a step): a newer folder
    name = name if again == 1 else f"{name}.{again}"
    staging = os.path.join(root, f".{name}.tmp-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    fault_point(f"link {name}")
    for rel in files_under(run.out_dir, run.spec.committed_files):
        link_or_copy(os.path.join(run.out_dir, rel), os.path.join(staging, rel))
    for folder, _, _ in os.walk(staging):
        fsync(folder)  # the links themselves on the disk before the rename that makes them count
    fault_point(f"commit {name}")
    os.rename(staging, os.path.join(root, name))  # THE COMMIT POINT
    fsync(root)
    fault_point(f"prune {name}")
    keep = max(1, getattr(args, "keep_last", 1) or 1)
    for old in committed(run.out_dir)[keep:]:
        shutil.rmtree(old, ignore_errors=True)  # a crash here leaves an extra old folder: --resume ignores it
    for left in os.listdir(root):  # staging folders of saves cut short
        if left.startswith(".") and ".tmp-" in left and left != os.path.basename(staging):
            shutil.rmtree(os.path.join(root, left), ignore_errors=True)
    # The temporary files of writes cut short (NAME.tmp-PID, lib.checkpoint.atomic_write), beside the files a
    # checkpoint takes: disk use stays bounded however many crashes a run goes through.
    folders = {run.out_dir} | {os.path.dirname(os.path.join(run.out_dir, rel)) for rel in files_under(
        os.path.join(root, name), run.spec.committed_files)}
    for folder in folders:
        for left in os.listdir(folder):
            pid = left.rpartition(".tmp-")[2]
            if pid.isdigit() and int(pid) != os.getpid() and os.path.isfile(os.path.join(folder, left)):
                with contextlib.suppress(FileNotFoundError):
                    os.remove(os.path.join(folder, left))


# --- 4. Ctrl-C and SIGTERM ------------------------------------------------------------------------------
Terminated = errors.Terminated  # SIGTERM, raised where Ctrl-C raises KeyboardInterrupt


def catch_sigterm():
    """SIGTERM (a scheduler's "stop now", sent some seconds before SIGKILL) raises Terminated, as Ctrl-C
    raises KeyboardInterrupt. Under torchrun, distributed.catch_ctrl_c then turns both into a flag the
    ranks agree on. Only the main thread may set a handler; elsewhere SIGTERM keeps its default."""
    distributed.STOP["signal"] = None  # a new run: no signal yet (an earlier run in this process may have had one)

    def on_sigterm(signum, frame):
        distributed.STOP["signal"] = signum
        raise Terminated
    with contextlib.suppress(ValueError):
        signal.signal(signal.SIGTERM, on_sigterm)


@contextlib.contextmanager
def whole_update():
    """Wrap a step's update and its counting (optimizer.step() to next_step = step + 1): a signal never cuts it.

    Python raises KeyboardInterrupt (and catch_sigterm Terminated) at whatever line is running; inside
    optimizer.step(), which updates the tensors in turn, a save would hold half an update, and between the update
    and next_step one the step counter misses. So inside this block SIGINT and SIGTERM are only noted; on leaving
    it the previous handlers are put back and a noted signal is sent again, to them: a single process then stops
    right after the block, and under torchrun catch_ctrl_c's handlers set their flag. (A block that raises keeps its
    exception and drops the noted signal: the scripts stop on that exception anyway.) A few signal.signal calls a step.
    Only the main thread may set handlers: elsewhere this does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    noted, previous = [], {}
    try:
        for signum in (signal.SIGINT, signal.SIGTERM):
            previous[signum] = signal.signal(signum, lambda signum, frame: noted.append(signum))
        yield
    finally:
        for signum, handler in previous.items():  # None: a handler not set from Python; the default stands in
            signal.signal(signum, signal.SIG_DFL if handler is None else handler)
    for signum in sorted(set(noted), reverse=True):  # SIGTERM (15) first: it outranks SIGINT, as in catch_ctrl_c
        signal.raise_signal(signum)


def save_on_interrupt(save: Callable, step: int, out_dir: str, is_main: bool = True, cleanup: Callable = None,
                      rng_at_step: tuple = None):
    """Ctrl-C or SIGTERM: save the updates made so far (step = the next one to run, so --resume neither
    skips nor repeats one: whole_update keeps an update and that count together), say so, and exit 130
    (128 + SIGINT) or 143 (128 + SIGTERM), the shell's codes. A second signal during the save (torchrun
    forwards one to its workers, a scheduler may repeat its SIGTERM) is ignored until the save is done;
    SIGKILL cannot be, and then the commit point keeps the previous checkpoint whole.

    rng_at_step is (a step, device.rng_states() as it began), taken at the top of each step before anything of
    it draws. A signal inside that step before its update counted (step is still that step) finds its dropout
    masks drawn and the generators moved on: those states are put back first, so the save holds the ones the
    step began with and --resume redraws the same masks, as the unbroken run did. After a counted step the
    current states are already the next step's."""
    terminated = isinstance(sys.exc_info()[1], Terminated) or distributed.STOP["signal"] == signal.SIGTERM
    distributed.STOP["signal"] = None  # read once: a later run in this process (a test, a notebook) starts clean
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if rng_at_step is not None and rng_at_step[0] == step:
        devices.restore_rng_states(rng_at_step[1])
    saved = save()
    if is_main:
        where = f"saved step {step} to {out_dir}" if saved is not False else f"{out_dir} keeps its last save"
        what = "terminated (SIGTERM)" if terminated else "interrupted"
        print(f"\n{what}: {where}; continue with --resume (or --auto-resume)", file=sys.stderr, flush=True)
    if cleanup is not None:
        cleanup()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the save is done: a late SIGTERM may end the process now
    sys.stdout.flush()
    sys.exit(143 if terminated else 130)


# --- 5. updates that did not happen --------------------------------------------------------------------
@dataclasses.dataclass
class Updates:
    """Counts the optimizer updates of a run: applied, and skipped for a non-finite gradient.

    A NaN or infinite gradient would turn every weight it touches into NaN, so that update is
    skipped; one bad batch is survivable, a run of them means the run has diverged. record() is
    called once per optimizer step, after the update; saved() whenever a checkpoint is written, so
    that a message can name the last finite one.
    """
    out_dir: str
    limit: int = MAX_SKIPPED
    in_a_row: int = 0
    applied: int = 0
    skipped: int = 0
    last_saved: int | None = None

    def check_loss(self, step: int, loss: float):
        """A non-finite loss stops the run before its update (the gradient of a NaN is NaN everywhere)."""
        if not (loss == loss and abs(loss) != float("inf")):
            raise UserError(f"the loss became {loss} at step {step}; stopped before the update, "
                            f"{guards.last_finite_text(self.last_saved, self.out_dir)}; lower the learning rate or "
                            f"check the data")

    def record(self, step: int, skipped: bool):
        if not skipped:
            self.applied, self.in_a_row = self.applied + 1, 0
            return
        self.skipped, self.in_a_row = self.skipped + 1, self.in_a_row + 1
        if self.in_a_row >= self.limit:
            raise UserError(f"the gradient norm was not finite for {self.limit} steps in a row (steps "
                            f"{step - self.limit + 1} to {step}); stopped, "
                            f"{guards.last_finite_text(self.last_saved, self.out_dir)}; lower the learning rate or "
                            f"check the data")

    def saved(self, step: int):
        self.last_saved = step

    def finish(self):
        """A run that tried to update and never could has trained nothing: say so, exit non-zero."""
        if self.skipped and not self.applied:
            raise UserError(f"no update was applied: all {self.skipped} were skipped for a non-finite gradient, so "
                            f"nothing was trained and nothing new was saved in {self.out_dir}; lower the learning "
                            f"rate or check the data")
