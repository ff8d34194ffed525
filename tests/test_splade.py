"""train_splade_unified.py and train_splade_optimized.py: the SPLADE arithmetic on hand-computed tensors,
GradCache against the full batch, every bad-data error, exact resume, tiny end-to-end runs, search."""

import json
import math
import os
import shutil

import pytest
import torch

import train_splade_optimized as optimized
import train_splade_unified as unified
from lib import bert, rundir
from lib.errors import UserError

# A tiny model: 2 layers, 64 wide, vocabulary learned up to 400 entries.
TINY = ["--hidden-size", "64", "--num-layers", "2", "--num-heads", "2", "--vocab-size", "400", "--max-length", "32",
        "--max-query-length", "16", "--eval-batch-size", "64", "--log-interval", "1", "--device", "cpu",
        "--lr", "1e-2", "--warmup-steps", "4", "--dtype", "fp32"]


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny matmuls gain nothing from threads, and on a shared 2-core machine threads fight."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# --- the SPLADE pieces, by hand -------------------------------------------------------------------
def test_splade_max_by_hand():
    # one text, 3 positions (the last is padding), vocabulary of 2
    logits = torch.tensor([[[1.0, -2.0], [3.0, -1.0], [9.0, 9.0]]])
    mask = torch.tensor([[1, 1, 0]])
    w = unified.splade_max(logits, mask)
    # term 0: max(log(1+1), log(1+3)) = log 4; term 1: both logits negative -> ReLU 0 -> log 1 = 0;
    # the padding position's 9s never count.
    assert torch.allclose(w, torch.tensor([[math.log(4.0), 0.0]]))


def test_splade_max_gradient_reaches_only_the_max_position():
    logits = torch.tensor([[[1.0, 2.0], [3.0, -1.0]]], requires_grad=True)
    unified.splade_max(logits, torch.ones(1, 2)).sum().backward()
    # d/dx log(1 + x) = 1 / (1 + x): term 0 at position 1 (x=3) gets 1/4, term 1 at position 0 (x=2) 1/3
    assert torch.allclose(logits.grad, torch.tensor([[[0.0, 1 / 3], [0.25, 0.0]]]))


def test_flops_by_hand():
    reps = torch.tensor([[1.0, 0.0, 2.0], [3.0, 2.0, 0.0]])
    # batch means per term: 2, 1, 1 -> 4 + 1 + 1
    assert unified.flops(reps).item() == pytest.approx(6.0)


def test_in_batch_cross_entropy_by_hand():
    q = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    d = torch.tensor([[2.0, 0.0], [0.0, 1.0], [1.0, 1.0]])  # positives of q0, q1, then one hard negative
    # scores: q0 -> [2, 0, 1] (positive 2), q1 -> [0, 1, 1] (positive 1)
    loss0 = -math.log(math.exp(2) / (math.exp(2) + 1 + math.exp(1)))
    loss1 = -math.log(math.exp(1) / (1 + 2 * math.exp(1)))
    assert unified.ranking_loss(q, d).item() == pytest.approx((loss0 + loss1) / 2, rel=1e-6)
    # the same with the documents in another order and the positives named
    perm = torch.tensor([2, 0, 1])
    assert unified.ranking_loss(q, d[perm], torch.tensor([1, 2])).item() == pytest.approx((loss0 + loss1) / 2, rel=1e-6)


def test_lambda_warmup_is_quadratic():
    assert unified.lambda_at(0, 1e-3, 100) == 0
    assert unified.lambda_at(50, 1e-3, 100) == pytest.approx(0.25e-3)
    assert unified.lambda_at(10, 1e-3, 100) == pytest.approx(1e-5)
    assert unified.lambda_at(100, 1e-3, 100) == 1e-3
    assert unified.lambda_at(5000, 1e-3, 100) == 1e-3
    assert unified.lambda_at(0, 1e-3, 0) == 1e-3


def test_retrieval_metrics_by_hand():
    scores = torch.tensor([[0.9, 0.1, 0.5], [0.2, 0.3, 0.8]])
    # query 0: relevant doc 0 ranks 1st; query 1: relevant doc 0 ranks 3rd
    m = unified.retrieval_metrics(scores, torch.tensor([0, 0]))
    assert m["mrr@10"] == pytest.approx((1 + 1 / 3) / 2)
    assert m["recall@10"] == 1.0
    assert m["ndcg@10"] == pytest.approx((1 + 1 / math.log2(4)) / 2)


