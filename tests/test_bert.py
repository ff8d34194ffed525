"""BERT and DistilBERT by hand: logits equal transformers' on tiny random checkpoints it saved
(tests/fixtures/make_bert_golden.py), HF key names round-trip, old formats load, errors are clear."""

import functools
import http.server
import json
import os
import re
import shutil
import threading

import pytest
import torch
from safetensors.torch import load_file, save_file

from lib import bert, hub, wordpiece
from lib.errors import UserError

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures")
BERT_DIR = os.path.join(FIXTURES, "bert_tiny")
DISTIL_DIR = os.path.join(FIXTURES, "distilbert_tiny")
quiet = lambda *a, **k: None  # noqa: E731


@pytest.fixture(scope="module")
def golden():
    return load_file(os.path.join(FIXTURES, "bert_golden.safetensors"))


def assert_close(got, want, atol=1e-5):
    """max |got - want| <= atol (torch.testing.assert_close would import torch.distributed: seconds)."""
    assert got.shape == want.shape, (got.shape, want.shape)
    diff = (got - want).abs().max().item()
    assert diff <= atol, f"max |diff| {diff:.3g} > {atol}"


def logits(model, golden):
    with torch.no_grad():
        return model(golden["input_ids"], golden["attention_mask"])


@pytest.mark.parametrize("kind, model_dir", [("bert", BERT_DIR), ("distilbert", DISTIL_DIR)])
def test_logits_match_transformers(golden, kind, model_dir):
    model, cfg, where = bert.load_pretrained(model_dir, log=quiet)
    assert where == model_dir and cfg.model_type == kind and not model.training
    assert type(model).__name__ == {"bert": "BertForMaskedLM", "distilbert": "DistilBertForMaskedLM"}[kind]
    assert_close(logits(model, golden), golden[f"{kind}_logits"])
    assert golden[f"{kind}_logits"].abs().max() > 1  # random weights and biases everywhere: a wrong map shows
    if kind == "bert":
        with torch.no_grad():
            hidden = model.encode(golden["input_ids"], golden["attention_mask"])
            no_mask = model(golden["input_ids"][:1])
        assert_close(hidden, golden["bert_hidden"])
        assert_close(no_mask, golden["bert_logits_nomask"])


@pytest.mark.parametrize("model_dir", [BERT_DIR, DISTIL_DIR])
def test_save_load_round_trip_keeps_hf_names(golden, tmp_path, model_dir):
    model, cfg, _ = bert.load_pretrained(model_dir, log=quiet)
    bert.save_pretrained(model, cfg, str(tmp_path), metadata={"step": 7})
    # The same tensor names transformers' own save_pretrained wrote (tied copies left out, as it does).
    saved = load_file(str(tmp_path / "model.safetensors"))
    assert sorted(saved) == sorted(load_file(os.path.join(model_dir, "model.safetensors")))
    ours, theirs = (json.loads(open(os.path.join(d, "config.json")).read()) for d in (tmp_path, model_dir))
    for key in ("architectures", "model_type", "vocab_size"):
        assert ours[key] == theirs[key]
    again, cfg2, _ = bert.load_pretrained(str(tmp_path), log=quiet)
    assert cfg2 == cfg
    assert torch.equal(logits(again, golden), logits(model, golden))
    assert not [f for f in os.listdir(tmp_path) if ".tmp" in f]


