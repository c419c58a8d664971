"""The online hidden-state client up to the vLLM boundary: the file protocol it reads (lock, validation,
deletion), its failure bounds against a closed port, URL assignment and the extraction server's command.
The same client against real vLLM servers: tests/vllm/test_vllm.py (`make test-vllm`)."""

import fcntl
import json
import os
import threading
import time

import pytest
import torch
from safetensors.torch import save_file

from trainer.config import RunConfig
from trainer.serving.server import free_port, spec_for_config
from trainer.states.vllm import BadStatesFile, VLLMStatesError, VLLMStateSource, read_states_file, urls_for_rank
from trainer.verifier.teacher import Teacher


def write_states(path, ids, layers=4, hidden=8, value=None):
    states = torch.randn(ids.numel(), layers, hidden) if value is None else torch.full((ids.numel(), layers, hidden), value)
    save_file({"hidden_states": states, "token_ids": ids.clone()}, str(path))
    open(str(path) + ".lock", "w").close()
    return states


def test_reads_a_valid_file_and_rejects_each_bad_one(tmp_path):
    ids = torch.arange(10, dtype=torch.long)
    states = write_states(tmp_path / "ok.safetensors", ids)
    assert torch.equal(read_states_file(str(tmp_path / "ok.safetensors"), ids, 4, 8), states)
    with pytest.raises(BadStatesFile, match="other token ids"):
        read_states_file(str(tmp_path / "ok.safetensors"), ids + 1, 4, 8)
    with pytest.raises(BadStatesFile, match=r"shape \[10, 4, 8\], not \[10, 3, 8\]"):
        read_states_file(str(tmp_path / "ok.safetensors"), ids, 3, 8)
    write_states(tmp_path / "nan.safetensors", ids, value=float("nan"))
    with pytest.raises(BadStatesFile, match="non-finite"):
        read_states_file(str(tmp_path / "nan.safetensors"), ids, 4, 8)
    data = (tmp_path / "ok.safetensors").read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(data[: len(data) // 2])
    open(tmp_path / "cut.safetensors.lock", "w").close()
    with pytest.raises(BadStatesFile, match="truncated or corrupt"):
        read_states_file(str(tmp_path / "cut.safetensors"), ids, 4, 8)
    open(tmp_path / "gone.safetensors.lock", "w").close()
    with pytest.raises(BadStatesFile, match="does not exist"):
        read_states_file(str(tmp_path / "gone.safetensors"), ids, 4, 8)


def test_waits_for_the_writers_lock_and_times_out_on_a_stuck_one(tmp_path):
    ids = torch.arange(6, dtype=torch.long)
    path = tmp_path / "late.safetensors"
    lock = os.open(str(path) + ".lock", os.O_CREAT | os.O_WRONLY, 0o644)
    fcntl.flock(lock, fcntl.LOCK_EX)  # the server's writer holds this until the file is complete

    def finish():
        time.sleep(0.3)
        save_file({"hidden_states": torch.ones(6, 2, 4), "token_ids": ids}, str(path))
        os.close(lock)

    thread = threading.Thread(target=finish)
    thread.start()
    started = time.monotonic()
    states = read_states_file(str(path), ids, 2, 4)  # not a FileNotFoundError: it waited for the lock
    thread.join()
    assert time.monotonic() - started >= 0.25 and torch.equal(states, torch.ones(6, 2, 4))
    stuck = os.open(str(tmp_path / "stuck.safetensors.lock"), os.O_CREAT | os.O_WRONLY, 0o644)
    fcntl.flock(stuck, fcntl.LOCK_EX)
    try:
        with pytest.raises(BadStatesFile, match="still being written"):
            read_states_file(str(tmp_path / "stuck.safetensors"), ids, 2, 4, lock_timeout=0.2)
    finally:
        os.close(stuck)


def source(tmp_path, urls, **kwargs):
    teacher = Teacher(torch.nn.Identity(), None, torch.randn(50, 8))
    return VLLMStateSource(urls, str(tmp_path), [1, 2, 3], 4, 8, teacher, "tiny/verifier", **kwargs)


def test_an_unreachable_server_is_named_before_training_and_stops_a_run_after_bounded_failures(tmp_path):
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(VLLMStatesError, match=rf"the vLLM server {url} is unreachable .*trainer vllm-server"):
        source(tmp_path, [url]).check()
    # During training: each document gets 1 + retries attempts; max_failures consecutive ones stop the run.
    src = source(tmp_path, [url], retries=5, max_failures=3, backoff=0.01)
    with pytest.raises(VLLMStatesError, match=r"3 hidden-state requests to the vLLM servers failed in a row"):
        src.document_states([torch.arange(5)])
    src = source(tmp_path, [url], retries=1, max_failures=10, backoff=0.01)
    with pytest.raises(VLLMStatesError, match=r"failed all 2 hidden-state requests"):
        src.document_states([torch.arange(5)])
    assert src.stats["retries"] == 2


def test_a_dead_servers_documents_go_to_the_live_url_and_its_in_flight_requests_count_once(tmp_path, monkeypatch):
    """Two URLs: one answers (a stand-in that writes each file like the connector), the other stalls every request
    until it dies, then refuses connections (a closed port, for real). All eight threads end up waiting on the dead
    one; when it dies they fail together, which is one failure of the run (not eight, which max_failures 2 would
    stop on), and their retries skip the dead URL while it cools down: every document is served."""
    dead, live = f"http://127.0.0.1:{free_port()}", "http://live.test:1"
    src = source(tmp_path, [dead, live], retries=3, max_failures=2, backoff=0.2)
    died, real_post, tried = threading.Event(), src._post_completion, {dead: 0, live: 0}
    names = iter(range(10**6))

    def post(url, ids):
        tried[url] += 1
        if url == live:
            name = f"cmpl-{next(names)}.safetensors"
            write_states(tmp_path / name, ids)
            return {"kv_transfer_params": {"hidden_states_path": f"/server/mount/{name}"}}
        died.wait(10)  # in flight until the server dies, then its port is closed
        return real_post(url, ids)

    monkeypatch.setattr(src, "_post_completion", post)
    threading.Timer(0.5, died.set).start()
    documents = [torch.arange(5) + i for i in range(24)]
    out = src.document_states(documents)
    src.close()
    assert len(out) == 24 and all(aux.shape == (5, 24) for aux, _ in out)
    assert src.stats["requests"] == 24 and src.stats["retries"] == tried[dead] >= 2
    assert tried[dead] <= 8 + 2  # the stalled ones, then a probe or two once its cool-down ran out
    assert os.listdir(tmp_path) == []  # every file the live one wrote was read and deleted


def test_urls_are_spread_or_assigned_per_rank():
    urls = ["http://a:1/", "http://b:1", "http://c:1"]
    assert urls_for_rank(urls, 0, 6, False) == ["http://a:1", "http://b:1", "http://c:1"]
    assert urls_for_rank(urls, 4, 6, False) == ["http://b:1", "http://c:1", "http://a:1"]
    # one server per node of two ranks: ranks 0-1 -> a, 2-3 -> b, 4-5 -> c
    assert [urls_for_rank(urls, r, 6, True) for r in range(6)] == [["http://a:1"]] * 2 + [["http://b:1"]] * 2 + \
        [["http://c:1"]] * 2


def test_server_command_extracts_the_runs_layers_plus_the_last(chat_verifier_dir, tmp_path):
    config = RunConfig.load(None, ["--verifier", chat_verifier_dir, "--train_data", "x.jsonl",
                                   "--aux_hidden_state_layer_ids", "[1, 2]", "--max_seq_length", "300",
                                   "--total_seq_length", "600"])
    cpu = spec_for_config(config, str(tmp_path / "hs"), device="cpu", port=8123)
    argv = cpu.argv("py")
    layers = json.loads(argv[argv.index("--speculative-config") + 1])
    assert layers["method"] == "extract_hidden_states"
    assert layers["draft_model_config"]["hf_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 2, 4]  # 4 layers
    kv = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    assert kv["kv_connector"] == "CPUHiddenStatesConnector" and kv["kv_connector_module_path"] == "trainer.serving.cpu_connector"
    assert kv["kv_connector_extra_config"]["shared_storage_path"] == str(tmp_path / "hs")
    assert argv[argv.index("--max-model-len") + 1] == "301" and argv[argv.index("--dtype") + 1] == "float32"
    names = argv[argv.index("--served-model-name") + 1: argv.index("--host")]
    assert names == [chat_verifier_dir, "dspark-hidden-states-1-2-4"]  # the second name says which layers
    assert cpu.env()["PYTHONPATH"].split(os.pathsep)[0] == os.path.dirname(os.path.dirname(os.path.abspath(
        __import__("trainer").__file__)))
    gpu = spec_for_config(config, "/shared/hs", device="gpu", tensor_parallel_size=2)
    assert gpu.argv()[:3] == ["vllm", "serve", chat_verifier_dir] and "--tensor-parallel-size" in gpu.argv()
    assert json.loads(gpu.argv()[gpu.argv().index("--kv-transfer-config") + 1])["kv_connector"] == \
        "ExampleHiddenStatesConnector"
    assert gpu.argv()[gpu.argv().index("--dtype") + 1] == "bfloat16" and gpu.env() == {}
