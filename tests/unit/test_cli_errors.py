"""Bad input gets one sentence and nothing is lost: every CLI maps expected failures to `error: <cause>; <fix>`
on one line with exit status 2 (bad input) or 1 (runtime failure), checks what it can before anything heavy
is loaded, and never touches earlier outputs when it refuses."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from trainer.errors import UsageError, run_cli

ROOT = Path(__file__).resolve().parents[2]
BASE = ["--num_hidden_layers", "1", "--num_attention_heads", "4", "--num_key_value_heads", "2", "--head_dim", "16",
        "--intermediate_size", "128", "--block_size", "4", "--draft_vocab_size", "500", "--markov_rank", "16",
        "--max_seq_length", "128", "--total_seq_length", "256", "--max_steps", "2"]


def refused(main, argv, capsys, code=2) -> str:
    """Run a CLI's main in-process through the shared error path; return its one-line message."""
    assert run_cli(main, argv) == code
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err, err
    return err


@pytest.fixture
def no_heavy_loading(monkeypatch):
    """Fail the test if data preparation or a model load starts: the refusal must come first."""
    import trainer.data.prepare as prepare
    import trainer.run as run

    def forbidden(*args, **kwargs):
        raise AssertionError("validation must refuse the input before data or models are loaded")

    monkeypatch.setattr(prepare, "load_chat_dataset", forbidden)
    monkeypatch.setattr(run, "load_verifier", forbidden)