def test_inverted_index_scores_equal_dot_products():
    torch.manual_seed(0)
    docs = torch.relu(torch.randn(7, 30) - 0.8)  # mostly zeros
    queries = torch.relu(torch.randn(3, 30) - 0.5)
    index = unified.build_index(docs)
    assert len(index["weights"]) == int((docs > 0).sum())
    t = 5  # term 5's posting list: exactly the documents that use term 5
    s, e = index["term_ptr"][t].item(), index["term_ptr"][t + 1].item()
    assert index["doc_ids"][s:e].tolist() == docs[:, t].nonzero().flatten().tolist()
    assert torch.allclose(unified.score(index, queries, len(docs)), queries @ docs.T, atol=1e-6)
    in_blocks = unified.build_index(iter([docs[:3], docs[3:4], docs[4:]]))  # as encode_batches gives them
    assert all(torch.equal(index[key], in_blocks[key]) for key in index)


# --- GradCache equals the full batch --------------------------------------------------------------
def tiny_model(dropout=0.0, vocab=50):
    torch.manual_seed(0)
    cfg = bert.BertConfig(vocab_size=vocab, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                          intermediate_size=128, max_position_embeddings=64, hidden_dropout_prob=dropout,
                          attention_probs_dropout_prob=dropout)
    return bert.init_weights(bert.build_model(cfg)).train()


def random_batch(gen, n_queries, k, vocab=50):
    def texts(n, lo, hi):
        return [[2] + torch.randint(5, vocab, (int(torch.randint(lo,
                                                                 hi, (1,), generator=gen)),), generator=gen).tolist()
                + [3] for _ in range(n)]
    return texts(n_queries, 2, 6), texts(n_queries, 5, 12), texts(n_queries * k, 5, 12)


def micro_batches(q, pos, neg, size, k):
    out = []
    for s in range(0, len(q), size):
        out.append(unified.Batch(*unified.pad(q[s:s + size], 0),
                                 *unified.pad(pos[s:s + size] + neg[s * k:(s + size) * k], 0)))
    return out


def grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_gradcache_equals_the_full_batch():
    gen = torch.Generator().manual_seed(1)
    q, pos, neg = random_batch(gen, 8, 1)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    model = tiny_model()
    full = unified.naive_step(model, micro_batches(q, pos, neg, 8, 1), 1e-3, 2e-3, None, scaler)
    g_full = grads(model)
    model.zero_grad(set_to_none=True)
    cached = optimized.gradcache_step(model, micro_batches(q, pos, neg, 2, 1), 1e-3, 2e-3, None, scaler)
    g_cached = grads(model)
    for key in ("loss", "rank_loss", "q_flops", "d_flops"):
        assert cached[key] == pytest.approx(full[key], rel=1e-5, abs=1e-6)
    assert g_full.keys() == g_cached.keys()
    for name in g_full:
        assert torch.allclose(g_cached[name], g_full[name], rtol=1e-5, atol=1e-6), name
    # naive accumulation is a different objective: fewer negatives, another loss and gradient
    model.zero_grad(set_to_none=True)
    naive = unified.naive_step(model, micro_batches(q, pos, neg, 2, 1), 1e-3, 2e-3, None, scaler)
    assert naive["rank_loss"] < full["rank_loss"] - 0.1


def test_gradcache_replays_dropout():
    """With dropout on, GradCache must give the gradient of the very forward pass it cached: the same as
    encoding the micro-batches with a graph, in order, from the same RNG state, and one backward."""
    gen = torch.Generator().manual_seed(2)
    q, pos, neg = random_batch(gen, 6, 1)
    mbs = micro_batches(q, pos, neg, 2, 1)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    model = tiny_model(dropout=0.3)
    torch.manual_seed(123)
    cached = optimized.gradcache_step(model, mbs, 1e-3, 1e-3, None, scaler)
    g_cached, after_cached = grads(model), torch.get_rng_state()
    model.zero_grad(set_to_none=True)
    torch.manual_seed(123)
    qs, ds, positives, offset = [], [], [], 0
    for mb in mbs:
        qs.append(unified.encode_batch(model, mb.q_ids, mb.q_mask))
        ds.append(unified.encode_batch(model, mb.d_ids, mb.d_mask))
        positives.append(torch.arange(len(qs[-1])) + offset)
        offset += len(ds[-1])
    loss, _ = unified.splade_loss(torch.cat(qs), torch.cat(ds), 1e-3, 1e-3, torch.cat(positives))
    loss.backward()
    assert cached["loss"] == pytest.approx(loss.item(), rel=1e-5)
    for name, g in grads(model).items():
        assert torch.allclose(g_cached[name], g, rtol=1e-5, atol=1e-6), name
    assert torch.equal(after_cached, torch.get_rng_state())  # the RNG ends where one pass would leave it


