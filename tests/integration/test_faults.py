"""Faults while running, injected for real: processes killed with SIGKILL, runs colliding in one output_dir, a
disk that fills (ENOSPC injected at the write), a DDP rank that dies. Each test checks what the user sees (one
sentence), what is on disk afterwards (every artefact loads), and that the rerun completes.

The processes are real `trainer/run.py` runs on a tiny random verifier that speaks SmolLM2's tokenizer; they are
bounded in time and killed with their process group on failure.
"""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import ROOT

from trainer.errors import UsageError
from trainer.train.checkpoints import RUN_LOCK_FILE, CheckpointError, RunLock, is_complete, latest_checkpoint

pytestmark = pytest.mark.faults
TINY = ["--num_hidden_layers", "1", "--num_attention_heads", "4", "--num_key_value_heads", "2", "--head_dim", "16",
        "--intermediate_size", "128", "--block_size", "4", "--draft_vocab_size", "500", "--markov_rank", "16",
        "--max_seq_length", "128", "--total_seq_length", "256", "--eval_at_start", "false",
        "--calibrate_confidence", "false", "--logging_steps", "1"]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}


def run_args(verifier, data, out, *extra) -> list[str]:
    return [sys.executable, str(ROOT / "trainer" / "run.py"), "--verifier", verifier, "--train_data", data,
            "--output_dir", str(out), *TINY, *extra]


def start(argv, log: Path, env=None) -> subprocess.Popen:
    return subprocess.Popen(argv, cwd=ROOT, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env or ENV,
                            start_new_session=True)


def finish(proc: subprocess.Popen, timeout=600) -> int:
    try:
        return proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def wait_for(condition, proc: subprocess.Popen, log: Path, timeout=300, what="the condition"):
    deadline = time.monotonic() + timeout
    while not condition():
        if proc.poll() is not None:
            raise AssertionError(f"the run exited ({proc.returncode}) before {what}:\n{log.read_text()[-3000:]}")
        if time.monotonic() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            raise AssertionError(f"{what} did not happen within {timeout} s:\n{log.read_text()[-3000:]}")
        time.sleep(0.05)


