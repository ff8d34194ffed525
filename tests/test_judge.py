"""The judge scripts: metrics against hand-computed values, prompt masking, data errors, the embedded
set, the memory estimate, and both scripts end to end on --model tiny (CPU). The run contract
(--resume, --overwrite, damaged files, Ctrl-C) is tests/test_run_contract.py's; here only what is
particular to the judge (which flags a resume keeps, the reference scores, --max_seq_length)."""

import json
import math
import os
import random

import numpy as np
import pytest
import torch

import judge_train_cuda
import judge_train_mps as judge
from lib.errors import UserError


# --- metrics, by hand -----------------------------------------------------------------------------
def test_parse_score_and_feedback():
    assert judge.parse_score("Score: 8/10\nFeedback: fine") == 8.0
    assert judge.parse_score("score:7.5 / 10") == 7.5
    assert judge.parse_score("I give it 8 out of 10") is None
    assert judge.parse_score("Score: 8") is None
    assert judge.parse_feedback("Score: 3/10\nFeedback:  Wrong words: gato.\n") == "Wrong words: gato."
    assert judge.parse_feedback("no marker here ") == "no marker here"
    # feedback first, then the score (the embedded set's order): the feedback stops at the score's line
    answer = "Feedback: sea (English), gato (1):\n1 of 2 words translated.\nScore: 5/10"
    assert judge.parse_score(answer) == 5.0
    assert judge.parse_feedback(answer) == "sea (English), gato (1):\n1 of 2 words translated."


def test_score_metrics_hand_computed():
    pred, ref = [8, 6, 10, 3], [7, 6, 8, 5]
    # |errors| = 1, 0, 2, 2 -> MAE 5/4; squares 1, 0, 4, 4 -> RMSE sqrt(9/4) = 1.5
    assert judge.mae(pred, ref) == 1.25
    assert judge.rmse(pred, ref) == 1.5
    # Pearson: pred mean 6.75, ref mean 6.5; dx = 1.25 -0.75 3.25 -3.75; dy = .5 -.5 1.5 -1.5
    # sum dxdy = .625 + .375 + 4.875 + 5.625 = 11.5; sum dx^2 = 1.5625+.5625+10.5625+14.0625 = 26.75; sum dy^2 = 5
    assert judge.pearson_r(pred, ref) == pytest.approx(11.5 / math.sqrt(26.75 * 5))
    assert math.isnan(judge.pearson_r([5, 5, 5], [1, 2, 3]))


def test_cohen_kappa_hand_computed():
    # 2x2 table: pred/ref agree on 1,1 and 2,2 twice each, disagree once each way (n = 6)
    pred = [1, 1, 2, 2, 1, 2]
    ref = [1, 1, 2, 2, 2, 1]
    # p_obs = 4/6; P(pred=1) = P(ref=1) = 1/2 -> p_chance = 1/2; kappa = (2/3 - 1/2) / (1/2) = 1/3
    assert judge.cohen_kappa(pred, ref) == pytest.approx(1 / 3)
    assert judge.cohen_kappa([3, 4, 5], [3, 4, 5]) == 1.0
    assert judge.cohen_kappa([7.4, 7.6], [7, 8]) == 1.0  # rounded first: 7, 8
    # all one label on both sides: total agreement
    assert judge.cohen_kappa([5, 5], [5, 5]) == 1.0
    # pred constant 5, ref 5 and 6: p_obs 1/2, p_chance = 1 * 1/2 -> 0
    assert judge.cohen_kappa([5, 5], [5, 6]) == 0.0


def test_rouge_l_hand_computed():
    # LCS("wrong words gato mesa", "wrong words gato casa") = 3 words; P = R = 3/4 -> F1 3/4
    assert judge.rouge_l_f1("Wrong words: gato, mesa.", "Wrong words: gato, casa.") == pytest.approx(0.75)
    # pred 2 words, ref 4, LCS 2 ("a c"): P 1, R 1/2 -> F1 2/3
    assert judge.rouge_l_f1("a c", "a b c d") == pytest.approx(2 / 3)
    # order matters: "c a" vs "a b c d": LCS 1 -> P 1/2, R 1/4 -> F1 1/3
    assert judge.rouge_l_f1("c a", "a b c d") == pytest.approx(1 / 3)
    assert judge.rouge_l_f1("", "a") == 0.0 and judge.rouge_l_f1("x y", "a b") == 0.0


