"""`python -m trainer vllm-server`: the printed command pastes into a shell as exactly the server the trainer
checks for, it can be printed without the verifier's config (offline), and `--start --detach` returns only once
the server is ready, leaving it running (or stops a failed one and names its log).

No vLLM here: the CPU form's program is `--python`, so a fake "python" (a small HTTP server answering `/health`
as it is told) stands in for the vLLM server where one must run.
"""

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from transformers import LlamaConfig

from trainer.__main__ import main
from trainer.config import RunConfig
from trainer.serving.server import free_port, layers_tag, server_command, spec_for_config

ROOT = Path(__file__).resolve().parents[3]
SMOLLM2 = str(ROOT / "configs" / "smollm2-135m.yaml")
GEMMA = str(ROOT / "configs" / "gemma-4-E4B-it.yaml")

# Every value the fake server was started with: its argv, working directory, environment additions and pid.
FAKE_SERVER = """\
#!{python}
import json, os, sys, time
from http.server import BaseHTTPRequestHandler, HTTPServer

argv = sys.argv[1:]
print(json.dumps({{"argv": argv, "cwd": os.getcwd(), "pid": os.getpid(), "env": {{k: os.environ.get(k) for k in
                  ("PYTHONPATH", "VLLM_CPU_KVCACHE_SPACE", "VLLM_NO_USAGE_STATS")}}}}), flush=True)
if os.environ.get("FAKE_VLLM_RECORD"):
    sys.exit(0)
mode, started = os.environ["FAKE_VLLM_MODE"], time.monotonic()
if mode == "exit":  # like vLLM's API server whose engine process outlives it
    import subprocess
    engine = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    print(json.dumps({{"engine_pid": engine.pid}}), flush=True)
    print("ValueError: the fake server refuses this model", flush=True)
    sys.exit(3)

class Health(BaseHTTPRequestHandler):
    def do_GET(self):
        ready = mode == "ready" and time.monotonic() - started > float(os.environ["FAKE_VLLM_READY_AFTER"])
        self.send_response(200 if ready and self.path == "/health" else 503)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass

HTTPServer(("127.0.0.1", int(argv[argv.index("--port") + 1])), Health).serve_forever()
"""


@pytest.fixture(scope="module")
def verifier_dir(tmp_path_factory):
    """A verifier directory with only a config (SmolLM2's layer count, tiny otherwise): the command reads no
    weights."""
    directory = tmp_path_factory.mktemp("verifier")
    LlamaConfig(num_hidden_layers=30, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                num_key_value_heads=1, vocab_size=128).save_pretrained(directory)
    return str(directory)


@pytest.fixture
def fake_python(tmp_path):
    path = tmp_path / "fake-vllm-python"
    path.write_text(FAKE_SERVER.format(python=sys.executable))
    path.chmod(0o755)
    return str(path)


def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, left to a parent that has not reaped it, counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True


def wait_gone(pid: int, within: float = 60.0) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if not alive(pid):
            return True
        time.sleep(0.2)
    return False


def test_the_printed_command_pastes_into_a_shell_as_the_exact_server(verifier_dir, fake_python, tmp_path, capsys):
    """Printed, pasted into bash, run: the program receives exactly the argv and environment the package starts
    the server with, including a states directory whose name needs quoting and both served names (the verifier,
    and the layers tag by which the trainer checks the exact aux ids)."""
    states = tmp_path / "hidden states's"
    argv = ["vllm-server", "--config", SMOLLM2, "--verifier", verifier_dir, "--device", "cpu", "--states_dir",
            str(states), "--python", fake_python, "--port", "8123"]
    assert main(argv) == 0
    line = capsys.readouterr().out.strip()
    assert "\n" not in line
    spec = spec_for_config(RunConfig.load(SMOLLM2, ["--verifier", verifier_dir]), str(states), device="cpu", port=8123)
    assert line == server_command(RunConfig.load(SMOLLM2, ["--verifier", verifier_dir]), str(states), device="cpu",
                                  python=fake_python, port=8123)
    proc = subprocess.run(["bash", "-c", line], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "FAKE_VLLM_RECORD": "1"})
    assert proc.returncode == 0, proc.stderr
    seen = json.loads(proc.stdout)
    assert seen["argv"] == spec.argv(fake_python)[1:]
    assert seen["env"] == spec.env()
    names = seen["argv"][seen["argv"].index("--served-model-name") + 1: seen["argv"].index("--host")]
    assert names == [verifier_dir, layers_tag([2, 15, 27, 30])]
    kv = json.loads(seen["argv"][seen["argv"].index("--kv-transfer-config") + 1])
    assert kv["kv_connector_extra_config"]["shared_storage_path"] == str(states)


