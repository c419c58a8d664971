"""End-to-end training: `trainer/run.py` on a tiny verifier with a real chat tokenizer, checkpoints, resume,
bad input, LoRA and a 2-process accelerate run."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from conftest import assert_ranks_trained_in_sync
from safetensors.torch import load_file
from transformers import AutoModel

from tiny import TINY_RUN
from trainer.config import RunConfig
from trainer.run import train
from trainer.train.checkpoints import CALIBRATION_FILE, COMPLETE_MARKER, SUMMARY_FILE

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = TINY_RUN


def config(verifier, data, out, *extra) -> RunConfig:
    return RunConfig.load(None, ["--verifier", verifier, "--train_data", data, "--output_dir", str(out), *TINY, *extra])


def eval_history(out, key: str) -> list[float]:
    """`eval_<key>` at every evaluation of the run in `out`, in step order (from the latest checkpoint's state)."""
    latest = max(out.glob("checkpoint-[0-9]*"), key=lambda p: int(p.name.split("-")[1]))
    state = json.loads((latest / "trainer_state.json").read_text())
    return [h[f"eval_{key}"] for h in state["log_history"] if f"eval_{key}" in h]


@pytest.mark.slow
def test_tiny_run_improves_acceptance_and_writes_servable_checkpoints(chat_verifier_dir, chat_data_file, tmp_path):
    out = tmp_path / "run"
    summary = train(config(chat_verifier_dir, chat_data_file, out, "--max_steps", "40", "--eval_steps", "20"))
    assert summary["global_step"] == 40
    # This random verifier puts ~99.9% of its mass outside the 500-token draft vocabulary (it does not speak the
    # data), so the full-vocabulary accept_len stays ~1.0; the learning shows against the restricted teacher.
    final = json.loads((out / SUMMARY_FILE).read_text())["final_metrics"]
    restricted = eval_history(out, "restricted_accept_len")
    assert final["eval_restricted_accept_len"] > restricted[0] + 0.3  # measured 1.15 -> 1.74
    assert final["eval_draft_vocab_coverage"] < 0.05
    assert 1.0 <= final["eval_accept_len"] <= 1.0 + 4 * final["eval_draft_vocab_coverage"]
    assert os.path.realpath(out / "checkpoint-best") == os.path.realpath(summary["best_checkpoint"])
    for ckpt in (out / "checkpoint-20", out / "checkpoint-40", out):
        files = set(os.listdir(ckpt))
        assert {"config.json", "model.safetensors", "configuration_dspark.py", "modeling_dspark.py",
                "dspark_run_config.yaml"} <= files
        weights = load_file(ckpt / "model.safetensors")
        assert not any(k.startswith(("verifier", "embed")) for k in weights)
        assert "lm_head.weight" in weights and "d2t" in weights  # draft vocabulary 500 < 49152
        cfg = json.loads((ckpt / "config.json").read_text())
        assert "model_type" not in cfg and cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 4
        drafter = AutoModel.from_pretrained(ckpt, trust_remote_code=True)
        assert type(drafter).__module__.startswith("transformers_modules")
    assert (out / "checkpoint-40" / COMPLETE_MARKER).exists()
    assert {"optimizer.pt", "scheduler.pt", "trainer_state.json", "rng_state.pth"} <= set(os.listdir(out / "checkpoint-40"))
    saved = RunConfig.load(str(out / "checkpoint-40" / "dspark_run_config.yaml"))
    assert saved.train.max_steps == 40 and saved.model.block_size == 4  # the run is reproducible from it
    state = json.loads((out / "checkpoint-40" / "trainer_state.json").read_text())
    assert state["best_metric"] == pytest.approx(max(h["eval_accept_len"] for h in state["log_history"]
                                                     if "eval_accept_len" in h))
    # the draft vocabulary is the most frequent supervised tokens, stored as d2t/t2d
    drafter = AutoModel.from_pretrained(out, trust_remote_code=True)
    assert drafter.config.draft_vocab_size == 500 and int(drafter.t2d.sum()) == 500


@pytest.mark.slow
def test_resume_continues_the_same_schedule(chat_verifier_dir, chat_data_file, tmp_path):
    straight = tmp_path / "straight"
    train(config(chat_verifier_dir, chat_data_file, straight, "--max_steps", "12", "--eval_steps", "6",
                 "--eval_at_start", "false"))
    resumed = tmp_path / "resumed"
    shutil.copytree(straight / "checkpoint-6", resumed / "checkpoint-6")
    if not (resumed / "checkpoint-6" / CALIBRATION_FILE).exists():  # calibrate it, as if it were the best one
        from trainer.train.calibration import HEAD_BIAS, HEAD_WEIGHT, fold, write_folded_head, write_record

        weights = load_file(resumed / "checkpoint-6" / "model.safetensors")
        head = dict(zip((HEAD_WEIGHT, HEAD_BIAS), fold(weights[HEAD_WEIGHT], weights[HEAD_BIAS], 1.5, -0.7)))
        assert write_folded_head(resumed / "checkpoint-6", head, weights, 1.5, -0.7)
        write_record(resumed / "checkpoint-6", {"a": 1.5, "c": -0.7})
    # resuming divides the fold out again, so the run continues from the trained head
    summary = train(config(chat_verifier_dir, chat_data_file, resumed, "--max_steps", "12", "--eval_steps", "6",
                           "--resume_from_checkpoint", "latest"))
    assert summary["global_step"] == 12
    a, b = load_file(straight / "model.safetensors"), load_file(resumed / "model.safetensors")
    for key in a:
        assert torch.allclose(a[key].float(), b[key].float(), atol=1e-5), key
    sa = json.loads((straight / "checkpoint-12" / "trainer_state.json").read_text())
    sb = json.loads((resumed / "checkpoint-12" / "trainer_state.json").read_text())
    lr = lambda s: [h["learning_rate"] for h in s["log_history"] if "learning_rate" in h and h["step"] > 6]  # noqa: E731
    assert lr(sa) == pytest.approx(lr(sb))


@pytest.mark.slow
def test_interrupted_save_is_ignored_on_resume(chat_verifier_dir, chat_data_file, tmp_path):
    out = tmp_path / "run"
    train(config(chat_verifier_dir, chat_data_file, out, "--max_steps", "8", "--eval_steps", "4",
                 "--eval_at_start", "false"))
    # simulate a kill while checkpoint-8 was being written: no completion marker, a truncated weight file
    (out / "checkpoint-8" / COMPLETE_MARKER).unlink()
    with open(out / "checkpoint-8" / "model.safetensors", "r+b") as f:
        f.truncate(100)
    summary = train(config(chat_verifier_dir, chat_data_file, out, "--max_steps", "10", "--eval_steps", "4",
                           "--resume_from_checkpoint", "latest"))
    assert summary["global_step"] == 10
    assert (out / "incomplete-checkpoint-8").is_dir()  # moved aside, never resumed from
    AutoModel.from_pretrained(out / "checkpoint-4", trust_remote_code=True)  # the previous one stayed loadable


@pytest.mark.slow
def test_resume_with_a_changed_model_shape_is_refused(chat_verifier_dir, chat_data_file, tmp_path):
    out = tmp_path / "run"
    train(config(chat_verifier_dir, chat_data_file, out, "--max_steps", "4", "--eval_steps", "4",
                 "--eval_at_start", "false"))
    with pytest.raises(ValueError, match=r"cannot resume from .*checkpoint-4: the drafter changed "
                                         r"\(block_size: 4 -> 3.*\); resume with the checkpoint's model settings"):
        train(config(chat_verifier_dir, chat_data_file, out, "--max_steps", "8", "--block_size", "3",
                     "--resume_from_checkpoint", "latest"))


def test_resume_diff_covers_every_drafter_key_but_the_runtime_ones():
    """The resume check is a diff of the whole drafter config: a layer field nobody listed is caught, while the
    keys declared runtime-only (versions, the local verifier path, the Hub id) are not."""
    from configuration_dspark import RUNTIME_ONLY_KEYS
    from trainer.train.checkpoints import config_diff

    saved = {"block_size": 4, "transformers_version": "5.0", "verifier_local_path": "/a",
             "transformer_layer_config": {"rms_norm_eps": 1e-6, "hidden_size": 64},
             "speculators_config": {"verifier": {"name_or_path": "org/a", "architectures": ["X"]}}}
    current = {"block_size": 4, "transformers_version": "5.19", "verifier_local_path": "/b",
               "transformer_layer_config": {"rms_norm_eps": 1e-5, "hidden_size": 64},
               "speculators_config": {"verifier": {"name_or_path": "org/b", "architectures": ["X"]}}}
    assert config_diff(saved, current) == ["transformer_layer_config.rms_norm_eps: 1e-06 -> 1e-05"]
    assert {"transformers_version", "verifier_local_path", "speculators_config.verifier.name_or_path"} <= \
        RUNTIME_ONLY_KEYS
    assert config_diff({**saved, "markov_rank": 8}, {**saved, "markov_rank": 16}) == ["markov_rank: 8 -> 16"]


@pytest.mark.slow
def test_init_from_adopts_the_drafters_block_size(chat_verifier_dir, chat_data_file, tmp_path):
    """A block-4 drafter continued with a block-3 run config trains as block 4: the objective, the saved drafter
    and the saved run config all say 4 (the objective never trains slots the drafter does not have)."""
    import trainer.train.trainer as dt

    base = tmp_path / "base"
    train(config(chat_verifier_dir, chat_data_file, base, "--max_steps", "2", "--eval_steps", "2",
                 "--eval_at_start", "false", "--validation_ratio", "0"))
    seen = []
    real = dt.dspark_loss

    def spy(drafter, outputs, *args, **kwargs):
        seen.append((args[-1].block_size, outputs.last_hidden_state.shape[2], drafter.config.block_size))
        return real(drafter, outputs, *args, **kwargs)

    dt.dspark_loss = spy
    try:
        out = tmp_path / "continued"
        train(config(chat_verifier_dir, chat_data_file, out, "--init_from", str(base), "--block_size", "3",
                     "--markov_rank", "8", "--max_steps", "2", "--eval_steps", "2", "--eval_at_start", "false",
                     "--validation_ratio", "0"))
    finally:
        dt.dspark_loss = real
    assert seen and set(seen) == {(4, 4, 4)}
    assert json.loads((out / "config.json").read_text())["block_size"] == 4
    saved = RunConfig.load(str(out / "dspark_run_config.yaml"))
    assert saved.model.block_size == 4 and saved.model.markov_rank == 16  # the drafter's, not the flags'


@pytest.mark.slow
def test_non_finite_loss_stops_before_the_update(chat_verifier_dir, chat_data_file, tmp_path, monkeypatch):
    import trainer.train.trainer as dt

    real = dt.dspark_loss
    calls = {"n": 0}

    def poisoned(*args, **kwargs):
        loss, stats = real(*args, **kwargs)
        calls["n"] += 1
        return (loss * float("nan"), stats) if calls["n"] == 7 else (loss, stats)

    monkeypatch.setattr(dt, "dspark_loss", poisoned)
    out = tmp_path / "run"
    with pytest.raises(FloatingPointError, match=r"non-finite loss \(nan\) at step 7 on packed rows \[\d+\]; "
                                                 r"training stopped before the update.*checkpoint-4"):
        train(config(chat_verifier_dir, chat_data_file, out, "--max_steps", "10", "--eval_steps", "4",
                     "--validation_ratio", "0", "--save_steps", "4", "--eval_at_start", "false"))
    weights = load_file(out / "checkpoint-4" / "model.safetensors")
    assert all(torch.isfinite(w.float()).all() for w in weights.values())


@pytest.mark.slow
@pytest.mark.parametrize("on_prompts", [False, True])
def test_train_on_prompts_anchors_training_blocks_on_prompt_tokens_and_never_evaluation_blocks(
        chat_verifier_dir, chat_data_file, tmp_path, monkeypatch, on_prompts):
    import trainer.train.trainer as dt

    calls = []  # per loss call: training?, the data's mask, the mask the loss got, its anchors, the document ids
    real_loss, real_step = dt.dspark_loss, dt.DSparkTrainer._loss

    def step(self, model, inputs, *args, **kwargs):
        calls.append({"training": model.training, "data": inputs["loss_mask"].clone(), "docs": inputs["document_ids"]})
        return real_step(self, model, inputs, *args, **kwargs)

    def loss(drafter, outputs, input_ids, loss_mask, document_ids, anchors, *args, **kwargs):
        calls[-1].update(given=loss_mask.clone(), anchors=anchors.clone())
        return real_loss(drafter, outputs, input_ids, loss_mask, document_ids, anchors, *args, **kwargs)

    monkeypatch.setattr(dt.DSparkTrainer, "_loss", step)
    monkeypatch.setattr(dt, "dspark_loss", loss)
    train(config(chat_verifier_dir, chat_data_file, tmp_path / "run", "--max_steps", "6", "--eval_steps", "6",
                 "--train_on_prompts", str(on_prompts).lower(), "--calibrate_confidence", "false"))
    training = [c for c in calls if c["training"]]
    evaluation = [c for c in calls if not c["training"]]
    assert len(training) == 6 and evaluation
    for c in calls:
        rows, anchors = (c["anchors"] >= 0).nonzero(as_tuple=True)
        c["reply_targets"] = c["data"][rows, c["anchors"][rows, anchors] + 1].bool()  # the data's mask at slot 0's target
        if c["training"] and on_prompts:
            assert torch.equal(c["given"], (c["docs"] >= 0).to(c["given"].dtype))
            assert not c["reply_targets"].all(), "no training block anchored on a prompt token"
        else:
            assert torch.equal(c["given"], c["data"]) and c["reply_targets"].all()
    if on_prompts:  # blocks still anchor on the replies as well
        assert any(c["reply_targets"].any() for c in training)


def test_too_little_supervision_is_explained(chat_verifier_dir, tmp_path):
    data = tmp_path / "tiny.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"},
                                             {"role": "assistant", "content": "ok"}]}) + "\n")
    with pytest.raises(ValueError, match="supervised tokens, fewer than one block of 4"):
        train(config(chat_verifier_dir, str(data), tmp_path / "run", "--max_steps", "2", "--validation_ratio", "0"))