def test_judge_metrics_counts_unparseable():
    preds = ["Score: 8/10\nFeedback: a b", "no idea", "Score: 4/10\nFeedback: c"]
    refs = ["Score: 7/10\nFeedback: a b", "Score: 5/10\nFeedback: x", "Score: 4/10\nFeedback: d"]
    m = judge.judge_metrics(preds, refs)
    assert m["n"] == 3 and m["n_scored"] == 2 and m["unparseable"] == 1
    assert m["mae"] == 0.5 and m["rmse"] == pytest.approx(math.sqrt(0.5))
    assert m["rouge_l_f1"] == pytest.approx(0.5)  # 1.0 and 0.0
    none = judge.judge_metrics(["?"], ["Score: 1/10"])
    assert none["mae"] is None and none["unparseable"] == 1
    assert judge.constant_predictor_mae(["Score: 2/10", "Score: 4/10", "Score: 9/10"],
                                        ["Score: 4/10", "Score: 8/10"]) == 2.0


def test_constant_guess_is_the_training_median():
    train = ["Score: 2/10", "Score: 4/10", "Score: 9/10", "Score: 7/10"]  # median (4 + 7) / 2 = 5.5
    test = ["Feedback: x\nScore: 4/10", "Score: 8/10", "Score: 5/10"]    # |5.5 - s| = 1.5, 2.5, 0.5 -> 4.5 / 3
    assert judge.constant_guess(train, test) == {"score": 5.5, "mae": 1.5}
    m = judge.judge_metrics(["Score: 4/10", "Score: 8/10", "?"], test)  # MAE 0 on the two that parse
    assert judge.beats_constant(m, {"score": 5.5, "mae": 1.5})
    assert not judge.beats_constant(m, {"score": 5.5, "mae": 0.0})
    # a score in fewer than half the answers is no judge, however small its MAE on those
    assert not judge.beats_constant(judge.judge_metrics(["Score: 4/10", "?", "?"], test), {"score": 5.5, "mae": 1.5})


def test_evaluation_prints_the_constant_guess_and_warns(tmp_path, capsys):
    """Without --baseline_eval the evaluation line still names the constant guess, and a judge no better
    than it (the untrained tiny base grades 7-10 whatever the errors) is told so, in the output and in
    test_predictions.json."""
    out = str(tmp_path / "eval")
    res = judge.main([*QUICK, "--epochs", "0", "--test_samples", "6", "--output_dir", out])
    printed = capsys.readouterr().out
    test_set = judge.embedded_judge_set(0)["test"][:6]
    const = judge.constant_guess([c["messages"][-1]["content"] for c in judge.embedded_judge_set(0)["train"]],
                                 [c["messages"][-1]["content"] for c in test_set])
    assert res["constant_guess"] == const
    line = next(ln for ln in printed.splitlines() if ln.startswith("judge: "))
    assert f"a constant guess (the training median, {const['score']:g}) has MAE {const['mae']:.3f}" in line
    assert res["test"]["mae"] > const["mae"]  # the untrained base: 7-10 for everything
    assert "warning: the judge does no better than always answering" in printed
    saved = json.load(open(os.path.join(out, judge.PREDICTIONS)))
    assert saved["constant_guess"] == const and saved["beats_constant"] is False
    assert saved["metrics"]["mae"] == res["test"]["mae"] and len(saved["predictions"]) == 6
    assert read_metrics(out)[-2]["constant_mae"] == const["mae"]


def test_cpu_warning_names_the_model_size(tmp_path):
    import argparse
    args = argparse.Namespace(model="Qwen/Qwen2-1.5B-Instruct", cache_dir=str(tmp_path))
    assert judge.model_size_text(args) == "a 1.54B model"
    assert judge.model_size_text(argparse.Namespace(model="someone/unknown", cache_dir=str(tmp_path))) == \
        "a model of unknown size"