@pytest.mark.parametrize("kind, model_dir", [("bert", BERT_DIR), ("distilbert", DISTIL_DIR)])
def test_model_made_here_round_trips(tmp_path, kind, model_dir):
    """A model generated in the test (2 layers, 64 wide, random everywhere) -> HF names -> back."""
    torch.manual_seed(0)
    cfg = bert.small_config(300, model_type=kind, num_hidden_layers=2, hidden_size=64, num_attention_heads=2,
                            intermediate_size=128, max_position_embeddings=32)
    model = bert.init_weights(bert.build_model(cfg)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    bert.save_pretrained(model, cfg, str(tmp_path))
    # Exactly the tensor names transformers wrote for the same architecture (2 layers there too).
    saved = load_file(str(tmp_path / "model.safetensors"))
    assert sorted(saved) == sorted(load_file(os.path.join(model_dir, "model.safetensors")))
    again, cfg2, _ = bert.load_pretrained(str(tmp_path), log=quiet)
    ids = torch.randint(5, 300, (2, 11))
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0
    with torch.no_grad():
        assert cfg2 == cfg and torch.equal(again(ids, mask), model(ids, mask))


def test_old_checkpoint_formats(golden, tmp_path):
    """pytorch_model.bin (torch.load, weights_only), TF-era LayerNorm.gamma/beta names, an explicit
    decoder weight, a decoder bias instead of cls.predictions.bias, the pooler and NSP head."""
    sd = load_file(os.path.join(BERT_DIR, "model.safetensors"))
    old = {k.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta"): v
           for k, v in sd.items()}
    old["cls.predictions.decoder.weight"] = sd["bert.embeddings.word_embeddings.weight"].clone()
    old["cls.predictions.decoder.bias"] = old.pop("cls.predictions.bias")
    old["bert.pooler.dense.weight"] = torch.zeros(32, 32)
    old["cls.seq_relationship.weight"] = torch.zeros(2, 32)
    old["bert.embeddings.position_ids"] = torch.arange(64)[None]
    torch.save(old, tmp_path / "pytorch_model.bin")
    shutil.copy(os.path.join(BERT_DIR, "config.json"), tmp_path)
    notes = []
    model, _, _ = bert.load_pretrained(str(tmp_path), log=notes.append)
    assert_close(logits(model, golden), golden["bert_logits"])
    assert notes == []
    # A decoder that is not the embedding matrix is overruled by the tie, and said so.
    old["cls.predictions.decoder.weight"] = old["cls.predictions.decoder.weight"] + 1
    torch.save(old, tmp_path / "pytorch_model.bin")
    model, _, _ = bert.load_pretrained(str(tmp_path), log=notes.append)
    assert_close(logits(model, golden), golden["bert_logits"])
    assert len(notes) == 1 and "cls.predictions.decoder.weight differs from the word embeddings" in notes[0]


def test_bare_encoder_checkpoint(tmp_path, golden):
    """A BertModel checkpoint (no "bert." prefix, no MLM head), like sentence-transformers' MiniLM."""
    sd = load_file(os.path.join(BERT_DIR, "model.safetensors"))
    save_file({k.removeprefix("bert."): v for k, v in sd.items() if not k.startswith("cls.")},
              str(tmp_path / "model.safetensors"))
    shutil.copy(os.path.join(BERT_DIR, "config.json"), tmp_path)
    with pytest.raises(UserError,
                       match=r"has no masked-LM head \(missing cls\.predictions\..*use a masked-LM or SPLADE "
                             r"checkpoint"):
        bert.load_pretrained(str(tmp_path), log=quiet)
    notes = []
    model, _, _ = bert.load_pretrained(str(tmp_path), allow_missing_head=True, log=notes.append)
    assert "no masked-LM head" in notes[0]
    with torch.no_grad():
        assert_close(model.encode(golden["input_ids"], golden["attention_mask"]), golden["bert_hidden"])


def test_distilbert_sinusoidal_table_may_be_absent(tmp_path):
    cfg = bert.small_config(60, model_type="distilbert", sinusoidal_pos_embds=True, num_hidden_layers=1, hidden_size=32,
                            num_attention_heads=2, intermediate_size=64, max_position_embeddings=16)
    torch.manual_seed(0)
    model = bert.init_weights(bert.build_model(cfg)).eval()
    bert.save_pretrained(model, cfg, str(tmp_path))
    sd = load_file(str(tmp_path / "model.safetensors"))
    del sd["distilbert.embeddings.position_embeddings.weight"]
    save_file(sd, str(tmp_path / "model.safetensors"))
    again, cfg2, _ = bert.load_pretrained(str(tmp_path), log=quiet)
    ids = torch.randint(5, 60, (2, 9))
    assert cfg2.sinusoidal_pos_embds and torch.equal(again(ids), model(ids))


def test_load_errors_name_the_file_and_tensor(tmp_path):
    d = tmp_path / "m"
    shutil.copytree(BERT_DIR, d)
    weights = d / "model.safetensors"
    sd = load_file(str(weights))
    sd["bert.encoder.layer.1.intermediate.dense.weight"] = torch.zeros(65, 32)
    save_file(sd, str(weights))
    with pytest.raises(UserError,
                       match=r"model\.safetensors: tensor bert\.encoder\.layer\.1\.intermediate\.dense\.weight has "
                             r"shape \(65, 32\), config\.json implies \(64, 32\)"):
        bert.load_pretrained(str(d), log=quiet)
    del sd["bert.encoder.layer.1.intermediate.dense.weight"]
    save_file(sd, str(weights))
    with pytest.raises(UserError, match=r"lacks tensor bert\.encoder\.layer\.1\.intermediate\.dense\.weight"):
        bert.load_pretrained(str(d), log=quiet)
    weights.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not safetensors")
    with pytest.raises(UserError, match=r"model\.safetensors cannot be read as safetensors"):
        bert.load_pretrained(str(d), log=quiet)
    weights.unlink()
    (d / "pytorch_model.bin").write_bytes(b"not a zip file")
    with pytest.raises(UserError, match=r"pytorch_model\.bin cannot be read"):
        bert.load_pretrained(str(d), log=quiet)
    torch.save({"epoch": 3, "weights": [1, 2]}, d / "pytorch_model.bin")
    with pytest.raises(UserError, match=r"pytorch_model\.bin holds a dict, not a state dict of tensors"):
        bert.load_pretrained(str(d), log=quiet)
    (d / "pytorch_model.bin").unlink()
    with pytest.raises(UserError, match=r"has neither model\.safetensors nor pytorch_model\.bin"):
        bert.load_pretrained(str(d), log=quiet)
    (d / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 2}))
    with pytest.raises(UserError, match=r"config\.json is not a BERT or DistilBERT config"):
        bert.load_pretrained(str(d), log=quiet)
    (d / "config.json").unlink()
    with pytest.raises(UserError, match=r"config\.json is missing"):
        bert.load_pretrained(str(d), log=quiet)
    with pytest.raises(UserError, match="neither a directory nor a hub id"):
        bert.load_pretrained(str(tmp_path / "nope"), log=quiet)