# ------------------------------------------------------------------------------------------ trainer/run.py
def test_config_file_problems(tmp_path, capsys, no_heavy_loading):
    from trainer.run import main

    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  verifier: x\n train: [\n")
    assert "is not valid YAML" in refused(main, ["--config", str(bad)], capsys)
    listed = tmp_path / "list.yaml"
    listed.write_text("- model\n- data\n")
    assert "holds a YAML list, not a mapping" in refused(main, ["--config", str(listed)], capsys)
    typo = tmp_path / "typo.yaml"
    typo.write_text("model:\n  verifier: x\ntrain:\n  learnig_rate: 0.1\n")
    assert "unknown key train.learnig_rate in the config; did you mean 'learning_rate'?" in \
        refused(main, ["--config", str(typo)], capsys)
    assert "config file nope.yaml does not exist" in refused(main, ["--config", "nope.yaml"], capsys)


@pytest.mark.parametrize("flags, message", [
    (["--train.learnig_rate", "1"], "unknown option --train.learnig_rate; did you mean --train.learning_rate?"),
    (["--trian.max_steps", "1"], "did you mean --train.max_steps?"),
    (["--learning_rate", "0"], "train.learning_rate is 0.0, but it must be > 0"),
    (["--learning_rate", "-1e-4"], "train.learning_rate is -0.0001, but it must be > 0"),
    (["--block_size", "0"], "model.block_size is 0, but it must be >= 1"),
    (["--warmup_ratio", "1.5"], "train.warmup_ratio is 1.5, but it must be in [0, 1)"),
    (["--validation_ratio", "1"], "data.validation_ratio is 1.0, but it must be in [0, 1)"),
])
def test_flags_are_validated_with_suggestions(flags, message, capsys, no_heavy_loading):
    from trainer.run import main

    assert message in refused(main, ["--verifier", "x", "--train_data", "y", *flags], capsys)


def test_paths_and_the_verifier_config_are_checked_before_loading(chat_verifier_dir, chat_data_file, tmp_path,
                                                                  capsys, no_heavy_loading, monkeypatch):
    from trainer.run import main

    run = ["--train_data", chat_data_file, "--output_dir", str(tmp_path / "out"), *BASE]
    assert "verifier directory ./no-such-verifier does not exist" in \
        refused(main, ["--verifier", "./no-such-verifier", *run], capsys)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    assert "is neither a local directory nor in the local Hugging Face cache, and the Hub is offline" in \
        refused(main, ["--verifier", "no-such-org/no-such-model", *run], capsys)
    # the tiny chat verifier has 4 layers and SmolLM2's 49,152-token vocabulary
    assert "aux layer id 4 is out of range for a 4-layer verifier; use ids in 1..3" in \
        refused(main, ["--verifier", chat_verifier_dir, *run, "--aux_hidden_state_layer_ids", "[1, 4]"], capsys)
    assert "model.draft_vocab_size 60000 does not fit the verifier vocabulary of 49152 tokens" in \
        refused(main, ["--verifier", chat_verifier_dir, *run, "--draft_vocab_size", "60000"], capsys)
    assert "data.train_data missing.jsonl does not exist" in \
        refused(main, ["--verifier", chat_verifier_dir, *run[2:], "--train_data", "missing.jsonl"], capsys)
    a_file = tmp_path / "file"
    a_file.write_text("x")
    assert f"train.output_dir {a_file} is a file" in \
        refused(main, ["--verifier", chat_verifier_dir, *run, "--output_dir", str(a_file)], capsys)


def test_a_fresh_run_never_replaces_a_previous_one(chat_verifier_dir, chat_data_file, tmp_path, capsys,
                                                   no_heavy_loading):
    from trainer.run import main
    from trainer.train.checkpoints import COMPLETE_MARKER, SUMMARY_FILE

    out = tmp_path / "out"
    (out / "checkpoint-4").mkdir(parents=True)
    (out / "checkpoint-4" / COMPLETE_MARKER).write_text("{}")
    (out / SUMMARY_FILE).write_text('{"global_step": 4}')
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    message = refused(main, ["--verifier", chat_verifier_dir, "--train_data", chat_data_file, "--output_dir",
                             str(out), *BASE], capsys)
    assert "already holds a run (checkpoint-4, dspark_train_summary.json)" in message
    assert "--resume_from_checkpoint latest" in message and "--overwrite_output_dir true" in message
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before


def test_overwrite_clears_only_what_a_run_wrote(tmp_path):
    from trainer.train.checkpoints import BEST_LINK, SUMMARY_FILE, clear_run

    (tmp_path / "checkpoint-2").mkdir()
    (tmp_path / "incomplete-checkpoint-3").mkdir()
    os.symlink("checkpoint-2", tmp_path / BEST_LINK)
    (tmp_path / SUMMARY_FILE).write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"x")
    (tmp_path / "notes.txt").write_text("mine")
    removed = clear_run(str(tmp_path))
    assert sorted(removed) == sorted(["checkpoint-2", "incomplete-checkpoint-3", BEST_LINK, SUMMARY_FILE,
                                      "model.safetensors"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


# ------------------------------------------------------------------------------------------ rotation
def _checkpoint(root: Path, step: int, complete: bool = True) -> Path:
    from trainer.train.checkpoints import COMPLETE_MARKER

    path = root / f"checkpoint-{step}"
    path.mkdir()
    if complete:
        (path / COMPLETE_MARKER).write_text(json.dumps({"step": step}))
    return path


def test_rotation_keeps_the_limit_the_best_and_the_newest(tmp_path):
    from trainer.train.checkpoints import BEST_LINK, rotate_checkpoints, update_best_link

    for step in (2, 4, 6, 8):
        _checkpoint(tmp_path, step)
    update_best_link(str(tmp_path), str(tmp_path / "checkpoint-2"))
    deleted = rotate_checkpoints(str(tmp_path), 3, str(tmp_path / "checkpoint-2"))
    # the best link is not a checkpoint: a limit of 3 keeps 3 real checkpoints, the best among them
    assert [Path(p).name for p in deleted] == ["checkpoint-4"]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([BEST_LINK, "checkpoint-2", "checkpoint-6",
                                                                  "checkpoint-8"])
    # limit 1: the best and the newest both survive (the limit cannot delete either)
    rotate_checkpoints(str(tmp_path), 1, str(tmp_path / BEST_LINK))
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([BEST_LINK, "checkpoint-2", "checkpoint-8"])


def test_rotation_never_counts_an_incomplete_checkpoint_as_the_newest(tmp_path):
    from trainer.train.checkpoints import latest_checkpoint, rotate_checkpoints

    for step in (2, 4):
        _checkpoint(tmp_path, step)
    _checkpoint(tmp_path, 6, complete=False)  # a save in progress (or killed): not a checkpoint yet
    rotate_checkpoints(str(tmp_path), 1, None)
    assert latest_checkpoint(str(tmp_path)) == str(tmp_path / "checkpoint-4")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-4", "checkpoint-6"]


# ------------------------------------------------------------------------------------------------ evaluate
@pytest.fixture(scope="module")
def drafter_dir(tmp_path_factory, qwen3_verifier):
    from tiny import tiny_drafter

    path = tmp_path_factory.mktemp("drafter") / "d"
    tiny_drafter(qwen3_verifier).save_pretrained(path)
    return path


def test_a_folder_that_is_not_a_drafter_is_named_as_such(chat_verifier_dir):
    """The verifier's folder passed as the drafter: refused at once, not read as a DSpark config with defaults
    (which failed later with "the drafter's config names no verifier")."""
    from trainer.verifier.loading import resolve_drafter

    with pytest.raises(UsageError, match=f"^drafter {re.escape(chat_verifier_dir)} is not a drafter \\(its "
                                         f"config.json describes a 'llama' model\\); pass a folder saved by"):
        resolve_drafter(chat_verifier_dir)


def test_acceptance_refuses_before_loading_models(drafter_dir, chat_verifier_dir, qwen3_verifier, tmp_path, capsys,
                                                  monkeypatch):
    import modeling_dspark
    from trainer.evaluation.in_process import main

    def forbidden(*args, **kwargs):
        raise AssertionError("the refusal must come before the drafter's weights are loaded")

    monkeypatch.setattr(modeling_dspark.DSparkDraftModel, "from_pretrained", forbidden)
    out = ["--out", str(tmp_path / "r.json")]
    assert "drafter directory ./no-such-drafter does not exist" in \
        refused(main, ["--drafter", "./no-such-drafter", *out], capsys)
    assert "the drafter does not fit the verifier" in \
        refused(main, ["--drafter", str(drafter_dir), "--verifier", chat_verifier_dir, *out], capsys)
    # prompt sets: checked with the drafter's own (matching) verifier, before any weights load
    own = tmp_path / "own-verifier"
    qwen3_verifier.save_pretrained(own)
    capsys.readouterr()  # the save's progress bar
    prompts = tmp_path / "prompts"
    assert f"prompt directory {prompts} does not exist" in \
        refused(main, ["--drafter", str(drafter_dir), "--verifier", str(own), "--prompts", str(prompts), *out], capsys)
    prompts.mkdir()
    assert "holds none of the subset files" in \
        refused(main, ["--drafter", str(drafter_dir), "--verifier", str(own), "--prompts", str(prompts), *out], capsys)
    assert not (tmp_path / "r.json").exists()


def test_prompt_files_name_the_file_and_line(tmp_path):
    from trainer.errors import UsageError
    from trainer.evaluation.prompts import load_prompt_sets

    (tmp_path / "qa.jsonl").write_text('{"prompt": "a?"}\n{"question": "b?"}\n')
    with pytest.raises(UsageError, match=r"qa.jsonl line 2 has no string `prompt` field \(found \['question'\]\)"):
        load_prompt_sets(str(tmp_path))
    (tmp_path / "qa.jsonl").write_text('{"prompt": "a?"}\n{"prompt": "b?\n')
    with pytest.raises(UsageError, match=r"qa.jsonl line 2 is not valid JSON"):
        load_prompt_sets(str(tmp_path))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(UsageError, match="holds none of the subset files"):
        load_prompt_sets(str(empty))
    with pytest.raises(UsageError, match="prompt directory ./missing does not exist"):
        load_prompt_sets("./missing")


def test_a_long_bad_line_is_quoted_as_a_short_excerpt(tmp_path, capsys):
    """A truncated 2,000-character last line (a writer killed mid-row) is named by file and line and quoted only
    as a short excerpt, so the one error line stays readable."""
    from trainer.data.files import scan_json_files
    from trainer.data.regenerate import main
    from trainer.errors import UsageError

    cut = json.dumps({"prompt": "x" * 3000})[:2000]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "a?"}\n' + cut)
    message = refused(main, ["--verifier", "./no-such-verifier", "--prompts", str(prompts), "--out",
                             str(tmp_path / "out.jsonl")], capsys)
    assert f"{prompts} line 2 is not valid JSON" in message and len(message) < 300, message
    assert "'{\"prompt\": \"xxx" in message and "xxx...'; fix or delete that line." in message
    # training data: the same excerpt (the rest of that line explains the bad-line policy)
    chat = tmp_path / "chat.jsonl"
    good = json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]})
    chat.write_text(f"{good}\n{good}\n{cut}")
    with pytest.raises(UsageError) as refusal:
        scan_json_files([chat])
    assert f"data file {chat} line 3 is truncated" in str(refusal.value)
    quoted = str(refusal.value).split(": '", 1)[1].split("'; ", 1)[0]
    assert len(quoted) == 80 and quoted.endswith("xxx..."), quoted


