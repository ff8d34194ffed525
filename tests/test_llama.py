"""lib/llama.py: the decoder's parts by hand, logits against transformers, loading, cache, hub."""
import base64
import functools
import http.server
import json
import math
import os
import shutil
import threading

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from lib import llama, lora
from lib.errors import UserError
from lib.nf4 import LinearNF4

GOLDEN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "llama_golden")
MODELS = ["llama_tied", "llama_untied_bf16", "llama_headdim", "qwen2", "qwen2_untied_sharded"]
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 1000}
quiet = functools.partial(print, end="", file=open(os.devnull, "w"))


def _array(d):
    return torch.from_numpy(np.frombuffer(base64.b64decode(d["f32"]), dtype="<f4").reshape(d["shape"]).copy())


@pytest.fixture(scope="module")
def golden():
    with open(os.path.join(GOLDEN, "logits.json")) as f:
        return json.load(f)


# --- the parts, by hand -----------------------------------------------------------------------------
def test_rmsnorm_by_hand():
    norm = llama.RMSNorm(2, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.tensor([1.0, 2.0]))
    rms = math.sqrt((3 ** 2 + 4 ** 2) / 2 + 1e-6)
    assert torch.allclose(norm(torch.tensor([[3.0, 4.0]])), torch.tensor([[3 / rms, 2 * 4 / rms]]), atol=1e-6)
    # bf16 input: computed in fp32, cast back to bf16 before the weight (as transformers does)
    y = norm(torch.tensor([[3.0, 4.0]], dtype=torch.bfloat16))
    assert y.dtype == torch.float32 and torch.allclose(y, torch.tensor([[3 / rms, 8 / rms]]), atol=1e-2)


def test_rope_frequencies_default_and_llama3_by_hand():
    cfg = llama.LlamaConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, rope_theta=10000.0)
    assert cfg.head_dim == 8
    assert torch.allclose(llama.rope_inv_freq(cfg), torch.tensor([1.0, 0.1, 0.01, 0.001]), rtol=1e-6)
    # llama3, original context 1000: wavelengths 2*pi/f = 6.3, 63 (< 1000/4: kept), 628 (between: blended),
    # 6283 (> 1000/1: divided by the factor 8)
    cfg.rope_scaling = LLAMA3
    smooth = (1000 / (2 * math.pi / 0.01) - 1) / (4 - 1)
    blended = (1 - smooth) * 0.01 / 8 + smooth * 0.01
    want = torch.tensor([1.0, 0.1, blended, 0.001 / 8])
    assert torch.allclose(llama.rope_inv_freq(cfg), want, rtol=1e-5)
    cfg.rope_scaling = {"rope_type": "linear", "factor": 4.0}
    assert torch.allclose(llama.rope_inv_freq(cfg), torch.tensor([1.0, 0.1, 0.01, 0.001]) / 4, rtol=1e-6)


def test_rope_rotates_pairs_i_and_i_plus_half():
    inv_freq = torch.tensor([1.0, 0.1])
    x = torch.tensor([1.0, 2.0, 3.0, 4.0]).view(1, 1, 1, 4)  # pairs (x0, x2) and (x1, x3)
    for p in (0, 1, 5):
        cos, sin = llama.rope_cos_sin(inv_freq, torch.tensor([[p]]), torch.float32)
        y = llama.apply_rope(x, cos, sin).flatten()
        a0, a1 = p * 1.0, p * 0.1
        want = [1 * math.cos(a0) - 3 * math.sin(a0), 2 * math.cos(a1) - 4 * math.sin(a1),
                1 * math.sin(a0) + 3 * math.cos(a0), 2 * math.sin(a1) + 4 * math.cos(a1)]
        assert torch.allclose(y, torch.tensor(want), atol=1e-6)
    # rotation: q.k depends on the distance between positions only
    q, k = torch.randn(1, 1, 1, 8), torch.randn(1, 1, 1, 8)
    f = llama.rope_inv_freq(llama.LlamaConfig(hidden_size=8, num_attention_heads=1, num_key_value_heads=1))

    def dot(pq, pk):
        cq, sq = llama.rope_cos_sin(f, torch.tensor([[pq]]), torch.float32)
        ck, sk = llama.rope_cos_sin(f, torch.tensor([[pk]]), torch.float32)
        return (llama.apply_rope(q, cq, sq) * llama.apply_rope(k, ck, sk)).sum()
    assert torch.allclose(dot(7, 3), dot(14, 10), atol=1e-5) and not torch.allclose(dot(7, 3), dot(7, 4), atol=1e-3)


