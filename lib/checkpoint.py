"""Saving and loading: the Hugging Face GPT-2 layout for weights, a separate file for training state.

Used by train.py, train_fsdp.py and the fine-tuning scripts. The one idea: a checkpoint is two
things with different audiences. config.json + model.safetensors (transformers' names and layouts)
is the model, which anyone can load; training_state.pt (optimizer moments, step, RNG states) is
only for --resume. Every file is written to a temporary name, flushed to disk and renamed into place,
so a crash mid-write never leaves a torn file. A torn *checkpoint* (the weights of one step beside the
training state of another, when a crash falls between two renames) is a different matter: a save is made
whole by one commit point, lib/rundir.commit (docs/crash_safe_checkpoints.md).
"""

import json
import os
import signal

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from lib import gpt
from lib.errors import UserError

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
STATE = "training_state.pt"


# Fault injection, for tests/test_faults.py: every write and rename of a save calls fault_point(what)
# first ("write model.safetensors", "rename training_state.pt", "commit step-000004"...). BYHAND_CRASH_AT=P
# in the environment kills this process with SIGKILL at the point P: the P-th point when P is a number,
# else the first point whose name starts with P. Nothing runs after it (no finally, no atexit, no flush),
# as when the OOM killer or a scheduler strikes. Under torchrun only the rank BYHAND_CRASH_RANK (default
# 0) is killed. BYHAND_FAULT_LOG=FILE appends each point's name to FILE, to list them. Without either
# variable fault_point costs two dictionary lookups.
CRASH_AT, FAULT_LOG = "BYHAND_CRASH_AT", "BYHAND_FAULT_LOG"
_faults_seen = [0]


def fault_point(what: str):
    if CRASH_AT not in os.environ and FAULT_LOG not in os.environ:
        return
    if os.environ.get("RANK", "0") != os.environ.get("BYHAND_CRASH_RANK", "0"):
        return
    _faults_seen[0] += 1
    if os.environ.get(FAULT_LOG):
        with open(os.environ[FAULT_LOG], "a") as f:
            f.write(f"{_faults_seen[0]}\t{what}\n")
    want = os.environ.get(CRASH_AT, "")
    if want and (want == str(_faults_seen[0]) if want.isdigit() else what.startswith(want)):
        os.kill(os.getpid(), signal.SIGKILL)


def fsync(path: str):
    """Ask the OS to put path (a file or a directory) on the disk now. A process killed outright loses
    nothing the kernel already has; a machine that loses power loses what is not on the disk yet, and
    a rename can reach the disk before the bytes it names unless they were synced first."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError:  # some file systems cannot sync a directory; the rename is still atomic
        pass
    finally:
        os.close(fd)


def atomic_write(path: str, write):
    """Call write(tmp_path), sync it, then rename tmp_path over path (atomic on POSIX and Windows).

    The file at path is always either the old one, whole, or the new one, whole. A rename replaces the
    name, not the bytes: whoever still holds the old file (a hard link in a committed checkpoint,
    lib/rundir.commit) keeps it unchanged."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        fault_point(f"write {os.path.basename(path)}")
        write(tmp)
        fsync(tmp)
        # Some writers (safetensors) create their file as 0600; give it the mode open() would: 0666 - umask.
        os.chmod(tmp, 0o666 & ~current_umask())
        fault_point(f"rename {os.path.basename(path)}")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def current_umask() -> int:
    mask = os.umask(0)  # the only way to read it is to set it; put it straight back
    os.umask(mask)
    return mask


def save_json(path: str, obj: dict):
    def write(tmp):
        with open(tmp, "w") as f:
            json.dump(obj, f, indent=2)
            f.write("\n")

    atomic_write(path, write)