def test_config_round_trips_through_hf_names():
    for cfg in (bert.small_config(8192), bert.small_config(500, model_type="distilbert", num_hidden_layers=2)):
        d = bert.config_to_hf(cfg)
        assert d["architectures"] == [{"bert": "BertForMaskedLM",
                                       "distilbert": "DistilBertForMaskedLM"}[cfg.model_type]]
        assert bert.config_from_hf(d) == cfg
    d = bert.config_to_hf(bert.small_config(500, model_type="distilbert"))
    assert (d["dim"], d["n_layers"], d["n_heads"], d["hidden_dim"]) == (256, 4, 4, 1024)
    with pytest.raises(ValueError, match="not a multiple"):
        bert.BertConfig(hidden_size=100, num_attention_heads=3)


def test_init_weights_and_tied_decoder():
    torch.manual_seed(0)
    cfg = bert.BertConfig(vocab_size=300, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                          intermediate_size=128, max_position_embeddings=32)
    model = bert.init_weights(bert.build_model(cfg))
    w = model.encoder.layer[0].intermediate.dense.weight
    assert abs(w.std().item() - 0.02) < 0.002 and model.encoder.layer[0].intermediate.dense.bias.abs().sum() == 0
    assert torch.all(model.encoder.layer[1].output.LayerNorm.weight == 1) and model.predictions.bias.abs().sum() == 0
    assert model.embeddings.word_embeddings.weight[cfg.pad_token_id].abs().sum() == 0
    distil = bert.init_weights(bert.build_model(bert.small_config(300, model_type="distilbert",
                                                                  sinusoidal_pos_embds=True)))
    assert distil.vocab_projector.weight is distil.embeddings.word_embeddings.weight
    table = distil.embeddings.position_embeddings.weight
    assert torch.allclose(table[3, :4], torch.tensor([torch.sin(torch.tensor(3.0)), torch.cos(torch.tensor(3.0)),
                                                      torch.sin(torch.tensor(3 / 10000 ** (2 / 256))),
                                                      torch.cos(torch.tensor(3 / 10000 ** (2 / 256)))]))
    assert not table.requires_grad
    assert bert.num_params(distil) == sum(p.numel() for p in set(distil.parameters())) == bert.param_count(distil.cfg)
    assert bert.num_params(model) == bert.param_count(cfg)