def test_grouped_query_attention_against_a_per_head_loop():
    torch.manual_seed(0)
    cfg = llama.LlamaConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, model_type="qwen2")
    attn = llama.Attention(cfg, 0)
    x = torch.randn(2, 5, 32)
    cos, sin = llama.rope_cos_sin(llama.rope_inv_freq(cfg), torch.arange(5).expand(2, 5), torch.float32)
    got = attn(x, cos, sin, None, None)
    q = llama.apply_rope(attn.q_proj(x).view(2, 5, 4, 8).transpose(1, 2), cos, sin)
    k = llama.apply_rope(attn.k_proj(x).view(2, 5, 2, 8).transpose(1, 2), cos, sin)
    v = attn.v_proj(x).view(2, 5, 2, 8).transpose(1, 2)
    heads = []
    for h in range(4):  # query heads 0,1 read key/value head 0; heads 2,3 read head 1
        s = q[:, h] @ k[:, h // 2].transpose(-1, -2) / math.sqrt(8)
        s = s.masked_fill(torch.triu(torch.ones(5, 5, dtype=torch.bool), 1), float("-inf"))
        heads.append(torch.softmax(s, -1) @ v[:, h // 2])
    want = attn.o_proj(torch.stack(heads, 1).transpose(1, 2).reshape(2, 5, 32))
    assert torch.allclose(got, want, atol=1e-5)
    assert attn.q_proj.bias is not None and attn.o_proj.bias is None  # Qwen2: q/k/v biases, none on o


# --- against transformers ---------------------------------------------------------------------------
@pytest.mark.parametrize("name", MODELS)
def test_logits_match_transformers(golden, name):
    model = llama.load_pretrained(os.path.join(GOLDEN, "models", name), log=quiet)
    ids = torch.tensor(golden["input_ids"])
    mask, pos = torch.tensor(golden["attention_mask"]), torch.tensor(golden["position_ids"])
    with torch.no_grad():
        assert (model(ids) - _array(golden[name]["logits"])).abs().max() < 1e-5
        padded, want = model(ids, attention_mask=mask, position_ids=pos), _array(golden[name]["padded_logits"])
    real = mask.bool()  # the padding positions' outputs are meaningless in both
    assert (padded[real] - want[real]).abs().max() < 1e-5
    assert model.generate(ids[:1, :5], 8).tolist()[0] == golden[name]["greedy"]


def test_loaded_configs():
    tied = llama.read_config(os.path.join(GOLDEN, "models", "llama_tied"))
    assert tied.rope_scaling["rope_type"] == "llama3" and tied.rope_theta == 500000.0 and tied.tie_word_embeddings
    m = llama.load_pretrained(os.path.join(GOLDEN, "models", "llama_tied"), log=quiet)
    assert m.lm_head.weight is m.model.embed_tokens.weight
    assert not any(p.requires_grad for p in m.parameters())
    m = llama.load_pretrained(os.path.join(GOLDEN, "models", "qwen2_untied_sharded"), dtype=torch.bfloat16, log=quiet)
    assert m.lm_head.weight is not m.model.embed_tokens.weight and m.lm_head.weight.dtype == torch.bfloat16
    assert m.num_params() == sum(p.numel() for p in m.parameters())
    assert m(torch.tensor([[1, 2, 3]])).dtype == torch.bfloat16


# --- cache, generation, training switches -----------------------------------------------------------
def _tiny(seed=0, **kw):
    return llama.build_model(llama.tiny_config(vocab_size=64, **kw), seed=seed).eval()


def test_kv_cache_generation_equals_full_forward_greedy_and_left_padded_batch():
    model = _tiny(rope_scaling=LLAMA3, tie_word_embeddings=False)
    prompt = torch.tensor([[5, 9, 2, 33, 7]])
    ids = prompt
    for _ in range(10):
        ids = torch.cat([ids, model(ids)[:, -1].argmax(-1, keepdim=True)], 1)
    assert model.generate(prompt, 10).tolist() == ids.tolist()
    # stop at an end-of-sequence id
    eos = ids[0, 7].item()
    first = ids[0, 5:].tolist().index(eos) + 5
    assert model.generate(prompt, 10, eos_token_id=[63, eos]).tolist()[0] == ids[0, :first + 1].tolist()
    # a left-padded batch gives each row what it gives alone
    short = torch.tensor([[9, 2, 33]])
    batch = torch.tensor([[5, 9, 2, 33, 7], [0, 0, 9, 2, 33]])
    mask = torch.tensor([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]])
    out = model.generate(batch, 6, attention_mask=mask)
    assert out[0].tolist() == model.generate(prompt, 6)[0].tolist()
    assert out[1, 2:].tolist() == model.generate(short, 6)[0].tolist()


def test_gradient_checkpointing_gives_the_same_gradients_and_lora_finds_the_projections():
    model = _tiny(model_type="qwen2")
    names = lora.apply_lora(model, targets=("q_proj", "k_proj", "v_proj", "o_proj"), r=4, alpha=8)
    assert len(names) == 8 and "model.layers.0.self_attn.q_proj" in names
    for m in lora._lora_modules(model).values():
        torch.nn.init.normal_(m.lora_B.weight)
    x = torch.randint(0, 64, (2, 9))
    grads = []
    for ckpt in (False, True):
        model.train()
        model.gradient_checkpointing = ckpt
        model.zero_grad()
        F.cross_entropy(model(x)[:, :-1].flatten(0, 1), x[:, 1:].flatten()).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad})
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) == 16
    for n in grads[0]:
        assert torch.allclose(grads[0][n], grads[1][n], atol=1e-6), n
    keys = lora.adapter_state_dict(model)
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in keys