def test_gradcache_keeps_only_the_gradients_while_it_encodes_again(monkeypatch):
    """Step 3 (the second encoding, with a graph) holds only the representations' gradients, one fp32
    rows x vocabulary tensor, not also the cached vectors and their concatenation (which the loss's graph
    would keep alive): the live tensors are counted, as they are made and freed, by a dispatch mode."""
    from tests.test_memory_estimates import LiveTensorBytes
    vocab, gen = 4000, torch.Generator().manual_seed(1)
    q, pos, neg = random_batch(gen, 16, 1, vocab=vocab)
    model = tiny_model(vocab=vocab)
    counter = LiveTensorBytes([*model.parameters(), *model.buffers()])
    before_step_3 = []
    encode = unified.encode_batch

    def counting_encode(*args, **kwargs):
        if torch.is_grad_enabled() and not before_step_3:
            before_step_3.append(counter.live())
        return encode(*args, **kwargs)
    monkeypatch.setattr(unified, "encode_batch", counting_encode)
    with counter:
        optimized.gradcache_step(model, micro_batches(q, pos, neg, 4, 1), 1e-3, 2e-3, None,
                                 torch.amp.GradScaler("cpu", enabled=False))
    one_copy = (16 + 32) * vocab * 4  # 16 queries and 32 documents
    assert 0.99 < before_step_3[0] / one_copy < 1.1, before_step_3[0] / one_copy


# --- data and its errors ----------------------------------------------------------------------------
def write(path, text):
    path.write_text(text, encoding="utf-8")
    return str(path)


def test_reads_json_list_and_jsonl(tmp_path):
    rec = [{"query": "q one", "positive_document": "doc one", "negative_documents": ["n1", {"document": "n2"}], "x": 1}]
    a = unified.read_examples(write(tmp_path / "a.json", json.dumps(rec, indent=2)), "--train-file", 1)
    b = unified.read_examples(write(tmp_path / "b.jsonl",
                                    "\n".join(json.dumps(r) for r in rec * 2) + "\n"), "--train-file", 1)
    assert a[0] == unified.Example("q one", "doc one", ["n1", "n2"])
    assert b == a * 2


GOOD = '{"query": "q", "positive_document": "d", "negative_documents": ["n"]}'
BAD_DATA = [
    ("", ["is empty"]),
    ('[\n  {"query": "q",\n   "positive_document": }\n]', ["invalid JSON", "line 3, column"]),
    (f"{GOOD}\n{{bad\n", ["invalid JSON", "line 2"]),
    ('{"query": "q", "positive_document": "d"}', []),  # a single object is JSONL with one record: fine
    ('"just a string"', ["top level", "not a list"]),
    ("[]", ["holds no records"]),
    (f'[{GOOD}, 3]', ["record 1", "is a JSON int", "expected an object"]),
    (f'[{GOOD},\n {{"positive_document": "d", "negative_documents": ["n"]}}]', ["record 1 (line 2)", "'query'"]),
    ('[{"query": 5, "positive_document": "d", "negative_documents": ["n"]}]',
     ["record 0", "'query'", "JSON int", "non-empty string"]),
    ('[{"query": "q", "positive_document": "  ", "negative_documents": ["n"]}]',
     ["'positive_document'", "empty string"]),
    ('[{"query": "q", "positive_document": "d", "negative_documents": "n"}]',
     ["'negative_documents'", "JSON str", "list"]),
    ('[{"query": "q", "positive_document": "d", "negative_documents": ["n", 7]}]',
     ["'negative_documents[1]'", "JSON int"]),
    ('[{"query": "q", "positive_document": "d", "negative_documents": [{"doc": "n"}]}]',
     ["'negative_documents[0]'", "without 'document'"]),
    ('[{"query": "q", "positive_document": "d", "negative_documents": []}]',
     ["record 0", "no negatives", "--negatives-per-query 0"]),
    ('[{"query": "q", "positive_document": "d"}]', ["record 0", "no negatives"]),
    (f"[{GOOD}] trailing", ["unexpected text after the list"]),
    (f"[{GOOD} {GOOD}]", ["expected ',' or ']'", "line 1"]),
]