@pytest.mark.parametrize("kind", ["bert", "distilbert"])
def test_gradient_checkpointing_gives_the_same_gradients(kind):
    torch.manual_seed(0)
    cfg = bert.BertConfig(vocab_size=120, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                          intermediate_size=128, max_position_embeddings=16, model_type=kind,
                          type_vocab_size=0 if kind == "distilbert" else 2)
    model = bert.init_weights(bert.build_model(cfg)).train()
    ids = torch.randint(5, 120, (3, 10))
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    grads = []
    for ckpt in (False, True):
        model.zero_grad()
        model.gradient_checkpointing = ckpt
        torch.manual_seed(1)  # same dropout masks: checkpoint replays the RNG state
        model(ids, mask).logsumexp(-1).sum().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    for n in grads[0]:
        assert_close(grads[1][n], grads[0][n], atol=1e-6)


@pytest.fixture
def hub_server(tmp_path):
    """A fake hub on 127.0.0.1 with one SPLADE-like repo whose weights are only pytorch_model.bin."""
    www = tmp_path / "www"
    repo = www / "naver" / "tiny-splade" / "resolve" / "main"
    repo.mkdir(parents=True)
    shutil.copy(os.path.join(DISTIL_DIR, "config.json"), repo)
    torch.save(load_file(os.path.join(DISTIL_DIR, "model.safetensors")), repo / "pytorch_model.bin")
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"w{i}" for i in range(245)]
    (repo / "vocab.txt").write_text("\n".join(vocab) + "\n")
    (repo / "tokenizer_config.json").write_text(json.dumps({"do_lower_case": False}))
    requests = []

    class Handler(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            requests.append((self.command, self.path))

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Handler, directory=str(www)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", requests
    server.shutdown()
    server.server_close()


def test_load_from_hub_id(hub_server, tmp_path, monkeypatch, golden):
    from lib.wordpiece import load_wordpiece

    endpoint, requests = hub_server
    monkeypatch.setenv("HF_ENDPOINT", endpoint)
    cache = str(tmp_path / "cache")
    assert bert.load_config("naver/tiny-splade", cache_dir=cache, log=quiet).model_type == "distilbert"
    assert requests == [("GET", "/naver/tiny-splade/resolve/main/config.json")]  # the config alone, for estimates
    model, cfg, model_dir = bert.load_pretrained("naver/tiny-splade", cache_dir=cache, log=quiet)
    assert model_dir == os.path.join(cache, "hub", "naver--tiny-splade", "main")
    assert_close(logits(model, golden), golden["distilbert_logits"])
    assert sorted(os.listdir(model_dir)) == ["config.json", "pytorch_model.bin", "tokenizer_config.json", "vocab.txt"]
    assert load_wordpiece(model_dir).tokenize("w1 W2") == ["w1", "[UNK]"]  # do_lower_case false came along
    got = [p for m, p in requests if m == "GET"]
    assert sorted(got) == sorted(f"/naver/tiny-splade/resolve/main/{n}" for n in os.listdir(model_dir))
    n = len(requests)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # everything is cached now: no request at all
    bert.load_pretrained("naver/tiny-splade", cache_dir=cache, log=quiet)
    assert len(requests) == n
    with pytest.raises(UserError, match="HF_HUB_OFFLINE is set"):
        bert.load_pretrained("naver/other", cache_dir=cache, log=quiet)
    monkeypatch.delenv("HF_HUB_OFFLINE")
    with pytest.raises(UserError, match="was not found"):
        bert.load_pretrained("naver/other", cache_dir=cache, log=quiet)
    assert hub.download_optional("naver/tiny-splade", "special_tokens_map.json", cache) is None


# ---- a real tokenizer.json-only SPLADE directory, and check_model_dir ----

REAL = os.path.join(FIXTURES, "real", "splade")


@pytest.fixture(scope="module")
def real_dir(tmp_path_factory):
    """The real SPLADE model's config.json and tokenizer files (tests/fixtures/real/splade/), with random
    weights of its shape (the real ones are not committed) under its tensor names: the old LayerNorm
    gamma/beta, as the real model.safetensors has them."""
    d = tmp_path_factory.mktemp("real-splade")
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(REAL, name), d)
    cfg = bert.read_config(str(d))
    torch.manual_seed(0)
    model = bert.init_weights(bert.build_model(cfg))
    sd = {re.sub(r"LayerNorm\.weight$", "LayerNorm.gamma", re.sub(r"LayerNorm\.bias$", "LayerNorm.beta", k)): v
          for k, v in bert.to_hf_state_dict(model).items()}
    save_file(sd, str(d / "model.safetensors"), metadata={"format": "pt"})
    return d


