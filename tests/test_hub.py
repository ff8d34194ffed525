"""Hub downloads over the stdlib, against a local http.server on 127.0.0.1 (never the internet)."""

import functools
import http.server
import os
import threading

import pytest
import torch

import train
from lib import checkpoint, gpt, hub
from lib.errors import UserError
from tests.conftest import TINY, val_losses


@pytest.fixture
def hub_server(tmp_path):
    """Serves tmp_path/www as a fake hub: /<org>/<repo>/resolve/main/<file>."""
    www = tmp_path / "www"
    repo = www / "openai-community" / "gpt2" / "resolve" / "main"
    torch.manual_seed(0)
    cfg = gpt.GPTConfig(block_size=32, n_layer=2, n_head=2, n_embd=64)
    checkpoint.save_hf(str(repo), cfg, gpt.to_hf_state_dict(gpt.GPT(cfg)))
    requests = []

    class Handler(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            requests.append(self.path)

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Handler, directory=str(www)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", repo, requests, server
    server.shutdown()
    server.server_close()


def test_download_honours_hf_endpoint_and_caches(hub_server, tmp_path, monkeypatch):
    endpoint, repo, requests, _ = hub_server
    monkeypatch.setenv("HF_ENDPOINT", endpoint)
    local = hub.resolve_pretrained("gpt2", str(tmp_path / "cache"), log=lambda *a: None)
    assert local == str(tmp_path / "cache" / "hub" / "openai-community--gpt2" / "main")
    for name in ("config.json", "model.safetensors"):
        assert open(os.path.join(local, name), "rb").read() == open(repo / name, "rb").read()
    assert sorted(requests) == sorted(f"/openai-community/gpt2/resolve/main/{n}"
                                      for n in ("config.json", "model.safetensors"))
    assert not [f for f in os.listdir(local) if "incomplete" in f]
    hub.resolve_pretrained("gpt2", str(tmp_path / "cache"), log=lambda *a: None)
    assert len(requests) == 2  # the second call is served from the cache


def test_offline_uses_only_the_cache(hub_server, tmp_path, monkeypatch):
    endpoint, _, requests, server = hub_server
    monkeypatch.setenv("HF_ENDPOINT", endpoint)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(UserError, match="HF_HUB_OFFLINE is set and openai-community/gpt2 is not in the cache"):
        hub.resolve_pretrained("gpt2", str(tmp_path / "cache"))
    assert requests == []
    monkeypatch.delenv("HF_HUB_OFFLINE")
    hub.resolve_pretrained("gpt2", str(tmp_path / "cache"), log=lambda *a: None)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert os.path.isdir(hub.resolve_pretrained("gpt2", str(tmp_path / "cache")))


def test_missing_repository_and_unreachable_endpoint(hub_server, tmp_path, monkeypatch):
    endpoint, _, _, _ = hub_server
    monkeypatch.setenv("HF_ENDPOINT", endpoint)
    with pytest.raises(UserError, match="was not found"):
        hub.resolve_pretrained("someone/no-such-model", str(tmp_path / "cache"), log=lambda *a: None)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # the discard port: nothing listens
    with pytest.raises(UserError, match="cannot reach"):
        hub.resolve_pretrained("gpt2-medium", str(tmp_path / "cache"), log=lambda *a: None)


def test_train_init_from_hub_id_loads_the_served_weights(hub_server, tmp_path, monkeypatch, text_dir):
    endpoint, repo, _, _ = hub_server
    monkeypatch.setenv("HF_ENDPOINT", endpoint)
    common = [*TINY, "--data", text_dir, "--steps", "1", "--eval-interval", "1"]
    train.main([*common, "--init-from", "gpt2", "--out-dir", str(tmp_path / "a"), "--cache-dir", str(tmp_path / "c")])
    train.main([*common, "--init-from", str(repo), "--out-dir", str(tmp_path / "b")])
    assert val_losses(tmp_path / "a") == val_losses(tmp_path / "b")