# --- the embedded set -----------------------------------------------------------------------------
def test_embedded_set_is_deterministic_and_right():
    a, b = judge.embedded_judge_set(0), judge.embedded_judge_set(0)
    assert a == b and {k: len(v) for k, v in a.items()} == judge.SPLIT_SIZES
    for ex in a["test"][:50]:
        user, answer = ex["messages"][0]["content"], ex["messages"][1]["content"]
        lines = dict(line.split(": ", 1) for line in user.split("\n")[1:])
        cand, ref = lines["Translation"].split(), lines["Reference"].split()
        wrong = [c for c, r in zip(cand, ref) if c != r]
        assert judge.parse_score(answer) == 10 - len(wrong)
        # feedback first: every word of the translation in order, the untranslated ones counted
        assert answer.startswith("Feedback: ") and answer.index("Feedback:") < answer.index("Score:")
        walk, count = judge.parse_feedback(answer).rsplit(": ", 1)
        assert count == f"{10 - len(wrong)} of 10 words translated."  # the score, written once more
        n, expected = 0, []
        for c, r in zip(cand, ref):
            n += c == r
            expected.append(f"{c} ({n})" if c == r else f"{c} (English)")
        assert walk.split(", ") == expected
        assert all(w in lines["Source"].split() for w in wrong)
    scores = [judge.parse_score(e["messages"][1]["content"]) for e in a["train"]]
    assert set(scores) == set(range(11))


# --- --data_dir errors ------------------------------------------------------------------------------
def _write(d, split, obj):
    path = os.path.join(d, f"judge_{split}.json")
    with open(path, "w", encoding="utf-8") as f:
        f.write(obj if isinstance(obj, str) else json.dumps(obj))
    return path


GOOD = [{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "Score: 5/10"}], "id": 3}]