def save_hf(out_dir: str, cfg: gpt.GPTConfig, hf_state: dict, step: int = None):
    """Write config.json and model.safetensors (tensors already in HF names, see gpt.to_hf_state_dict).

    The step goes into the safetensors metadata, so --resume can check that the weights and the
    training state belong together.
    """
    metadata = {"format": "pt"}
    if step is not None:
        metadata["step"] = str(step)
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in hf_state.items()}
    atomic_write(os.path.join(out_dir, WEIGHTS), lambda tmp: save_file(tensors, tmp, metadata=metadata))
    save_json(os.path.join(out_dir, CONFIG), gpt.config_to_hf(cfg))


def weights_step(path: str):
    from safetensors import safe_open

    with safe_open(path, framework="pt") as f:
        step = (f.metadata() or {}).get("step")
    return None if step is None else int(step)


def load_config(model_dir: str) -> gpt.GPTConfig:
    """config.json alone (for --estimate-memory, which must not read or download the weights)."""
    config_path = os.path.join(model_dir, CONFIG)
    if not os.path.isfile(config_path):
        raise UserError(f"{config_path} is missing, so {model_dir!r} is not a GPT-2 checkpoint; point --init-from "
                        f"at a directory holding a GPT-2 config.json and model.safetensors")
    try:
        with open(config_path) as f:
            return gpt.config_from_hf(json.load(f))
    except (json.JSONDecodeError, ValueError, KeyError, TypeError) as e:
        raise UserError(f"{config_path} is not a GPT-2 config ({e}); point --init-from at a GPT-2 checkpoint") from None


def check_shape_flags(cfg: gpt.GPTConfig, args, given: set):
    """--init-from brings its own shape: --model-size, --n-layer, --n-head and --n-embd (the flags in
    `given`) may repeat it, never contradict it. Used by train.py and train_fsdp.py."""
    want = {k: v for k, v in gpt.MODEL_SIZES[args.model_size].items()
            if k != "block_size"} if "model_size" in given else {}
    want.update({k: getattr(args, k) for k in ("n_layer", "n_head", "n_embd") if k in given})
    for key, value in want.items():
        if value != getattr(cfg, key):
            flag = f"--{key.replace('_', '-')} {value}" if key in given else f"--model-size {args.model_size}"
            raise UserError(f"{flag} contradicts --init-from {args.init_from}, whose {key} is {getattr(cfg, key)}; "
                            f"drop the shape flags (only --block-size may shorten the sequence)")


def load_hf(model_dir: str):
    """Read a Hugging Face GPT-2 directory -> (GPTConfig, state dict in our names and layouts)."""
    config_path = os.path.join(model_dir, CONFIG)
    weights_path = os.path.join(model_dir, WEIGHTS)
    hint = "point --init-from at a directory holding a GPT-2 config.json and model.safetensors"
    if not os.path.isdir(model_dir):
        raise UserError(f"{model_dir!r} is not a directory; {hint}")
    if not os.path.isfile(config_path):
        raise UserError(f"{config_path} is missing, so {model_dir!r} is not a GPT-2 checkpoint; {hint}")
    try:
        with open(config_path) as f:
            cfg = gpt.config_from_hf(json.load(f))
    except (json.JSONDecodeError, ValueError) as e:
        raise UserError(f"{config_path} is not a GPT-2 config ({e}); {hint}") from None
    if not os.path.isfile(weights_path):
        extra = " (only PyTorch .bin weights found: convert them to safetensors)" if os.path.isfile(
            os.path.join(model_dir, "pytorch_model.bin")) else ""
        raise UserError(f"{weights_path} is missing{extra}; {hint}")
    try:
        sd = gpt.from_hf_state_dict(load_file(weights_path))
    except (SafetensorError, OSError) as e:
        raise UserError(f"{weights_path} cannot be read as safetensors ({e}); download or save it again") from None
    check_state_dict(sd, cfg, weights_path)
    return cfg, sd


