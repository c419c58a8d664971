"""The llama.cpp rules that need no llama.cpp build: how its last blocks count (against a brute-force simulation of
both engines), which drafters it can serve, where its build is looked for, and the server's command line."""

import json
import random
from pathlib import Path

import pytest

from benchmarks.llamacpp import whole_block_committed
from trainer.errors import UsageError
from trainer.evaluation.results import clamp_last_block
from trainer.export.gguf import export_gguf, llamacpp_problems
from trainer.serving.llamacpp import DIR_VARIABLE, LlamaCpp, LlamaServer, locate, sampling_body


def simulate(run_length, max_new_tokens: int, block: int, clamped: bool) -> list[int]:
    """One generation, step by step, on an engine that drafts a whole block (vLLM, in process) or cuts it to the
    tokens left (llama.cpp: `min(B, left - 1)` drafts, none with one token left). `run_length(g)` is how many drafts
    the verifier accepts at position g when the draft is long enough."""
    committed, generated = [], 1  # the prefill's token
    while generated < max_new_tokens:
        left = max_new_tokens - generated
        drafts = min(block, left - 1) if clamped else block
        if drafts <= 0:
            generated += 1  # a plain decode: no verification step
            continue
        accepted = min(run_length(generated), drafts)
        committed.append(accepted + 1)
        generated += accepted + 1
    return committed


@pytest.mark.parametrize("seed", range(40))
def test_clamp_last_block_counts_what_the_clamped_engine_counts(seed):
    rng = random.Random(seed)
    block, max_new_tokens = rng.randint(1, 8), rng.randint(2, 60)
    lengths = [rng.randint(0, block) for _ in range(max_new_tokens + block + 2)]
    full = simulate(lambda g: lengths[g], max_new_tokens, block, clamped=False)
    clamped = simulate(lambda g: lengths[g], max_new_tokens, block, clamped=True)
    assert clamp_last_block(full, max_new_tokens) == clamped
    # and the whole-block steps are where both engines drafted B tokens: the same steps, the same counts
    whole = whole_block_committed(full, max_new_tokens, block)
    assert whole == full[:len(whole)]
    assert all(c == k for c, k in zip(whole, clamped))


def test_clamp_last_block_examples():
    assert clamp_last_block([5, 5, 5], 12) == [5, 5]  # 1 + 5 + 5 = 11: one token left, no draft, a plain decode
    assert clamp_last_block([5, 5, 5], 13) == [5, 5, 2]  # two left: one draft, at most 2 committed
    assert clamp_last_block([2, 3], 2) == []  # one token left after the prefill: nothing is drafted
    assert clamp_last_block([], 10) == []


def drafter_config(**changes) -> dict:
    config = {"architectures": ["DSparkDraftModel"], "vocab_size": 1000, "draft_vocab_size": 100,
              "markov_head_type": "vanilla", "block_size": 4,
              "transformer_layer_config": {"model_type": "qwen3", "vocab_size": 1000}}
    config.update(changes)
    return config


def test_a_servable_drafter_has_no_problems():
    assert llamacpp_problems(drafter_config(), {"d2t", "t2d", "lm_head.weight"}, 1000) == []
    assert llamacpp_problems(drafter_config(draft_vocab_size=1000), set(), 1000) == []  # full vocabulary: no d2t


@pytest.mark.parametrize("changes, names, verifier_vocab, expected", [
    ({"transformer_layer_config": {"model_type": "llama"}}, {"d2t"}, 1000, "Qwen3 backbone only"),
    ({"markov_head_type": "gated"}, {"d2t"}, 1000, "vanilla head only"),
    ({}, {"t2d"}, 1000, "no d2t mapping"),
    ({"draft_vocab_size": 2000}, {"d2t"}, 1000, "larger than the verifier vocabulary"),
    ({}, {"d2t"}, 32000, "the verifier has 32000"),
    ({"architectures": ["Eagle3Speculator"]}, {"d2t"}, 1000, "not a DSpark drafter"),
])
def test_what_llamacpp_cannot_serve_is_named(changes, names, verifier_vocab, expected):
    problems = llamacpp_problems(drafter_config(**changes), names, verifier_vocab)
    assert len(problems) == 1 and expected in problems[0], problems


def test_export_refuses_before_converting_anything(tmp_path, chat_verifier_dir):
    """The refusal comes from the files alone: no llama.cpp build is needed to be told why."""
    drafter = tmp_path / "drafter"
    drafter.mkdir()
    (drafter / "config.json").write_text(json.dumps(drafter_config(markov_head_type="gated", vocab_size=None,
                                                                   draft_vocab_size=None)))
    with pytest.raises(UsageError, match=r"llama.cpp cannot serve the drafter .*Markov head is 'gated'"):
        export_gguf(str(drafter), str(tmp_path / "gguf"), verifier=chat_verifier_dir, check=False)
    assert not (tmp_path / "gguf").exists()


