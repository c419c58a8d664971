"""The benchmarks, in one command (runs in `.venv`):

    .venv/bin/python -m benchmarks.run [--quick] [--only train_step,loss,extraction,drafting] [--json out/benchmarks/results.json]

`train_step`: a DSpark training step of this package against speculators 0.9.0 on identical inputs and weights
(`benchmarks/train_step.py`, `benchmarks/speculators_step.py`). It writes the inputs once (reused while their
shapes match), then, per config (small: T 1024, 64 anchors, 512 supervised slots; large: T 2048, 256 anchors,
2,048 slots), runs ours and speculators interleaved (ours, speculators, ours, speculators: `--reps` each, every
run a fresh process), then `ours-default` (the package's default objective, full-vocabulary metrics included)
once. Reported per implementation: the median and min step time over all timed steps of all repetitions, the
forward / backward / optimizer split, supervised slots/s, the peak RSS the timed steps add over the RSS before
them, the first-step loss (ours and speculators must agree to ~1e-5 relative; the difference is reported as
is), and the achieved FLOP/s (FlopCounterMode: matmuls and attention) against the measured fp32 matmul peak.
Speedup = speculators' median / ours; memory ratio = ours / speculators'.

`loss` (`benchmarks/loss_alone.py`) and `extraction` / `drafting` (`benchmarks/inference.py`) run as
subprocesses when present (`python -m benchmarks.<name> --json OUT [--quick]`; each prints its own table and
writes a JSON dict whose "table" rows are reprinted here); a missing module is skipped with a note.

One JSON report (date, machine, git commit, every number and every run's raw measurements) goes to `--json`
(default `out/benchmarks/results.json`; with `--quick`, `out/benchmarks/results-quick.json`). The last printed line
is `step speedup vs speculators: X.XXx, peak memory ratio: Y.YY` for the small config. `--quick` uses tiny shapes
(hidden 64, vocabulary 4,096, draft vocabulary 512, T 128/256) and 2 timed steps, to check the harness.
"""

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

try:
    from benchmarks.common import ROOT, BenchmarkError, fail, machine, matmul_peak_gflops, summary, write_json
except ImportError as e:  # torch missing: not this package's environment
    print(f"error: {e}; run the benchmarks with .venv/bin/python -m benchmarks.run (create .venv with `make setup`).",
          file=sys.stderr)
    raise SystemExit(2) from None

from trainer.errors import Parser, run_cli  # noqa: E402

SPECULATORS_PYTHON = Path(".venv-speculators") / "bin" / "python"
SECTIONS = ("train_step", "loss", "extraction", "drafting")
MODULES = {"loss": "loss_alone", "extraction": "inference", "drafting": "inference"}  # section -> benchmarks.<module>
CONFIGS = ("small", "large")
IMPLS = ("ours", "speculators")
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1",
               "TOKENIZERS_PARALLELISM": "false"}