def check_state_dict(sd: dict, cfg: gpt.GPTConfig, where: str):
    """Compare names and shapes with the model cfg describes; one clear message for any mismatch."""
    with torch.device("meta"):  # shapes only: no memory, instant even for gpt2-xl
        want = {k: tuple(v.shape) for k, v in gpt.GPT(cfg).state_dict().items()}
    missing = sorted(set(want) - set(sd))
    unexpected = sorted(set(sd) - set(want))
    if missing or unexpected:
        raise UserError(f"{where} does not match a {cfg.n_layer}-layer GPT-2: missing {missing[:4]}, unexpected "
                        f"{unexpected[:4]}")
    for k, shape in want.items():
        if tuple(sd[k].shape) != shape:
            raise UserError(f"{where}: tensor {k} has shape {tuple(sd[k].shape)}, config.json implies {shape}")


def save_training_state(out_dir: str, state: dict):
    atomic_write(os.path.join(out_dir, STATE), lambda tmp: torch.save(state, tmp))


def load_training_state(out_dir: str) -> dict:
    path = os.path.join(out_dir, STATE)
    if not os.path.isfile(path):
        raise UserError(f"--resume: {path} does not exist; run without --resume first, or pass the --out-dir of an "
                        "earlier run")
    try:
        # weights_only=True: unpickling arbitrary objects can run code; tensors and dicts cannot.
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # a truncated or foreign file; tell the user which one
        raise UserError(f"{path} cannot be read ({type(e).__name__}: {e}); it is not a byhand training state") from None


# A safetensors file is an 8-byte little-endian header length, a JSON header naming each tensor's
# dtype, shape and byte range, and then the raw bytes. Reading it by hand lets a loader take one
# tensor at a time with plain file reads (lib/finetune.py for GPT-2, lib/llama.py): nothing is
# memory-mapped, so the resident set never holds the whole file.
SAFETENSORS_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64}


def read_safetensors_header(path: str, missing_hint: str, dtypes=SAFETENSORS_DTYPES):
    """(header without its metadata, offset where the tensor bytes start), checked: every byte range
    inside the file, so a truncated download fails before any work, and (unless dtypes is None) float
    tensors only."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if not 2 <= n <= size - 8:
                raise ValueError(f"a header of {n} bytes in a file of {size}")
            header = json.loads(f.read(n))
        header.pop("__metadata__", None)
        end = max((e["data_offsets"][1] for e in header.values()), default=0)
        if not all(isinstance(e["shape"], list) for e in header.values()):
            raise ValueError("a tensor entry without a shape list")
    except FileNotFoundError:
        raise UserError(f"{path} is missing; {missing_hint}") from None
    except (ValueError, KeyError, TypeError, AttributeError, OSError, MemoryError, OverflowError) as e:
        raise UserError(f"{path} cannot be read as safetensors ({type(e).__name__}: {e}); download or save it "
                        f"again") from None
    for name, entry in header.items() if dtypes is not None else ():
        if entry.get("dtype") not in dtypes:
            raise UserError(f"{path}: tensor {name} has dtype {entry.get('dtype')}; expected a float checkpoint "
                            f"(pre-quantised checkpoints are not supported)")
    if 8 + n + end > size:
        raise UserError(f"{path} is truncated ({size:,} bytes; its tensors end at byte {8 + n + end:,}); download or "
                        f"save it again")
    return header, 8 + n


def read_tensor(f, entry: dict, data_start: int) -> torch.Tensor:
    """One tensor of an open safetensors file, read into its own buffer."""
    begin, end = entry["data_offsets"]
    buf = bytearray(end - begin)
    f.seek(data_start + begin)
    if f.readinto(buf) != len(buf):
        raise UserError(f"{f.name} is truncated (a tensor's bytes end past the end of the file); download or save it "
                        "again")
    dtype = SAFETENSORS_DTYPES[entry["dtype"]]
    t = torch.frombuffer(buf, dtype=dtype) if buf else torch.empty(0, dtype=dtype)
    return t.reshape(entry["shape"])