def test_a_missing_build_names_the_make_target(tmp_path, monkeypatch):
    monkeypatch.setenv(DIR_VARIABLE, str(tmp_path))
    with pytest.raises(UsageError, match=r"llama.cpp is not built at .*run `make llamacpp-env`"):
        locate()


def test_the_server_command(tmp_path):
    build = LlamaCpp(Path("/opt/llama"))
    server = LlamaServer(build, tmp_path / "v.gguf", tmp_path / "d.gguf", block_size=4, p_min=0.5, kv_type="f32",
                         port=8123)
    argv = server.argv()
    assert argv[0] == "/opt/llama/build/bin/llama-server"
    pairs = {argv[i]: argv[i + 1] for i in range(1, len(argv) - 1) if argv[i].startswith("-")}
    assert pairs["-md"].endswith("d.gguf") and pairs["--spec-type"] == "draft-dspark"
    assert pairs["--spec-draft-n-max"] == "4" and pairs["--spec-draft-p-min"] == "0.5"
    assert pairs["--host"] == "127.0.0.1" and pairs["--port"] == "8123" and pairs["-np"] == "1"
    assert pairs["-ctk"] == pairs["-ctv"] == pairs["-ctkd"] == pairs["-ctvd"] == "f32"
    assert "--metrics" in argv
    alone = LlamaServer(build, tmp_path / "v.gguf", port=8124).argv()
    assert "-md" not in alone and "--spec-type" not in alone and "-ctk" not in alone


def test_sampling_sets_every_llamacpp_filter():
    """llama.cpp's own defaults (top-k 40, top-p 0.95, min-p 0.05) would change the verifier's distribution."""
    assert sampling_body({"temperature": 0.0}) | {} == {
        "temperature": 0.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "typical_p": 1.0, "repeat_penalty": 1.0,
        "presence_penalty": 0.0, "frequency_penalty": 0.0}
    body = sampling_body({"temperature": 0.7, "top_k": 20, "top_p": 0.8})
    assert (body["temperature"], body["top_k"], body["top_p"], body["min_p"]) == (0.7, 20, 0.8, 0.0)


def test_the_documented_server_command_is_the_one_export_gguf_prints(monkeypatch):
    """docs/serving-llamacpp.md shows the command export-gguf prints for the demo's pair, run from the checkout."""
    import re
    import shlex

    from trainer import REPO_ROOT
    from trainer.export.gguf import serve_command

    monkeypatch.chdir(REPO_ROOT)
    text = (REPO_ROOT / "docs" / "serving-llamacpp.md").read_text()
    block = re.search(r"```bash\n(\.llamacpp/build/bin/llama-server .*?)\n```", text, re.S).group(1)
    shown = shlex.split(block.replace("\\\n", " "))
    printed = shlex.split(serve_command(LlamaCpp(REPO_ROOT / ".llamacpp"), Path("out/demo/gguf/verifier-f32.gguf"),
                                        Path("out/demo/gguf/drafter-f32.gguf"), 4))
    assert shown == printed


@pytest.mark.parametrize("argv, expected", [
    ([], r"pass either --gguf .* or --server"),
    (["--gguf", "g", "--server", "http://127.0.0.1:1"], r"pass either --gguf .* or --server"),
    (["--server", "http://127.0.0.1:1", "--max-new-tokens", "1"], r"--max-new-tokens must be at least 2"),
    (["--server", "http://127.0.0.1:1", "--p-min", "1.5"], r"--p-min 1.5 is out of range"),
])
def test_evaluate_llamacpp_refuses_bad_flags_before_any_work(argv, expected, tmp_path):
    from trainer.evaluation.llamacpp import main

    with pytest.raises(UsageError, match=expected):
        main([*argv, "--verifier", "v", "--out", str(tmp_path / "r.json")])


def test_a_missing_gguf_pair_names_the_export_command(tmp_path):
    from trainer.evaluation.llamacpp import gguf_pair

    (tmp_path / "verifier-f16.gguf").write_bytes(b"")
    with pytest.raises(UsageError, match=r"drafter-f16.gguf does not exist; write the f16 pair with `python -m trainer "
                                         r"export-gguf --outtypes f16"):
        gguf_pair(str(tmp_path), "f16")
