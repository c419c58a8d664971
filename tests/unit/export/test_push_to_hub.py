"""`push_to_hub.py` offline: staging from a real tiny trainer run, the serving checks, the model card, and the
upload against an injected fake `HfApi` (nothing here touches the network)."""

import copy
import json
import os
import re
import shutil
import struct
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import huggingface_hub
import pytest
import torch
from huggingface_hub import ModelCard
from huggingface_hub.errors import RepositoryNotFoundError
from safetensors.torch import load_file, save_file

import push_to_hub as ph
from trainer.config import RunConfig
from trainer.contract import check_remote_code_load, check_serving_config, contract_tensors
from trainer.evaluation.results import read_results
from trainer.export import staging
from trainer.export.plots import CALIBRATION_PLOT_FILE, PLOT_FILE
from trainer.export.staging import DELETE_PATTERNS, Staged, folder_files, stage
from trainer.run import train
from trainer.train.checkpoints import CALIBRATION_FILE, COMPLETE_MARKER, resolve_checkpoint

VERIFIER_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
REPO = "me/tiny-dspark"
TOKEN = "hf_FAKEtoken1234567890secret"
TINY = ["--num_hidden_layers", "1", "--num_attention_heads", "4", "--num_key_value_heads", "2", "--head_dim", "16",
        "--intermediate_size", "128", "--block_size", "4", "--draft_vocab_size", "500", "--markov_rank", "16",
        "--max_seq_length", "128", "--total_seq_length", "256", "--validation_ratio", "0.1", "--logging_steps", "5",
        "--learning_rate", "3e-3", "--max_anchors", "16", "--save_total_limit", "5"]
BASE_FILES = {"README.md", "config.json", "configuration_dspark.py", "modeling_dspark.py", "model.safetensors",
              "custom_generate/generate.py"}
PLOTS = {PLOT_FILE, CALIBRATION_PLOT_FILE}  # the run calibrates its best checkpoint, so both plots are staged


# ------------------------------------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def run_dir(chat_verifier_dir, chat_data_file, tmp_path_factory) -> Path:
    """A real 4-step run: checkpoint-2, checkpoint-4, checkpoint-best and the final model in the output_dir."""
    out = tmp_path_factory.mktemp("push") / "run"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a 64-wide model gains nothing from a second thread, and loses 20x on a shared CPU
    try:
        train(RunConfig.load(None, ["--verifier", chat_verifier_dir, "--train_data", chat_data_file, "--output_dir",
                                    str(out), *TINY, "--max_steps", "4", "--eval_steps", "2", "--eval_at_start",
                                    "false", "--verifier_id", VERIFIER_ID]))
    finally:
        torch.set_num_threads(threads)
    return out


def results_json(block_size: int = 4, **overrides) -> dict:
    data = {
        "schema": "dspark-acceptance/1", "backend": "transformers", "drafter": "run", "verifier": VERIFIER_ID,
        "block_size": block_size, "sampling": {"temperature": 1.0, "top_p": 0.95, "top_k": 64}, "max_new_tokens": 64,
        "concurrency": 1,
        "dataset": "RedHatAI/speculator_benchmarks", "date": "2026-11-29", "machine": "test CPU",
        "versions": {"transformers": "5.19.0"},
        "subsets": {  # deliberately out of the canonical order, with one non-standard subset
            "qa": {"acceptance_length": 1.8, "pos": [0.5, 0.2, 0.08, 0.02] + [0.0] * (block_size - 4),
                   "steps": 300, "prompts": 10, "tokens_per_s": 50.0, "baseline_tokens_per_s": 40.0},
            "my_subset": {"acceptance_length": 1.5, "pos": [0.3, 0.1, 0.07, 0.03] + [0.0] * (block_size - 4),
                          "steps": 100, "prompts": 5},
            "math_reasoning": {"acceptance_length": 2.9, "pos": [0.8, 0.6, 0.3, 0.2] + [0.0] * (block_size - 4),
                               "steps": 200, "prompts": 10, "tokens_per_s": 80.0, "baseline_tokens_per_s": 40.0,
                               "speedup": 2.0},
            "writing": {"acceptance_length": None, "pos": [None] * block_size, "steps": 0, "prompts": 2,
                        "generated_tokens": 0},  # what trainer/evaluation/in_process.py writes for a subset without steps
        },
        "weighted_acceptance_length": 2.15, "unweighted_acceptance_length": 2.0667, "total_steps": 600,
        "other_drafters": {"MTP (x/y-assistant)": {"math_reasoning": {"acceptance_length": 2.5, "tokens_per_s": 70.0},
                                                   "qa": {"acceptance_length": 2.0, "tokens_per_s": 55.0}}},
    }
    data.update(overrides)
    return data


@pytest.fixture(scope="module")
def results_files(tmp_path_factory) -> list[Path]:
    """A T=1 file with throughput and another drafter, and a greedy file without them (and without steps)."""
    d = tmp_path_factory.mktemp("results")
    sampled, greedy = d / "t1.json", d / "greedy.json"
    sampled.write_text(json.dumps(results_json()))
    plain = results_json(sampling={"temperature": 0.0}, other_drafters={})
    plain.pop("weighted_acceptance_length"), plain.pop("total_steps")
    for s in plain["subsets"].values():
        s.pop("steps", None), s.pop("tokens_per_s", None), s.pop("baseline_tokens_per_s", None), s.pop("speedup", None)
    greedy.write_text(json.dumps(plain))
    return [sampled, greedy]