def error_line(text: str) -> str:
    """The one `error: ...` line a failed command printed (a progress bar may still close after it)."""
    errors = [line for line in text.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, text[-3000:]
    return errors[0]


# ------------------------------------------------------------------------------------------ the run lock
def test_the_run_lock_refuses_a_second_owner_and_takes_over_a_dead_ones(tmp_path, caplog):
    out = str(tmp_path / "run")
    first = RunLock(out).acquire()
    owner = json.loads((tmp_path / "run" / RUN_LOCK_FILE).read_text())
    assert owner["pid"] == os.getpid() and owner["host"] == socket.gethostname()
    message = (rf"^train.output_dir {out} is in use by a run in progress \(pid {os.getpid()} on host "
               rf"{socket.gethostname()}, started [0-9: -]+\); wait for it to finish, stop it, or pass another "
               r"--output_dir.$")
    with pytest.raises(CheckpointError, match=message):
        RunLock(out).check()  # the probe preflight makes
    with pytest.raises(CheckpointError, match=message):
        RunLock(out).acquire()
    first.release()
    assert (tmp_path / "run" / RUN_LOCK_FILE).read_text() == ""  # released: no owner left to name
    with RunLock(out):
        assert not [r for r in caplog.records if "taking over" in r.message]
    # A lock file that names an owner whose lock the kernel dropped (the process died): taken over, with a warning.
    (tmp_path / "run" / RUN_LOCK_FILE).write_text(json.dumps({"pid": 999999, "host": "elsewhere", "started": "x"}))
    with RunLock(out):
        pass
    assert any("taking over the lock of a run that is no longer running (pid 999999 on host elsewhere" in r.message
               for r in caplog.records)
    (tmp_path / "file").write_text("")
    with pytest.raises(CheckpointError, match="is a file, not a directory"):
        RunLock(str(tmp_path / "file")).acquire()


def test_two_runs_into_one_output_dir_and_a_killed_owner(chat_verifier_dir, chat_data_file, tmp_path):
    """A second run into a directory a run is training into is refused before it loads anything; once the owner
    is killed (SIGKILL: no clean-up ran), the rerun takes the lock over, resumes and finishes."""
    out = tmp_path / "out"
    args = run_args(chat_verifier_dir, chat_data_file, out, "--max_steps", "400", "--save_steps", "2",
                    "--validation_ratio", "0")
    owner = start(args, tmp_path / "owner.log")
    try:
        wait_for(lambda: latest_checkpoint(str(out)) is not None, owner, tmp_path / "owner.log",
                 what="the first checkpoint")
        for extra in ([], ["--resume_from_checkpoint", "latest"], ["--overwrite_output_dir", "true"]):
            second = subprocess.run([*args, *extra], cwd=ROOT, capture_output=True, text=True, env=ENV, timeout=300)
            assert second.returncode == 2 and "Traceback" not in second.stderr, second.stderr[-3000:]
            assert error_line(second.stderr) == (
                f"error: train.output_dir {out} is in use by a run in progress (pid {owner.pid} on host "
                f"{socket.gethostname()}, started {json.loads((out / RUN_LOCK_FILE).read_text())['started']}); "
                f"wait for it to finish, stop it, or pass another --output_dir."), second.stderr[-3000:]
        assert owner.poll() is None  # the owner trained on, untouched
        os.killpg(owner.pid, signal.SIGKILL)
        owner.wait()
    finally:
        if owner.poll() is None:
            os.killpg(owner.pid, signal.SIGKILL)
            owner.wait()
    killed_at = int(Path(latest_checkpoint(str(out))).name.split("-")[1])
    rerun = start([*args[:args.index("--max_steps")], "--max_steps", str(killed_at + 4), "--save_steps", "2",
                   "--validation_ratio", "0", "--resume_from_checkpoint", "latest"], tmp_path / "rerun.log")
    assert finish(rerun) == 0, (tmp_path / "rerun.log").read_text()[-3000:]
    log = (tmp_path / "rerun.log").read_text()
    assert f"taking over the lock of a run that is no longer running (pid {owner.pid} on host" in log
    assert json.loads((out / "dspark_train_summary.json").read_text())["global_step"] == killed_at + 4
    assert all(is_complete(str(p)) for p in out.glob("checkpoint-[0-9]*"))
    assert (out / RUN_LOCK_FILE).read_text() == ""


# ------------------------------------------------------------------------------------------ checkpoint saves
def fault_env(tmp_path: Path, spec: str) -> dict:
    """The environment of a subprocess whose `spec` fault (tests/fault_hook/sitecustomize.py) fires once."""
    return {**ENV, "PYTHONPATH": os.pathsep.join([str(ROOT / "tests" / "fault_hook"), str(ROOT)]),
            "DSPARK_FAULT": spec, "DSPARK_FAULT_REACHED": str(tmp_path / "fault-reached")}


def assert_loadable_checkpoint(path: Path) -> None:
    """A checkpoint that a user could resume, export or serve: the marker, a readable config and weights."""
    from modeling_dspark import DSparkDraftModel
    from trainer.contract import check_folder

    assert is_complete(str(path)), path
    check_folder(path)
    DSparkDraftModel.from_pretrained(str(path))


def final_weights(out: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(out / "model.safetensors"))


@pytest.fixture(scope="module")
def uninterrupted(chat_verifier_dir, chat_data_file, tmp_path_factory):
    """The 6-step run the interrupted runs below must end equal to."""
    out = tmp_path_factory.mktemp("uninterrupted") / "out"
    proc = subprocess.run(run_args(chat_verifier_dir, chat_data_file, out, "--max_steps", "6", "--save_steps", "2",
                                   "--validation_ratio", "0"), cwd=ROOT, capture_output=True, text=True, env=ENV,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return final_weights(out)


def assert_same_weights(ours: dict, reference: dict) -> None:
    assert ours.keys() == reference.keys()
    for name, value in reference.items():
        assert torch.allclose(ours[name], value, rtol=1e-5, atol=1e-6), name


def resume_and_finish(chat_verifier_dir, chat_data_file, out: Path, log: Path) -> None:
    proc = start(run_args(chat_verifier_dir, chat_data_file, out, "--max_steps", "6", "--save_steps", "2",
                          "--validation_ratio", "0", "--resume_from_checkpoint", "latest"), log)
    assert finish(proc) == 0, log.read_text()[-3000:]


def test_a_full_disk_during_a_checkpoint_save(chat_verifier_dir, chat_data_file, tmp_path, uninterrupted):
    out = tmp_path / "out"
    env = fault_env(tmp_path, "safetensors.torch:save_file:*/checkpoint-4/*:half-enospc")
    proc = subprocess.run(run_args(chat_verifier_dir, chat_data_file, out, "--max_steps", "6", "--save_steps", "2",
                                   "--validation_ratio", "0"), cwd=ROOT, capture_output=True, text=True, env=env,
                          timeout=600)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert error_line(proc.stderr) == (
        f"error: the disk of {out} filled up while saving checkpoint-4, which was removed (checkpoint-2 is the newest "
        f"complete checkpoint); free some space and rerun the same command with --resume_from_checkpoint latest.")
    assert sorted(p.name for p in out.glob("*checkpoint-*")) == ["checkpoint-2"]
    assert_loadable_checkpoint(out / "checkpoint-2")
    resume_and_finish(chat_verifier_dir, chat_data_file, out, tmp_path / "rerun.log")
    assert_same_weights(final_weights(out), uninterrupted)


def test_kill_9_during_a_checkpoint_save(chat_verifier_dir, chat_data_file, tmp_path, uninterrupted):
    """Killed with checkpoint-4's weights half written: the rerun sets it aside, resumes from checkpoint-2 and ends
    where an uninterrupted run ends."""
    out = tmp_path / "out"
    env = fault_env(tmp_path, "safetensors.torch:save_file:*/checkpoint-4/*:half-pause")
    proc = start(run_args(chat_verifier_dir, chat_data_file, out, "--max_steps", "6", "--save_steps", "2",
                          "--validation_ratio", "0"), tmp_path / "killed.log", env=env)
    wait_for(lambda: (tmp_path / "fault-reached").exists(), proc, tmp_path / "killed.log", what="the save")
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not is_complete(str(out / "checkpoint-4")) and latest_checkpoint(str(out)) == str(out / "checkpoint-2")
    resume_and_finish(chat_verifier_dir, chat_data_file, out, tmp_path / "rerun.log")
    assert "checkpoint " in (log := (tmp_path / "rerun.log").read_text()) and "moved aside" in log
    assert (out / "incomplete-checkpoint-4").is_dir()  # kept for inspection, never resumed from
    for path in out.glob("checkpoint-[0-9]*"):
        assert_loadable_checkpoint(path)
    assert_same_weights(final_weights(out), uninterrupted)


def test_a_newest_checkpoint_damaged_after_it_completed_is_set_aside(chat_verifier_dir, chat_data_file, tmp_path,
                                                                    uninterrupted):
    """A complete checkpoint-6 whose weights were cut later (a disk or copy error): `--resume_from_checkpoint latest`
    sets it aside with a warning naming the file and resumes from checkpoint-4 instead of refusing."""
    out = tmp_path / "out"
    proc = subprocess.run(run_args(chat_verifier_dir, chat_data_file, out, "--max_steps", "6", "--save_steps", "2",
                                   "--validation_ratio", "0"), cwd=ROOT, capture_output=True, text=True, env=ENV,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    weights = out / "checkpoint-6" / "model.safetensors"
    os.truncate(weights, weights.stat().st_size // 2)
    resume_and_finish(chat_verifier_dir, chat_data_file, out, tmp_path / "rerun.log")
    log = (tmp_path / "rerun.log").read_text()
    assert (f"{out / 'checkpoint-6'} is damaged ({weights} is not a readable safetensors file" in log
            and "moved aside as damaged-checkpoint-6, resuming from the checkpoint before it" in log), log[-3000:]
    assert "resuming from " + str(out / "checkpoint-4") in log
    assert_same_weights(final_weights(out), uninterrupted)


# ------------------------------------------------------------------------------------------ calibration's fold
# One checkpoint, so checkpoint-best is also the one `--resume_from_checkpoint latest` resumes from.
CALIBRATED = ["--max_steps", "2", "--save_steps", "2", "--eval_steps", "2", "--calibrate_confidence", "true"]
BEST_FOLD = "safetensors.torch:save_file:*/checkpoint-*/model.safetensors.tmp"  # the fold into checkpoint-best


@pytest.fixture(scope="module")
def calibrated(chat_verifier_dir, chat_data_file, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("calibrated") / "out"
    proc = subprocess.run(run_args(chat_verifier_dir, chat_data_file, out, *CALIBRATED), cwd=ROOT,
                          capture_output=True, text=True, env=ENV, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def assert_calibrated_like(out: Path, reference: Path) -> None:
    """Both the final drafter and checkpoint-best carry the fold, in their weights, equal to the reference run's."""
    from trainer.train.calibration import applied_fold

    best = (out / "checkpoint-best").resolve()
    assert best.name == (reference / "checkpoint-best").resolve().name
    for ours, theirs in ((out, reference), (best, (reference / "checkpoint-best").resolve())):
        fold_ours, fold_theirs = applied_fold(ours), applied_fold(theirs)
        assert fold_ours is not None and fold_ours == pytest.approx(fold_theirs, rel=1e-4)
        assert_same_weights(final_weights(ours), final_weights(theirs))
    assert_loadable_checkpoint(best)
    assert not list(out.rglob("*.tmp"))


def test_kill_9_during_calibrations_fold_into_checkpoint_best(chat_verifier_dir, chat_data_file, tmp_path,
                                                              calibrated):
    from trainer.train.calibration import applied_fold

    out = tmp_path / "out"
    proc = start(run_args(chat_verifier_dir, chat_data_file, out, *CALIBRATED), tmp_path / "killed.log",
                 env=fault_env(tmp_path, f"{BEST_FOLD}:half-pause"))
    wait_for(lambda: (tmp_path / "fault-reached").exists(), proc, tmp_path / "killed.log", what="the fold")
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    best = (out / "checkpoint-best").resolve()
    assert applied_fold(best) is None  # the half-written file is the temporary one: best is intact, unfolded
    assert_loadable_checkpoint(best)
    resume_calibrated(chat_verifier_dir, chat_data_file, out, tmp_path / "rerun.log")
    assert_calibrated_like(out, calibrated)


def test_kill_9_between_the_folded_weights_and_the_calibration_record(chat_verifier_dir, chat_data_file, tmp_path,
                                                                     calibrated):
    """checkpoint-best's weights are folded but its record is not written yet: the fold is read from the weights
    file itself, so the rerun, resuming from that checkpoint, unfolds it instead of training on a folded head."""
    from trainer.train.calibration import applied_fold

    out = tmp_path / "out"
    env = fault_env(tmp_path, "trainer.files:write_json_atomic:*/checkpoint-*/dspark_calibration.json:pause")
    proc = start(run_args(chat_verifier_dir, chat_data_file, out, *CALIBRATED), tmp_path / "killed.log", env=env)
    wait_for(lambda: (tmp_path / "fault-reached").exists(), proc, tmp_path / "killed.log", what="the record")
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    best = (out / "checkpoint-best").resolve()
    assert applied_fold(best) is not None and not (best / "dspark_calibration.json").exists()
    resume_calibrated(chat_verifier_dir, chat_data_file, out, tmp_path / "rerun.log")
    assert_calibrated_like(out, calibrated)
    assert (best / "dspark_calibration.json").exists()


def test_a_full_disk_during_calibrations_fold(chat_verifier_dir, chat_data_file, tmp_path, calibrated):
    out = tmp_path / "out"
    proc = subprocess.run(run_args(chat_verifier_dir, chat_data_file, out, *CALIBRATED), cwd=ROOT,
                          capture_output=True, text=True, env=fault_env(tmp_path, f"{BEST_FOLD}:half-enospc"),
                          timeout=600)
    best = (out / "checkpoint-best").resolve()
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert error_line(proc.stderr) == (
        f"error: the disk of {best} filled up while folding the confidence calibration into model.safetensors, "
        f"which is unchanged (not calibrated); free some space and rerun the same command with "
        f"--resume_from_checkpoint latest.")
    assert not list(out.rglob("*.tmp"))
    assert_loadable_checkpoint(best)
    resume_calibrated(chat_verifier_dir, chat_data_file, out, tmp_path / "rerun.log")
    assert_calibrated_like(out, calibrated)


def resume_calibrated(chat_verifier_dir, chat_data_file, out: Path, log: Path) -> None:
    proc = start(run_args(chat_verifier_dir, chat_data_file, out, *CALIBRATED, "--resume_from_checkpoint", "latest"),
                 log)
    assert finish(proc) == 0, log.read_text()[-3000:]


# ------------------------------------------------------------------------------------------ the offline cache
def cache_args(verifier, data, cache_dir: Path) -> list[str]:
    return [sys.executable, "-m", "trainer", "states-cache", "--cache_dir", str(cache_dir), "--shard_tokens", "1024",
            "--verifier", verifier, "--train_data", data, "--max_seq_length", "128", "--total_seq_length", "256"]


def cache_tensors(cache_dir: Path) -> dict:
    from safetensors.torch import load_file

    return {p.name: load_file(str(p)) for p in sorted(cache_dir.glob("shard-*.safetensors"))}


@pytest.fixture(scope="module")
def complete_cache(chat_verifier_dir, chat_data_file, tmp_path_factory) -> Path:
    cache_dir = tmp_path_factory.mktemp("cache") / "states"
    proc = subprocess.run(cache_args(chat_verifier_dir, chat_data_file, cache_dir), cwd=ROOT, capture_output=True,
                          text=True, env=ENV, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(list(cache_dir.glob("shard-*.safetensors"))) > 3
    return cache_dir


def assert_same_cache(ours: Path, reference: Path) -> None:
    from trainer.states.offline_cache import OfflineCache

    OfflineCache(str(ours))  # complete and readable
    a, b = cache_tensors(ours), cache_tensors(reference)
    assert a.keys() == b.keys()
    for name in a:
        for key in ("aux", "last", "offsets"):
            assert torch.allclose(a[name][key], b[name][key], rtol=1e-5, atol=1e-5), (name, key)


def test_kill_9_during_a_cache_write(chat_verifier_dir, chat_data_file, tmp_path, complete_cache):
    from trainer.states.cache_format import COMPLETE_FILE
    from trainer.states.offline_cache import OfflineCache

    cache_dir = tmp_path / "states"
    proc = start(cache_args(chat_verifier_dir, chat_data_file, cache_dir), tmp_path / "killed.log",
                 env=fault_env(tmp_path, "os:replace:*/shard-00002.safetensors.tmp:pause"))  # written, not renamed
    wait_for(lambda: (tmp_path / "fault-reached").exists(), proc, tmp_path / "killed.log", what="the third shard")
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert sorted(p.name for p in cache_dir.glob("shard-*")) == ["shard-00000.safetensors", "shard-00001.safetensors",
                                                                 "shard-00002.safetensors.tmp"]
    assert not (cache_dir / COMPLETE_FILE).exists()
    with pytest.raises(UsageError, match=rf"cache {cache_dir} is incomplete \(2 of \d+ shards\); rerun the"):
        OfflineCache(str(cache_dir))  # a training run refuses it rather than reading half a cache
    rerun = subprocess.run(cache_args(chat_verifier_dir, chat_data_file, cache_dir), cwd=ROOT, capture_output=True,
                           text=True, env=ENV, timeout=600)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert "removing shard-00002.safetensors.tmp, left half-written by an interrupted run" in rerun.stdout
    assert re.search(r"complete: \d+ shards written, 2 skipped \(already done\)", rerun.stdout), rerun.stdout[-3000:]
    assert_same_cache(cache_dir, complete_cache)


def test_a_full_disk_during_a_cache_write(chat_verifier_dir, chat_data_file, tmp_path, complete_cache, monkeypatch):
    """The disk fills while the third shard is written (ENOSPC from the file's write, after half of it): the
    shards before it stay, the partial file goes, one sentence says how many are kept; the rerun resumes."""
    import contextlib
    import errno
    import io

    import trainer.states.cache_format as states_cache
    from trainer.errors import run_cli
    from trainer.states.cache_cli import main as cache_main

    class FillingFile(io.FileIO):
        def write(self, data):
            if self.tell() > 4096:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), self.name)
            return super().write(data)

    def filling_open(path, mode="r", *args, **kwargs):
        if str(path).endswith("shard-00002.safetensors.tmp") and "w" in mode:
            return FillingFile(path, "w")
        return open(path, mode, *args, **kwargs)

    cache_dir = tmp_path / "states"
    argv = cache_args(chat_verifier_dir, chat_data_file, cache_dir)[4:]  # after `python -m trainer states-cache`
    monkeypatch.setattr(states_cache, "open", filling_open, raising=False)
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr):
        assert run_cli(cache_main, argv) == 1
    total = len(list(complete_cache.glob("shard-*.safetensors")))
    assert error_line(stderr.getvalue()) == (
        f"error: the disk of cache {cache_dir} filled up while writing shard-00002.safetensors (2 of {total} shards "
        f"are finished and kept); free some space and rerun the same command to resume.")
    assert sorted(p.name for p in cache_dir.iterdir()) == ["plan.json", "shard-00000.safetensors",
                                                           "shard-00001.safetensors"]  # no partial file
    monkeypatch.undo()
    assert run_cli(cache_main, argv) == 0
    assert_same_cache(cache_dir, complete_cache)


# ------------------------------------------------------------------------------------------ push staging
def push_args(checkpoint: Path, out: Path) -> list[str]:
    return [sys.executable, str(ROOT / "push_to_hub.py"), "--checkpoint", str(checkpoint), "--repo-id", "me/drafter",
            "--verifier-id", "HuggingFaceTB/SmolLM2-135M-Instruct", "--dry-run", str(out)]


def assert_exported(out: Path) -> None:
    from modeling_dspark import DSparkDraftModel
    from trainer.contract import check_folder

    check_folder(out)
    DSparkDraftModel.from_pretrained(str(out))
    assert sorted(p.name for p in out.parent.iterdir()) == [out.name]  # no staging or replaced folder left


def test_kill_9_and_a_full_disk_during_push_staging(calibrated, tmp_path):
    out = tmp_path / "export" / "exported"
    staged_weights = "safetensors.torch:save_file:*/exported.tmp-*/model.safetensors"
    proc = start(push_args(calibrated, out), tmp_path / "killed.log", env=fault_env(tmp_path, f"{staged_weights}:pause"))
    wait_for(lambda: (tmp_path / "fault-reached").exists(), proc, tmp_path / "killed.log", what="the staging")
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not out.exists() and [p.name.split("-")[0] for p in out.parent.iterdir()] == ["exported.tmp"]
    rerun = subprocess.run(push_args(calibrated, out), cwd=ROOT, capture_output=True, text=True, env=ENV, timeout=600)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert "left by an interrupted dry run" in rerun.stdout
    assert_exported(out)
    before = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    # The disk fills while a second export is staged: the first one is untouched and the staging folder is gone.
    (tmp_path / "fault-reached").unlink()
    full = subprocess.run(push_args(calibrated, out), cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env=fault_env(tmp_path, f"{staged_weights}:half-enospc"))
    assert full.returncode == 1 and "Traceback" not in full.stderr, full.stderr[-3000:]
    line = error_line(full.stderr)
    assert line.startswith(f"error: staging into {out.parent}/exported.tmp-") and "No space left on device" in line
    assert line.endswith("free disk space there or choose another --dry-run directory, then rerun.")
    assert {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    assert_exported(out)


# ------------------------------------------------------------------------------------------ regeneration
# `python -m trainer regenerate` runs the module as __main__, which the fault hook cannot patch before it runs;
# this is the same entry point (its `if __name__ == "__main__"` line) under its importable name.
REGENERATE = "import sys; from trainer.errors import run_cli; from trainer.data.regenerate import main; sys.exit(run_cli(main))"


def regenerate_args(verifier: str, prompts: Path, out: Path) -> list[str]:
    # batch size 1: every row is generated alone, so a rerun's rows equal an uninterrupted run's bit for bit
    return [sys.executable, "-c", REGENERATE, "--verifier", verifier, "--prompts", str(prompts), "--out", str(out),
            "--max-new-tokens", "12", "--temperature", "0", "--batch-size", "1"]


def test_kill_9_during_a_regeneration_run(chat_verifier_dir, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "prompt": f"Tell me about river {i}."}) + "\n"
                               for i in range(8)))
    reference = tmp_path / "reference.jsonl"
    proc = subprocess.run(regenerate_args(chat_verifier_dir, prompts, reference), cwd=ROOT, capture_output=True,
                          text=True, env=ENV, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = tmp_path / "out.jsonl"
    proc = start(regenerate_args(chat_verifier_dir, prompts, out), tmp_path / "killed.log",
                 env=fault_env(tmp_path, "trainer.data.replies:OrderedWriter._write:#3:pause"))
    wait_for(lambda: (tmp_path / "fault-reached").exists(), proc, tmp_path / "killed.log", what="the third row")
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    kept = out.read_text().splitlines()
    assert [json.loads(line)["id"] for line in kept] == ["p0", "p1"]  # every finished row is on disk, whole
    with open(out, "a") as f:  # and a kill in the middle of a write leaves at most one cut line
        f.write(reference.read_text().splitlines()[2][:40])
    rerun = subprocess.run(regenerate_args(chat_verifier_dir, prompts, out), cwd=ROOT, capture_output=True,
                           text=True, env=ENV, timeout=600)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert out.read_text() == reference.read_text()


# ------------------------------------------------------------------------------------------ a dead DDP rank
def rank_pid(rank: int) -> int | None:
    """The pid of the trainer/run.py worker whose torchrun RANK is `rank` (this user's processes only)."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(part.endswith(b"trainer/run.py") for part in cmdline) and f"RANK={rank}".encode() in environ:
            return int(pid)
    return None


def test_one_killed_ddp_rank_stops_the_other_promptly(chat_verifier_dir, chat_data_file, tmp_path):
    out = tmp_path / "ddp"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
           *run_args(chat_verifier_dir, chat_data_file, out, "--max_steps", "400", "--validation_ratio", "0",
                     "--record_batches", "true", "--save_steps", "2")[1:]]
    log = tmp_path / "ddp.log"
    proc = start(cmd, log)
    try:
        wait_for(lambda: (out / "batches-rank1.jsonl").exists()
                 and len((out / "batches-rank1.jsonl").read_text().splitlines()) >= 3, proc, log, what="3 steps")
        victim = rank_pid(1)
        assert victim is not None
        os.kill(victim, signal.SIGKILL)
        killed = time.monotonic()
        code = proc.wait(timeout=300)  # a hang would last until the process group's 30-minute timeout
        stopped = time.monotonic() - killed
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    text = log.read_text()
    print(f"the run stopped {stopped:.1f} s after rank 1 was killed, exit {code}")
    assert code != 0 and stopped < 120  # a generous bound: gloo's own timeout would be 30 minutes
    assert rank_pid(0) is None  # no orphaned rank left training
    # rank 0 says what happened in one line (torchrun's own report of the dead rank follows it)
    assert ("error: this process was stopped by SIGTERM (under accelerate launch: another rank of this run died, its "
            "log above says why); completed checkpoints are kept, so fix that cause and rerun with "
            "--resume_from_checkpoint latest.") in text or "error: another rank of this run stopped" in text, text[-5000:]
    assert "Traceback" not in text.split("error: ")[0][-3000:]  # no traceback from our ranks before the sentence
    for path in out.glob("checkpoint-[0-9]*"):
        assert_loadable_checkpoint(path)
    # the rerun on both ranks resumes from the newest complete checkpoint and finishes
    resumed_at = int(Path(latest_checkpoint(str(out))).name.split("-")[1])
    cmd[cmd.index("400")] = str(resumed_at + 2)
    rerun = subprocess.run([*cmd, "--resume_from_checkpoint", "latest"], cwd=ROOT, capture_output=True, text=True,
                           env=ENV, timeout=600)
    assert rerun.returncode == 0, rerun.stdout[-3000:] + rerun.stderr[-3000:]
    assert json.loads((out / "dspark_train_summary.json").read_text())["global_step"] == resumed_at + 2