@pytest.mark.parametrize("text,expected", BAD_DATA)
def test_each_bad_data_error_is_one_line(tmp_path, capsys, text, expected):
    path = write(tmp_path / "train.json", text)
    if not expected:
        assert len(unified.read_examples(path, "--train-file", 0)) == 1
        return
    with pytest.raises(SystemExit) as e:
        unified.main(["--train-file", path, "--out-dir", str(tmp_path / "out"), *TINY])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("error: ") and path in err, err
    for piece in expected:
        assert piece in err, (piece, err)
    assert not os.path.exists(tmp_path / "out" / "model.safetensors")


def test_not_utf8_and_missing_file(tmp_path, capsys):
    bad = tmp_path / "latin1.json"
    bad.write_bytes(b'[{"query": "caf\xe9"}]')
    for path, piece in ((str(bad), "not UTF-8"), (str(tmp_path / "nope.json"), "does not exist")):
        with pytest.raises(SystemExit):
            unified.main(["--train-file", path, "--out-dir", str(tmp_path / "out"), *TINY])
        assert piece in capsys.readouterr().err


def test_a_byte_order_mark_is_named_and_skipped(tmp_path):
    """Windows editors start UTF-8 files with a BOM; JSON has no place for one. The reader says so and
    reads on, and the lines it names in errors are still the file's lines."""
    rec = {"query": "q one", "positive_document": "doc one", "negative_documents": ["n1"]}
    for name, text in (("list.json", json.dumps([rec, rec], indent=1)), ("lines.jsonl", f"{json.dumps(rec)}\n" * 2)):
        path = tmp_path / name
        path.write_bytes(b"\xef\xbb\xbf" + text.encode())
        notes = []
        read = unified.read_examples(str(path), "--train-file", 1, log=notes.append)
        assert read == [unified.Example("q one", "doc one", ["n1"])] * 2
        assert len(notes) == 1 and "byte-order mark (BOM)" in notes[0] and str(path) in notes[0]
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + f"{json.dumps(rec)}\n{{bad\n".encode())
    with pytest.raises(UserError, match="line 2"):
        unified.read_examples(str(path), "--train-file", 1, log=lambda *a: None)


# --- tiny end-to-end runs -----------------------------------------------------------------------------
# A retrieval task a 2-layer model learns in a few dozen steps, and that needs more than matching words:
# a document is six topic words ("t17"); its query names one of them as it is and one by a synonym
# ("s42" for "t42"), among filler words every query shares. The untrained model, a bag of words
# (init_lexical), only matches the first; training has to learn the synonyms: SPLADE's expansion.
def synthetic(n, seed):
    import random

    rng = random.Random(seed)
    filler = ["find", "the", "code", "that", "does", "about", "with"]
    records = []
    for i in range(n):
        topics = rng.sample(range(60), 6)
        doc = " ".join([f"t{t}" for t in topics] + rng.sample(filler, 2))
        query = " ".join(rng.sample(filler, 3) + [f"t{topics[0]}", f"s{topics[1]}"])
        negs = [" ".join([f"t{t}" for t in rng.sample(range(60), 5)] + [f"t{topics[0]}"])]
        records.append({"query": query, "positive_document": doc, "negative_documents": negs})
    return records


@pytest.fixture(scope="module")
def data_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("splade-data")
    (d / "train.json").write_text(json.dumps(synthetic(192, 0)))
    (d / "val.jsonl").write_text("\n".join(json.dumps(r) for r in synthetic(48, 1)))
    return str(d / "train.json"), str(d / "val.jsonl")


def contract_data(directory):
    """The data of the SPLADE cases in tests/test_run_contract.py: 48 training and 16 validation records."""
    train, val = os.path.join(directory, "train.json"), os.path.join(directory, "val.jsonl")
    with open(train, "w") as f:
        json.dump(synthetic(48, 0), f)
    with open(val, "w") as f:
        f.write("\n".join(json.dumps(r) for r in synthetic(16, 1)))
    return ["--train-file", train, "--val-file", val]


