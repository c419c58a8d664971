"""Drafters that speculators 0.9.0 trained and saved are first-class input: they load, evaluate, continue training
(full and LoRA) and export to this package's servable format; other algorithms and Markov heads vLLM cannot
serve are refused in one sentence.

The folders are made by speculators itself (tests/speculators_checkpoints.py, in .venv-speculators) against the
suite's tiny chat verifier, once per session; their forward against speculators' own is checked in that venv by
tests/speculators_crosscheck.py. Marker `speculators`: skipped without that environment.
"""

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from conftest import speculators_python
from safetensors.torch import load_file

from configuration_dspark import DSparkConfig
from modeling_dspark import DSparkDraftModel
from trainer.errors import UsageError
from trainer.verifier.loading import resolve_drafter

ROOT = Path(__file__).resolve().parents[3]

pytestmark = [pytest.mark.speculators]


@pytest.fixture(scope="session")
def theirs(tmp_path_factory, chat_verifier_dir) -> Path:
    """`dspark-full`, `dspark-reduced`, `dspark-gated` and `dflash`, each saved by speculators' `save_pretrained`."""
    out = tmp_path_factory.mktemp("speculators-saved")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONPATH": ""}
    proc = subprocess.run([speculators_python(), str(ROOT / "tests" / "speculators_checkpoints.py"), str(out),
                           chat_verifier_dir], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out


def test_what_speculators_saves_is_its_own_format(theirs):
    """The premise: no `model_type`, an `auto_map` to speculators' own config.py beside it, and `d2t`/`t2d`/`lm_head`
    only with a reduced vocabulary; `AutoConfig` cannot read it."""
    from transformers import AutoConfig

    config = json.loads((theirs / "dspark-full" / "config.json").read_text())
    assert "model_type" not in config and config["auto_map"] == {"": "config.DSparkSpeculatorConfig"}
    assert (theirs / "dspark-full" / "config.py").exists() and "verifier_text_config" not in config
    assert not {"d2t", "t2d", "lm_head.weight"} & set(load_file(theirs / "dspark-full" / "model.safetensors"))
    assert {"d2t", "t2d", "lm_head.weight"} <= set(load_file(theirs / "dspark-reduced" / "model.safetensors"))
    with pytest.raises(ValueError, match="model_type"):
        AutoConfig.from_pretrained(theirs / "dspark-full")


@pytest.mark.parametrize("name,draft_vocab", [("dspark-full", None), ("dspark-reduced", 100)])
def test_a_speculators_checkpoint_loads_with_identical_weights(theirs, chat_verifier_dir, name, draft_vocab):
    from transformers import AutoModelForCausalLM

    path, config = resolve_drafter(str(theirs / name))
    assert isinstance(config, DSparkConfig) and config.draft_vocab_size == (draft_vocab or config.vocab_size)
    drafter, info = DSparkDraftModel.from_pretrained(path, dtype=torch.float32, output_loading_info=True)
    assert not info["unexpected_keys"] and set(info["missing_keys"]) <= {"lm_head.weight"}
    saved, state = load_file(theirs / name / "model.safetensors"), drafter.state_dict()
    assert all(torch.equal(tensor, state[key]) for key, tensor in saved.items())
    if draft_vocab:  # their d2t offsets map draft ids to the verifier ids they were built from
        manifest = json.loads((theirs / "manifest.json").read_text())
        assert drafter.draft_to_verifier_ids(torch.arange(draft_vocab)).tolist() == manifest["reduced_draft_ids"]
    verifier = AutoModelForCausalLM.from_pretrained(chat_verifier_dir)
    assert drafter.config.verifier_text_config is None
    drafter.attach_verifier(verifier)  # gives the drafter the snapshot speculators does not write
    snapshot = drafter.config.verifier_text_config
    assert (snapshot["hidden_size"], snapshot["num_hidden_layers"], snapshot["model_type"]) == (64, 4, "llama")


def test_evaluate_reads_a_speculators_checkpoint(theirs, chat_verifier_dir, tmp_path):
    """`python -m trainer evaluate --drafter <speculators folder>`, verifier taken from its config; at T = 0 the
    training forward agrees with every measured verification step (the fidelity check)."""
    from trainer.evaluation.in_process import main

    (tmp_path / "prompts").mkdir()
    (tmp_path / "prompts" / "qa.jsonl").write_text(json.dumps({"prompt": "What is 2+2?"}) + "\n")
    results = main(["--drafter", str(theirs / "dspark-reduced"), "--prompts", str(tmp_path / "prompts"),
                    "--temperature", "0", "--max-new-tokens", "8", "--out", str(tmp_path / "r.json")])
    qa = results["subsets"]["qa"]
    assert qa["steps"] >= 1 and 1.0 <= qa["acceptance_length"] <= 5.0
    assert qa["fidelity_steps"] >= 1 and qa["fidelity_steps_differing"] == 0
    assert results["verifier"] == chat_verifier_dir  # speculators wrote the local folder it was built against


@pytest.mark.slow
@pytest.mark.parametrize("name,extra", [("dspark-reduced", []), ("dspark-full", ["--lora_rank", "4"])])
def test_init_from_a_speculators_checkpoint_full_and_lora(theirs, chat_verifier_dir, chat_data_file, tmp_path,
                                                         name, extra):
    from tiny import TINY_RUN
    from trainer.config import RunConfig
    from trainer.run import train

    out = tmp_path / "run"
    config = RunConfig.load(None, ["--verifier", chat_verifier_dir, "--train_data", chat_data_file, "--output_dir",
                                   str(out), *TINY_RUN, "--init_from", str(theirs / name), "--max_steps", "3",
                                   "--eval_steps", "3", "--eval_at_start", "false", *extra])
    summary = train(config)
    assert summary["global_step"] == 3
    # the run adopted the drafter's architecture (TINY_RUN asks for 1 layer and a 500-token vocabulary)
    assert (config.model.num_hidden_layers, config.model.block_size) == (2, 4)
    before, after = load_file(theirs / name / "model.safetensors"), load_file(out / "model.safetensors")
    assert set(before) <= set(after)
    moved = [k for k in before if not torch.equal(before[k], after[k])]
    if extra:  # LoRA: only the adapted matrices (and the confidence head's calibration fold) moved
        assert moved and all(".self_attn." in k or ".mlp." in k or k.startswith("confidence_head.") for k in moved)
    else:  # full: started from their weights, three small steps away (the confidence head also got a fold)
        assert moved and all(float((after[k] - before[k]).abs().max()) < 0.1 * float(before[k].abs().max())
                             for k in moved if not k.startswith("confidence_head."))
    saved = json.loads((out / "config.json").read_text())
    assert saved["auto_map"]["AutoModel"] == "modeling_dspark.DSparkDraftModel" and saved["verifier_text_config"]
    assert not (out / "config.py").exists()


def test_export_turns_a_speculators_checkpoint_into_this_packages_format(theirs, tmp_path):
    """push_to_hub.py --dry-run on the folder speculators saved: our remote code instead of speculators' config.py,
    the verifier snapshot filled from the folder it was trained against, the same weights in bf16, and a folder
    `AutoModel.from_pretrained(..., trust_remote_code=True)` loads (the staging validates that in a fresh process)."""
    from transformers import AutoModel

    import push_to_hub as ph

    out = tmp_path / "export"
    assert ph.main(["--checkpoint", str(theirs / "dspark-reduced"), "--repo-id", "me/drafter", "--verifier-id",
                    "HuggingFaceTB/SmolLM2-135M-Instruct", "--dry-run", str(out)]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["auto_map"] == {"AutoConfig": "configuration_dspark.DSparkConfig",
                                  "AutoModel": "modeling_dspark.DSparkDraftModel"}
    assert config["speculators_config"]["verifier"]["name_or_path"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert config["verifier_text_config"]["hidden_size"] == 64 and not (out / "config.py").exists()
    drafter = AutoModel.from_pretrained(out, trust_remote_code=True, dtype=torch.float32)
    state = drafter.state_dict()
    for key, tensor in load_file(theirs / "dspark-reduced" / "model.safetensors").items():
        expected = tensor.to(torch.bfloat16).float() if tensor.is_floating_point() else tensor
        assert torch.equal(state[key], expected), key


def test_other_algorithms_and_unservable_markov_heads_are_refused(theirs, tmp_path):
    rnn = tmp_path / "dspark-rnn"
    shutil.copytree(theirs / "dspark-gated", rnn)
    config = json.loads((rnn / "config.json").read_text())
    (rnn / "config.json").write_text(json.dumps({**config, "markov_head_type": "rnn"}))
    refusals = {
        "dflash": "is a speculators 'dflash' checkpoint, not a DSpark drafter",
        "dspark-gated": "markov_head_type 'gated' is not supported; use 'vanilla' (the only head vLLM serves)",
    }
    for name, message in refusals.items():
        with pytest.raises(UsageError, match=f"^drafter {re.escape(str(theirs / name))} cannot be used: .*"
                                             f"{re.escape(message)}"):
            resolve_drafter(str(theirs / name))
        with pytest.raises(ValueError, match=re.escape(message)):
            DSparkDraftModel.from_pretrained(theirs / name)
    with pytest.raises(UsageError, match="markov_head_type 'rnn' is not supported"):
        resolve_drafter(str(rnn))