@pytest.fixture(scope="module")
def staged(run_dir, results_files, tmp_path_factory) -> Staged:
    """The output_dir staged with both results files, including the fresh-module-cache remote-code load."""
    folder = tmp_path_factory.mktemp("staged") / "repo"
    return stage(resolve_checkpoint(run_dir), folder, repo_id=REPO, eval_results=results_files)


class FakeApi:
    """Records the `HfApi` calls `upload` makes; any other method is an AttributeError."""

    def __init__(self, tmp_path: Path, remote_verifier: str | None = None, fail: Exception | None = None):
        self.calls, self.tmp, self.remote_verifier, self.fail = [], tmp_path, remote_verifier, fail
        self.uploaded: dict[str, bytes] = {}

    def hf_hub_download(self, repo_id, filename, revision=None, repo_type=None):
        self.calls.append(("hf_hub_download", {"repo_id": repo_id, "filename": filename, "revision": revision}))
        if self.remote_verifier is None:
            raise RepositoryNotFoundError("404 Client Error: Repository Not Found", response=mock.Mock(headers={}))
        path = self.tmp / "remote-config.json"
        path.write_text(json.dumps({"speculators_config": {"verifier": {"name_or_path": self.remote_verifier}}}))
        return str(path)

    def create_repo(self, **kwargs):
        self.calls.append(("create_repo", kwargs))

    def create_branch(self, **kwargs):
        self.calls.append(("create_branch", kwargs))

    def upload_folder(self, **kwargs):
        self.calls.append(("upload_folder", kwargs))
        folder = Path(kwargs["folder_path"])
        self.uploaded = {p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*") if p.is_file()}
        if self.fail is not None:
            raise self.fail
        return SimpleNamespace(commit_url=f"https://huggingface.co/{kwargs['repo_id']}/commit/0123abcd", pr_url=None)

    def names(self) -> list[str]:
        return [name for name, _ in self.calls]


class NoNetwork:
    def __getattr__(self, name):
        raise AssertionError(f"--dry-run touched the Hub API ({name})")


@pytest.fixture
def online(monkeypatch):
    """Upload path enabled: offline mode off, a fake token in HF_TOKEN, and the (separately tested) subprocess
    remote-code load replaced by a recorder to keep the suite fast."""
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    loads = []
    monkeypatch.setattr(staging, "check_remote_code_load", lambda folder: loads.append(Path(folder)) or {})
    return loads


def args(run_dir, *extra) -> list[str]:
    return ["--checkpoint", str(run_dir), "--repo-id", REPO, *extra]


# ------------------------------------------------------------------------------------------------ checkpoint selection
def test_checkpoint_resolution(run_dir, tmp_path):
    best = resolve_checkpoint(run_dir)
    assert best.path == (run_dir / "checkpoint-best").resolve() and best.kind == "checkpoint"
    assert resolve_checkpoint(run_dir / "checkpoint-best").path == best.path  # symlink resolved
    latest = resolve_checkpoint(f"{run_dir}:latest")
    assert (latest.path.name, latest.step) == ("checkpoint-4", 4)
    assert resolve_checkpoint(f"{run_dir}:2").path.name == "checkpoint-2"
    final = resolve_checkpoint(f"{run_dir}:final")
    assert (final.kind, final.path, final.step) == ("final", run_dir.resolve(), best.step)
    with pytest.raises(ph.PushError, match=r"run has no checkpoint-7; pick one of the available steps \['2', '4'\]"):
        resolve_checkpoint(f"{run_dir}:7")

    copy_dir = tmp_path / "run"
    shutil.copytree(run_dir, copy_dir, symlinks=True, ignore=shutil.ignore_patterns("optimizer.pt"))
    (copy_dir / "checkpoint-best").unlink()
    assert resolve_checkpoint(copy_dir).kind == "final"  # no best: the run's own final model
    (copy_dir / "config.json").unlink()
    assert resolve_checkpoint(copy_dir).path.name == "checkpoint-4"  # no final model: the latest complete one
    (copy_dir / "checkpoint-4" / COMPLETE_MARKER).unlink()
    assert resolve_checkpoint(copy_dir).path.name == "checkpoint-2"
    with pytest.raises(ph.PushError, match=r"checkpoint-4 is an incomplete checkpoint \(no dspark_checkpoint.json"):
        resolve_checkpoint(copy_dir / "checkpoint-4")
    with pytest.raises(ph.PushError, match="does not exist; pass a checkpoint-N directory or a training output_dir"):
        resolve_checkpoint(tmp_path / "nowhere")
    other = tmp_path / "llama"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ph.PushError, match=r"is not a DSpark drafter .*; pass a checkpoint written by trainer/run.py"):
        resolve_checkpoint(other)


# ------------------------------------------------------------------------------------------------ staging
def test_staged_folder_is_exactly_the_contract(staged, run_dir):
    folder = staged.folder
    assert folder_files(folder) == BASE_FILES | PLOTS
    assert staged.checkpoint.path == (run_dir / "checkpoint-best").resolve()
    config = json.loads((folder / "config.json").read_text())
    assert config["dtype"] == "bfloat16" and "model_type" not in config
    assert config["speculators_config"]["verifier"]["name_or_path"] == VERIFIER_ID
    assert config["verifier_local_path"] is None
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == config["block_size"] == 4
    weights = load_file(folder / "model.safetensors")
    source = load_file(staged.checkpoint.path / "model.safetensors")
    assert set(weights) == set(source) == set(contract_tensors(config))
    assert not any(k.startswith(("verifier", "embed")) for k in weights)
    for name, tensor in weights.items():
        expected = {"d2t": torch.int64, "t2d": torch.bool}.get(name, torch.bfloat16)
        assert tensor.dtype == expected, name
        reference = source[name].to(torch.bfloat16) if source[name].is_floating_point() else source[name]
        assert torch.equal(tensor, reference), name


