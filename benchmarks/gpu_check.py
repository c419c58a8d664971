"""`make gpu-check`: everything a GPU machine should tell us, in one call that fits a short device lease.

    make gpu-check                                  # = python -m benchmarks.gpu_check (on the GPU machine)
    make gpu-check GPU_CHECK_ARGS=--cpu-smoke       # the same code paths at tiny shapes on the CPU (in the suite)

In order, each part timed and recorded even when a later one fails, the whole within `--budget` (480 s by default:
each part's own timeout is cut to what is left):

1. **matrix rate**: the bf16 matmul rate the chip really gives (8192^3, after a warm-up; fp32 at 512^3 in the
   smoke), and the chip's dense bf16 spec peak where its name is known (`benchmarks.gpu_step.SPEC_PEAK`);
2. **gpu tests**: `pytest -m gpu` (tests/gpu: bf16 + flex attention against sdpa, a bf16 training run that asserts
   flex attention really ran on bf16 queries; the bf16 Newton-Schulz test in tests/unit/train/test_optim.py). On
   the CPU they are skipped, which the smoke reports as such;
3. **our training step** at the seed recipe's shapes (`benchmarks.gpu_step`: the gemma-4-E4B-it drafter, T = 4096,
   512 anchors, fp32 master weights under bf16 autocast, flex attention), once with the package's default objective
   and once with the objective matched to speculators', each in a fresh process, each with its MFU against the
   spec peak and against the measured matrix rate;
4. **speculators' step** at the same shapes, as it ships (`benchmarks.speculators_gpu_step`: its flex attention,
   fused Triton loss, Muon + AdamW, under bf16 autocast; a fresh process in `--speculators-python`), and our step's
   speedup over it per objective. Where the shipped step fails (on the H200 with torch 2.11, Dynamo failed inside
   its fused loss), it is measured again with speculators' eager loss and the table says which ran. Where
   speculators does not import, the table says so: the GPU machine has no network, so `make gpu-wheels` downloads
   speculators 0.9.0 and the dependencies that machine lacks (7.2 MiB) into `.whl/`, to carry and install there
   before this runs.

It writes one JSON (the protocol's `--json`, default `out/benchmarks/gpu_check.json`) and prints one table; the
same table is written beside the JSON as Markdown (`gpu_check.md`), ready for benchmarks/RESULTS.md. A failed part
makes the command fail after everything is written. After each part, what is measured so far is also written to
`gpu_check.partial.json` beside it and summarised in one printed line, so a run cut off by a short lease still leaves
its finished parts behind.
"""

from __future__ import annotations

import functools
import json
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
EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Unsupported): ")  # a traceback's last line
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


def step_process(label: str, command: list[str], json_out: Path, timeout: float) -> dict:
    """One step benchmark as its own process, its JSON read back, or why it failed (its last `error:` line, else
    its exit status, with the tail of its output). A fresh process per measurement: compiled graphs, dispatch
    modes and allocator state of one step cannot leak into the next."""
    json_out.unlink(missing_ok=True)
    start = time.perf_counter()
    try:
        proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"failed": f"{label} did not finish within {timeout:.0f} s."}
    tail = (proc.stdout + proc.stderr).strip().splitlines()[-25:]
    if proc.returncode != 0 or not json_out.is_file():
        errors = [line.removeprefix("error: ") for line in tail if line.startswith("error: ")]
        raised = [line for line in (proc.stdout + proc.stderr).splitlines() if EXCEPTION_LINE.match(line)]
        cause = (errors or raised or [None])[-1]
        return {"failed": f"{label} exited with status {proc.returncode}" + (f": {cause}" if cause else ""),
                "tail": tail}
    result = json.loads(json_out.read_text())
    result.pop("table", None)
    result.update(command=" ".join(command[1:]), process_s=time.perf_counter() - start, json=str(json_out))
    return result


def our_step(smoke: bool, steps: int, warmup: int, overrides: list[list[str]], json_out: Path,
             timeout: float, profile: bool = False) -> dict:
    """`benchmarks.gpu_step` with the recipe overrides `overrides`, in a fresh process (`profile`: its JSON also
    holds torch.profiler's top-ops table of one more step)."""
    command = [sys.executable, "-m", "benchmarks.gpu_step", "--json", str(json_out), "--steps", str(steps),
               "--warmup", str(warmup), *(["--cpu-smoke"] if smoke else []), *(["--profile"] if profile else []),
               *[item for key, value in overrides for item in ("--set", key, value)]]
    return step_process("our step", command, json_out, timeout)


def default_speculators_python() -> str:
    """DSPARK_SPECULATORS_PYTHON, else `.venv-speculators` (here), else this Python (the GPU machine, where
    `make gpu-wheels`' wheels are installed beside it)."""
    env = os.environ.get("DSPARK_SPECULATORS_PYTHON")
    local = os.path.join(ROOT, ".venv-speculators", "bin", "python")
    return env or (local if os.path.isfile(local) else sys.executable)