def test_unified_end_to_end_beats_the_untrained_model_and_searches(tmp_path, data_files, capsys):
    train, val = data_files
    out = str(tmp_path / "run")
    result = unified.main(["--train-file", train, "--val-file", val, "--out-dir", out, "--epochs", "3",
                           "--batch-size", "16", *TINY])
    assert result["final"]["mrr@10"] > result["first"]["mrr@10"] + 0.1, (result["first"], result["final"])
    for name in ("config.json", "model.safetensors", "tokenizer.json", "vocab.txt", "tokenizer_config.json",
                 "training_state.pt", "metrics.jsonl", unified.INDEX_FILE, unified.DOCUMENTS_FILE,
                 "best/model.safetensors"):
        assert os.path.isfile(os.path.join(out, name)), name
    assert json.load(open(os.path.join(out, "config.json")))["architectures"] == ["BertForMaskedLM"]
    records = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    steps = [r for r in records if "rank_loss" in r]
    assert {"loss", "rank_loss", "q_flops", "d_flops", "q_terms", "d_terms"} <= steps[0].keys()
    assert len([r for r in records if "val" in r and "event" not in r]) == 4  # before training + 3 epochs

    # the Python API and the search CLI on the saved run
    model, tok = unified.load_splade(out)
    docs = json.load(open(os.path.join(out, unified.DOCUMENTS_FILE)))
    reps = unified.encode(model, tok, docs[:3], max_length=32)
    assert reps.shape == (3, tok.vocab_size) and (reps >= 0).all()
    capsys.readouterr()
    query = synthetic(48, 1)[5]
    found = unified.main(["--search", out, "--query", query["query"], "--top-k", "5", "--max-query-length", "16"])
    text = capsys.readouterr().out
    assert "top terms" in text and "top 5 of" in text
    assert docs.index(query["positive_document"]) in [i for i, _ in found["results"]]

    # the saved directory is a checkpoint like any Hugging Face one: fine-tune from it
    tuned = unified.main(["--train-file", train, "--val-file", val, "--model-name", out, "--out-dir",
                          str(tmp_path / "ft"), "--steps", "2", "--index", "none", *TINY])
    assert tuned["first"]["mrr@10"] == pytest.approx(result["final"]["mrr@10"])  # the same model, the same pool


def test_optimized_end_to_end_with_gradcache(tmp_path, data_files, capsys):
    train, val = data_files
    out = str(tmp_path / "opt")
    result = optimized.main(["--train-file", train, "--val-file", val, "--out-dir", out, "--epochs", "3",
                             "--batch-size", "8", "--gradient-accumulation-steps", "2", "--memory-efficient",
                             "--memory-tracking", "--memory-tracking-interval", "2", "--index", "none", *TINY])
    assert result["final"]["mrr@10"] > result["first"]["mrr@10"] + 0.1, (result["first"], result["final"])
    records = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    tracked = [r for r in records if "rss" in r]
    assert tracked and all(r["rss"] > 0 for r in tracked) and tracked[0]["step"] == 0
    assert "rss" in capsys.readouterr().out


def test_resume_refuses_a_contradicting_flag(tmp_path, data_files, capsys):
    train, _ = data_files
    out = str(tmp_path / "r")
    unified.main(["--train-file", train, "--steps", "1", "--batch-size", "8", "--out-dir", out,
                  "--index", "none", *TINY])
    with pytest.raises(SystemExit):
        unified.main(["--train-file", train, "--steps", "2", "--batch-size", "4", "--out-dir", out, "--resume", *TINY])
    assert "--batch-size 4 contradicts the saved run" in capsys.readouterr().err


# --- real model directories ---------------------------------------------------------------------------
REAL = os.path.join(os.path.dirname(__file__), "fixtures", "real", "splade")


@pytest.fixture(scope="module")
def tokenizer_json_only(tmp_path_factory):
    """A model directory laid out like the real splade-tiny (tests/fixtures/real/splade): its real
    tokenizer.json and tokenizer_config.json, no vocab.txt; a 2-layer, 64-wide BERT over its 30,522
    ids stands in for the weights, which stay out of git."""
    d = tmp_path_factory.mktemp("tokenizer-json-only")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(REAL, name), d / name)
    torch.manual_seed(0)
    cfg = bert.BertConfig(vocab_size=30522, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                          intermediate_size=128, max_position_embeddings=64)
    bert.save_pretrained(unified.init_lexical(bert.init_weights(bert.build_model(cfg))), cfg, str(d))
    return str(d)