def test_staged_folder_loads_via_remote_code_in_a_fresh_module_cache(staged, tmp_path):
    report = staged.remote_report
    assert report["module"].startswith("transformers_modules.") and report["class"] == "DSparkDraftModel"
    assert report["modules_cache"] != os.environ["HF_MODULES_CACHE"]  # not the suite's (already populated) cache
    assert report["compared"] == len(load_file(staged.folder / "model.safetensors")) and not report["mismatched"]
    broken = tmp_path / "broken"
    shutil.copytree(staged.folder, broken)
    (broken / "modeling_dspark.py").unlink()
    with pytest.raises(ph.PushError, match=r"does not load with AutoModel.from_pretrained\(\.\.\., "
                                           r"trust_remote_code=True\) in a fresh module cache"):
        check_remote_code_load(broken)


_DECODE = r"""
import json, sys
for name in ("configuration_dspark", "modeling_dspark", "generation_dspark", "trainer", "tiny"):
    sys.modules[name] = None  # the package, should it be installed: only the staged folder's code may run
import torch
from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer

folder, verifier_dir, prompts = sys.argv[1], sys.argv[2], sys.argv[3:]
verifier = AutoModelForCausalLM.from_pretrained(verifier_dir, dtype=torch.float32).eval()
tokenizer = AutoTokenizer.from_pretrained(verifier_dir)
drafter = AutoModel.from_pretrained(folder, trust_remote_code=True)
block, real_draft = drafter.config.block_size, drafter.draft


def oracle(reference):
    # drafts from the known greedy continuation, one slot corrupted per step in turn, so steps accept 0..B drafts
    steps = []

    def draft(aux, bonus, cache=None, **kw):
        proposal = real_draft(aux, bonus, cache=cache, **kw)  # keeps the draft cache in step
        at = cache.length  # the bonus token's index
        tokens = proposal.token_ids.clone()
        truth = reference[at + 1: at + 1 + block]
        tokens[: len(truth)] = torch.tensor(truth)
        if len(steps) % (block + 1) < block:
            slot = len(steps) % (block + 1)
            tokens[slot] = (tokens[slot] + 1) % verifier.config.vocab_size
        steps.append(at)
        proposal.token_ids = tokens
        return proposal

    return draft


report = {"drafter_module": type(drafter).__module__, "plain": [], "speculative": [], "oracle": [], "committed": [],
          "oracle_committed": []}
for prompt in prompts:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                        return_tensors="pt", return_dict=True)["input_ids"]
    plain = verifier.generate(ids, do_sample=False, max_new_tokens=24)
    report["plain"].append(tokenizer.decode(plain[0, ids.shape[1]:]))
    for key in ("speculative", "oracle"):
        drafter.draft = oracle(plain[0].tolist()) if key == "oracle" else real_draft
        out = verifier.generate(ids, custom_generate=folder, trust_remote_code=True, drafter=drafter,
                                do_sample=False, max_new_tokens=24, return_dict_in_generate=True)
        report["output_module"] = type(out).__module__
        report[key].append(tokenizer.decode(out.sequences[0, ids.shape[1]:]))
        report["committed" if key == "speculative" else "oracle_committed"].append(out.committed_per_step)
print("RESULT " + json.dumps(report))
"""


def test_staged_folder_decodes_in_process_through_custom_generate(staged, chat_verifier_dir, smollm2_tokenizer,
                                                                   tmp_path):
    """A user with only the staged folder (this package's modules blocked, an empty module cache, offline) decodes
    with `verifier.generate(..., custom_generate=<folder>, trust_remote_code=True, drafter=...)`, and speculative
    decoding at T=0 gives the verifier's own greedy replies: with the staged drafter (4 training steps: it accepts
    little) and with an oracle drafter whose steps accept every count 0..B, so the accept, crop and bonus paths of
    the staged loop all run."""
    import subprocess
    import sys

    from conftest import assert_same_greedy_replies
    from transformers import AutoModelForCausalLM

    prompts = ["Tell me about river stone.", "Why is the sky blue?", "Write a haiku about paper light."]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env |= {"HF_MODULES_CACHE": str(tmp_path / "modules"), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-c", _DECODE, str(staged.folder), chat_verifier_dir, *prompts], env=env,
                          cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))[len("RESULT "):])
    assert report["drafter_module"].startswith("transformers_modules.")
    assert report["output_module"].startswith("transformers_modules.") and \
        report["output_module"].endswith(".custom_generate.generate")  # the staged loop ran, not transformers' own
    block = json.loads((staged.folder / "config.json").read_text())["block_size"]
    committed = [n for key in ("committed", "oracle_committed") for c in report[key] for n in c]
    assert all(1 <= n <= block + 1 for n in committed)  # tokens per verification step
    assert set(n for c in report["oracle_committed"] for n in c) == set(range(1, block + 2))  # 0..B drafts accepted
    verifier = AutoModelForCausalLM.from_pretrained(chat_verifier_dir).eval()
    messages = [[{"role": "user", "content": p}] for p in prompts]
    for key in ("speculative", "oracle"):
        assert_same_greedy_replies(verifier, smollm2_tokenizer, messages, report[key], report["plain"])