@pytest.mark.parametrize("content, needle", [
    ('[{"messages": [', "line 1 column"),
    ({"messages": []}, "top level must be a non-empty list"),
    ([{"msgs": []}], "record 0 has no field 'messages'"),
    ([GOOD[0], {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": 5}]}],
     "record 1: field messages[1].content must be a string"),
    ([{"messages": [{"role": "user", "content": "q"}, {"role": "bot", "content": "a"}]}], "messages[1].role is 'bot'"),
    ([{"messages": [{"role": "assistant", "content": "q"}, {"role": "user", "content": "a"}]}],
     "messages[1].role must be 'assistant'"),
])
def test_data_errors_name_file_record_field(tmp_path, content, needle):
    for split in ("train", "val", "test"):
        _write(tmp_path, split, GOOD)
    path = _write(tmp_path, "val", content)
    with pytest.raises(UserError) as e:
        judge.load_judge_data(str(tmp_path))
    assert needle in str(e.value) and path in str(e.value)


@pytest.mark.parametrize("answer, found", [
    ("Score: 15/10\nFeedback: fine", "found 'Score: 15/10'"),
    ("Score: 42/10", "found 'Score: 42/10'"),
    ("Score: -3/10\nFeedback: bad", "found 'Score: -3/10'"),
    ("Score: 7/100", "found 'Score: 7/100'"),
    ("7 out of 10", "it has no 'Score:'"),
])
def test_reference_scores_must_be_0_to_10(tmp_path, answer, found):
    """A reference is what the judge is graded against: a score outside 0-10 (or none) is the data's
    fault, said with the file, the record and what was found, before any model is built."""
    for split in ("train", "val", "test"):
        _write(tmp_path, split, GOOD)
    bad = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": answer}]}
    path = _write(tmp_path, "test", [GOOD[0], bad])
    with pytest.raises(UserError) as e:
        judge.load_judge_data(str(tmp_path))
    message = str(e.value)
    assert message.startswith(f"{path}: record 1: field messages[1].content: a reference answer must give its "
                              f"score as `Score: X/10` with X from 0 to 10"), message
    assert found in message
    assert judge.parse_score("Score: 10/10") == 10.0 and judge.parse_score("Score: 0/10") == 0.0
    assert judge.parse_score(answer) is None  # nor does a prediction with such a score count as scored


def test_a_byte_order_mark_is_accepted(tmp_path):
    for split in ("train", "val", "test"):
        path = _write(tmp_path, split, GOOD)
        with open(path, "rb") as f:
            body = f.read()
        with open(path, "wb") as f:
            f.write(b"\xef\xbb\xbf" + body)
    assert judge.load_judge_data(str(tmp_path))["val"] == [GOOD[0]["messages"]]


def test_data_dir_reads_and_ignores_extra_keys(tmp_path):
    for split in ("train", "val", "test"):
        _write(tmp_path, split, GOOD)
    data = judge.load_judge_data(str(tmp_path))
    assert data["train"] == [GOOD[0]["messages"]]
    with pytest.raises(UserError, match="judge_test.json does not exist"):
        os.remove(tmp_path / "judge_test.json")
        judge.load_judge_data(str(tmp_path))


# --- prompt masking ---------------------------------------------------------------------------------
class CharTok:
    """A stand-in tokenizer: one id per character, ChatML-like template."""
    pad_token_id = 0

    def encode(self, text):
        return [ord(c) for c in text]

    def apply_chat_template(self, messages, add_generation_prompt=False):
        s = "".join(f"<{m['role']}>{m['content']}|" for m in messages)
        return s + ("<assistant>" if add_generation_prompt else "")


def test_prompt_masking_and_dynamic_padding():
    tok = CharTok()
    convs = [[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}],
             [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "fine!"}]]
    enc = [judge.encode_conversation(tok, c, 100) for c in convs]
    assert enc[0][1] == len("<user>hi|<assistant>")  # the prompt, generation prompt included
    assert "".join(map(chr, enc[0][0][enc[0][1]:])) == "ok|"  # the answer and its end marker carry the loss
    ids, labels = judge.collate(enc, pad_id=0)
    assert ids.shape == (2, len("<user>hello|<assistant>fine!|"))  # as long as the longest, no more
    assert (labels[0] != -100).sum() == 3 and (labels[1] != -100).sum() == 6
    assert torch.all(labels[0, enc[0][1] + 3:] == -100) and torch.all(ids[0, len(enc[0][0]):] == 0)
    # the loss is the answer tokens' cross-entropy only, by hand from the full logits: position t - 1
    # predicts token t, where token t is an answer token
    from lib import llama

    model = llama.build_model(llama.LlamaConfig(vocab_size=130, hidden_size=32, intermediate_size=64,
                                                num_hidden_layers=1, num_attention_heads=2,
                                                num_key_value_heads=1), seed=0)
    logp = torch.log_softmax(model(ids).float(), -1)
    terms = [-logp[b, t - 1, ids[b, t]] for b in range(2) for t in range(1, ids.shape[1]) if labels[b, t] != -100]
    assert len(terms) == 9
    torch.testing.assert_close(judge.answer_loss(model, ids, labels), torch.stack(terms).mean())
    # too long: the prompt is cut from the left, the answer kept
    ids_cut, n_prompt = judge.encode_conversation(tok, convs[1], 10)
    assert len(ids_cut) == 10 and "".join(map(chr, ids_cut[n_prompt:])) == "fine!|"


# --- the estimate ---------------------------------------------------------------------------------
def test_estimate_counts_known_models():
    from lib.llama import KNOWN_CONFIGS, LlamaConfig

    counts = {name: judge.count_params(LlamaConfig(**c)) for name, c in KNOWN_CONFIGS.items()}
    assert counts["Qwen/Qwen2-1.5B-Instruct"] == pytest.approx(1.544e9, rel=1e-3)  # the model card's 1.54B
    assert counts["Qwen/Qwen2.5-3B-Instruct"] == pytest.approx(3.086e9, rel=1e-3)  # 3.09B
    assert counts["meta-llama/Llama-3.2-1B-Instruct"] == pytest.approx(1.236e9, rel=1e-3)  # 1.24B
    assert [judge.lora_rank_for(n)[0] for n in counts.values()] == [16, 8, 16]
    cfg = LlamaConfig(**KNOWN_CONFIGS["Qwen/Qwen2.5-3B-Instruct"])
    fp32 = judge.estimate_memory(cfg, 1, 512, "cuda", "fp32", 4, 8)
    nf4 = judge.estimate_memory(cfg, 1, 512, "cuda", "nf4", 2, 8, "adamw8bit", True)
    assert sum(nf4.values()) < 0.25 * sum(fp32.values())
    n_lora = judge.lora_param_count(cfg, 8)
    assert fp32["AdamW moments (2 x fp32)"] == 8 * n_lora
    # per layer: six 16,384-element matrices in 8 bits (2 bytes each + 8 bytes per 256) and the k/v
    # B matrices [256, 8] = 2,048 elements under 4,096, in fp32 (8 bytes each)
    assert nf4["8-bit AdamW state"] == 36 * (6 * (2 * 16384 + 8 * 64) + 2 * 8 * 2048)