def speculators_step(smoke: bool, steps: int, warmup: int, python: str, json_out: Path, timeout: float,
                     loss_implementation: str | None = None) -> dict:
    """`benchmarks.speculators_gpu_step` in `python`, as speculators ships (its fused Triton loss on a GPU), or why
    it was not run. Where that fails, the step is measured again with speculators' eager loss, and the result says
    so (`as_shipped_failed`): a number for its model and optimizer is still worth having beside the failure."""
    probe = subprocess.run([python, "-c", "import speculators"], capture_output=True, text=True)
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or ["no output"])[-1]
        return {"not_run": f"speculators does not import in {python} ({last}); carry its wheels with `make "
                           f"gpu-wheels` and install them there (Makefile, gpu-wheels), or pass --speculators-python"}
    command = [python, "-m", "benchmarks.speculators_gpu_step", "--json", str(json_out), "--steps", str(steps),
               "--warmup", str(warmup), *(["--cpu-smoke"] if smoke else []),
               *(["--loss-implementation", loss_implementation] if loss_implementation else [])]
    start = time.perf_counter()
    result = step_process("speculators' step", command, json_out, timeout)
    if "failed" not in result or (loss_implementation or ("eager" if smoke else "fused")) == "eager":
        return result
    remaining = timeout - (time.perf_counter() - start)
    if remaining < 60:
        return result
    retry = step_process("speculators' step (eager loss)", [*command, "--loss-implementation", "eager"], json_out,
                         remaining)  # argparse keeps the last --loss-implementation
    if "failed" in retry:
        result["eager_retry"] = retry
        return result
    retry["as_shipped_failed"] = result["failed"]
    retry["as_shipped_tail"] = result.get("tail", [])
    return retry