@pytest.mark.parametrize("tied", [True, False])
def test_labels_give_the_shifted_loss_without_logits_and_its_gradients(tied):
    """forward(ids, labels=...) is transformers' .loss: position t predicts labels[t + 1], -100 ignored,
    computed by lib/lm_loss; loss and every gradient equal F.cross_entropy on the logits."""
    model = _tiny(model_type="qwen2", tie_word_embeddings=tied).train()
    ids = torch.randint(0, 64, (3, 9), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    labels[:, :4] = -100  # the prompt
    labels[2, 7:] = -100  # padding
    model.zero_grad()
    logits = model(ids)
    ref = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)
    ref.backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    loss = model(ids, labels=labels)
    assert loss.dim() == 0 and loss.item() == pytest.approx(ref.item(), rel=1e-6)
    loss.backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want[n], rtol=1e-4, atol=1e-7, msg=n)
    # Nothing to learn in the batch (every answer cut off): 0, not nan.
    assert model(ids, labels=torch.full_like(ids, -100)).item() == 0.0


def test_labels_with_gradient_checkpointing_and_a_frozen_lora_model():
    """The judge's setting: a frozen base with LoRA adapters, the loss from labels, checkpointed layers."""
    model = _tiny(model_type="qwen2")
    lora.apply_lora(model, targets=("q_proj", "v_proj"), r=4, alpha=8)
    for m in lora._lora_modules(model).values():
        torch.nn.init.normal_(m.lora_B.weight)
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(2))
    labels = torch.where(torch.arange(9) < 3, -100, ids)
    grads = []
    for ckpt, use_labels in ((False, False), (False, True), (True, True)):
        model.train()
        model.gradient_checkpointing = ckpt
        model.zero_grad()
        if use_labels:
            loss = model(ids, labels=labels)
        else:
            loss = F.cross_entropy(model(ids)[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)
        loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad})
    assert len(grads[0]) == 8 and model.lm_head.weight.grad is None  # the head is frozen: no d_W made
    for g in grads[1:]:
        for n in grads[0]:
            torch.testing.assert_close(g[n], grads[0][n], rtol=1e-4, atol=1e-7, msg=n)