def test_verifier_layers_prints_the_same_command_without_reading_the_config(verifier_dir, tmp_path):
    config = RunConfig.load(SMOLLM2, ["--verifier", verifier_dir])
    read = server_command(config, str(tmp_path / "hs"), device="gpu", data_parallel_size=2)
    assert server_command(config, str(tmp_path / "hs"), device="gpu", data_parallel_size=2, verifier_layers=30) == read
    # the aux ids are still checked against the count given
    with pytest.raises(ValueError, match="aux_hidden_state_layer_ids"):
        server_command(config, str(tmp_path / "hs"), verifier_layers=20)


def test_the_seed_recipes_command_needs_no_download_with_its_layer_count():
    """The command the docs show for configs/gemma-4-E4B-it.yaml on 4 GPUs, built offline: Gemma 4 E4B has 42
    layers, so the server extracts the recipe's aux layers 2/10/20/30/40 plus 42."""
    line = server_command(GEMMA, "/dev/shm/hidden-states", data_parallel_size=4, verifier_layers=42)
    assert line == (
        "vllm serve google/gemma-4-E4B-it --served-model-name google/gemma-4-E4B-it "
        "dspark-hidden-states-2-10-20-30-40-42 --host 127.0.0.1 --port 8000 --dtype bfloat16 --max-model-len 2561 "
        "--speculative-config '{\"method\":\"extract_hidden_states\",\"num_speculative_tokens\":1,"
        "\"draft_model_config\":{\"hf_config\":{\"eagle_aux_hidden_state_layer_ids\":[2,10,20,30,40,42]}}}' "
        "--kv-transfer-config '{\"kv_connector\":\"ExampleHiddenStatesConnector\",\"kv_role\":\"kv_producer\","
        "\"kv_connector_extra_config\":{\"shared_storage_path\":\"/dev/shm/hidden-states\"}}' --data-parallel-size 4")