def test_bad_config_values_are_caught_up_front(chat_verifier_dir, chat_data_file):
    with pytest.raises(ValueError, match="max_seq_length 512 exceeds the packing window"):
        RunConfig.load(None, ["--verifier", "x", "--train_data", "y", "--max_seq_length", "512",
                              "--total_seq_length", "256"])
    with pytest.raises(ValueError, match="unknown option --learning_rat; did you mean --learning_rate?"):
        RunConfig.load(None, ["--verifier", "x", "--train_data", "y", "--learning-rat", "1"])
    with pytest.raises(ValueError, match="train.max_steps: expected a number"):
        RunConfig.load(None, ["--verifier", "x", "--train_data", "y", "--max_steps", "many"])
    with pytest.raises(ValueError, match="model.verifier is not set"):
        RunConfig.load(None, ["--train_data", "y"])


def test_recipes_load_and_the_seed_recipe_is_exact():
    seed = RunConfig.load(os.path.join(ROOT, "configs", "gemma-4-E4B-it.yaml"))
    m, d, t = seed.model, seed.data, seed.train
    assert (m.num_hidden_layers, m.intermediate_size, m.num_attention_heads, m.num_key_value_heads, m.head_dim) == (
        4, 8192, 32, 8, 128)
    assert m.layer_types == ["sliding_attention"] * 3 + ["full_attention"] and m.sliding_window == 2048
    assert (m.block_size, m.draft_vocab_size, m.aux_hidden_state_layer_ids) == (8, 32000, [2, 10, 20, 30, 40])
    assert (t.num_train_epochs, t.learning_rate, t.optimizer, t.lr_scheduler_type, t.warmup_ratio) == (
        3, 5e-4, "muon", "cosine", 0.04)
    assert t.loss_weights == {"ce": 0.1, "tv": 0.9} and t.max_anchors == 512
    assert (d.validation_ratio, d.max_seq_length, d.total_seq_length) == (0.04, 2560, 4096)
    demo = RunConfig.load(os.path.join(ROOT, "configs", "smollm2-135m.yaml"))
    # The flagship keeps the published seed recipe's loss; a run that names none gets the package's measured default.
    assert demo.train.loss_weights == {"kl": 0.5, "tv": 0.5} and demo.objective().loss_weights == {"kl": 0.5, "tv": 0.5}
    # The demo trains on the prompts' tokens too (measured on its 243 conversations); the package default does not.
    assert demo.objective().train_on_prompts and demo.objective().max_anchors == 128
    assert not seed.objective().train_on_prompts