def test_labels_with_a_lora_adapted_head_take_the_plain_way():
    model = _tiny(tie_word_embeddings=False)
    lora.apply_lora(model, targets=("lm_head",), r=4, alpha=8)
    torch.nn.init.normal_(model.lm_head.lora_B.weight)
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(3))
    ref = F.cross_entropy(model(ids)[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    assert model(ids, labels=ids).item() == pytest.approx(ref.item(), rel=1e-6)


def test_lora_adapter_for_llama_says_fan_in_fan_out_false(tmp_path):
    model = _tiny()
    lora.apply_lora(model, targets=("q_proj", "k_proj", "v_proj", "o_proj"), r=4, alpha=8)
    config = lora.save_adapter(model, str(tmp_path), fan_in_fan_out=False)
    assert config["fan_in_fan_out"] is False and config["target_modules"] == ["k_proj", "o_proj", "q_proj", "v_proj"]
    again = _tiny()
    lora.load_adapter(again, str(tmp_path))
    x = torch.randint(0, 64, (1, 6))
    assert torch.equal(again(x), model(x))


def test_save_load_round_trip_and_convert_linear(tmp_path):
    cfg = llama.tiny_config(vocab_size=64, tie_word_embeddings=False, rope_scaling=LLAMA3, model_type="qwen2")
    model = llama.build_model(cfg, seed=1).eval()
    llama.save_pretrained(model, cfg, str(tmp_path))
    d = json.load(open(tmp_path / "config.json"))
    assert d["architectures"] == ["Qwen2ForCausalLM"] and d["rope_scaling"]["rope_type"] == "llama3"
    back = llama.config_from_hf(d)
    assert back.extra == {"use_sliding_window": False, "hidden_act": "silu", "torch_dtype": "float32"}
    back.extra = {}
    assert back == cfg
    x = torch.randint(0, 64, (1, 7))
    again = llama.load_pretrained(str(tmp_path), log=quiet)
    assert torch.equal(again(x), model(x))
    seen = []

    def to_nf4(name, linear):
        seen.append(name)
        return LinearNF4.from_linear(linear)
    q = llama.load_pretrained(str(tmp_path), convert_linear=to_nf4, log=quiet)
    assert len(seen) == 14 and all(isinstance(q.get_submodule(n), LinearNF4) for n in seen)
    assert isinstance(q.lm_head, torch.nn.Linear)  # the head stays full precision
    err = (q(x) - model(x)).abs().max() / model(x).abs().max()
    assert 0 < err < 0.2
    with pytest.raises(ValueError, match="merge or dequantise"):
        llama.save_pretrained(q, cfg, str(tmp_path / "q"))


# --- errors a user can make -------------------------------------------------------------------------
def test_clear_errors_for_wrong_model_files(tmp_path):
    bad = tmp_path / "gpt2"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(UserError, match="only LlamaForCausalLM and Qwen2ForCausalLM"):
        llama.load_pretrained(str(bad))
    with pytest.raises(UserError, match="config.json is missing"):
        llama.load_pretrained(str(tmp_path / "nowhere"))
    d = tmp_path / "sharded"
    shutil.copytree(os.path.join(GOLDEN, "models", "qwen2_untied_sharded"), d)
    os.remove(d / "model-00003-of-00007.safetensors")
    with pytest.raises(UserError, match="model-00003-of-00007.safetensors is missing"):
        llama.load_pretrained(str(d), log=quiet)
    d = tmp_path / "wrong_shape"
    shutil.copytree(os.path.join(GOLDEN, "models", "qwen2"), d)
    cfg = json.load(open(d / "config.json"))
    cfg["intermediate_size"] = 48
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UserError, match=r"tensor model.layers.0.mlp.(gate|up|down)_proj.weight has shape"):
        llama.load_pretrained(str(d), log=quiet)
    del cfg["intermediate_size"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UserError, match="config.json has no integer intermediate_size"):
        llama.load_pretrained(str(d), log=quiet)
    cfg["intermediate_size"], cfg["num_hidden_layers"] = 64, 3
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UserError, match="tensor model.layers.2.* is missing"):
        llama.load_pretrained(str(d), log=quiet)


def test_config_errors():
    base = {"model_type": "llama", "vocab_size": 8, "hidden_size": 8, "intermediate_size": 8,
            "num_hidden_layers": 1, "num_attention_heads": 2}
    assert llama.config_from_hf(base).num_key_value_heads == 2 and not llama.config_from_hf(base).tie_word_embeddings
    with pytest.raises(UserError, match="rope scaling llama3 needs numbers for factor, low_freq_factor"):
        llama.config_from_hf({**base, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}})
    with pytest.raises(UserError, match="rope_type 'yarn'; supported are default, linear and llama3"):
        llama.config_from_hf({**base, "rope_scaling": {"type": "yarn", "factor": 4.0}})
    with pytest.raises(UserError, match="use_sliding_window"):
        llama.config_from_hf({**base, "model_type": "qwen2", "use_sliding_window": True})


