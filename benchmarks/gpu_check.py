"""`make gpu-check`: everything a GPU machine should tell us, in one call that fits a short device lease.

    make gpu-check                                  # = python -m benchmarks.gpu_check (on the GPU machine)
    make gpu-check GPU_CHECK_ARGS=--cpu-smoke       # the same code paths at tiny shapes on the CPU (in the suite)

In order, each part timed and recorded even when a later one fails:

1. **matrix rate**: the bf16 matmul rate the chip really gives (8192^3, after a warm-up; fp32 at 512^3 in the
   smoke), and the chip's dense bf16 spec peak where its name is known (`benchmarks.gpu_step.SPEC_PEAK`);
2. **gpu tests**: `pytest -m gpu` (tests/gpu: bf16 + flex attention against sdpa, a bf16 training run that asserts
   flex attention really ran on bf16 queries; the bf16 Newton-Schulz test in tests/unit/train/test_optim.py). On
   the CPU they are skipped, which the smoke reports as such;
3. **our training step** at the seed recipe's shapes (`benchmarks.gpu_step`: the gemma-4-E4B-it drafter, T = 4096,
   512 anchors, fp32 master weights under bf16 autocast, flex attention), once with the package's default objective
   and once with the objective matched to speculators', each with its MFU against the spec peak and against the
   measured matrix rate;
4. **speculators' step**: run only where speculators 0.9.0 is importable; otherwise the table says it was not run
   and why (carrying its wheel and dependencies to a machine without network is left to the next check).

It writes one JSON (the protocol's `--json`, default `out/benchmarks/gpu_check.json`) and prints one table; the
same table is written beside the JSON as Markdown (`gpu_check.md`), ready for benchmarks/RESULTS.md. A failed part
makes the command fail after everything is written.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

from benchmarks import common  # noqa: E402
from benchmarks.gpu_step import spec_peak  # noqa: E402

NAME = "gpu_check"
QUICK_ARGS = ["--quick"] if torch.cuda.is_available() else ["--quick", "--cpu-smoke"]
MATCHED = [["confidence_target", "sampled_restricted"], ["full_vocab_metrics", "false"]]
TEST_PATHS = ["tests/gpu", "tests/unit/train/test_optim.py"]


def matrix_rate(device: torch.device, dtype: torch.dtype, n: int, repeats: int) -> dict:
    """Measured `n x n x n` matmul rate in FLOP/s (median of `repeats`, after two warm-up products)."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(2):
        torch.mm(a, b)
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        torch.mm(a, b)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    times.sort()
    seconds = times[len(times) // 2]
    return {"n": n, "dtype": str(dtype).removeprefix("torch."), "repeats": repeats, "seconds": seconds,
            "flops_per_s": 2 * n**3 / seconds}


def gpu_tests(timeout: float) -> dict:
    """`pytest -m gpu` in a fresh process: its counts, exit status and the tail of its output."""
    try:
        import pytest  # noqa: F401
    except ImportError:
        return {"failed": "pytest is not installed in this Python; install it (pip install pytest, or pip install "
                          "--no-index --find-links <wheel folder> pytest on a machine without network)."}
    command = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-rs", "-p", "no:cacheprovider", *TEST_PATHS]
    start = time.perf_counter()
    try:
        proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"failed": f"the gpu tests did not finish within {timeout:.0f} s."}
    output = proc.stdout + proc.stderr
    counts = {kind: int(n) for n, kind in re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected)", output)}
    result = {"command": " ".join(command[1:]), "returncode": proc.returncode, "counts": counts,
              "seconds": time.perf_counter() - start, "tail": output.strip().splitlines()[-25:]}
    if proc.returncode != 0:
        result["failed"] = f"the gpu tests failed (pytest exit status {proc.returncode}): {counts}."
    return result


def our_step(smoke: bool, steps: int, warmup: int, overrides: list[list[str]]) -> dict:
    """`benchmarks.gpu_step` in this process with the recipe overrides `overrides`."""
    from benchmarks import gpu_step

    args = argparse.Namespace(cpu_smoke=smoke, quick=False, steps=steps, warmup=warmup, bf16_weights=False,
                              attn=None, no_flops=False, set=overrides)
    result = gpu_step.run(args)
    result.pop("table", None)
    return result


def speculators_step() -> dict:
    """speculators' step runs only where speculators is importable (it is not on the lent GPU machine)."""
    import importlib.util

    if importlib.util.find_spec("speculators") is None:
        return {"not_run": "speculators is not installed in this Python"}
    return {"not_run": "speculators is installed, but its GPU step driver is not written yet"}


def add_arguments(parser) -> None:
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on the CPU (checks every code path)")
    parser.add_argument("--steps", type=int, default=5, help="timed training steps per objective (median reported)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (flex attention compiles here)")
    parser.add_argument("--skip-tests", action="store_true", help="do not run the gpu tests")
    parser.add_argument("--tests-timeout", type=float, default=300.0, help="seconds for the gpu tests (default 300)")