def fresh_copy(real_dir, tmp_path):
    d = tmp_path / "model"
    shutil.copytree(real_dir, d)
    return d


def test_real_tokenizer_json_only_directory_checks_and_loads(real_dir):
    """What train_splade_*.py --model-name does with it: check first, then load model and tokenizer."""
    assert not (real_dir / "vocab.txt").exists()
    assert bert.check_model_dir(str(real_dir), log=pytest.fail) == str(real_dir)
    model, cfg, model_dir = bert.load_pretrained(str(real_dir), log=pytest.fail)
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.vocab_size) == (2, 128, 2, 30522)
    tok = wordpiece.load_tokenizer(model_dir, log=pytest.fail)
    golden = json.load(open(os.path.join(REAL, "golden.json"), encoding="utf-8"))
    assert [tok.encode(t) for t in golden["texts"][:50]] == golden["variants"]["real"]["auto"][:50]
    with torch.no_grad():
        out = model(*tok.batch(["sparse retrieval, by hand"], max_length=16))
    assert out.shape == (1, 7, 30522)


def test_check_model_dir_reports_every_problem_one_line_each(real_dir, tmp_path):
    d = fresh_copy(real_dir, tmp_path)
    weights = d / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])  # a cut-off download
    (d / "tokenizer.json").unlink()
    (d / "config.json").write_text(json.dumps({"model_type": "roberta"}))
    with pytest.raises(UserError) as e:
        bert.check_model_dir(str(d), log=quiet)
    lines = str(e.value).split("\nerror: ")
    assert len(lines) == 3, lines
    assert re.search(r"config\.json is not a BERT or DistilBERT config \(model_type 'roberta'", lines[0])
    assert re.search(r"model\.safetensors is truncated \(17,6\d\d,\d\d\d bytes; its tensors end at byte "
                     r"17,6\d\d,\d\d\d\); download or save it again", lines[1])
    assert re.search(r"has neither tokenizer\.json nor vocab\.txt", lines[2])


