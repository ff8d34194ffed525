"""Download model files from the Hugging Face Hub with the standard library.

Used by every script that takes --init-from. The one idea: a hub file is one HTTPS GET of
`{endpoint}/{repo}/resolve/{revision}/{filename}`; everything else is caching (download once, to a
temporary name, then rename) and respecting the two variables users already set for
huggingface_hub: HF_ENDPOINT (a mirror) and HF_HUB_OFFLINE=1 (never touch the network).
Nothing here runs unless the user names a hub id.
"""

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
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=60) as resp, open(tmp, "wb") as f:
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


def resolve_pretrained(name_or_dir: str, cache_dir: str, filenames=("config.json", "model.safetensors"), log=print) -> str:
    """A local directory as it is; a hub id (gpt2, gpt2-medium, org/name) downloaded into the cache."""
    if os.path.isdir(name_or_dir):
        return name_or_dir
    if is_hub_id(name_or_dir) and not os.path.exists(name_or_dir):
        return download(name_or_dir, filenames, cache_dir, log=log)
    raise UserError(
        f"--init-from {name_or_dir!r} is neither a directory nor a hub id; pass a local Hugging Face "
        f"GPT-2 directory or one of {', '.join(ALIASES)}"
    )


# --- whole model directories: optional files and sharded weights (judge_train_*.py) ----------------
ABSENT = ".absent.json"  # names the hub answered 404 for, so a later offline run knows they do not exist


def _exists(url: str) -> bool:
    """HEAD the file: True when the hub has it, False on 404; other failures raise as _fetch does."""
    headers = {"User-Agent": "byhand/0.1 (stdlib urllib)"}
    if os.environ.get("HF_TOKEN"):
        headers["Authorization"] = f"Bearer {os.environ['HF_TOKEN']}"
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers, method="HEAD"), timeout=60):
            return True
    except urllib.error.HTTPError as e:
        if e.code == 404:
            return False
        what = {401: "needs authentication (set HF_TOKEN)",
                403: "is forbidden (gated repository? accept its licence on the hub and set HF_TOKEN)"}
        raise UserError(f"download of {url} {what.get(e.code, f'failed with HTTP {e.code}')}") from None
    except (urllib.error.URLError, TimeoutError, ConnectionError) as e:
        raise UserError(f"cannot reach {url} ({getattr(e, 'reason', e)}); check the network or HF_ENDPOINT, "
                        f"or pass a local directory (HF_HUB_OFFLINE=1 uses only the cache)") from None


def download_optional(repo_id: str, filenames, cache_dir: str, revision: str = "main", log=print) -> list:
    """Fetch whichever of `filenames` the repository has; return the names now in the cache.

    A 404 is remembered in .absent.json beside the files. With HF_HUB_OFFLINE only the cache is used.
    """
    import json

    repo_id = ALIASES.get(repo_id, repo_id)
    local = os.path.join(cache_dir, "hub", repo_id.replace("/", "--"), revision)
    absent_path = os.path.join(local, ABSENT)
    try:
        with open(absent_path) as f:
            absent = set(json.load(f))
    except (OSError, ValueError):
        absent = set()
    todo = [n for n in filenames if not os.path.isfile(os.path.join(local, n)) and n not in absent]
    if todo and not offline():
        endpoint = os.environ.get("HF_ENDPOINT", DEFAULT_ENDPOINT).rstrip("/")
        os.makedirs(local, exist_ok=True)
        for name in todo:
            url = f"{endpoint}/{repo_id}/resolve/{revision}/{name}"
            if _exists(url):
                log(f"downloading {url}")
                _fetch(url, os.path.join(local, name), log)
            else:
                absent.add(name)
        tmp = absent_path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(sorted(absent), f)
        os.replace(tmp, absent_path)
    return [n for n in filenames if os.path.isfile(os.path.join(local, n))]


def download_model(repo_id: str, cache_dir: str, optional=(), revision: str = "main", hint: str | None = None,
                   log=print) -> str:
    """config.json, the safetensors weights (one file, or model.safetensors.index.json and every shard it
    names) and whichever `optional` files exist; return the local directory.

    `hint` is appended to any error (e.g. "or --model tiny for the offline demo").
    """
    import json

    try:
        local = download(repo_id, ["config.json"], cache_dir, revision, log)
        if "model.safetensors.index.json" in download_optional(repo_id, ["model.safetensors.index.json"],
                                                               cache_dir, revision, log):
            index = os.path.join(local, "model.safetensors.index.json")
            try:
                with open(index) as f:
                    shards = sorted(set(json.load(f)["weight_map"].values()))
            except (ValueError, KeyError, TypeError, AttributeError) as e:
                raise UserError(f"{index} is not a safetensors index ({type(e).__name__}); delete it and download again") from None
            download(repo_id, shards, cache_dir, revision, log)
        else:
            download(repo_id, ["model.safetensors"], cache_dir, revision, log)
        download_optional(repo_id, list(optional), cache_dir, revision, log)
    except UserError as e:
        if hint:
            raise UserError(f"{e}; {hint}") from None
        raise
    return local