def record_part(out: dict, markdown: Path, part: str) -> None:
    """What is measured so far, written beside the final JSON, and one line for the log: a lease that ends
    mid-run (the whole check is sized to one short device call) must not lose the parts already done."""
    result = out.get(part)
    if part == "matrix_rate":
        line = f"{result['flops_per_s'] / 1e12:.4g} TFLOP/s ({result['dtype']} {result['n']}^3)"
    elif part == "gpu_tests":
        line = result.get("failed") or result.get("skipped") or f"{result['counts']} in {result['seconds']:.0f} s"
    else:
        results = result.items() if part == "ours" else [
            ("eager loss, the shipped one failed" if "as_shipped_failed" in result else "as it ships", result)]
        line = "; ".join(f"{name}: " + (f"step {r['step_median_s']:.4g} s" if "step_median_s" in r else
                                        str(r.get("failed") or r.get("not_run"))) for name, r in results)
    print(f"   {part}: {line}", flush=True)
    path = markdown.with_name(markdown.stem + ".partial.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(out, indent=1, default=str))
    tmp.replace(path)


def add_arguments(parser) -> None:
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on the CPU (checks every code path)")
    parser.add_argument("--steps", type=int, default=5, help="timed training steps per objective (median reported)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (flex attention compiles here)")
    parser.add_argument("--skip-tests", action="store_true", help="do not run the gpu tests")
    parser.add_argument("--tests-timeout", type=float, default=300.0, help="seconds for the gpu tests (default 300)")
    parser.add_argument("--speculators-python", default=default_speculators_python(),
                        help="a Python where speculators 0.9.0 imports (default: DSPARK_SPECULATORS_PYTHON, else "
                             ".venv-speculators, else this one)")
    parser.add_argument("--step-timeout", type=float, default=240.0,
                        help="seconds for each of our steps, building and compiling included (default 240)")
    parser.add_argument("--speculators-timeout", type=float, default=300.0,
                        help="seconds for speculators' step, building and a retry with its eager loss included "
                             "(default 300)")
    parser.add_argument("--speculators-loss", choices=["shipped", "eager"], default="shipped",
                        help="speculators' loss: as it ships (its fused Triton loss on a GPU, measured again with "
                             "the eager one if it fails), or its eager loss at once (saves the failing attempt "
                             "where the fused one is known to fail)")
    parser.add_argument("--profile", action="store_true",
                        help="keep torch.profiler's top-ops table of one more step of ours in each step's JSON")
    parser.add_argument("--budget", type=float, default=480.0,
                        help="seconds for the whole check (default 480, what a short device lease leaves): each "
                             "part's timeout is cut to what is left, and a part with under 20 s left is not started")


def unavailable(args) -> str | None:
    if not args.cpu_smoke and not torch.cuda.is_available():
        return ("no CUDA device: make gpu-check measures a GPU; run it on the GPU machine, or pass "
                "GPU_CHECK_ARGS=--cpu-smoke to check its code paths on tiny CPU shapes")
    return None


def region_rows(label: str, result: dict) -> list[list]:
    """The "step by region" row of one step's JSON: device time per region where it was measured, else host time."""
    recorded = result.get("regions") or {}
    regions = recorded.get("gpu_s") or recorded.get("host_s")
    if not regions:
        return []
    where = "device" if recorded.get("gpu_s") else "host"
    return [[f"{label}: step by region", sum(regions.values()), "s", f"{where} time, median per region: " +
             ", ".join(f"{name} {seconds * 1e3:.1f} ms" for name, seconds in regions.items())]]


def run(args) -> dict:
    smoke = args.cpu_smoke
    if args.quick:
        args.steps, args.warmup = min(args.steps, 2), min(args.warmup, 1)
    device = torch.device("cpu" if smoke else "cuda")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else common.cpu_model()
    started = time.time()

    def budgeted(part: str, timeout: float, measure) -> dict:
        """`measure(timeout)` with its timeout cut to what the check's --budget has left; not started under 20 s."""
        left = min(timeout, args.budget - (time.time() - started))
        if left < 20:
            return {"failed": f"{part} not started: under 20 s of the check's --budget of {args.budget:.0f} s was "
                              f"left."}
        return measure(left)

    markdown = (args.json or common.default_json(NAME, args.quick)).with_suffix(".md")
    out: dict = {"markdown": str(markdown), "smoke": smoke, "device": name, "torch": torch.__version__,
                 "cuda": torch.version.cuda, "spec_peak_flops_per_s": None if smoke else spec_peak(name)}
    failures = []

    print("1/4 matrix rate ...", flush=True)
    out["matrix_rate"] = matrix_rate(device, torch.float32 if smoke else torch.bfloat16, 512 if smoke else 8192,
                                     3 if smoke else 20)
    record_part(out, markdown, "matrix_rate")
    print("2/4 gpu tests ...", flush=True)
    out["gpu_tests"] = ({"skipped": "--skip-tests"} if args.skip_tests else
                        budgeted("the gpu tests", args.tests_timeout, gpu_tests))
    record_part(out, markdown, "gpu_tests")
    print("3/4 our training step, default and matched objectives ...", flush=True)
    out["ours"] = {}
    for objective, overrides in (("default", []), ("matched", MATCHED)):
        try:
            json_out = markdown.with_name(f"{markdown.stem}-ours-{objective}.json")
            out["ours"][objective] = budgeted("our step", args.step_timeout, functools.partial(
                our_step, smoke, args.steps, args.warmup, overrides, json_out, profile=args.profile))
        except Exception as e:  # noqa: BLE001 - recorded, and the check goes on to the next part
            out["ours"][objective] = {"failed": f"{type(e).__name__}: {e}"}
        record_part(out, markdown, "ours")
    print("4/4 speculators' step ...", flush=True)
    theirs = budgeted("speculators' step", args.speculators_timeout, functools.partial(
        speculators_step, smoke, args.steps, args.warmup, args.speculators_python,
        markdown.with_name(markdown.stem + "-speculators.json"),
        loss_implementation="eager" if args.speculators_loss == "eager" else None))
    out["speculators"] = theirs
    record_part(out, markdown, "speculators")

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
        rows += region_rows(label, result)
    if "not_run" in theirs:
        rows.append(["speculators: step", None, "s", theirs["not_run"]])
    elif "failed" in theirs:
        failures.append(f"speculators' step failed: {theirs['failed']}")
        rows.append(["speculators: step", None, "s", theirs["failed"]])
    else:
        median = theirs["step_median_s"]
        flops = (theirs.get("flops") or {}).get("total")
        theirs["mfu_measured_rate"] = flops / median / measured if flops else None
        theirs["mfu_spec_peak"] = flops / median / peak if flops and peak else None
        memory = theirs.get("memory", {}).get("peak_allocated_bytes")
        shipped = theirs.get("as_shipped_failed")
        rows += [["speculators: step", median, "s", f"median of {args.steps}; {theirs['precision']}; "
                                                    f"{theirs['attention']}, {theirs['loss_implementation']} loss" +
                  (f" (as it ships, with its fused loss, it failed: {shipped[:160]})" if shipped else "")],
                 ["speculators: peak memory", memory / 2**30 if memory else None, "GiB",
                  "torch.cuda.max_memory_allocated" if memory else "CUDA only"],
                 ["speculators: MFU vs measured rate", theirs["mfu_measured_rate"], "share",
                  f"{flops / 1e12:.3g} TFLOP per step counted" if flops else
                  (theirs.get("flops") or {}).get("failed", "not counted")]]
        rows += region_rows("speculators", theirs)
        for objective, result in out["ours"].items():
            if "step_median_s" in result:
                ours_memory = result.get("memory", {}).get("peak_allocated_bytes")
                rows.append([f"step speedup vs speculators, {objective} objective", median / result["step_median_s"],
                             "x", f"peak memory ratio {ours_memory / memory:.2f}" if ours_memory and memory else
                             "speculators' median / ours"])
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