@pytest.mark.parametrize("spec", ["output_dir", "checkpoint-best", "checkpoint-2", "final"])
def test_stage_from_any_checkpoint_the_trainer_writes(run_dir, tmp_path, spec):
    target = {"output_dir": run_dir, "checkpoint-best": run_dir / "checkpoint-best",
              "checkpoint-2": f"{run_dir}:2", "final": f"{run_dir}:final"}[spec]
    staged = stage(resolve_checkpoint(target), tmp_path / "repo", repo_id=REPO, remote_code_check=False)
    calibrated = (staged.checkpoint.path / CALIBRATION_FILE).exists()
    assert calibrated or spec == "checkpoint-2"  # the best checkpoint and the final model are calibrated
    assert set(staged.files) == BASE_FILES | ({CALIBRATION_PLOT_FILE} if calibrated else set())
    step = 2 if spec == "checkpoint-2" else staged.checkpoint.step
    assert staged.commit_message == f"Upload DSpark drafter for {VERIFIER_ID} (step {step})"


@pytest.mark.parametrize("mutate, message", [
    (lambda c: c.pop("sample_from_anchor"), "sample_from_anchor is missing"),
    (lambda c: c.update(sample_from_anchor=False), "sample_from_anchor is False, not true"),
    (lambda c: c.update(model_type="qwen3"), "top-level model_type 'qwen3' is set"),
    (lambda c: c["speculators_config"]["proposal_methods"][0].update(speculative_tokens=3),
     "speculative_tokens 3 differs from block_size 4"),
    (lambda c: c["speculators_config"]["proposal_methods"].clear(), "speculative_tokens is missing"),
    (lambda c: c["speculators_config"]["verifier"].update(name_or_path="/models/llama"), "is not a Hub id"),
    (lambda c: c.update(speculators_model_type="eagle3"), "speculators_model_type is 'eagle3', not 'dspark'"),
    (lambda c: c.update(transformer_layer_config="qwen3"), "transformer_layer_config is not a mapping"),
    (lambda c: c.update(aux_hidden_state_layer_ids=[2, 1]), r"aux_hidden_state_layer_ids \[2, 1\] must be"),
    (lambda c: c.update(aux_hidden_state_layer_ids=[0, 1]), r"aux layer id 0 is out of range for a 4-layer verifier"),
    (lambda c: c.update(aux_hidden_state_layer_ids=[1, 4]), r"aux layer id 4 is out of range for a 4-layer verifier; use ids in 1..3"),
    (lambda c: c["transformer_layer_config"].update(hidden_act="gelu"), "hidden_act is 'gelu', not 'silu'"),
    (lambda c: c["transformer_layer_config"]["rope_parameters"].pop("rope_theta"), "has no rope_theta"),
    (lambda c: c["transformer_layer_config"].pop("vocab_size"), "vocab_size is missing"),
    (lambda c: c.update(sliding_window_non_causal=True), r"sliding_window_non_causal is true, but vLLM ignores it "
     r"and serves the sliding layers causal .*retrain it with sliding_window_non_causal: false"),
])
def test_vllm_structure_checks_refuse_a_tampered_config(staged, mutate, message):
    config = json.loads((staged.folder / "config.json").read_text())
    tensors = load_file(staged.folder / "model.safetensors")
    check_serving_config(config, tensors)  # the staged one passes
    bad = copy.deepcopy(config)
    mutate(bad)
    with pytest.raises(ph.PushError, match=rf"the staged config.json would not serve with vLLM: .*{message}"):
        check_serving_config(bad, tensors)
    with pytest.raises(ph.PushError, match=r"d2t must be \[500\]"):
        check_serving_config(config, {k: v for k, v in tensors.items() if k != "d2t"})


def test_nan_weights_are_refused(run_dir, tmp_path):
    ckpt = tmp_path / "checkpoint-4"
    shutil.copytree(run_dir / "checkpoint-4", ckpt, ignore=shutil.ignore_patterns("optimizer.pt"))
    weights = load_file(ckpt / "model.safetensors")
    weights["fc.weight"][0, :3] = float("nan")
    save_file(weights, ckpt / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ph.PushError, match=r"weight fc.weight has 3 non-finite values \(NaN/inf\) .*; push an "
                                           r"earlier checkpoint"):
        stage(resolve_checkpoint(ckpt), tmp_path / "repo", repo_id=REPO, remote_code_check=False)


def test_local_verifier_path_is_refused_with_the_fix(run_dir, tmp_path):
    ckpt = tmp_path / "checkpoint-4"
    shutil.copytree(run_dir / "checkpoint-4", ckpt, ignore=shutil.ignore_patterns("optimizer.pt"))
    config = json.loads((ckpt / "config.json").read_text())
    config["speculators_config"]["verifier"]["name_or_path"] = str(tmp_path)  # an existing local directory
    (ckpt / "config.json").write_text(json.dumps(config))
    checkpoint = resolve_checkpoint(ckpt)
    with pytest.raises(ph.PushError, match=rf"the checkpoint names no Hub id for its verifier \(found '{tmp_path}'\); "
                                           r"pass --verifier-id org/name\."):
        stage(checkpoint, tmp_path / "a", repo_id=REPO, remote_code_check=False)
    with pytest.raises(ph.PushError, match=r"--verifier-id .* is not a Hub id .*; pass the verifier's id on the Hub"):
        stage(checkpoint, tmp_path / "b", repo_id=REPO, verifier_id=str(tmp_path), remote_code_check=False)
    staged = stage(checkpoint, tmp_path / "c", repo_id=REPO, verifier_id=VERIFIER_ID, remote_code_check=False)
    assert json.loads((staged.folder / "config.json").read_text())["speculators_config"]["verifier"][
        "name_or_path"] == VERIFIER_ID


