"""Download model files from the Hugging Face Hub with the standard library.

Used by every script that takes --init-from. The one idea: a hub file is one HTTPS GET of
`{endpoint}/{repo}/resolve/{revision}/{filename}`; everything else is caching (download once, to a
temporary name, then rename) and respecting the two variables users already set for
huggingface_hub: HF_ENDPOINT (a mirror) and HF_HUB_OFFLINE=1 (never touch the network).
Nothing here runs unless the user names a hub id.
"""

import json
import os
import re
import urllib.error
import urllib.request

from lib.errors import UserError

DEFAULT_ENDPOINT = "https://huggingface.co"
# The short names people type, and where those repositories live today.
ALIASES = {
    "gpt2": "openai-community/gpt2",
    "gpt2-medium": "openai-community/gpt2-medium",
    "gpt2-large": "openai-community/gpt2-large",
    "gpt2-xl": "openai-community/gpt2-xl",
}


def is_hub_id(name: str) -> bool:
    return name in ALIASES or re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", name) is not None


def offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "0").strip().lower() in ("1", "true", "yes", "on")


def _fetch(url: str, dest: str, log):
    headers = {"User-Agent": "byhand/0.1 (stdlib urllib)"}
    if os.environ.get("HF_TOKEN"):
        headers["Authorization"] = f"Bearer {os.environ['HF_TOKEN']}"
    tmp = dest + ".incomplete"
    try:
        # urllib follows the hub's redirect to its file CDN by itself.
        request = urllib.request.Request(url, headers=headers)
        with urllib.request.urlopen(request, timeout=60) as resp, open(tmp, "wb") as f:
            total = int(resp.headers.get("Content-Length") or 0)
            done, next_report = 0, 0
            while chunk := resp.read(1 << 20):
                f.write(chunk)
                done += len(chunk)
                if total and done >= next_report:
                    log(f"  {os.path.basename(dest)}: {done / 1e6:.1f} / {total / 1e6:.1f} MB")
                    next_report += max(total // 10, 1 << 20)
        if total and done != total:
            raise UserError(f"download of {url} stopped at {done} of {total} bytes; run again to retry")
        os.replace(tmp, dest)
    except urllib.error.HTTPError as e:
        what = {401: "needs authentication (set HF_TOKEN)", 403: "is forbidden (gated repository? set HF_TOKEN)",
                404: "was not found (check the repository id and file name)"}.get(e.code, f"failed with HTTP {e.code}")
        raise UserError(f"download of {url} {what}") from None
    except (urllib.error.URLError, TimeoutError, ConnectionError) as e:
        reason = getattr(e, "reason", e)
        raise UserError(
            f"cannot reach {url} ({reason}); check the network or HF_ENDPOINT, or pass a local directory "
            f"(HF_HUB_OFFLINE=1 uses only the cache)"
        ) from None
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def download(repo_id: str, filenames, cache_dir: str, revision: str = "main", log=print) -> str:
    """Make sure cache_dir/hub/<repo>/<revision>/ holds `filenames`; return that directory."""
    repo_id = ALIASES.get(repo_id, repo_id)
    local = os.path.join(cache_dir, "hub", repo_id.replace("/", "--"), revision)
    missing = [f for f in filenames if not os.path.isfile(os.path.join(local, f))]
    if not missing:
        return local
    if offline():
        raise UserError(
            f"HF_HUB_OFFLINE is set and {repo_id} is not in the cache ({local} lacks {missing}); "
            f"unset HF_HUB_OFFLINE once to download it, or pass a local directory"
        )
    endpoint = os.environ.get("HF_ENDPOINT", DEFAULT_ENDPOINT).rstrip("/")
    os.makedirs(local, exist_ok=True)
    for name in missing:
        url = f"{endpoint}/{repo_id}/resolve/{revision}/{name}"
        log(f"downloading {url}")
        _fetch(url, os.path.join(local, name), log)
    return local


def looks_like_path(name: str) -> bool:
    """A name the user meant as a local path: it starts like one (/, ., ~), has more separators than a hub
    id's one slash, or its parent directory exists here (out/trian when out/ exists)."""
    seps = [os.sep] + ([os.altsep] if os.altsep else [])
    if name.startswith(("/", ".", "~", *seps)) or name.endswith(tuple(seps)):
        return True
    if sum(name.count(s) for s in seps) > 1 or (os.sep != "/" and os.sep in name):
        return True
    parent = os.path.dirname(name)
    return bool(parent) and os.path.isdir(parent)


def resolve_pretrained(name_or_dir: str, cache_dir: str,
                       filenames=("config.json", "model.safetensors"), log=print) -> str:
    """A local directory as it is; a hub id (gpt2, gpt2-medium, org/name) downloaded into the cache."""
    if os.path.isdir(name_or_dir):
        return name_or_dir
    if os.path.exists(name_or_dir):
        raise UserError(f"--init-from {name_or_dir!r} is a file, not a directory; pass the Hugging Face GPT-2 "
                        f"directory that holds config.json and model.safetensors")
    if looks_like_path(name_or_dir):
        full = os.path.abspath(os.path.expanduser(name_or_dir))
        raise UserError(f"--init-from {name_or_dir!r}: the local path {full} does not exist; check the path "
                        f"(or, for the hub, pass an id such as gpt2 or org/name)")
    if is_hub_id(name_or_dir):
        try:
            return download(name_or_dir, filenames, cache_dir, log=log)
        except UserError as e:  # the user may have meant a local directory: say both
            raise UserError(f"{e} (--init-from {name_or_dir!r} was read as a hub id: no local directory of that "
                            f"name exists here)") from None
    raise UserError(
        f"--init-from {name_or_dir!r} is neither a directory nor a hub id; pass a local Hugging Face "
        f"GPT-2 directory or one of {', '.join(ALIASES)}"
    )


def _missing_on_hub(repo_id: str, filename: str, revision: str) -> bool:
    """True when the hub answers 404 for this file (a HEAD request: nothing is downloaded)."""
    endpoint = os.environ.get("HF_ENDPOINT", DEFAULT_ENDPOINT).rstrip("/")
    url = f"{endpoint}/{ALIASES.get(repo_id, repo_id)}/resolve/{revision}/{filename}"
    headers = {"User-Agent": "byhand/0.1 (stdlib urllib)"}
    if os.environ.get("HF_TOKEN"):
        headers["Authorization"] = f"Bearer {os.environ['HF_TOKEN']}"
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers, method="HEAD"), timeout=60):
            return False
    except urllib.error.HTTPError as e:
        return e.code == 404  # other answers (401, 403, 5xx) are reported by the download itself
    except (urllib.error.URLError, TimeoutError, ConnectionError):
        return False  # let the download report the network problem