@pytest.mark.slow
def test_init_from_and_lora_adaptation_merge_into_plain_weights(chat_verifier_dir, chat_data_file, tmp_path):
    base = tmp_path / "base"
    train(config(chat_verifier_dir, chat_data_file, base, "--max_steps", "10", "--eval_steps", "10",
                 "--eval_at_start", "false"))
    adapted = tmp_path / "adapted"
    train(config(chat_verifier_dir, chat_data_file, adapted, "--init_from", str(base), "--lora_rank", "4",
                 "--max_steps", "10", "--eval_steps", "5", "--learning_rate", "1e-2"))
    # started from the trained drafter, not from scratch (restricted: this random verifier's mass is outside the
    # draft vocabulary, see test_tiny_run_improves_acceptance_and_writes_servable_checkpoints)
    assert eval_history(adapted, "restricted_accept_len")[0] > 1.3
    before, after = load_file(base / "model.safetensors"), load_file(adapted / "checkpoint-10" / "model.safetensors")
    assert set(before) == set(after)  # merged: same keys, no lora_* or base_layer names
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    calibrated = (adapted / "checkpoint-10" / CALIBRATION_FILE).exists()  # its frozen head got this run's fold
    assert changed and all(".self_attn." in k or ".mlp." in k or (calibrated and k.startswith("confidence_head."))
                           for k in changed)  # only adapted matrices moved
    assert (adapted / "checkpoint-10" / "adapter" / "adapter_config.json").exists()  # kept to resume the run
    drafter = AutoModel.from_pretrained(adapted / "checkpoint-10", trust_remote_code=True)
    assert not any("lora" in n for n, _ in drafter.named_parameters())
    summary = train(config(chat_verifier_dir, chat_data_file, adapted, "--init_from", str(base), "--lora_rank", "4",
                           "--max_steps", "12", "--eval_steps", "5", "--learning_rate", "1e-2",
                           "--resume_from_checkpoint", "latest"))
    assert summary["global_step"] == 12