# ------------------------------------------------------------------------------------------ push_to_hub.py
def test_push_refuses_a_truncated_weight_file(drafter_dir, tmp_path, capsys):
    import shutil

    import push_to_hub
    from trainer.train.checkpoints import mark_complete

    checkpoint = tmp_path / "checkpoint-3"
    shutil.copytree(drafter_dir, checkpoint)
    mark_complete(str(checkpoint), 3)
    with open(checkpoint / "model.safetensors", "r+b") as f:
        f.truncate(200)
    code = push_to_hub.main(["--checkpoint", str(checkpoint), "--repo-id", "me/x", "--dry-run",
                             str(tmp_path / "exported")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith("error: ") and "\n" not in err
    assert "model.safetensors is not a readable safetensors file" in err and "truncated or corrupt" in err
    assert not (tmp_path / "exported").exists()


# ------------------------------------------------------------------------------------------ real processes
CONFIG = str(ROOT / "configs" / "smollm2-135m.yaml")
UNKNOWN = "unrecognized arguments: --no-such-flag"  # what the shared parser (trainer/errors.py) reports
NOT_INT = "invalid int value: 'abc'"
REQUIRED = "the following arguments are required: "

# Every entry point with each kind of bad input it can get: an unknown flag, a missing required argument, a
# missing input file, a value of the wrong type. Where a kind does not apply, the comment says why. Each row:
# (entry point, case, arguments, the cause its one error line names). The processes run in an empty directory.
EVERY_CLI = [
    # trainer/run.py parses its own flags (run config overrides, trainer/config.py)
    ("trainer/run.py", "unknown flag", ["--verifier", "x", "--train_data", "y", "--no_such_flag", "1"],
     "unknown option --no_such_flag"),
    ("trainer/run.py", "missing argument", [], "model.verifier is not set"),
    ("trainer/run.py", "missing file", ["--config", "nope.yaml"], "config file nope.yaml does not exist"),
    ("trainer/run.py", "wrong type", ["--verifier", "x", "--train_data", "y", "--max_steps", "abc"],
     "train.max_steps: expected a number, got 'abc'"),
    ("trainer/run.py", "bad value", ["--verifier", "x", "--train_data", "y", "--learning_rate", "0"],
     "train.learning_rate is 0.0, but it must be > 0"),
    ("evaluate", "unknown flag", ["--drafter", "d", "--out", "r.json", "--no-such-flag"], UNKNOWN),
    ("evaluate", "missing argument", ["--out", "r.json"], REQUIRED + "--drafter"),
    ("evaluate", "missing file", ["--drafter", "./no-such-drafter", "--out", "r.json"],
     "drafter directory ./no-such-drafter does not exist"),
    ("evaluate", "wrong type", ["--drafter", "d", "--out", "r.json", "--max-prompts", "abc"],
     "argument --max-prompts: " + NOT_INT),
    ("regenerate", "unknown flag", ["--verifier", "v", "--prompts", "p.jsonl", "--out", "o.jsonl",
                                            "--no-such-flag"], UNKNOWN),
    ("regenerate", "missing argument", ["--verifier", "v", "--out", "o.jsonl"], REQUIRED + "--prompts"),
    ("regenerate", "missing file", ["--verifier", "./no-such-verifier", "--prompts", "./no-such.jsonl",
                                            "--out", "o.jsonl"], "prompt file ./no-such.jsonl does not exist"),
    ("regenerate", "wrong type", ["--verifier", "v", "--prompts", "p.jsonl", "--out", "o.jsonl",
                                          "--batch-size", "abc"], "argument --batch-size: " + NOT_INT),
    ("evaluate-vllm", "unknown flag", ["--server", "http://127.0.0.1:1", "--out", "r.json", "--no-such-flag"],
     UNKNOWN),
    ("evaluate-vllm", "missing argument", ["--out", "r.json"], REQUIRED + "--server"),
    ("evaluate-vllm", "missing file", ["--server", "http://127.0.0.1:1", "--prompts", "./no-such-prompts",
                                           "--out", "r.json"], "prompt directory ./no-such-prompts does not exist"),
    ("evaluate-vllm", "wrong type", ["--server", "http://127.0.0.1:1", "--out", "r.json", "--max-prompts",
                                         "abc"], "argument --max-prompts: " + NOT_INT),
    # states-cache parses its own four flags and passes the rest to the run config
    ("states-cache", "unknown flag", ["--config", CONFIG, "--cache_dir", "c", "--no_such_flag", "1"],
     "unknown option --no_such_flag"),
    ("states-cache", "missing argument", [], "no --cache_dir was given"),
    ("states-cache", "missing file", ["--config", "nope.yaml", "--cache_dir", "c"],
     "config file nope.yaml does not exist"),
    ("states-cache", "wrong type", ["--config", CONFIG, "--cache_dir", "c", "--shard_tokens", "abc"],
     "argument --shard_tokens: invalid int value: 'abc'"),
    # vllm-server: flags it does not know are run config overrides
    ("vllm-server", "unknown flag", ["--config", CONFIG, "--no_such_flag", "1"],
     "unknown option --no_such_flag"),
    ("vllm-server", "missing argument", [], REQUIRED + "--config"),
    ("vllm-server", "missing file", ["--config", "nope.yaml"], "config file nope.yaml does not exist"),
    ("vllm-server", "wrong type", ["--config", CONFIG, "--port", "abc"], "argument --port: " + NOT_INT),
    # small-models: no missing file (a name that is not registered is passed on unchanged, as a Hub id
    # or a directory for the caller to check) and no typed flag
    ("small-models", "unknown flag", ["x", "--no-such-flag"], UNKNOWN),
    ("small-models", "missing argument", [], REQUIRED + "names"),
    # push_to_hub.py: no typed flag; the closest is a malformed --repo-id
    ("push_to_hub.py", "unknown flag", ["--checkpoint", "c", "--repo-id", "me/x", "--no-such-flag"], UNKNOWN),
    ("push_to_hub.py", "missing argument", ["--repo-id", "me/x"], REQUIRED + "--checkpoint"),
    ("push_to_hub.py", "missing file", ["--checkpoint", "./no-such-run", "--repo-id", "me/x", "--dry-run", "x"],
     "checkpoint path ./no-such-run does not exist"),
    ("push_to_hub.py", "bad value", ["--checkpoint", "c", "--repo-id", "me/x y", "--dry-run", "x"],
     "--repo-id 'me/x y' is not a valid Hub repo id"),
    # scripts/demo.py: no required argument and no input file (it reads the repo's data/demo; --out is created)
    ("scripts/demo.py", "unknown flag", ["--no-such-flag"], UNKNOWN),
    ("scripts/demo.py", "wrong type", ["--max-new-tokens", "abc"], "argument --max-new-tokens: " + NOT_INT),
    # scripts/seed_checkpoint.py: no input file (--out is written)
    ("scripts/seed_checkpoint.py", "unknown flag", ["--out", "s", "--no-such-flag"], UNKNOWN),
    ("scripts/seed_checkpoint.py", "missing argument", [], REQUIRED + "--out"),
    ("scripts/seed_checkpoint.py", "wrong type", ["--out", "s", "--mask-token-id", "abc"],
     "argument --mask-token-id: " + NOT_INT),
    # scripts/vllm_check_config.py: checked before vLLM is imported, so these hold in any environment
    ("scripts/vllm_check_config.py", "unknown flag", ["d", "v", "--no-such-flag"], UNKNOWN),
    ("scripts/vllm_check_config.py", "missing argument", ["d"], REQUIRED + "verifier"),
    ("scripts/vllm_check_config.py", "missing file", ["./no-such-drafter", "v"],
     "drafter ./no-such-drafter is neither an existing directory nor a Hub id"),
    ("scripts/vllm_check_config.py", "wrong type", ["d", "v", "--num-speculative-tokens", "abc"],
     "argument --num-speculative-tokens: " + NOT_INT),
    ("scripts/vllm_serving_fidelity.py", "unknown flag", ["--drafter", "d", "--prompts", "p", "--out", "o",
                                                          "--no-such-flag"], UNKNOWN),
    ("scripts/vllm_serving_fidelity.py", "missing argument", ["--drafter", "d", "--out", "o"],
     REQUIRED + "--prompts"),
    ("scripts/vllm_serving_fidelity.py", "missing file", ["--drafter", "./no-such-drafter", "--prompts", "p",
                                                          "--out", "o"],
     "drafter directory ./no-such-drafter does not exist"),
    ("scripts/vllm_serving_fidelity.py", "wrong type", ["--drafter", "d", "--prompts", "p", "--out", "o",
                                                        "--max-prompts", "abc"], "argument --max-prompts: " + NOT_INT),
    # benchmarks.run: no required argument and no input file (--work and --json are written)
    ("benchmarks.run", "unknown flag", ["--no-such-flag"], UNKNOWN),
    ("benchmarks.run", "wrong type", ["--reps", "abc"], "argument --reps: " + NOT_INT),
    ("benchmarks.train_step", "unknown flag", ["run", "--config", "small", "--inputs", "i", "--json", "j",
                                               "--no-such-flag"], UNKNOWN),
    ("benchmarks.train_step", "missing argument", ["run", "--inputs", "i", "--json", "j"], REQUIRED + "--config"),
    ("benchmarks.train_step", "missing subcommand", [], REQUIRED + "command"),
    ("benchmarks.train_step", "missing file", ["run", "--config", "small", "--inputs", "./no-such-inputs", "--json",
                                               "j"], "no-such-inputs holds no benchmark inputs"),
    ("benchmarks.train_step", "wrong type", ["run", "--config", "small", "--inputs", "i", "--json", "j", "--steps",
                                             "abc"], "argument --steps: " + NOT_INT),
    # benchmarks.speculators_step: its inputs are checked before its environment (.venv-speculators)
    ("benchmarks.speculators_step", "unknown flag", ["--config", "small", "--inputs", "i", "--json", "j",
                                                     "--no-such-flag"], UNKNOWN),
    ("benchmarks.speculators_step", "missing argument", ["--config", "small", "--json", "j"], REQUIRED + "--inputs"),
    ("benchmarks.speculators_step", "missing file", ["--config", "small", "--inputs", "./no-such-inputs", "--json",
                                                     "j"], "no-such-inputs holds no benchmark inputs"),
    ("benchmarks.speculators_step", "wrong type", ["--config", "small", "--inputs", "i", "--json", "j", "--steps",
                                                   "abc"], "argument --steps: " + NOT_INT),
    # benchmarks.recipe: no required argument; the input file is the speculators python
    ("benchmarks.recipe", "unknown flag", ["--no-such-flag"], UNKNOWN),
    ("benchmarks.recipe", "missing file", ["--speculators-python", "./no-such-python"],
     "no speculators 0.9.0 environment at ./no-such-python"),
    ("benchmarks.recipe", "wrong type", ["--steps", "abc"], "argument --steps: " + NOT_INT),
    ("benchmarks.recipe", "wrong list", ["--seeds", "0,0"],
     "argument --seeds: '0,0' is not a comma-separated list of distinct integers; pass e.g. 0,1"),
    ("benchmarks.recipe", "unknown row", ["--attribution", "loss,warmth"],
     "argument --attribution: 'loss,warmth' names ['warmth']; use a comma-separated subset of"),
    ("benchmarks.recipe", "missing argument", ["--ours-only"],
     "--ours-only measures the attribution rows alone; name them with --attribution ROWS|all."),
    # benchmarks.speculators_recipe: its work directory is checked before its environment (.venv-speculators)
    ("benchmarks.speculators_recipe", "unknown flag", ["--work", "w", "--verifier", "v", "--steps", "1", "--out", "o",
                                                       "--no-such-flag"], UNKNOWN),
    ("benchmarks.speculators_recipe", "missing argument", ["--verifier", "v", "--steps", "1", "--out", "o"],
     REQUIRED + "--work"),
    ("benchmarks.speculators_recipe", "missing file", ["--work", "./no-such-work", "--verifier", "v", "--steps", "1",
                                                       "--out", "o"], "no-such-work/data/shape.json is missing"),
    ("benchmarks.speculators_recipe", "wrong type", ["--work", "w", "--verifier", "v", "--steps", "abc", "--out", "o"],
     "argument --steps: " + NOT_INT),
    # benchmarks.gpu_step, loss_alone, muon_step: no required argument and no input file
    ("benchmarks.gpu_step", "unknown flag", ["--no-such-flag"], UNKNOWN),
    ("benchmarks.gpu_step", "wrong type", ["--steps", "abc"], "argument --steps: " + NOT_INT),
    ("benchmarks.gpu_check", "unknown flag", ["--no-such-flag"], UNKNOWN),
    ("benchmarks.gpu_check", "wrong type", ["--steps", "abc"], "argument --steps: " + NOT_INT),
    ("benchmarks.loss_alone", "unknown flag", ["--no-such-flag"], UNKNOWN),
    ("benchmarks.loss_alone", "wrong type", ["--repeats", "abc"], "argument --repeats: " + NOT_INT),
    ("benchmarks.loss_alone", "wrong list", ["--quick", "--vocab", "abc"],
     "--vocab 'abc' is not a comma-separated list of integers"),
    ("benchmarks.muon_step", "unknown flag", ["--no-such-flag"], UNKNOWN),
    ("benchmarks.muon_step", "wrong type", ["--repeats", "abc"], "argument --repeats: " + NOT_INT),
    # benchmarks.inference: no required argument; the optional --drafter is the input file
    ("benchmarks.inference", "unknown flag", ["--no-such-flag"], UNKNOWN),
    ("benchmarks.inference", "missing file", ["--drafter", "./no-such-drafter"],
     "drafter directory ./no-such-drafter does not exist"),
    ("benchmarks.inference", "wrong type", ["--threads", "abc"], "argument --threads: " + NOT_INT),
    # benchmarks.hidden_states, regeneration: no required argument; the input file is the vLLM python
    ("benchmarks.hidden_states", "unknown flag", ["--no-such-flag"], UNKNOWN),
    ("benchmarks.hidden_states", "missing file", ["--vllm-python", "./no-such-python"],
     "no vLLM environment at ./no-such-python"),
    ("benchmarks.hidden_states", "wrong type", ["--steps", "abc"], "argument --steps: " + NOT_INT),
    ("benchmarks.regeneration", "unknown flag", ["--no-such-flag"], UNKNOWN),
    ("benchmarks.regeneration", "missing file", ["--vllm-python", "./no-such-python"],
     "no vLLM environment at ./no-such-python"),
    ("benchmarks.regeneration", "wrong type", ["--prompts", "abc"], "argument --prompts: " + NOT_INT),
]


def cli_env() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "DSPARK_DEBUG"}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    return env


def assert_refused(returncode: int, stderr: str, cause: str, wrote: list) -> None:
    assert returncode == 2, stderr[-2000:]
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert lines[-1].startswith("error: ") and cause in lines[-1], stderr[-2000:]
    assert "Traceback" not in stderr and "usage:" not in stderr
    assert not wrote, f"a refused command wrote {wrote} into its working directory"


def script_path(entry: str) -> str:
    return str(ROOT / entry) if entry.endswith(".py") else entry


def test_every_cli_prints_one_line_and_exits_2(tmp_path):
    """Every case of EVERY_CLI, run as its command line runs it (`runpy` as `__main__`, its own working directory
    and argv) in one process for all of them (tests/cli_cases.py), so the suite imports torch once, not per case."""
    cases = []
    for i, (entry, _, args, _) in enumerate(EVERY_CLI):
        (tmp_path / f"case-{i}").mkdir()
        cases.append({"entry": script_path(entry), "args": args, "cwd": str(tmp_path / f"case-{i}")})
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "cli_cases.py"), str(tmp_path / "cases.json"),
                           str(tmp_path / "results.json")], capture_output=True, text=True, env=cli_env(), timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    assert len(results) == len(EVERY_CLI)
    failures = []
    for (entry, case, _, cause), r in zip(EVERY_CLI, results, strict=True):
        try:
            assert_refused(r["returncode"], r["stderr"], cause, r["wrote"])
        except AssertionError as e:
            failures.append(f"{entry} {case}: {e}")
    assert not failures, "\n".join(failures)