# ------------------------------------------------------------------------------------------------ the model card
def test_card_metadata_tables_and_plot_come_from_the_results(staged, results_files):
    card = ModelCard.load(staged.folder / "README.md")
    data = card.data
    assert data.base_model == VERIFIER_ID and data.library_name == "transformers" and data.license == "apache-2.0"
    assert data.pipeline_tag == "text-generation"
    assert {"speculative-decoding", "dspark", "speculators"} <= set(data.tags)
    assert data.datasets is None  # the training data was a local file, not a Hub dataset
    evals = {(e.dataset_config, e.metric_name): e.metric_value for e in data.eval_results}
    # the results files predate the recorded draft method: in-process at T=1 they drafted top-k/top-p-filtered
    assert evals[("math_reasoning", "acceptance length (T=1.0, top_p=0.95, top_k=64, filtered drafts)")] == 2.9
    assert evals[(None, "weighted mean acceptance length (T=1.0, top_p=0.95, top_k=64, filtered drafts)")] == 2.15
    assert evals[("qa", "acceptance length (greedy)")] == 1.8
    assert all(e.dataset_name == "RedHatAI/speculator_benchmarks" and e.metric_type == "acceptance_length"
               for e in data.eval_results)
    text = card.text
    headings = [line for line in text.splitlines() if line.startswith("## ")]
    assert headings == ["## Usage", "## Architecture", "## Training", "## Evaluation", "## Limitations",
                        "## Provenance"]
    assert ("### Acceptance (in-process; T = 1, top_p 0.95, top_k 64; top-k/top-p-filtered drafts, not what vLLM "
            "serves)") in text
    assert "### Acceptance (in-process; T = 0: greedy decoding and greedy drafts)" in text
    assert "- Drafts: filtered, sampled from the draft logits with the verifier's temperature, top-k and top-p" in text
    assert "which predates the record: inferred from its backend and temperature" in text
    assert "| subset | acceptance_length | pos_0 | pos_1 | pos_2 | pos_3 |" in text
    assert "| math_reasoning | 2.900 | 80.0% | 60.0% | 30.0% | 20.0% |" in text
    assert text.index("| math_reasoning |") < text.index("| qa |") < text.index("| my_subset |")  # canonical order
    assert "Weighted across all subsets: 2.150 over 600 verification steps" in text
    assert "| math_reasoning | 40.0 | 70.0 | 80.0 | 2.00× |" in text  # baseline / other drafter / this / speedup
    assert "| average speedup | 1.00× | 1.56× | 1.62× | 1.62× |" in text
    assert "| qa | 2.000 | 1.800 | MTP (x/y-assistant) |" in text
    assert "step counts were not recorded, so no weighted mean" in text  # the greedy file has no steps
    assert "Throughput was not measured in these results." in text
    assert "- Not measured (no verification steps): writing" in text and "| writing |" not in text
    assert f"![Per-position acceptance by subset]({PLOT_FILE})" in text
    assert "Mean acceptance length is 2.15 tokens committed per verification step over 600 steps" in text
    assert "throughput speedup over the verifier alone of 2.00× on math_reasoning and 1.25× on qa." in text
    assert f"vllm serve {REPO}" in text and 'revision=REVISION' in text and f'custom_generate="{REPO}"' in text
    assert "- Hidden size 64 (the verifier's), MLP size 128" in text  # from config.json
    assert "Loss: {\"kl\": 0.5, \"tv\": 0.5}" in text and "conversations capped at 128 tokens" in text  # run config
    png = (staged.folder / PLOT_FILE).read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and struct.unpack(">II", png[16:24])[0] > 1000  # two panels wide


def test_card_without_results_says_so(run_dir, tmp_path):
    staged = stage(resolve_checkpoint(f"{run_dir}:final"), tmp_path / "repo", repo_id=REPO,
                      remote_code_check=False)
    assert PLOT_FILE not in staged.files
    card = ModelCard.load(staged.folder / "README.md")
    assert card.data.eval_results is None and "model-index" not in card.content
    assert "No evaluation results were given to this export" in card.text
    assert "No acceptance was measured for this export" in card.text
    assert "Weights from the run's final model" in card.text


