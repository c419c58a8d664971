"""Confidence calibration (trainer/train/calibration.py): the fit against known logistic parameters, ECE, reliability
and cumulative-product bias against brute-force formulas, the fold in memory and on disk, and a tiny real run."""

import json
import math
import os
import re

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from modeling_dspark import positions_from_document_ids
from tiny import VOCAB, tiny_drafter
from trainer.config import RunConfig
from trainer.errors import UsageError
from trainer.run import train
from trainer.states.in_process import verifier_hidden_states
from trainer.train.calibration import (
    FOLD_METADATA_KEY,
    HEAD_BIAS,
    HEAD_WEIGHT,
    applied_fold,
    calibration_record,
    cumprod_bias,
    expected_calibration_error,
    fit_logistic,
    fold,
    fold_head,
    reliability,
    unfold_head,
    write_folded_head,
    write_record,
)
from trainer.train.checkpoints import CALIBRATION_FILE, SUMMARY_FILE

TINY = ["--num_hidden_layers", "1", "--num_attention_heads", "4", "--num_key_value_heads", "2", "--head_dim", "16",
        "--intermediate_size", "128", "--block_size", "4", "--draft_vocab_size", "500", "--markov_rank", "16",
        "--max_seq_length", "128", "--total_seq_length", "256", "--validation_ratio", "0.1", "--logging_steps", "5",
        "--learning_rate", "3e-3", "--max_anchors", "16", "--save_total_limit", "5"]


def confidence(drafter, verifier, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (1, 24), generator=g)
    docs = torch.zeros_like(ids)
    aux, _ = verifier_hidden_states(verifier, drafter.config.aux_hidden_state_layer_ids, ids)
    anchors = torch.tensor([[0, 5, 9, 14]])
    out = drafter(ids, aux.double(), anchors, document_ids=docs, position_ids=positions_from_document_ids(docs),
                  return_logits=False)
    return out.confidence_logits


def test_the_fold_changes_the_heads_outputs_exactly_as_the_logistic_map(gemma4_verifier, tmp_path):
    drafter = tiny_drafter(gemma4_verifier).double()
    a, c = 1.7, -0.45
    with torch.no_grad():
        z = confidence(drafter, gemma4_verifier)
        fold_head(drafter.confidence_head.proj, a, c)
        folded = confidence(drafter, gemma4_verifier)
    assert torch.allclose(folded, a * z + c, rtol=1e-12, atol=1e-12)
    assert torch.allclose(torch.sigmoid(folded), torch.sigmoid(a * z + c), rtol=1e-12, atol=1e-14)
    write_record(tmp_path, {"a": a, "c": c})
    with torch.no_grad():
        unfold_head(drafter.confidence_head.proj, tmp_path)  # what a resumed run does with a calibrated checkpoint
        assert torch.allclose(confidence(drafter, gemma4_verifier), z, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("a, c", [(1.0, 0.0), (2.5, -1.2), (0.4, 0.9), (-0.8, 0.3)])
def test_the_fit_recovers_known_logistic_parameters(a, c):
    g = torch.Generator().manual_seed(0)
    z = torch.randn(200_000, generator=g, dtype=torch.float64) * 2.0 + 0.5
    soft = torch.sigmoid(a * z + c)
    fa, fc = fit_logistic(z, soft)  # soft targets from the model itself: the optimum is exactly (a, c)
    assert (fa, fc) == pytest.approx((a, c), abs=1e-7)
    hard = torch.bernoulli(soft, generator=g)  # 0/1 outcomes drawn from it: recovered within sampling error
    fa, fc = fit_logistic(z, hard)
    assert abs(fa - a) < 0.03 and abs(fc - c) < 0.03


def brute_reliability(pred, target, bins=10):
    out = [[] for _ in range(bins)]
    for p, t in zip(pred.tolist(), target.tolist()):
        out[min(int(math.floor(p * bins)), bins - 1)].append((p, t))
    return out


def test_ece_reliability_and_cumprod_bias_equal_brute_force():
    g = torch.Generator().manual_seed(1)
    pred = torch.rand(6, 4, generator=g, dtype=torch.float64)
    pred[0, 0], pred[1, 0] = 1.0, 0.0  # the closed top bin and the bottom edge
    target = torch.rand(6, 4, generator=g, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1], [1, 0, 0, 0]]).bool()
    p, t = pred[mask], target[mask]
    bins = brute_reliability(p, t)
    ece = sum(len(b) / p.numel() * abs(sum(x for x, _ in b) / len(b) - sum(y for _, y in b) / len(b))
              for b in bins if b)
    assert expected_calibration_error(p, t) == pytest.approx(ece, rel=1e-12)
    for got, want in zip(reliability(p, t), bins):
        assert got["count"] == len(want)
        if want:
            assert got["mean_predicted"] == pytest.approx(sum(x for x, _ in want) / len(want), rel=1e-12)
            assert got["mean_observed"] == pytest.approx(sum(y for _, y in want) / len(want), rel=1e-12)
    for k, got in enumerate(cumprod_bias(pred, target, mask)):
        rows = [r for r in range(6) if mask[r, k]]
        want = sum(math.prod(pred[r, : k + 1].tolist()) - math.prod(target[r, : k + 1].tolist()) for r in rows)
        assert got == pytest.approx(want / len(rows), rel=1e-12)
    z = torch.logit(pred)
    record = calibration_record(z, target, mask, 1.3, -0.2)
    assert record["n_slots"] == int(mask.sum()) and record["n_blocks"] == 6
    assert record["ece_after"] == pytest.approx(expected_calibration_error(torch.sigmoid(1.3 * z[mask] - 0.2), t))
    assert len(record["reliability_after"]) == 4 and sum(b["count"] for b in record["reliability_after"][1]) == 4