def unavailable(args) -> str | None:
    if not args.cpu_smoke and not torch.cuda.is_available():
        return ("no CUDA device: make gpu-check measures a GPU; run it on the GPU machine, or pass "
                "GPU_CHECK_ARGS=--cpu-smoke to check its code paths on tiny CPU shapes")
    return None


def run(args) -> dict:
    smoke = args.cpu_smoke
    if args.quick:
        args.steps, args.warmup = min(args.steps, 2), min(args.warmup, 1)
    device = torch.device("cpu" if smoke else "cuda")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else common.cpu_model()
    started = time.time()
    markdown = (args.json or common.default_json(NAME, args.quick)).with_suffix(".md")
    out: dict = {"markdown": str(markdown), "smoke": smoke, "device": name, "torch": torch.__version__,
                 "cuda": torch.version.cuda, "spec_peak_flops_per_s": None if smoke else spec_peak(name)}
    failures = []

    print("1/4 matrix rate ...", flush=True)
    out["matrix_rate"] = matrix_rate(device, torch.float32 if smoke else torch.bfloat16, 512 if smoke else 8192,
                                     3 if smoke else 20)
    print("2/4 gpu tests ...", flush=True)
    out["gpu_tests"] = {"skipped": "--skip-tests"} if args.skip_tests else gpu_tests(args.tests_timeout)
    print("3/4 our training step, default and matched objectives ...", flush=True)
    out["ours"] = {}
    for objective, overrides in (("default", []), ("matched", MATCHED)):
        try:
            out["ours"][objective] = our_step(smoke, args.steps, args.warmup, overrides)
        except Exception as e:  # noqa: BLE001 - recorded, and the check goes on to the next part
            out["ours"][objective] = {"failed": f"{type(e).__name__}: {e}"}
    print("4/4 speculators' step ...", flush=True)
    out["speculators"] = speculators_step()

    measured, peak = out["matrix_rate"]["flops_per_s"], out["spec_peak_flops_per_s"]
    rows = [["device", name, "", f"torch {torch.__version__}, CUDA {torch.version.cuda}"],
            ["matrix rate (measured)", measured / 1e12, "TFLOP/s",
             f"{out['matrix_rate']['dtype']} {out['matrix_rate']['n']}^3 matmul, median of "
             f"{out['matrix_rate']['repeats']}"],
            ["spec peak (dense bf16)", peak / 1e12 if peak else None, "TFLOP/s",
             "vendor data sheet" if peak else "unknown for this device"]]
    tests = out["gpu_tests"]
    if "failed" in tests:
        failures.append(tests["failed"])
    rows.append(["gpu tests", ", ".join(f"{n} {k}" for k, n in tests.get("counts", {}).items()) or
                 tests.get("skipped", tests.get("failed")), "", "pytest -m gpu"])
    for objective, result in out["ours"].items():
        label = f"ours, {objective} objective"
        if "failed" in result:
            failures.append(f"our step ({objective} objective) failed: {result['failed']}")
            rows.append([f"{label}: step", None, "s", result["failed"]])
            continue
        if not result.get("losses_finite"):
            failures.append(f"our step ({objective} objective) produced a non-finite loss")
        median = result["step_median_s"]
        flops = (result.get("flops") or {}).get("total")
        result["mfu_measured_rate"] = flops / median / measured if flops else None
        result["mfu_spec_peak"] = flops / median / peak if flops and peak else None
        memory = result.get("memory", {}).get("peak_allocated_bytes")
        rows += [[f"{label}: step", median, "s", f"median of {args.steps}; {result['precision']}; "
                                                 f"{result['attention']}"],
                 [f"{label}: context tokens/s", result["context_tokens_per_s"], "tokens/s",
                  f"T = {result['shape']['context_tokens']}, {result['shape']['anchors']} anchors"],
                 [f"{label}: peak memory", memory / 2**30 if memory else None, "GiB",
                  "torch.cuda.max_memory_allocated" if memory else "CUDA only"],
                 [f"{label}: MFU vs measured rate", result["mfu_measured_rate"], "share",
                  f"{flops / 1e12:.3g} TFLOP per step counted" if flops else ""],
                 [f"{label}: MFU vs spec peak", result["mfu_spec_peak"], "share", ""]]
    rows.append(["speculators step", None, "s", out["speculators"].get("not_run", "")])
    out["seconds"] = time.time() - started
    out["table"] = rows
    if failures:
        out["failed"] = "; ".join(failures)
    return out


def describe(result: dict) -> None:
    """The table as Markdown beside the JSON, for benchmarks/RESULTS.md."""
    path = Path(result["markdown"])
    lines = ["| measurement | value | unit | note |", "|---|---|---|---|"]
    lines += [f"| {r[0]} | {common.fmt(r[1])} | {r[2]} | {r[3]} |" for r in result["table"]]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    print(f"table: {common.rel(path)}")


if __name__ == "__main__":
    common.main(sys.modules[__name__])