@pytest.mark.slow
def test_two_process_accelerate_run(chat_verifier_dir, chat_data_file, tmp_path):
    out = tmp_path / "ddp"
    # accelerate 1.15 starts several CPU processes through torchrun only with --multi_gpu (they use gloo on a
    # machine without GPUs); `--cpu` alone runs a single process.
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2", "--num_machines",
           "1", "--mixed_precision", "no", "--dynamo_backend", "no", os.path.join(ROOT, "trainer", "run.py"),
           "--verifier", chat_verifier_dir, "--train_data", chat_data_file, "--output_dir", str(out), *TINY,
           "--max_steps", "6", "--eval_steps", "6", "--record_batches", "true", "--warmup_ratio", "0"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert_ranks_trained_in_sync(out, 6)
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-6", "checkpoint-best"]
    assert (out / "checkpoint-6" / COMPLETE_MARKER).exists()
    assert "validation accept_len" in proc.stdout + proc.stderr
    # the calibration sample was gathered from both ranks: every validation block, as one process sees them
    record = json.loads((out / "checkpoint-6" / CALIBRATION_FILE).read_text())
    assert record["n_blocks"] == json.loads((out / SUMMARY_FILE).read_text())["final_metrics"]["eval_blocks"]
    assert json.loads((out / CALIBRATION_FILE).read_text()) == record


@pytest.mark.slow
def test_fsdp_on_a_machine_without_gpus_is_refused_not_run_as_replicas(chat_verifier_dir, chat_data_file, tmp_path):
    """accelerate runs FSDP only on accelerator process groups; on CPU `--use_fsdp` would quietly become data
    parallelism (a full replica per process), so every rank refuses it before loading anything."""
    out = tmp_path / "fsdp"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--use_fsdp", "--fsdp_version", "2", "--num_processes",
           "2", "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
           os.path.join(ROOT, "trainer", "run.py"), "--verifier", chat_verifier_dir, "--train_data", chat_data_file,
           "--output_dir", str(out), *TINY, "--max_steps", "2"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"},
                          cwd=ROOT)
    assert proc.returncode != 0
    refusal = ("error: accelerate launch --use_fsdp shards a run only across GPUs (accelerate runs FSDP on accelerator "
               "process groups alone), and this machine has none, so each process would train a full replica; launch "
               "with --multi_gpu for data-parallel processes on CPU, or run on GPUs.")
    assert proc.stderr.count(refusal) == 2, proc.stderr[-3000:]  # one line from each rank, no traceback of ours
    assert not out.exists()