def test_the_folded_head_is_written_atomically_and_only_to_the_fitted_weights(gemma4_verifier, tmp_path):
    drafter = tiny_drafter(gemma4_verifier)
    drafter.save_pretrained(tmp_path)
    path = tmp_path / "model.safetensors"
    original, reference = load_file(path), drafter.state_dict()
    with safe_open(str(path), framework="pt") as f:
        metadata = f.metadata()
    head = dict(zip((HEAD_WEIGHT, HEAD_BIAS), fold(original[HEAD_WEIGHT], original[HEAD_BIAS], 2.0, 0.5)))
    other = {**reference, "fc.weight": reference["fc.weight"] + 1e-6}  # another model: refused, file untouched
    before = path.read_bytes()
    assert not write_folded_head(tmp_path, head, other, 2.0, 0.5) and path.read_bytes() == before
    assert applied_fold(tmp_path) is None
    assert write_folded_head(tmp_path, head, reference, 2.0, 0.5)
    rewritten = load_file(path)
    assert torch.equal(rewritten[HEAD_WEIGHT], 2.0 * original[HEAD_WEIGHT])
    assert torch.equal(rewritten[HEAD_BIAS], (2.0 * original[HEAD_BIAS].double() + 0.5).float())
    assert all(torch.equal(rewritten[k], v) for k, v in original.items() if k not in head)
    with safe_open(str(path), framework="pt") as f:  # the fold travels with the weights, in one rename
        assert f.metadata() == {**metadata, FOLD_METADATA_KEY: json.dumps({"a": 2.0, "c": 0.5})}
    assert applied_fold(tmp_path) == {"a": 2.0, "c": 0.5}
    assert sorted(os.listdir(tmp_path)) == sorted(p for p in os.listdir(tmp_path) if not p.endswith(".tmp"))