def test_card_reports_the_confidence_calibration(staged, run_dir, tmp_path):
    record = json.loads((staged.checkpoint.path / CALIBRATION_FILE).read_text())
    text = ModelCard.load(staged.folder / "README.md").text
    section = text[text.index("### Confidence calibration"):text.index("## Limitations")]
    assert f"(a = {record['a']:.4f}, c = {record['c']:+.4f})" in section
    assert f"{record['ece_before']:.4f} before, {record['ece_after']:.4f} after" in section
    assert f"fitted on {record['n_slots']:,} validation positions" in section
    assert "greedy drafts checked by a sampling verifier" in section  # the default confidence target
    assert ("- Teacher: the verifier's distribution renormalised over the draft vocabulary; confidence head trained "
            "for greedy drafts checked by a sampling verifier") in text  # from the run config
    fmt = lambda xs: " | ".join("–" if x is None else f"{x:+.3f}" for x in xs)  # noqa: E731
    assert f"| cumulative-product bias before | {fmt(record['cumprod_bias_before'])} |" in section
    assert f"| cumulative-product bias after | {fmt(record['cumprod_bias_after'])} |" in section
    assert f"![Confidence reliability per position]({CALIBRATION_PLOT_FILE})" in section
    png = (staged.folder / CALIBRATION_PLOT_FILE).read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and struct.unpack(">II", png[16:24])[0] > 1000  # two panels wide

    # Without the record: the card says so, no reliability plot, and every other staged byte is the same.
    ckpt = tmp_path / staged.checkpoint.path.name
    shutil.copytree(staged.checkpoint.path, ckpt, ignore=shutil.ignore_patterns("optimizer.pt"))
    (ckpt / CALIBRATION_FILE).unlink()
    with_record = stage(resolve_checkpoint(staged.checkpoint.path), tmp_path / "a", repo_id=REPO,
                        remote_code_check=False)
    without = stage(resolve_checkpoint(ckpt), tmp_path / "b", repo_id=REPO, remote_code_check=False)
    assert set(without.files) == BASE_FILES and set(with_record.files) == BASE_FILES | {CALIBRATION_PLOT_FILE}
    for name in BASE_FILES - {"README.md"}:
        assert (without.folder / name).read_bytes() == (with_record.folder / name).read_bytes(), name
    card = ModelCard.load(without.folder / "README.md").text
    assert f"### Confidence calibration\n\nNot recorded: the checkpoint has no `{CALIBRATION_FILE}`" in card
    assert CALIBRATION_PLOT_FILE not in card
    (ckpt / CALIBRATION_FILE).write_text(json.dumps({"a": 1.0}))
    with pytest.raises(ph.PushError, match=rf"{CALIBRATION_FILE} lacks valid c, n_slots, .*; restore it from the run"):
        stage(resolve_checkpoint(ckpt), tmp_path / "c", repo_id=REPO, remote_code_check=False)


def test_training_section_and_datasets_follow_the_run_config(run_dir, tmp_path):
    import yaml

    ckpt = tmp_path / "checkpoint-4"
    shutil.copytree(run_dir / "checkpoint-4", ckpt, ignore=shutil.ignore_patterns("optimizer.pt"))
    run_config = yaml.safe_load((ckpt / "dspark_run_config.yaml").read_text())
    run_config["data"]["train_data"] = "HuggingFaceH4/ultrachat_200k"
    (ckpt / "dspark_run_config.yaml").write_text(yaml.safe_dump(run_config))
    staged = stage(resolve_checkpoint(ckpt), tmp_path / "a", repo_id=REPO, remote_code_check=False)
    card = ModelCard.load(staged.folder / "README.md")
    assert card.data.datasets == ["HuggingFaceH4/ultrachat_200k"]
    assert "[HuggingFaceH4/ultrachat_200k](https://huggingface.co/datasets/HuggingFaceH4/ultrachat_200k)" in card.text
    (ckpt / "dspark_run_config.yaml").unlink()
    staged = stage(resolve_checkpoint(ckpt), tmp_path / "b", repo_id=REPO, remote_code_check=False)
    card = ModelCard.load(staged.folder / "README.md")
    assert card.data.datasets is None
    assert "No run configuration (`dspark_run_config.yaml`) was found in the checkpoint" in card.text
    stats_card = ModelCard.load(stage(resolve_checkpoint(run_dir / "checkpoint-4"), tmp_path / "c",
                                         repo_id=REPO, remote_code_check=False).folder / "README.md")
    assert re.search(r"- Trained on \d+ conversations \([\d,]+ supervised tokens in \d+ packed rows\)", stats_card.text)
    assert "Run config sha256" not in staged.commit_description


def test_bad_results_files_are_refused(run_dir, tmp_path):
    wrong_block = tmp_path / "b8.json"
    wrong_block.write_text(json.dumps(results_json(block_size=8)))
    with pytest.raises(ph.PushError, match=r"b8.json were measured with block size 8 but this drafter has block size "
                                           r"4; pass results measured for this drafter\."):
        stage(resolve_checkpoint(run_dir), tmp_path / "repo", repo_id=REPO, eval_results=[wrong_block],
                 remote_code_check=False)
    assert not (tmp_path / "repo").exists()  # refused before anything was written
    wrong_schema = tmp_path / "other.json"
    wrong_schema.write_text(json.dumps({"schema": "something/2"}))
    with pytest.raises(ph.PushError, match=r"has schema 'something/2', not 'dspark-acceptance/1'"):
        read_results(wrong_schema, 4)
    other_verifier = tmp_path / "v.json"
    other_verifier.write_text(json.dumps(results_json(verifier="google/gemma-4-E4B-it")))
    with pytest.raises(ph.PushError, match=r"measured with verifier google/gemma-4-E4B-it but this drafter's"):
        read_results(other_verifier, 4, VERIFIER_ID)
    other_weights = tmp_path / "w.json"
    other_weights.write_text(json.dumps(results_json(drafter_weights_sha256="0" * 64)))
    with pytest.raises(ph.PushError, match=r"w.json were measured on different drafter weights than this "
                                           r"checkpoint's \(sha256 000000000000 vs [0-9a-f]{12}\); evaluate this"):
        stage(resolve_checkpoint(run_dir), tmp_path / "repo", repo_id=REPO, eval_results=[other_weights],
                 remote_code_check=False)
    short = results_json()
    short["subsets"]["qa"]["pos"] = [0.5, 0.2]
    (tmp_path / "short.json").write_text(json.dumps(short))
    with pytest.raises(ph.PushError, match=r"subsets.qa.pos has 2 values, expected 4"):
        read_results(tmp_path / "short.json", 4)