def download_optional(repo_id: str, filename: str, cache_dir: str, revision: str = "main", log=print):
    """The local path of `filename` (downloaded if needed), or None when the repository has no such
    file (or HF_HUB_OFFLINE is set and it is not cached). For files a model may or may not ship,
    such as tokenizer_config.json."""
    local = os.path.join(cache_dir, "hub", ALIASES.get(repo_id, repo_id).replace("/", "--"), revision)
    if os.path.isfile(os.path.join(local, filename)):
        return os.path.join(local, filename)
    if offline() or _missing_on_hub(repo_id, filename, revision):
        return None
    return os.path.join(download(repo_id, [filename], cache_dir, revision, log), filename)


def download_first(repo_id: str, filenames, cache_dir: str, revision: str = "main", log=print) -> str:
    """The local path of the first of `filenames` the repository has (a cached one wins), e.g.
    model.safetensors, else pytorch_model.bin for checkpoints older than safetensors."""
    local = os.path.join(cache_dir, "hub", ALIASES.get(repo_id, repo_id).replace("/", "--"), revision)
    for name in filenames:
        if os.path.isfile(os.path.join(local, name)):
            return os.path.join(local, name)
    if offline():
        raise UserError(f"HF_HUB_OFFLINE is set and {repo_id} is not in the cache ({local} has none of "
                        f"{list(filenames)}); unset HF_HUB_OFFLINE once to download it, or pass a local directory")
    for name in filenames:
        if not _missing_on_hub(repo_id, name, revision):
            return os.path.join(download(repo_id, [name], cache_dir, revision, log), name)
    raise UserError(f"{repo_id} has none of {', '.join(filenames)} (checked on the hub); check the repository id")


def download_model(repo_id: str, cache_dir: str, optional=(), revision: str = "main", hint: str | None = None,
                   log=print) -> str:
    """A whole model directory (judge_train_*.py): config.json, the safetensors weights (one file, or
    model.safetensors.index.json and every shard it names) and whichever `optional` files the
    repository has (tokenizer files); return the local directory.

    `hint` is appended to any error (e.g. "--model tiny runs the offline demo").
    """
    try:
        local = download(repo_id, ["config.json"], cache_dir, revision, log)
        index = download_optional(repo_id, "model.safetensors.index.json", cache_dir, revision, log)
        if index:
            try:
                with open(index) as f:
                    shards = sorted(set(json.load(f)["weight_map"].values()))
            except (ValueError, KeyError, TypeError, AttributeError) as e:
                raise UserError(f"{index} is not a safetensors index ({type(e).__name__}); delete it and download "
                                "again") from None
            download(repo_id, shards, cache_dir, revision, log)
        else:
            if not offline() and not os.path.isfile(os.path.join(local, "model.safetensors")) \
                    and _missing_on_hub(repo_id, "model.safetensors", revision):
                raise UserError(f"{repo_id} has neither model.safetensors nor model.safetensors.index.json; "
                                f"only safetensors checkpoints can be loaded")
            download(repo_id, ["model.safetensors"], cache_dir, revision, log)
        for name in optional:
            download_optional(repo_id, name, cache_dir, revision, log)
    except UserError as e:
        if hint:
            raise UserError(f"{e}; {hint}") from None
        raise
    return local