def test_an_unreadable_hub_verifier_names_verifier_layers(capsys):
    """Offline (the suite's default) a Hub verifier that is not cached cannot give its layer count: one sentence
    that says how to print the command anyway."""
    code = main(["vllm-server", "--config", GEMMA, "--verifier", "nobody/no-such-verifier-7f3a", "--states_dir",
                 "out/hs"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith("error: verifier nobody/no-such-verifier-7f3a is neither a local directory nor in the "
                          "local Hugging Face cache")
    assert "to only print the command, pass --verifier_layers with the verifier's num_hidden_layers." in err


def test_start_refuses_a_missing_vllm_python_in_one_sentence(verifier_dir, tmp_path, capsys):
    missing = str(tmp_path / "no-venv" / "bin" / "python")
    code = main(["vllm-server", "--config", SMOLLM2, "--verifier", verifier_dir, "--device", "cpu", "--states_dir",
                 str(tmp_path / "hs"), "--python", missing, "--start", "--detach"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert err == (f"error: --python {missing} is not an executable python, so the vLLM server cannot start here; "
                   f"create the vLLM environment (make vllm-env creates .venv-vllm) or pass its python.\n")
    assert not (tmp_path / "hs").exists()


def detach(verifier_dir, fake_python, tmp_path, mode: str, *extra: str, ready_after: float = 0.0):
    port = free_port()
    argv = [sys.executable, "-m", "trainer", "vllm-server", "--config", SMOLLM2, "--verifier", verifier_dir,
            "--device", "cpu", "--states_dir", "hs", "--python", fake_python, "--port", str(port), "--start",
            "--detach", *extra]
    env = {**os.environ, "FAKE_VLLM_MODE": mode, "FAKE_VLLM_READY_AFTER": str(ready_after),
           "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env)
    return proc, port


def test_detach_returns_once_the_server_is_ready_and_leaves_it_running(verifier_dir, fake_python, tmp_path):
    """The fake answers /health 503 for its first 2 s: the command returns only after it answered 200, prints
    the URL, PID and log, and the server outlives it (its own session), running in the caller's directory."""
    proc, port = detach(verifier_dir, fake_python, tmp_path, "ready", ready_after=2.0)
    record = None
    try:
        assert proc.returncode == 0, proc.stderr
        log = tmp_path / f"vllm-server-{port}.log"  # next to the states directory "hs"
        record = json.loads(log.read_text().splitlines()[0])
        url = f"http://127.0.0.1:{port}"
        assert proc.stdout.strip().splitlines()[-1] == (
            f"vLLM server ready at {url} (pid {record['pid']}, log {log.relative_to(tmp_path)}); stop it with: "
            f"kill -TERM -- -{record['pid']}")
        assert alive(record["pid"])
        with urllib.request.urlopen(url + "/health", timeout=10) as response:  # ready without any further wait
            assert response.status == 200
        assert record["cwd"] == str(tmp_path) and (tmp_path / "hs").is_dir()
        assert record["argv"][record["argv"].index("--port") + 1] == str(port)
        assert record["env"]["PYTHONPATH"].split(os.pathsep)[0] == str(ROOT)
    finally:
        if record is not None and alive(record["pid"]):
            os.killpg(record["pid"], signal.SIGTERM)
    assert wait_gone(record["pid"])


def detach_here(verifier_dir, fake_python, tmp_path, monkeypatch, capsys, mode: str, *extra: str):
    """The failure cases in this process (quicker; nothing must outlive the command there)."""
    port = free_port()
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("FAKE_VLLM_MODE", mode)
    code = main(["vllm-server", "--config", SMOLLM2, "--verifier", verifier_dir, "--device", "cpu", "--states_dir",
                 "hs", "--python", fake_python, "--port", str(port), "--start", "--detach", *extra])
    out, err = capsys.readouterr()
    assert "vLLM server ready" not in out
    return code, err, port


def test_detach_stops_a_server_that_is_not_ready_in_time_and_names_its_log(verifier_dir, fake_python, tmp_path,
                                                                           monkeypatch, capsys):
    code, err, port = detach_here(verifier_dir, fake_python, tmp_path, monkeypatch, capsys, "never",
                                  "--ready_timeout", "3", "--log", "logs/s.log")
    assert code == 1
    assert err == (f"error: the vLLM server at http://127.0.0.1:{port} was not ready after 3 s (last error: none "
                   f"logged); it was stopped, and its log is logs/s.log.\n")
    record = json.loads((tmp_path / "logs" / "s.log").read_text().splitlines()[0])
    assert wait_gone(record["pid"])


def test_detach_reports_a_server_that_exits_with_its_last_error_and_log(verifier_dir, fake_python, tmp_path,
                                                                        monkeypatch, capsys):
    """...and the engine process the server left behind in its process group is stopped too."""
    code, err, port = detach_here(verifier_dir, fake_python, tmp_path, monkeypatch, capsys, "exit")
    assert code == 1
    assert err == (f"error: the vLLM server on port {port} exited with status 3 before it was ready (last error: "
                   f"ValueError: the fake server refuses this model); its log is vllm-server-{port}.log.\n")
    engine = json.loads((tmp_path / f"vllm-server-{port}.log").read_text().splitlines()[1])["engine_pid"]
    try:
        assert wait_gone(engine, within=30.0)
    finally:
        if alive(engine):
            os.kill(engine, signal.SIGKILL)


@pytest.mark.parametrize("flags", [["--log", "x.log"], ["--ready_timeout", "5"]])
def test_detach_only_flags_are_refused_without_detach(verifier_dir, tmp_path, flags, capsys):
    code = main(["vllm-server", "--config", SMOLLM2, "--verifier", verifier_dir, "--states_dir", str(tmp_path / "hs"),
                 *flags])
    err = capsys.readouterr().err
    assert code == 2 and err == ("error: --log and --ready_timeout apply to a detached server; add --start --detach, "
                                 "or drop them.\n")
