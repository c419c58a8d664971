"""Our drafter served by llama.cpp's llama-server (the build of `make llamacpp-env`, SmolLM2-135M-Instruct verifier):
run by `make test-llamacpp`.

* export-gguf converts a freshly trained checkpoint and its verifier with llama.cpp's own converter, and the
  GGUF carries our config (block size, target layers, anchor sampling, the confidence head, d2t);
* at T = 0 llama.cpp and the in-process evaluator generate the same tokens from the same prompt ids, and their
  acceptance agrees over the steps both draft as a whole block;
* evaluate-llamacpp writes the same results file as the other backends, its streamed steps checked against the
  server's /metrics, with the verifier alone on the same binary as the baseline;
* the confidence threshold cuts blocks; a server without a drafter, or an unreadable GGUF, is reported.
"""

import json

import pytest
from conftest import ROOT

from trainer.config import RunConfig
from trainer.errors import DSparkError
from trainer.evaluation.results import read_results
from trainer.run import train

pytestmark = pytest.mark.llamacpp
DEMO = str(ROOT / "configs" / "smollm2-135m.yaml")
PROMPTS = {"question": ["What is the capital of France?", "Name three primary colors."],
           "writing": ["Write one sentence about the sea.", "Describe a cat in five words."],
           "math_reasoning": ["What is 12 times 7? Explain briefly."]}
NEW_TOKENS = 40


@pytest.fixture(scope="module")
def drafter(tmp_path_factory):
    """The demo drafter after a short training, confidence calibrated: a checkpoint exactly as training writes it."""
    out = tmp_path_factory.mktemp("drafter")
    train(RunConfig.load(DEMO, ["--max_steps", "12", "--validation_ratio", "0.1", "--max_samples", "80",
                                "--save_steps", "12", "--eval_steps", "12", "--output_dir", str(out)]))
    return out


@pytest.fixture(scope="module")
def gguf(drafter, tmp_path_factory):
    from trainer.export.gguf import export_gguf

    out = tmp_path_factory.mktemp("gguf")
    written = export_gguf(str(drafter), str(out), outtypes=("f32", "f16"))
    return out, written


@pytest.fixture(scope="module")
def prompt_ids(smollm2_tokenizer):
    from trainer.evaluation.prompts import chat_prompt_ids

    return {k: [chat_prompt_ids(smollm2_tokenizer, p) for p in v] for k, v in PROMPTS.items()}


def test_export_writes_servable_ggufs_with_our_config(drafter, gguf):
    from trainer.serving.llamacpp import gguf_metadata, locate

    out, written = gguf
    config = json.loads((drafter / "config.json").read_text())
    for outtype in ("f32", "f16"):
        entry = written["files"][outtype]
        assert entry["load_check"]["drafts"] > 0 and entry["load_check"]["tokens"] > 0  # it served and drafted
    meta = gguf_metadata(out / "drafter-f32.gguf", locate())
    assert meta["general.architecture"] == "dflash"
    assert meta["dflash.block_size"] == config["block_size"]
    assert meta["dflash.sample_from_anchor"] is True and meta["dflash.has_confidence_head"] is True
    # f16 halves the drafter's weights
    assert written["files"]["f16"]["drafter_bytes"] < 0.6 * written["files"]["f32"]["drafter_bytes"]
    assert "--spec-type draft-dspark" in written["serve"] and "drafter-f32.gguf" in written["serve"]


def test_t0_generations_and_acceptance_agree_with_the_in_process_evaluator(drafter, gguf, prompt_ids):
    """Both engines are lossless at T = 0, so both give the verifier's greedy tokens: identical generations, or
    generations that part where the verifier's float64 logits of the two tokens are tied to float32 rounding
    (1e-2 here; two implementations' float32 arithmetic breaks such ties differently). On the identical ones the
    steps before the last that draft a whole block on both engines (`left > B`) are the same steps and must accept
    alike (stated tolerance: 0.1 tokens per step, for the drafter's own argmax ties)."""
    from benchmarks.llamacpp import agreement, in_process, totals
    from trainer.evaluation.llamacpp import serve_and_evaluate
    from trainer.verifier.small_models import resolve_model

    out, _ = gguf
    results, served, generations = serve_and_evaluate(str(out), "f32", prompt_ids, kv_type="f32",
                                                      with_baseline=False, sampling={"temperature": 0.0},
                                                      max_new_tokens=NEW_TOKENS, progress=False)
    verifier = resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct")
    ours = in_process(drafter, verifier, prompt_ids, NEW_TOKENS, generations)
    table = agreement(ours, generations, NEW_TOKENS, served["block_size"])
    identical = sum(r["identical"] for r in table.values())
    gaps = [g for r in table.values() for g in r["float64_logit_gap_at_difference"]]
    assert identical >= 3 and all(g is not None and g < 1e-2 for g in gaps), table
    a, b, steps_a, steps_b = totals(table, "whole_block")
    print(f"whole-block acceptance: in process {a:.3f} ({steps_a} steps), llama.cpp {b:.3f} ({steps_b} steps)")
    # a drafter argmax tie shifts the step boundaries after it by a token or two, so the counts may differ slightly
    assert steps_a > 0 and abs(steps_a - steps_b) <= 2 and abs(a - b) <= 0.1
    assert results["last_block"] == "clamped" and results["backend"] == "llama.cpp"