@pytest.mark.parametrize("break_it, match", [
    (lambda d: (d / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not safetensors"),
     r"model\.safetensors cannot be read as safetensors"),
    (lambda d: _shard(d), r"holds a sharded checkpoint"),
    (lambda d: (d / "model.safetensors").unlink(), r"has neither model\.safetensors nor pytorch_model\.bin"),
    (lambda d: (d / "config.json").unlink(), r"config\.json is missing"),
    (lambda d: _edit_json(d / "config.json", hidden_size=64),
     r"embeddings\.word_embeddings\.weight has shape \(30522, 128\), "
                                                              r"config\.json implies \(30522, 64\)"),
    (lambda d: _edit_json(d / "config.json", vocab_size=30000), r"the tokenizer has 30,522 ids but .*config\.json says "
                                                                r"vocab_size 30,000"),
    (lambda d: _edit_json(d / "tokenizer.json", normalizer={"type": "Precompiled"}) or
     _edit_json(d / "tokenizer_config.json", tokenizer_class="PreTrainedTokenizerFast"),
     r"tokenizer\.json: normalizer Precompiled"),
    (lambda d: _edit_json(d / "tokenizer.json", model={"type": "Unigram", "vocab": []}),
     r"model type Unigram is not WordPiece"),
    (lambda d: (d / "tokenizer_config.json").write_text("{oops"), r"tokenizer_config\.json is not valid JSON"),
])
def test_check_model_dir_names_the_file_and_what_to_do(real_dir, tmp_path, break_it, match):
    d = fresh_copy(real_dir, tmp_path)
    break_it(d)
    with pytest.raises(UserError, match=match) as e:
        bert.check_model_dir(str(d), log=quiet)
    assert str(d) in str(e.value)


def _shard(d):
    (d / "model.safetensors").rename(d / "model-00001-of-00002.safetensors")
    (d / "model.safetensors.index.json").write_text("{}")


def _edit_json(path, **changes):
    obj = json.loads(path.read_text(encoding="utf-8"))
    obj.update(changes)
    path.write_text(json.dumps(obj))


def test_check_model_dir_reads_pytorch_bin_without_loading_it(real_dir, tmp_path):
    d = fresh_copy(real_dir, tmp_path)
    torch.save(load_file(str(d / "model.safetensors")), d / "pytorch_model.bin")  # zip format: memory-mapped
    (d / "model.safetensors").unlink()
    assert bert.check_model_dir(str(d), log=quiet) == str(d)
    shapes, path = bert.read_weight_shapes(str(d))
    assert path.endswith("pytorch_model.bin") and shapes["bert.embeddings.word_embeddings.weight"] == (30522, 128)
    assert shapes["bert.encoder.layer.1.output.LayerNorm.gamma"] == (128,)


def test_check_model_dir_on_a_hub_id_with_tokenizer_json_only(hub_server, tmp_path, monkeypatch):
    """A repository like most current ones: tokenizer.json, no vocab.txt. It is downloaded and checked."""
    endpoint, requests = hub_server
    repo = tmp_path / "www" / "org" / "json-splade" / "resolve" / "main"
    repo.mkdir(parents=True)
    for name in ("config.json", "model.safetensors"):
        shutil.copy(os.path.join(DISTIL_DIR, name), repo)
    tok = wordpiece.WordPiece(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
                              + [f"w{i}" for i in range(245)], do_lower_case=False)
    tok.save(str(repo))
    (repo / "vocab.txt").unlink()
    monkeypatch.setenv("HF_ENDPOINT", endpoint)
    model_dir = bert.check_model_dir("org/json-splade", cache_dir=str(tmp_path / "cache"), log=quiet)
    assert sorted(os.listdir(model_dir)) == ["config.json", "model.safetensors", "special_tokens_map.json",
                                             "tokenizer.json", "tokenizer_config.json"]
    assert wordpiece.load_tokenizer(model_dir).tokenize("w1 W2") == ["w1", "[UNK]"]
    (repo / "tokenizer.json").unlink()
    with pytest.raises(UserError, match=r"org/no-tokenizer has none of tokenizer\.json, vocab\.txt"):
        shutil.copytree(repo, tmp_path / "www" / "org" / "no-tokenizer" / "resolve" / "main")
        bert.check_model_dir("org/no-tokenizer", cache_dir=str(tmp_path / "cache"), log=quiet)