# One case per kind of entry in a fresh process of its own: a script by path, a package command, a module.
FRESH = [case for case in EVERY_CLI if (case[0], case[1]) in {
    ("trainer/run.py", "unknown flag"), ("push_to_hub.py", "missing file"), ("evaluate", "missing file"),
    ("benchmarks.train_step", "missing subcommand")}]


@pytest.mark.parametrize("entry, case, args, cause", FRESH, ids=[f"{e} {c}" for e, c, _, _ in FRESH])
def test_a_cli_in_a_fresh_process_prints_one_line_and_exits_2(entry, case, args, cause, tmp_path):
    if entry.endswith(".py"):
        command = [str(ROOT / entry)]
    else:  # a package command (`python -m trainer <command>`) or a benchmark module
        command = ["-m", "trainer", entry] if "." not in entry else ["-m", entry]
    proc = subprocess.run([sys.executable, *command, *args], cwd=tmp_path, capture_output=True, text=True,
                          env=cli_env(), timeout=300)
    assert_refused(proc.returncode, proc.stderr, cause, sorted(os.listdir(tmp_path)))


def test_the_shared_parser_names_the_fix():
    from trainer.errors import Parser, UsageError

    parser = Parser(prog="x")
    parser.add_argument("--max-prompts", type=int)
    parser.add_argument("--out", required=True)
    with pytest.raises(UsageError, match=r"^unrecognized arguments: --max-promts 3; did you mean --max-prompts\? "
                                         r"\(run with --help to see the flags and what each takes\)\.$"):
        parser.parse_args(["--out", "o", "--max-promts", "3"])
    with pytest.raises(UsageError, match=r"^unrecognized arguments: --zzz; run with --help to see the flags"):
        parser.parse_args(["--out", "o", "--zzz"])
    with pytest.raises(UsageError, match="^the following arguments are required: --out; run with --help"):
        parser.parse_args([])
    with pytest.raises(UsageError, match="^argument --max-prompts: invalid int value: 'x'; run with --help"):
        parser.parse_args(["--out", "o", "--max-prompts", "x"])
    assert parser.parse_args(["--out", "o", "--max-prompts", "3"]).max_prompts == 3


def test_bad_data_files_are_named_before_the_verifier_loads(chat_verifier_dir, tmp_path, capsys, monkeypatch):
    import trainer.run as run

    def forbidden(*args, **kwargs):
        raise AssertionError("the data must be refused before the verifier is loaded")

    monkeypatch.setattr(run, "load_verifier", forbidden)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    argv = ["--verifier", chat_verifier_dir, "--output_dir", str(tmp_path / "out"), *BASE]
    assert "empty.jsonl" in refused(run.main, [*argv, "--train_data", str(empty)], capsys)
    broken = tmp_path / "broken.jsonl"
    good = json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]})
    broken.write_text("\n".join([good] * 20 + ['{"messages": [oops'] + [good] * 5) + "\n")
    message = refused(run.main, [*argv, "--train_data", str(broken)], capsys)
    assert "broken.jsonl" in message and "line 21" in message and "max_bad_line_ratio" in message