def test_hub_id_offline_and_not_a_model(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(UserError, match="HF_HUB_OFFLINE.*--model tiny"):
        llama.resolve_model("Qwen/Qwen2-1.5B-Instruct", str(tmp_path))
    with pytest.raises(UserError, match="neither a directory nor a hub id.*--model tiny"):
        llama.resolve_model("./no/such/dir", str(tmp_path))
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens
    with pytest.raises(UserError, match="cannot reach.*--model tiny"):
        llama.resolve_model("Qwen/Qwen2-1.5B-Instruct", str(tmp_path))


def test_hub_download_of_a_sharded_model_with_optional_files(tmp_path, monkeypatch):
    www = tmp_path / "www"
    repo = www / "org" / "tiny-qwen" / "resolve" / "main"
    shutil.copytree(os.path.join(GOLDEN, "models", "qwen2_untied_sharded"), repo)
    shutil.copy(os.path.join(GOLDEN, "tokenizers", "qwen2", "tokenizer.json"), repo)
    shutil.copy(os.path.join(GOLDEN, "tokenizers", "qwen2", "tokenizer_config.json"), repo)
    single = www / "org" / "tiny-llama" / "resolve" / "main"
    shutil.copytree(os.path.join(GOLDEN, "models", "llama_tied"), single)
    requests, auth = [], []

    class Handler(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            requests.append((self.command, self.path))
            auth.append(self.headers.get("Authorization"))

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Handler, directory=str(www)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{server.server_address[1]}")
        monkeypatch.setenv("HF_TOKEN", "hf_secret")
        local = llama.resolve_model("org/tiny-qwen", str(tmp_path / "cache"), log=quiet)
        assert sorted(os.listdir(local)) == sorted(os.listdir(repo))
        assert set(auth) == {"Bearer hf_secret"}
        fetched = [p for c, p in requests if c == "GET"]
        assert "/org/tiny-qwen/resolve/main/model.safetensors" not in fetched  # sharded: the index + shards
        n = len(requests)
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
        assert llama.resolve_model("org/tiny-qwen", str(tmp_path / "cache"), log=quiet) == local
        assert len(requests) == n  # offline: the cache only
        monkeypatch.delenv("HF_HUB_OFFLINE")
        llama.resolve_model("org/tiny-qwen", str(tmp_path / "cache"), log=quiet)
        assert all(c == "HEAD" for c, _ in requests[n:])  # online again: nothing downloaded twice
        a = llama.load_pretrained(local, log=quiet)
        b = llama.load_pretrained(os.path.join(GOLDEN, "models", "qwen2_untied_sharded"), log=quiet)
        x = torch.tensor([[1, 2, 3]])
        assert torch.equal(a(x), b(x))
        one = llama.resolve_model("org/tiny-llama", str(tmp_path / "cache"), log=quiet)  # single file
        assert sorted(os.listdir(one)) == sorted(os.listdir(single))
        bin_only = www / "org" / "old" / "resolve" / "main"
        bin_only.mkdir(parents=True)
        shutil.copy(single / "config.json", bin_only)
        with pytest.raises(UserError, match="org/old has neither model.safetensors nor .*--model tiny"):
            llama.resolve_model("org/old", str(tmp_path / "cache"), log=quiet)
    finally:
        server.shutdown()
        server.server_close()


def test_known_configs_have_the_published_sizes(tmp_path):
    sizes = {"Qwen/Qwen2-1.5B-Instruct": 1.54e9, "Qwen/Qwen2.5-3B-Instruct": 3.09e9,
             "meta-llama/Llama-3.2-1B-Instruct": 1.24e9}
    for name, n in sizes.items():
        cfg = llama.config_for_estimate(name, str(tmp_path))
        params = sum(math.prod(s) for s in llama.expected_shapes(cfg).values())
        assert abs(params - n) / n < 0.01, (name, params)
    assert llama.config_for_estimate(os.path.join(GOLDEN, "models", "qwen2"), str(tmp_path)).hidden_size == 32
    with pytest.raises(UserError, match="not downloaded yet"):
        llama.config_for_estimate("someone/else", str(tmp_path))