def rel(path: Path) -> str:
    """`path` relative to the repo root when it is inside it (for messages and the report)."""
    try:
        return str(Path(path).resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


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


class Runner:
    """Runs each measurement in a fresh subprocess, with a progress line and its output kept in a log."""

    def __init__(self, work: Path, total: int):
        self.work = work
        self.total = total
        self.done = 0
        (work / "logs").mkdir(parents=True, exist_ok=True)
        (work / "runs").mkdir(parents=True, exist_ok=True)

    def __call__(self, label: str, command: list[str], log_name: str, timeout: float | None = None) -> float:
        self.done += 1
        prefix = f"[{self.done:>2}/{self.total}] {label}"
        print(f"{prefix} ...", flush=True)
        log = self.work / "logs" / f"{log_name}.log"
        start = time.perf_counter()
        env = {**os.environ, **OFFLINE_ENV}
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


# ------------------------------------------------------------------------------------------------ train_step
def train_step_section(args, runner: Runner, work: Path) -> dict:
    from benchmarks.train_step import inputs_match, read_meta

    inputs = work / ("inputs-quick" if args.quick else "inputs")
    if args.fresh_inputs or not inputs_match(inputs, args.quick):
        runner("make inputs", [sys.executable, "-m", "benchmarks.train_step", "make-inputs", "--out", str(inputs)]
               + (["--quick"] if args.quick else []), "make-inputs")
    else:
        runner.done += 1
        print(f"[{runner.done:>2}/{runner.total}] make inputs: reusing {rel(inputs)}", flush=True)
    meta = read_meta(inputs)
    timing = ["--warmup", str(args.warmup), "--steps", str(args.steps)]
    runs: dict[str, dict[str, list[dict]]] = {c: {i: [] for i in (*IMPLS, "ours-default")} for c in args.configs}
    for config in args.configs:
        order = [(impl, rep) for rep in range(args.reps) for impl in IMPLS] + [("ours-default", 0)]
        for impl, rep in order:
            name = f"{config}-{impl}-{rep + 1}"
            out = work / "runs" / f"{name}.json"
            out.unlink(missing_ok=True)
            if impl == "speculators":
                command = [str(ROOT / SPECULATORS_PYTHON), "-m", "benchmarks.speculators_step"]
            else:
                command = [sys.executable, "-m", "benchmarks.train_step", "run", "--impl", impl]
            command += ["--config", config, "--inputs", str(inputs), "--json", str(out), *timing]
            if rep:  # the FLOPs of a step do not change between repetitions: count them once
                command.append("--no-flops")
            reps = 1 if impl == "ours-default" else args.reps
            runner(f"{config} {impl} (repetition {rep + 1}/{reps})", command, name, timeout=args.timeout)
            runs[config][impl].append(json.loads(out.read_text()))
    summaries = {config: summarize(runs[config], args.matmul) for config in args.configs}
    return {"inputs": rel(inputs), "meta": meta, "summary": summaries, "runs": runs}


def summarize(runs: dict[str, list[dict]], matmul: dict) -> dict:
    """Per-implementation statistics over all timed steps of all repetitions, and the comparisons."""
    out: dict = {}
    for impl, reps in runs.items():
        if not reps:
            continue
        steps = [s for r in reps for s in r["steps"]]
        slots = reps[0]["supervised_slots"]
        total = summary([s["total_s"] for s in steps])
        deltas = [r["peak_rss_delta_bytes"] for r in reps if r.get("peak_rss_delta_bytes") is not None]
        flops = reps[0].get("flops", {}).get("total")
        entry = {
            "repetitions": len(reps), "timed_steps": len(steps), "supervised_slots": slots,
            "step_s": total,
            **{phase: summary([s[f"{phase}_s"] for s in steps]) for phase in ("forward", "backward", "optimizer")},
            "slots_per_s": slots / total["median"] if total["median"] else None,
            "peak_rss_delta_bytes": summary(deltas),
            "peak_rss_bytes": summary([r["peak_rss_bytes"] for r in reps if r.get("peak_rss_bytes") is not None]),
            "loss_first_step": [r["loss_first_step"] for r in reps],
            "flops_per_step": flops,
            "flops_by_phase": reps[0].get("flops"),
            "achieved_gflops": flops / total["median"] / 1e9 if flops and total["median"] else None,
            "max_load_average": max(max(r.get("load_average_before", 0), r.get("load_average_after", 0))
                                    for r in reps),
            "cpu_utilization": summary([r["cpu_utilization"] for r in reps if r.get("cpu_utilization")]),
        }
        if entry["achieved_gflops"] and matmul.get("gflops"):
            entry["fraction_of_matmul_peak"] = entry["achieved_gflops"] / matmul["gflops"]
        out[impl] = entry
    ours, theirs = out.get("ours"), out.get("speculators")
    if ours and theirs:
        out["step_speedup"] = theirs["step_s"]["median"] / ours["step_s"]["median"]
        out["step_speedup_min"] = theirs["step_s"]["min"] / ours["step_s"]["min"]
        a, b = ours["peak_rss_delta_bytes"]["median"], theirs["peak_rss_delta_bytes"]["median"]
        out["peak_memory_ratio"] = a / b if a is not None and b else None
        la, lb = ours["loss_first_step"][0], theirs["loss_first_step"][0]
        out["loss_first_step"] = {"ours": la, "speculators": lb, "abs_diff": abs(la - lb),
                                  "rel_diff": abs(la - lb) / abs(lb) if lb else None}
    if ours and out.get("ours-default"):
        out["default_objective_cost"] = out["ours-default"]["step_s"]["median"] / ours["step_s"]["median"]
    return out


def train_step_rows(section: dict, matmul: dict) -> list[list]:
    rows = []
    mib = 2**20
    for config, s in section["summary"].items():
        c = section["meta"]["configs"][config]
        rows.append([f"{config}: T {c['tokens']}, {c['anchors']} anchors x B {c['block_size']}",
                     c["supervised_slots"], "slots", "one packed row of 4 documents"])
        for impl in (*IMPLS, "ours-default"):
            e = s.get(impl)
            if not e:
                continue
            rows.append([f"  {impl} step", round(e["step_s"]["median"], 4), "s",
                         f"median of {e['timed_steps']} steps ({e['repetitions']} run{'s' if e['repetitions'] > 1 else ''}), "
                         f"min {e['step_s']['min']:.4f}; "
                         f"fwd {e['forward']['median']:.4f} / bwd {e['backward']['median']:.4f} / "
                         f"opt {e['optimizer']['median']:.4f}"])
            rows.append([f"  {impl} throughput", round(e["slots_per_s"], 1), "slots/s",
                         f"CPU {e['cpu_utilization']['median']:.2f} s per s of wall time, 1-min load average up to "
                         f"{e['max_load_average']:.1f}" if e["cpu_utilization"]["median"] else ""])
            peak = e["peak_rss_delta_bytes"]["median"]
            process = e["peak_rss_bytes"]["max"]
            rows.append([f"  {impl} peak memory", round(peak / mib, 1) if peak is not None else None, "MiB",
                         "peak RSS of the timed steps over the RSS before them (process peak "
                         f"{process / 2**30:.2f} GiB)" if process else "peak RSS of the timed steps over the RSS "
                         "before them"])
            if e.get("achieved_gflops"):
                rows.append([f"  {impl} achieved", round(e["achieved_gflops"], 1), "GFLOP/s",
                             f"{e['flops_per_step'] / 1e9:.1f} GFLOP/step counted, "
                             f"{100 * e.get('fraction_of_matmul_peak', 0):.0f}% of the 2048^2 fp32 matmul rate"])
        if "step_speedup" in s:
            rows.append(["  step speedup vs speculators", round(s["step_speedup"], 3), "x",
                         f"speculators median / ours median (min / min: {s['step_speedup_min']:.3f}x)"])
            ratio = s["peak_memory_ratio"]
            rows.append(["  peak memory ratio", round(ratio, 3) if ratio is not None else None, "ours/speculators",
                         ""])
            loss = s["loss_first_step"]
            rows.append(["  first-step loss difference", f"{loss['rel_diff']:.2e}", "relative",
                         f"ours {loss['ours']:.9g}, speculators {loss['speculators']:.9g}"])
        if "default_objective_cost" in s:
            rows.append(["  default objective cost", round(s["default_objective_cost"], 3), "x ours",
                         "ours-default / ours median step (full-vocabulary metrics)"])
    rows.append(["fp32 matmul peak", round(matmul["gflops"], 1), "GFLOP/s",
                 f"{matmul['n']}x{matmul['n']}, best of {matmul['repeats']}, {matmul['threads']} threads (a reference, "
                 f"not a bound: larger GEMMs can run faster)"])
    return rows


# ------------------------------------------------------------------------------------------------ other modules
def module_section(module: str, args, runner: Runner, work: Path) -> dict:
    if not (ROOT / "benchmarks" / f"{module}.py").is_file():
        runner.done += 1
        note = f"benchmarks/{module}.py is not present; skipped"
        print(f"[{runner.done:>2}/{runner.total}] {module}: {note}", flush=True)
        return {"skipped": note, "table": [[module, None, "", note]]}
    out = work / "runs" / f"{module}.json"
    out.unlink(missing_ok=True)
    runner(f"benchmarks.{module}", [sys.executable, "-m", f"benchmarks.{module}", "--json", str(out)]
           + (["--quick"] if args.quick else []), module, timeout=args.timeout)
    try:
        result = json.loads(out.read_text())
    except (OSError, ValueError) as e:
        raise RuntimeError(f"benchmarks.{module} wrote no readable JSON to {rel(out)} ({e}).") from None
    if not isinstance(result, dict) or not isinstance(result.get("table"), list):
        raise RuntimeError(f"benchmarks.{module} wrote JSON without a top-level 'table' list to {rel(out)}.")
    return result


def print_table(title: str, rows: list[list]) -> None:
    if not rows:
        return
    def text(value) -> str:
        if value is None:
            return "n/a"
        return f"{value:.4g}" if isinstance(value, float) else str(value)

    cells = [[text(c) for c in (list(r) + [""] * 4)[:4]] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(3)]
    print(f"\n{title}")
    for name, value, unit, note in cells:
        print(f"  {name:<{widths[0]}}  {value:>{widths[1]}} {unit:<{widths[2]}}  {note}".rstrip())


# ------------------------------------------------------------------------------------------------ main
def parse_args(argv):
    parser = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny shapes and 2 timed steps: checks the harness")
    parser.add_argument("--only", default=",".join(SECTIONS), help=f"comma-separated subset of {','.join(SECTIONS)}")
    parser.add_argument("--json", type=Path, default=None,
                        help="report path (default out/benchmarks/results.json; --quick: out/benchmarks/results-quick.json)")
    parser.add_argument("--configs", default=",".join(CONFIGS), help="train_step configs (default small,large)")
    parser.add_argument("--reps", type=int, default=2, help="runs per implementation and config (default 2)")
    parser.add_argument("--warmup", type=int, default=None, help="warm-up steps per run (default 2; --quick 1)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per run (default 5; --quick 2)")
    parser.add_argument("--work", type=Path, default=Path("out") / "benchmarks",
                        help="inputs, per-run JSON and logs (default out/benchmarks)")
    parser.add_argument("--fresh-inputs", action="store_true", help="rebuild the inputs even if they match")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds per subprocess (default 3600)")
    args = parser.parse_args(argv)
    only = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = sorted(set(only) - set(SECTIONS))
    if unknown or not only:
        raise BenchmarkError(f"--only {args.only!r} names {unknown or 'nothing'}; use a comma-separated subset of "
                             f"{','.join(SECTIONS)}.")
    args.only = [s for s in SECTIONS if s in only]
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    if not configs or set(configs) - set(CONFIGS):
        raise BenchmarkError(f"--configs {args.configs!r} is not a subset of {','.join(CONFIGS)}; use e.g. small.")
    args.configs = [c for c in CONFIGS if c in configs]
    args.warmup = args.warmup if args.warmup is not None else (1 if args.quick else 2)
    args.steps = args.steps if args.steps is not None else (2 if args.quick else 5)
    if args.reps < 1 or args.warmup < 1 or args.steps < 1:
        raise BenchmarkError("--reps, --warmup and --steps must each be at least 1.")
    if args.json is None:
        args.json = Path("out/benchmarks/results-quick.json") if args.quick else Path("out/benchmarks/results.json")
    args.json = args.json if args.json.is_absolute() else ROOT / args.json
    args.work = args.work if args.work.is_absolute() else ROOT / args.work
    return args


def main(argv=None) -> None:
    try:
        args = parse_args(argv)
        if "train_step" in args.only and not (ROOT / SPECULATORS_PYTHON).is_file():
            raise BenchmarkError(f"{SPECULATORS_PYTHON.parent.parent} (the speculators 0.9.0 environment the "
                                 f"train_step comparison runs in) is missing; create it with `make speculators-env`, "
                                 f"or skip the comparison with "
                                 f"--only {','.join(s for s in SECTIONS if s != 'train_step')}.")
    except BenchmarkError as e:
        fail(str(e))
    started = time.time()
    report = {"schema": "dspark-benchmarks/1",
              "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
              "quick": args.quick, "machine": machine(), "git": git_commit(),
              "command": "python -m benchmarks.run " + " ".join(sys.argv[1:] if argv is None else argv)}
    modules = list(dict.fromkeys(MODULES[s] for s in args.only if s in MODULES))
    total = 0
    if "train_step" in args.only:
        total += 1 + len(args.configs) * (2 * args.reps + 1)
    total += len(modules)
    runner = Runner(args.work, total)
    tables: list[tuple[str, list]] = []
    try:
        if "train_step" in args.only:
            print(f"measuring the fp32 matmul peak ({report['machine']['cpu']}, "
                  f"{report['machine']['torch_threads']} threads) ...", flush=True)
            args.matmul = matmul_peak_gflops()
            report["matmul_peak"] = args.matmul
            section = train_step_section(args, runner, args.work)
            report["train_step"] = section
            tables.append(("training step: ours vs speculators 0.9.0 (fp32, CPU)",
                           train_step_rows(section, args.matmul)))
        for module in modules:
            result = module_section(module, args, runner, args.work)
            report[module] = result
            tables.append((f"benchmarks.{module}", result.get("table", [])))
    except BenchmarkError as e:
        fail(str(e))
    except RuntimeError as e:
        fail(str(e), status=1)
    report["wall_s"] = time.time() - started
    write_json(args.json, report)
    for title, rows in tables:
        print_table(title, rows)
    print(f"\nreport: {rel(args.json)} ({report['wall_s'] / 60:.1f} min)")
    busy = [(c, i, e["max_load_average"]) for c, s in report.get("train_step", {}).get("summary", {}).items()
            for i, e in s.items() if isinstance(e, dict) and e.get("max_load_average", 0) > (os.cpu_count() or 1) + 1]
    if busy:
        worst = max(b[2] for b in busy)
        print(f"warning: other processes competed for the CPU during {len(busy)} of the measured groups (1-min load "
              f"average up to {worst:.1f} on {os.cpu_count()} cores); rerun on an idle machine for steady timings.")
    small = report.get("train_step", {}).get("summary", {}).get("small", {})
    if "step_speedup" in small:
        ratio = small["peak_memory_ratio"]
        ratio_text = f"{ratio:.2f}" if ratio is not None else "n/a"
        print(f"step speedup vs speculators: {small['step_speedup']:.2f}x, peak memory ratio: {ratio_text}")


if __name__ == "__main__":
    sys.exit(run_cli(main))