def test_results_measured_on_the_staged_export_are_accepted_for_its_checkpoint(run_dir, chat_verifier_dir, tmp_path,
                                                                              capsys, online):
    """The documented serving-evaluation workflow, offline at tiny scale: stage `OUTPUT_DIR:best` with --dry-run,
    evaluate the staged bf16 folder (the in-process evaluator here; the vLLM one writes the same provenance through
    the same `with_provenance`), then push the *checkpoint* with those results: accepted, and the card renders them,
    although the staged weights' sha256 is not the fp32 checkpoint's. Results measured on an export of another
    checkpoint of the same run are still refused."""
    from safetensors import safe_open

    from trainer.contract import check_folder
    from trainer.evaluation.in_process import main as evaluate
    from trainer.evaluation.results import source_weights_sha256, weights_sha256, with_provenance

    best = f"{run_dir}:best"
    exported, other_export = tmp_path / "exported", tmp_path / "exported-2"
    for checkpoint, out in ((best, exported), (f"{run_dir}:2", other_export)):
        assert ph.main(["--checkpoint", checkpoint, "--repo-id", REPO, "--dry-run", str(out)], api=NoNetwork()) == 0
    checkpoint = resolve_checkpoint(best).path
    assert weights_sha256(exported) != weights_sha256(checkpoint)  # bf16 bytes: the sha alone cannot pair them
    assert source_weights_sha256(exported) == weights_sha256(checkpoint)
    assert source_weights_sha256(other_export) == weights_sha256(resolve_checkpoint(f"{run_dir}:2").path)
    assert source_weights_sha256(checkpoint) is None  # a training checkpoint is nobody's export
    check_folder(exported, check_dtype=True)  # still exactly the contract's tensors, bf16
    with safe_open(exported / "model.safetensors", framework="pt") as f:
        assert f.metadata()["format"] == "pt"  # what transformers' loader requires of the metadata

    prompts = tmp_path / "prompts"
    prompts.mkdir()
    (prompts / "qa.jsonl").write_text(json.dumps({"prompt": "Tell me about river stone."}) + "\n")
    results = tmp_path / "results" / "vllm-t0.json"
    measured = evaluate(["--drafter", str(exported), "--verifier", chat_verifier_dir, "--prompts", str(prompts),
                         "--temperature", "0", "--max-new-tokens", "8", "--out", str(results)])
    assert measured["drafter_weights_sha256"] == weights_sha256(exported)
    assert measured["drafter_source_weights_sha256"] == weights_sha256(checkpoint)
    capsys.readouterr()

    api = FakeApi(tmp_path)
    rc = ph.main(args(best, "--eval-results", str(results)), api=api)
    out, err = capsys.readouterr()
    assert rc == 0, err
    card = ModelCard(api.uploaded["README.md"].decode())
    qa = measured["subsets"]["qa"]
    assert f"| qa | {qa['acceptance_length']:.3f} |" in card.text and "`vllm-t0.json`" in card.text
    assert [e.metric_value for e in card.data.eval_results if e.dataset_config == "qa"] == \
        [round(qa["acceptance_length"], 4)]

    # The same measurement, recorded by the same writer for another checkpoint's export: refused.
    other = tmp_path / "other.json"
    other.write_text(json.dumps(with_provenance(dict(measured), str(other_export),
                                                measured["verifier"], str(prompts))))
    api = FakeApi(tmp_path)
    assert ph.main(args(best, "--eval-results", str(other)), api=api) == 2
    assert re.search(r"other.json were measured on different drafter weights than this checkpoint's \(sha256 "
                     r"[0-9a-f]{12}, exported from [0-9a-f]{12}, vs [0-9a-f]{12}\)", capsys.readouterr().err)
    assert "upload_folder" not in api.names()


# ------------------------------------------------------------------------------------------------ upload
def test_upload_makes_exactly_one_commit_with_the_staged_files(run_dir, results_files, tmp_path, capsys, online):
    api = FakeApi(tmp_path)
    rc = ph.main(args(run_dir, "--eval-results", str(results_files[0]), "--private", "--revision", "dev"), api=api)
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert api.names() == ["hf_hub_download", "create_repo", "create_branch", "upload_folder"]
    assert api.calls[0][1] == {"repo_id": REPO, "filename": "config.json", "revision": "dev"}
    assert api.calls[1][1] == {"repo_id": REPO, "private": True, "exist_ok": True, "repo_type": "model"}
    assert api.calls[2][1] == {"repo_id": REPO, "branch": "dev", "exist_ok": True, "repo_type": "model"}
    upload = api.calls[3][1]
    assert upload["repo_id"] == REPO and upload["revision"] == "dev" and upload["create_pr"] is False
    assert upload["commit_message"] == (f"Upload DSpark drafter for {VERIFIER_ID} (step 4, acceptance length 2.15 on "
                                        f"RedHatAI/speculator_benchmarks)")
    assert "Run config sha256: " in upload["commit_description"]
    assert upload["delete_patterns"] == DELETE_PATTERNS
    assert set(api.uploaded) == BASE_FILES | PLOTS
    assert json.loads(api.uploaded["config.json"])["speculators_config"]["verifier"]["name_or_path"] == VERIFIER_ID
    assert online == [Path(upload["folder_path"])]  # validated (remote-code load) before the upload
    assert not Path(upload["folder_path"]).exists()  # the staged temp folder is gone
    assert f"in one commit: https://huggingface.co/{REPO}/commit/0123abcd" in out
    assert TOKEN not in out + err