def test_evaluate_llamacpp_writes_the_shared_results_file(drafter, gguf, tmp_path, capsys):
    from trainer.evaluation.llamacpp import main

    out, _ = gguf
    prompts = tmp_path / "prompts"
    prompts.mkdir()
    for subset, items in PROMPTS.items():
        (prompts / f"{subset}.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in items))
    path = tmp_path / "eval.json"
    main(["--gguf", str(out), "--outtype", "f16", "--verifier", "HuggingFaceTB/SmolLM2-135M-Instruct", "--drafter",
          str(drafter), "--prompts", str(prompts), "--max-new-tokens", "24", "--out", str(path)])
    data = json.loads(path.read_text())
    config = json.loads((drafter / "config.json").read_text())
    parsed = read_results(path, config["block_size"])
    assert data["backend"] == "llama.cpp" and data["llamacpp"]["outtype"] == "f16"
    assert data["drafter_weights_sha256"]  # provenance from the checkpoint the GGUF came from
    for subset in parsed.subsets:
        assert 1.0 <= subset.acceptance_length <= config["block_size"] + 1
        assert subset.steps > 0 and subset.baseline_tokens_per_s > 0 and subset.speedup > 0
    assert "Weighted mean acceptance length" in capsys.readouterr().out
    # the model card says where and how it was measured
    from trainer.export.card_sections import _heading, _results_section

    section = _results_section(parsed, config["block_size"])
    assert "llama.cpp server (CPU)" in _heading(parsed)
    assert "cut to the tokens left, as llama.cpp drafts them" in section


def test_the_confidence_threshold_cuts_blocks(gguf, prompt_ids):
    from trainer.evaluation.llamacpp import serve_and_evaluate

    out, _ = gguf
    runs = {}
    for p_min in (0.0, 0.99):
        _, served, generations = serve_and_evaluate(str(out), "f32", prompt_ids, p_min=p_min, kv_type="f32",
                                                    with_baseline=False, sampling={"temperature": 0.0},
                                                    max_new_tokens=NEW_TOKENS, progress=False)
        runs[p_min] = [d for gens in generations.values() for g in gens for d, _ in g.steps]
    assert max(runs[0.0]) == served["block_size"]
    # a young drafter is rarely 99% sure: blocks are cut (often to nothing), so far fewer tokens are drafted
    assert sum(runs[0.99]) < 0.5 * sum(runs[0.0])


def test_a_server_without_a_drafter_is_reported(gguf, prompt_ids):
    from trainer.evaluation.llamacpp import evaluate_llamacpp
    from trainer.serving.llamacpp import LlamaServer, locate

    out, _ = gguf
    with LlamaServer(locate(), out / "verifier-f32.gguf", ctx_size=512, log_path=out / "alone.log") as server:
        with pytest.raises(DSparkError, match=r"counted no drafts during subset question"):
            evaluate_llamacpp(server.url, {"question": prompt_ids["question"]}, sampling={"temperature": 0.0},
                              max_new_tokens=8, progress=False)


def test_an_unreadable_gguf_is_reported_with_its_log(tmp_path):
    from trainer.serving.llamacpp import LlamaCppError, LlamaServer, locate

    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 64)
    with pytest.raises(LlamaCppError, match=r"llama-server exited with status \d+ before it was ready .*its log is"):
        LlamaServer(locate(), bad, ctx_size=256, log_path=tmp_path / "server.log", ready_timeout=120).start()