def test_estimate_matches_a_built_model():
    from lib import llama, lora

    cfg = llama.LlamaConfig(model_type="qwen2", vocab_size=300, hidden_size=64, intermediate_size=160,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    model = llama.build_model(cfg, seed=0)
    assert judge.count_params(cfg) == model.num_params()
    lora.apply_lora(model, judge.LORA_TARGETS, 8, 16)
    assert judge.lora_param_count(cfg, 8) == sum(p.numel() for p in model.parameters() if p.requires_grad)


def test_estimate_uses_the_lengths_of_the_data():
    """The step that needs the most memory is a full batch padded to the longest conversation the run
    will see, not --max_seq_length; a batch larger than the data is the data."""
    import argparse

    from lib import llama

    cfg = llama.LlamaConfig(vocab_size=640, **judge.TINY_SHAPE)  # h 64, q 64, k/v 32, MLP 192, 2 layers
    args = argparse.Namespace(batch_size=8, max_seq_length=512, skip_eval=True, baseline_eval=False,
                              test_samples=None, max_new_tokens=48)
    recipe = judge.Recipe(torch.device("cuda"))  # no measured runtime: the arithmetic alone
    train_enc, val_enc = [([0] * n, 1) for n in (10, 37, 20)], [([0] * 30, 1)]
    est = judge.estimate_for(cfg, recipe, args, 8, train_enc, val_enc, [])
    # per layer and token, fp32: 4 x (2h + q + 2kv + o + 4 x 192 + 4h) + 8h = 4 x 1344 + 512 = 5,888 bytes
    assert est["activations"] == 2 * 3 * 37 * 5888  # 2 layers, 3 rows (all the data), 37 tokens
    # the loss: one chunk (all 111 rows) of fp32 logits, and the hidden states' gradient [111, 64] in fp32
    assert est[judge.LOSS_LABEL] == 111 * 640 * 4 + 111 * 64 * 4
    # the test evaluation: 16 prompts of at most 20 tokens + 48 new ones; its KV cache (3 layers' keys
    # and values of 32, one layer's repeated to 64, 4 bytes) is below a training step: not counted
    args.skip_eval, args.test_samples = False, 16
    assert judge.estimate_for(cfg, recipe, args, 8, train_enc, val_enc, [[0] * 20] * 16) == est
    big = judge.estimate_for(cfg, recipe, args, 8, train_enc, val_enc, [[0] * 400] * 16)
    beyond = 16 * 448 * 4 * (2 * 32 * 3 + 2 * 64) - est["activations"] - est[judge.LOSS_LABEL]
    assert big["test generation (KV cache, 16 x 448) beyond a step"] == beyond > 0


# --- both scripts end to end on --model tiny (CPU) -------------------------------------------------
from conftest import read_metrics  # noqa: E402

QUICK = ["--model", "tiny", "--device", "cpu", "--log_interval", "5"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """One short fine-tuning run of the MPS script on the tiny demo (the base is built once per session,
    in the session's cache: tests/conftest.py points BYHAND_CACHE there before any module is imported)."""
    out = str(tmp_path_factory.mktemp("judge_mps"))
    res = judge.main([*QUICK, "--output_dir", out, "--max_samples", "800", "--eval_steps", "50",
                                "--test_samples", "24", "--log_interval", "50"])
    return out, res


def test_fine_tuned_judge_beats_untrained(trained):
    out, res = trained
    base, after = res["baseline"], res["test"]
    assert base["n"] == after["n"] == 24
    assert after["unparseable"] <= 1
    # measured: 5.9 untrained (it grades 7-10 whatever the errors) -> 1.04 after 200 steps (r 0.95); always
    # answering the training median, 5, has MAE 2.7
    assert after["mae"] < base["mae"] - 1.0, (base["mae"], after["mae"])
    assert after["mae"] < res["constant_guess"]["mae"] - 1.0, (after["mae"], res["constant_guess"])
    assert after["pearson_r"] > 0.5
    # the PEFT adapter, the tokenizer, the predictions and the metrics are all in --output_dir
    cfg = json.load(open(os.path.join(out, "adapter_config.json")))
    assert cfg["r"] == 8 and cfg["lora_alpha"] == 16 and sorted(cfg["target_modules"]) == sorted(judge.LORA_TARGETS)
    assert cfg["base_model_name_or_path"].endswith(judge.TINY_VERSION)
    preds = json.load(open(os.path.join(out, "test_predictions.json")))["predictions"]
    assert len(preds) == 24 and {"prediction", "reference", "predicted_score"} <= set(preds[0])
    records = read_metrics(out)
    assert records[0]["event"] == "start" and records[0]["seed"] == 0
    test_rec = [r for r in records if r.get("event") == "test"][0]
    assert test_rec["mae"] == after["mae"]
    assert any(r.get("best") for r in records if "val_loss" in r)


def test_adapter_evaluates_in_the_other_script(trained, tmp_path):
    out, res = trained
    # the MPS script's adapter on the CUDA script's NF4 base (CPU fallback), no training
    ev = judge_train_cuda.main([*QUICK, "--adapter", out, "--epochs", "0", "--output_dir", str(tmp_path / "cuda_eval"),
                                "--test_samples", "24"])
    assert ev["test"]["mae"] < res["baseline"]["mae"] - 1.0  # the same judge on an NF4-rounded base
    # and the CUDA script's adapter (NF4, 8-bit AdamW, checkpointing) read back by the MPS script
    cuda_out = str(tmp_path / "cuda_train")
    trained_cuda = judge_train_cuda.main([*QUICK, "--output_dir", cuda_out, "--max_samples", "32", "--epochs", "1",
                                          "--skip_eval"])
    assert trained_cuda["best_step"] is not None
    back = judge.main([*QUICK, "--adapter", cuda_out, "--epochs", "0", "--output_dir",
                                 str(tmp_path / "mps_eval"), "--test_samples", "8", "--max_new_tokens", "12"])
    assert back["test"]["n"] == 8


def test_learning_curve_reads_a_run_and_renders(trained, tmp_path):
    """bench/judge_curve.py reads a point back from a run's own files and renders the docs' table."""
    from bench import judge_curve
    out, res = trained
    point = judge_curve.read_point(out)
    assert point["n_train"] == 800 and point["optimizer_steps"] == 200 and point["n_test"] == 24
    assert point["mae"] == res["test"]["mae"] and point["pearson_r"] == res["test"]["pearson_r"]
    assert point["constant_mae"] == res["constant_guess"]["mae"] and point["val_loss_best"] == res["best_val"]
    path = str(tmp_path / "curve.json")
    machine = {"cpu": "a CPU", "cores": 2, "gpu": None, "torch": "2.x", "date": "2026-01-01", "quiet": False}
    judge_curve.merge(path, [{**point, "wall_s": 119.5, "cpu_s": 59.4}], machine, "tiny")
    judge_curve.merge(path, [{**point, "n_train": 100, "wall_s": None, "cpu_s": None}], machine, "tiny")
    table = judge_curve.render(path)
    rows = [line for line in table.splitlines() if line.startswith("| 1") or line.startswith("| 8")]
    assert rows[0].startswith("| 100 | 200 |") and "| - (-) | shared (time rough)" in rows[0]  # sorted by size
    assert rows[1] == (f"| 800 | 200 | {point['mae']:.2f} | {point['constant_mae']:.2f} | {point['pearson_r']:.2f} | "
                       f"{point['cohen_kappa']:.2f} | {point['unparseable']}/24 | 2 min 00 s (0 min 59 s) | "
                       f"shared (time rough), torch's default threads |")
    assert "Not measured yet: 300, 600, 1,200 conversations" in table
    assert table.endswith("Measured on a CPU, 2 cores, torch 2.x, 2026-01-01.")


def write_judge_dir(directory, seed=0, sizes=None):
    os.makedirs(directory, exist_ok=True)
    for split, records in judge.embedded_judge_set(seed, sizes or {"train": 48, "val": 8, "test": 16}).items():
        with open(judge.split_path(str(directory), split), "w", encoding="utf-8") as f:
            json.dump(records, f)


def test_resume_keeps_the_saved_flags_and_finds_moved_data(tmp_path, capsys):
    """A resumed run that must keep its flags: after a run with --data_dir D --max_samples 40 --lr 0.01 --eval_steps 2
    --test_samples 16, `--resume --epochs 2` keeps every one of them; the LoRA rank the run used is
    recorded (a resume naming it is not a contradiction); a moved --data_dir with the same contents
    resumes, one with other contents is refused."""
    data, out = tmp_path / "data", str(tmp_path / "run")
    write_judge_dir(data)
    judge.main([*QUICK, "--output_dir", out, "--data_dir", str(data), "--max_samples", "40", "--lr", "0.01",
                "--eval_steps", "2", "--test_samples", "16", "--epochs", "1", "--max_new_tokens", "12"])
    capsys.readouterr()
    res = judge.main(["--model", "tiny", "--device", "cpu", "--output_dir", out, "--resume", "--epochs", "2"])
    log = capsys.readouterr().out
    assert "--resume: --epochs changed from 1 to 2" in log and "changed from 0.01" not in log
    assert f"data: 40 train / 8 val / 16 test conversations ({data})" in log
    saved = [r for r in read_metrics(out) if r.get("event") == "start"][-1]
    assert {k: saved["args"][k] for k in ("data_dir", "max_samples", "lr", "eval_steps", "test_samples",
                                           "max_new_tokens", "lora_r", "epochs")} == {
        "data_dir": str(data), "max_samples": 40, "lr": 0.01, "eval_steps": 2, "test_samples": 16,
        "max_new_tokens": 12, "lora_r": 8, "epochs": 2}
    assert saved["step"] == 5 and saved["total_steps"] == 10 and res["test"]["n"] == 16
    with pytest.raises(SystemExit) as e:  # a fixed flag given with another value
        judge.main([*QUICK, "--output_dir", out, "--resume", "--batch_size", "4"])
    assert e.value.code == 2 and "--batch-size 4 contradicts the saved run" in capsys.readouterr().err
    # the data moved: the same contents under another name continue the run
    moved = tmp_path / "moved"
    os.rename(data, moved)
    judge.main([*QUICK, "--output_dir", out, "--resume", "--epochs", "3", "--data_dir", str(moved), "--lora_r", "8",
                "--skip_eval"])
    assert f"--data-dir moved from {data} to {moved} (same contents)" in capsys.readouterr().out
    other = tmp_path / "other"
    write_judge_dir(other, seed=1)
    before = open(os.path.join(out, "training_state.pt"), "rb").read()
    with pytest.raises(SystemExit) as e:
        judge.main([*QUICK, "--output_dir", out, "--resume", "--epochs", "4", "--data_dir", str(other)])
    assert e.value.code == 2 and "(the contents differ)" in capsys.readouterr().err
    assert open(os.path.join(out, "training_state.pt"), "rb").read() == before


def test_a_max_seq_length_that_leaves_no_answer_token_is_refused(tmp_path, capsys):
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as e:
        judge.main([*QUICK, "--output_dir", str(out), "--max_samples", "16", "--max_seq_length", "1"])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1, err
    assert err.startswith("error: --max_seq_length 1 leaves no answer token") and "--max_seq_length 1" in err
    assert not out.exists() or os.listdir(out) == []  # nothing written, not even metrics.jsonl


def test_nonfinite_gradient_skips_the_update(tmp_path, monkeypatch):
    real = torch.nn.utils.clip_grad_norm_
    calls = {"n": 0}

    def first_is_nan(params, max_norm):
        calls["n"] += 1
        real(params, max_norm)
        return torch.tensor(float("nan")) if calls["n"] == 1 else real(params, max_norm)

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", first_is_nan)
    out = str(tmp_path / "nan")
    res = judge.main([*QUICK, "--output_dir", out, "--max_samples", "16", "--epochs", "1", "--skip_eval"])
    steps = [r for r in read_metrics(out) if "loss" in r]
    assert [r.get("skipped", False) for r in steps] == [True, False]
    assert res["best_step"] is not None