def test_existing_repo_for_another_verifier_needs_force(run_dir, tmp_path, capsys, online):
    api = FakeApi(tmp_path, remote_verifier="google/gemma-4-E4B-it")
    assert ph.main(args(run_dir), api=api) == 2
    err = capsys.readouterr().err
    assert f"error: {REPO} already holds a drafter for verifier google/gemma-4-E4B-it, not {VERIFIER_ID}; push to " \
           f"another repo, or pass --force to replace it." in err
    assert api.names() == ["hf_hub_download"]  # refused before creating or uploading anything
    api = FakeApi(tmp_path, remote_verifier="google/gemma-4-E4B-it")
    assert ph.main(args(run_dir, "--force", "--create-pr"), api=api) == 0
    assert api.names() == ["hf_hub_download", "create_repo", "upload_folder"]
    assert api.calls[-1][1]["create_pr"] is True
    same = FakeApi(tmp_path, remote_verifier=VERIFIER_ID)  # a new version of the same drafter needs no --force
    assert ph.main(args(run_dir), api=same) == 0 and same.names()[-1] == "upload_folder"


def test_failed_upload_leaves_nothing_and_says_what_to_rerun(run_dir, tmp_path, capsys, online):
    api = FakeApi(tmp_path, fail=OSError(f"connection reset while sending Authorization: Bearer {TOKEN}"))
    assert ph.main(args(run_dir, "--commit-message", "v1"), api=api) == 1
    out, err = capsys.readouterr()
    assert f"error: upload to {REPO} failed (OSError: connection reset" in err
    assert f"nothing was committed and the staged folder was removed, so fix the cause and rerun: python " \
           f"push_to_hub.py --checkpoint {run_dir} --repo-id {REPO} --commit-message v1" in err
    assert api.calls[-1][1]["commit_message"] == "v1"
    assert not Path(api.calls[-1][1]["folder_path"]).parent.exists()
    assert TOKEN not in out + err and "Bearer ***" in err


def test_missing_token_and_offline_mode_are_explained(run_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    assert ph.main(args(run_dir), api=NoNetwork()) == 2
    assert "error: Hugging Face Hub offline mode is on (HF_HUB_OFFLINE=1); unset it to upload or use --dry-run " \
           "OUT_DIR." in capsys.readouterr().err
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setattr(ph, "get_token", lambda: None)  # no saved login either
    assert ph.main(args(run_dir), api=NoNetwork()) == 2
    assert "error: no Hugging Face token found; run `hf auth login` or set HF_TOKEN." in capsys.readouterr().err
    assert ph.main(["--checkpoint", str(run_dir), "--repo-id", "no-namespace", "--dry-run", str(tmp_path / "x")]) == 2
    assert "has no namespace; use ORG/NAME" in capsys.readouterr().err


def test_dry_run_writes_the_folder_and_never_calls_the_hub(run_dir, results_files, tmp_path, capsys, monkeypatch):
    loads = []
    monkeypatch.setattr(staging, "check_remote_code_load", lambda folder: loads.append(Path(folder)) or {})
    out_dir = tmp_path / "export"
    for _ in range(2):  # a repeated dry run replaces its previous export
        rc = ph.main(args(run_dir, "--eval-results", *map(str, results_files), "--dry-run", str(out_dir)),
                     api=NoNetwork())
        out, err = capsys.readouterr()
        assert rc == 0, err
    assert folder_files(out_dir) == BASE_FILES | PLOTS
    assert [p.name for p in tmp_path.iterdir()] == ["export"]  # no OUT_DIR.tmp-* or .old-* left behind
    assert len(loads) == 2 and loads[0].name.startswith("export.tmp-")  # validated before the atomic rename
    assert "model.safetensors" in out and f"commit to {REPO} (revision main):" in out
    assert f"message: Upload DSpark drafter for {VERIFIER_ID} (step 4, acceptance length 2.15" in out
    assert "nothing was uploaded" in out
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    assert ph.main(args(run_dir, "--dry-run", str(foreign)), api=NoNetwork()) == 2
    assert "exists and holds other files; pass a new directory or remove it" in capsys.readouterr().err
    assert (foreign / "notes.txt").read_text() == "mine"


def test_card_names_the_serving_options_the_drafter_was_trained_for(tmp_path):
    """Block size, the drafting mode of the confidence target, adaptive verification (calibrated or not) and, for
    Gemma 4 verifiers, the fast-prefill caveat all come from the checkpoint's own records."""
    from trainer.export.card_sections import _CALIBRATION_KEYS
    from trainer.export.card_usage import serving_options
    from trainer.train.checkpoints import CALIBRATION_FILE

    config = {"block_size": 8, "enable_confidence_head": True, "verifier_text_config": {"model_type": "gemma4_text"}}
    inputs = SimpleNamespace(config=config, checkpoint=SimpleNamespace(path=tmp_path),
                             run_config={"train": {"confidence_target": "greedy"}})
    text = serving_options(inputs)
    assert "Keep `num_speculative_tokens` at 8" in text and "default greedy drafting" in text
    assert "was not calibrated for this export" in text and "kv_sharing_fast_prefill" in text
    record = {"a": 1.44, "c": 0.42, "n_slots": 5791, "ece_before": 0.0431, "ece_after": 0.0175,
              "cumprod_bias_before": [], "cumprod_bias_after": [], "reliability_before": [], "reliability_after": []}
    assert set(record) == set(_CALIBRATION_KEYS)
    (tmp_path / CALIBRATION_FILE).write_text(json.dumps(record))
    inputs.config = {**config, "verifier_text_config": {"model_type": "llama"}}
    inputs.run_config = {"train": {"confidence_target": "sampled"}}
    text = serving_options(inputs)
    assert "probabilistic drafting" in text and "0.043 -> 0.018" in text and "kv_sharing_fast_prefill" not in text