def test_a_tokenizer_json_only_directory_fine_tunes(tmp_path, data_files, tokenizer_json_only):
    out = str(tmp_path / "ft")
    result = unified.main(["--model-name", tokenizer_json_only, "--train-file", data_files[0], "--steps", "2",
                           "--batch-size", "4", "--max-length", "16", "--max-query-length", "8", "--out-dir", out,
                           "--index", "none", "--device", "cpu", "--log-interval", "1"])
    assert result["step"] == 2 and "vocab.txt" not in os.listdir(tokenizer_json_only)
    real = unified.wordpiece.load_tokenizer(tokenizer_json_only)
    _, saved = unified.load_splade(out)  # the output's tokenizer: tokenizer.json (and vocab.txt) as saved
    text = "Café déjà vu: the QUICK fox's e-mail, 東京 and [MASK]"
    assert saved.encode(text) == real.encode(text) and saved.vocab_size == 30522
    assert json.load(open(os.path.join(out, "tokenizer.json")))["model"]["vocab"] == \
        json.load(open(os.path.join(REAL, "tokenizer.json")))["model"]["vocab"]


def test_the_model_directory_is_checked_before_the_data_is_built(tmp_path, tokenizer_json_only, capsys):
    """No --train-file: the embedded set takes seconds to build; a broken model directory must stop first."""
    broken = tmp_path / "broken"
    shutil.copytree(tokenizer_json_only, broken)
    (broken / "tokenizer.json").unlink()
    whole = (broken / "model.safetensors").read_bytes()
    (broken / "model.safetensors").write_bytes(whole[: len(whole) // 2])
    with pytest.raises(SystemExit) as e:
        unified.main(["--model-name", str(broken), "--out-dir", str(tmp_path / "out"), "--device", "cpu"])
    captured = capsys.readouterr()
    assert e.value.code == 2 and "data:" not in captured.out, captured.out
    assert "model.safetensors is truncated" in captured.err and "neither tokenizer.json nor vocab.txt" in captured.err


# --- the run contract: what tests/test_run_contract.py does not already cover ---------------------
def error_of(capsys, main, argv):
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1 and err.startswith("error: "), err
    return err


def test_every_update_skipped_saves_nothing_and_says_so(tmp_path, data_files, capsys):
    """--lambda-q 1e30: the FLOPS term's gradient overflows and every update is skipped. The run must not
    save, index or exit 0: ten skipped in a row stop it, and a shorter run that applied none says so."""
    diverge = ["--train-file", data_files[0], "--lambda-q", "1e30", "--lambda-d", "1e30", "--reg-warmup-steps", "0",
               "--batch-size", "32", *TINY]
    # 12 steps: the end of the first epoch (step 6) comes in the middle of the skipped updates, and is not saved
    for steps, message in (("12", "not finite for 10 steps in a row (steps 0 to 9)"), ("3", "no update was applied")):
        out = tmp_path / steps
        err = error_of(capsys, unified.main, [*diverge, "--steps", steps, "--out-dir", str(out)])
        assert message in err, err
        assert sorted(os.listdir(out)) == ["checkpoints", "metrics.jsonl"]  # no model, no state, no index
        assert os.listdir(out / "checkpoints") == []  # and no checkpoint committed
        records = [json.loads(line) for line in open(out / "metrics.jsonl")]
        assert all(r.get("skipped") for r in records if "grad_norm" in r)


def test_search_with_damaged_index_files_is_one_line(tmp_path, data_files, capsys):
    out = tmp_path / "run"
    unified.main(["--train-file", data_files[0], "--steps", "1", "--batch-size", "8", "--out-dir", str(out), *TINY])
    search = ["--search", str(out), "--query", "find t3", "--max-query-length", "16"]
    index, docs = out / unified.INDEX_FILE, out / unified.DOCUMENTS_FILE
    whole_index, whole_docs = index.read_bytes(), docs.read_bytes()
    damage = [
        (index, whole_index[: len(whole_index) // 2], "truncated"),
        (index, b"garbage, not a safetensors file", "not a safetensors file"),
        (docs, whole_docs[: len(whole_docs) // 2], "invalid JSON"),
        (docs, b'["one document"]', "but index.safetensors indexes"),
        (docs, b'{"a": 1}', "not a JSON list"),
        (docs, None, "documents.json is missing"),
    ]
    for path, content, expected in damage:
        path.unlink()
        if content is not None:
            path.write_bytes(content)
        err = error_of(capsys, unified.main, search)
        assert expected in err and str(path.name) in err, err
        index.write_bytes(whole_index)
        docs.write_bytes(whole_docs)
    assert unified.main(search)["results"]  # restored: it searches again


def test_a_moved_train_file_resumes_when_its_contents_are_the_same(tmp_path, data_files, capsys):
    first = tmp_path / "train.json"
    shutil.copy(data_files[0], first)
    out = str(tmp_path / "run")
    common = ["--batch-size", "8", "--index", "none", "--out-dir", out, *TINY]
    unified.main(["--train-file", str(first), "--steps", "2", *common])
    moved = tmp_path / "elsewhere.json"
    first.rename(moved)
    assert "no longer exists" in error_of(capsys, unified.main, ["--resume", "--steps", "3", *common])
    other = tmp_path / "other.json"
    other.write_text(json.dumps(synthetic(48, 5)))
    assert "the contents differ" in error_of(capsys, unified.main, ["--resume", "--steps", "3", "--train-file",
                                                                      str(other), *common])
    result = unified.main(["--resume", "--steps", "3", "--train-file", str(moved), *common])
    assert result["step"] == 3 and "moved from" in capsys.readouterr().out


def remove_saved(out, name):
    """A file gone from a saved run: from the top of OUT and from every committed checkpoint folder (a
    file missing from the top alone is put back from the checkpoint at --resume)."""
    for folder in (out, *rundir.committed(out)):
        os.remove(os.path.join(folder, name))


def test_a_run_saved_with_vocab_txt_only_resumes(tmp_path, data_files, capsys):
    """Runs saved before tokenizer.json was written have only vocab.txt; either file is a tokenizer."""
    out = str(tmp_path / "run")
    common = ["--batch-size", "8", "--index", "none", "--out-dir", out, *TINY]
    unified.main(["--train-file", data_files[0], "--steps", "1", *common])
    remove_saved(out, "tokenizer.json")
    assert unified.main(["--resume", "--steps", "2", *common])["step"] == 2
    for name in ("tokenizer.json", "vocab.txt"):
        remove_saved(out, name)
    assert "neither tokenizer.json nor vocab.txt" in error_of(capsys, unified.main,
                                                              ["--resume", "--steps", "3", *common])


def test_memory_advice_fits_the_script(tmp_path, data_files, capsys):
    """The unified script points to the optimized one; the optimized one names its own flags."""
    argv = ["--train-file", data_files[0], "--batch-size", "100000000", "--out-dir", str(tmp_path / "m"), *TINY]
    assert "use train_splade_optimized.py" in error_of(capsys, unified.main, argv)
    err = error_of(capsys, optimized.main, argv)
    assert "train_splade_optimized.py" not in err and "--gradient-accumulation-steps 2" in err, err
    assert not os.path.exists(tmp_path / "m" / "metrics.jsonl")


def test_memory_advice_names_mixed_precision_only_where_it_would_change_the_dtype():
    args = optimized.build_parser().parse_args(["--max-length", "64"])
    cuda, mps = torch.device("cuda"), torch.device("mps")
    assert "--mixed-precision" not in optimized.memory_advice(args, cuda, torch.bfloat16)  # --dtype auto on CUDA
    assert "--mixed-precision" in optimized.memory_advice(args, mps, None)  # MPS computes in fp32 by default
    assert "--mixed-precision" not in optimized.memory_advice(args, torch.device("cpu"), None)  # refused on CPU


def test_memory_advice_keeps_the_effective_batch():
    """Smaller micro-batches are offered only as the same effective batch: a batch of 1 cannot be split."""
    def advice(*argv):
        return optimized.memory_advice(optimized.build_parser().parse_args([*argv, "--memory-efficient"]),
                                       torch.device("cpu"), None)
    assert advice("--batch-size", "6").startswith("--batch-size 3 --gradient-accumulation-steps 2 ")
    assert advice("--batch-size", "9", "--gradient-accumulation-steps", "2").startswith(
        "--batch-size 3 --gradient-accumulation-steps 6 ")
    assert advice("--batch-size", "7").startswith("--batch-size 1 --gradient-accumulation-steps 7 ")
    assert "--gradient-accumulation-steps" not in advice("--batch-size", "1", "--max-length", "128")
    assert advice("--batch-size", "1") == "a smaller model, or a machine with more memory"


def test_val_file_needs_a_train_file(tmp_path, data_files, capsys):
    err = error_of(capsys, unified.main, ["--val-file", data_files[1], "--out-dir", str(tmp_path / "v"), *TINY])
    assert "--val-file goes with --train-file" in err


# --- flags ----------------------------------------------------------------------------------------
def test_force_device(capsys):
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    assert optimized.choose_device("cuda", force=False) == optimized.devices.pick_device(None)
    assert "not available" in capsys.readouterr().err
    with pytest.raises(UserError, match="--force-device"):
        optimized.choose_device("cuda", force=True)
    assert optimized.choose_device("cpu", force=True) == torch.device("cpu")


def test_mixed_precision_refused_on_cpu(tmp_path, data_files, capsys):
    with pytest.raises(SystemExit) as e:
        optimized.main(["--train-file", data_files[0], "--out-dir", str(tmp_path / "m"), "--mixed-precision", *TINY])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--mixed-precision" in err and "CPU" in err


@pytest.mark.parametrize("message", ["CUDA out of memory. Tried to allocate 2.00 GiB",
                                     "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't "
                                     "allocate memory: you tried to allocate 4611686018427387904 bytes."])
def test_out_of_memory_is_one_line_with_what_to_try(tmp_path, data_files, capsys, monkeypatch, message):
    def no_memory(*args):
        raise RuntimeError(message)
    monkeypatch.setattr(unified, "run", no_memory)
    with pytest.raises(SystemExit) as e:
        optimized.main(["--train-file", data_files[0], "--out-dir", str(tmp_path / "m"), *TINY])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1, err
    assert "out of memory on cpu; no checkpoint was saved yet; try --batch-size" in err


def test_estimate_memory_flags(capsys):
    base = ["--estimate-memory", "--batch-size", "64", "--device", "cpu"]
    plain = unified.main(base)["estimate"]
    cached = optimized.main(["--estimate-memory", "--batch-size", "8", "--gradient-accumulation-steps", "8",
                             "--device", "cpu"])["estimate"]
    efficient = optimized.main([*base, "--memory-efficient"])["estimate"]

    def tensors(estimate):  # the runtime rows are this (pytest) process's resident set: the same for both
        return sum(v for k, v in estimate.items() if not k.startswith("runtime"))
    assert tensors(cached) < tensors(plain) / 2
    assert efficient["encoder activations"] < plain["encoder activations"]
    assert "total (predicted peak)" in capsys.readouterr().out


def test_the_estimate_counts_a_validation_batch_larger_than_a_step():
    cfg = bert.BertConfig(vocab_size=1000, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                          intermediate_size=256)
    small = unified.estimate_memory(cfg, 10, batch_size=8, k=1, q_len=16, d_len=32, device_type="cpu", eval_batch=8)
    assert "validation batch, beyond a step" not in small
    big = unified.estimate_memory(cfg, 10, batch_size=8, k=1, q_len=16, d_len=32, device_type="cpu", eval_batch=512)
    step = big["encoder activations"] + big["MLM logits + gradient"]
    # 512 documents x 32 tokens: fp32 logits over the vocabulary, and 8 x hidden floats a token of temporaries
    by_hand = 512 * 32 * 1000 * 4 + 512 * 32 * 64 * 4 * 8
    assert big["validation batch, beyond a step"] == by_hand - step


def test_stdlib_default_set_is_split_by_module():
    files = [f for f in unified.stdlib_data.stdlib_files() if f.startswith(("json/", "email/", "http/"))]
    train, val, pool = unified.stdlib_examples(files, n_train=1000, n_val=1000)
    assert train and val
    assert not {ex.query for ex in train} & {ex.query for ex in val}
    assert all(ex.positive in pool for ex in val) and not set(pool) & {ex.positive for ex in train}
    ex = train[0]
    assert ex.positive.startswith(("def ", "async def ")) and '"""' not in ex.positive.split("\n")[1]
    assert ex.negatives and ex.positive not in ex.negatives


def test_early_stopping_and_save_best_only(tmp_path, data_files):
    from lib import checkpoint

    train, val = data_files
    out = str(tmp_path / "es")
    # an improvement of 1.0 in MRR@10 is impossible: the first validation after step 0 sets the best,
    # the next one is a miss and (patience 1) stops the run; OUT keeps the best, not the last.
    result = unified.main(["--train-file", train, "--val-file", val, "--out-dir", out, "--epochs", "3",
                           "--batch-size", "16", "--early-stopping", "--early-stopping-patience", "1",
                           "--early-stopping-min-delta", "1.0", "--save-best-only", "--index", "none", *TINY])
    assert result["step"] == 24 and result["best"] is not None
    assert checkpoint.weights_step(os.path.join(out, "model.safetensors")) == 12
    end = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))][-1]
    assert end["stopped_early"] and end["best_step"] == 12