@pytest.fixture(scope="module")
def aligned_verifier_dir(chat_verifier_dir, chat_data_file, tmp_path_factory):
    """The tiny chat verifier with the output rows of every token the chat data never uses set to zero, so its
    predictions, like a real verifier's on its own data, concentrate on the data's tokens: the full-vocabulary
    metrics then have signal (the plain random one puts ~99.9% of its mass outside a 500-token draft vocabulary)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(chat_verifier_dir)
    model = AutoModelForCausalLM.from_pretrained(chat_verifier_dir)
    used = set()
    with open(chat_data_file) as f:
        for line in f:
            used.update(tokenizer.apply_chat_template(json.loads(line)["messages"], tokenize=True,
                                                      return_dict=True)["input_ids"])
    unused = torch.ones(model.lm_head.weight.shape[0], dtype=torch.bool)
    unused[sorted(used)] = False
    with torch.no_grad():
        model.lm_head.weight[unused] = 0.0
    directory = tmp_path_factory.mktemp("aligned-verifier")
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return str(directory)


def run(verifier, data, out, *extra):
    return train(RunConfig.load(None, ["--verifier", verifier, "--train_data", data, "--output_dir", str(out), *TINY,
                                       *extra]))


@pytest.mark.slow
def test_a_tiny_run_calibrates_the_exported_checkpoints(aligned_verifier_dir, chat_data_file, tmp_path, caplog):
    caplog.set_level("INFO", logger="dspark")
    out = tmp_path / "run"
    summary = run(aligned_verifier_dir, chat_data_file, out, "--max_steps", "40", "--eval_steps", "20")
    final = json.loads((out / SUMMARY_FILE).read_text())["final_metrics"]
    assert summary["eval_accept_len"] > summary["initial_eval_accept_len"] + 0.2  # measured 1.24 -> 1.70
    assert final["eval_accept_len"] <= final["eval_restricted_accept_len"]
    assert 0.5 < final["eval_draft_vocab_coverage"] < 1.0
    best = out / "checkpoint-best"
    record = json.loads((best / CALIBRATION_FILE).read_text())
    assert json.loads((out / CALIBRATION_FILE).read_text()) == record  # the final model is the best one
    assert record["ece_after"] <= record["ece_before"] and record["bce_after"] <= record["bce_before"]
    assert record["confidence_target"] == "greedy" and record["n_slots"] == final["eval_supervised_slots"]
    after = [b for bins in record["reliability_after"] for b in bins if b["count"]]
    n = sum(b["count"] for b in after)
    # an intercept fitted by BCE calibrates in the large: mean predicted == mean observed
    assert sum(b["count"] * b["mean_predicted"] for b in after) / n == pytest.approx(
        sum(b["count"] * b["mean_observed"] for b in after) / n, abs=1e-6)
    assert summary["calibration"]["a"] == record["a"] and summary["calibration"]["applied_to"] == [
        str(out), str(os.path.realpath(best))]
    a, b = load_file(best / "model.safetensors"), load_file(out / "model.safetensors")
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    for name in os.listdir(out / "checkpoint-20"):
        assert not name.endswith(".tmp")
    if os.path.realpath(best) != str(out / "checkpoint-20"):
        assert not (out / "checkpoint-20" / CALIBRATION_FILE).exists()  # only the fitted weights are calibrated
    assert "confidence calibration (greedy target) on" in caplog.text and "ECE" in caplog.text


@pytest.mark.slow
def test_other_targets_and_skipped_calibration(aligned_verifier_dir, chat_data_file, tmp_path, caplog):
    caplog.set_level("INFO", logger="dspark")
    summary = run(aligned_verifier_dir, chat_data_file, tmp_path / "full", "--max_steps", "4", "--eval_steps", "4",
                  "--teacher_vocab", "full", "--confidence_target", "greedy_t0", "--eval_at_start", "false")
    record = json.loads((tmp_path / "full" / CALIBRATION_FILE).read_text())
    assert (record["teacher_vocab"], record["confidence_target"]) == ("full", "greedy_t0")
    assert record["ece_after"] <= record["ece_before"] and summary["calibration"]["a"] == record["a"]
    # speculators' confidence target needs no full-vocabulary pass: training skips it, evaluation still reports it
    summary = run(aligned_verifier_dir, chat_data_file, tmp_path / "restricted", "--max_steps", "2", "--eval_steps",
                  "2", "--logging_steps", "1", "--confidence_target", "sampled_restricted", "--full_vocab_metrics",
                  "false", "--eval_at_start", "false")
    assert math.isfinite(summary["eval_accept_len"]) and summary["eval_accept_len"] <= summary.get(
        "eval_restricted_accept_len", math.inf)
    history = json.loads((tmp_path / "restricted" / "checkpoint-2" / "trainer_state.json").read_text())["log_history"]
    train_logs = [h for h in history if "loss" in h and "eval_loss" not in h]
    assert train_logs and all("restricted_accept_len" in h and "accept_len" not in h for h in train_logs)
    summary = run(aligned_verifier_dir, chat_data_file, tmp_path / "nohead", "--max_steps", "2", "--eval_steps", "2",
                  "--enable_confidence_head", "false", "--eval_at_start", "false")
    assert summary["calibration"] is None and not (tmp_path / "nohead" / CALIBRATION_FILE).exists()
    assert "confidence calibration skipped: the drafter has no confidence head" in caplog.text
    summary = run(aligned_verifier_dir, chat_data_file, tmp_path / "noval", "--max_steps", "2", "--eval_steps", "2",
                  "--validation_ratio", "0")
    assert summary["calibration"] is None and not (tmp_path / "noval" / CALIBRATION_FILE).exists()
    assert "confidence calibration skipped: there is no validation split" in caplog.text


def test_bad_teacher_and_target_choices_are_refused_before_anything_is_loaded(tmp_path):
    for flag, value, valid in (("--teacher_vocab", "verifier", "['draft', 'full']"),
                               ("--confidence_target", "tv", "['greedy', 'greedy_t0', 'sampled', 'sampled_restricted']")):
        with pytest.raises(UsageError, match=re.escape(f"train: {flag[2:]} must be one of {valid}")):
            run("no/such-verifier", str(tmp_path / "missing.jsonl"), tmp_path / "out", flag, value)
    assert not (tmp_path / "out").exists()
