"""Time one optimizer step on three 1536x576 matrices: AdamW, Muon with float32 Newton-Schulz (this project's
CPU default) and Muon with bfloat16 Newton-Schulz (`torch.optim.Muon`).

    .venv/bin/python -m benchmarks.muon_step [--repeats 5] [--threads N] [--skip-bf16] [--shape 1536 576] [--count 3]
                                             [--quick] [--json OUT]

`--quick`: one 64x32 matrix, 1 timed step (checks the harness).

`ONEDNN_MAX_CPU_ISA=AVX2` emulates a CPU without native bf16 matmuls on one that has them. On a machine
shared with other processes, `--threads 1` avoids oversubscribed multi-threaded kernels and is far steadier.
"""

import statistics
import sys
import time

import torch

from benchmarks import common

NAME = "muon_step"
QUICK = dict(shape=(64, 32), count=1, repeats=1)


def step_seconds(make_optimizer, shape=(1536, 576), count=3, repeats=5, seed=0) -> list[float]:
    """Wall time of `repeats` optimizer steps (after one untimed warm-up step) on `count` fresh matrices."""
    gen = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(*shape, generator=gen) * 0.02) for _ in range(count)]
    opt = make_optimizer(params)
    times = []
    for i in range(repeats + 1):
        for p in params:
            p.grad = torch.randn(*shape, generator=gen)
        start = time.perf_counter()
        opt.step()
        if i:
            times.append(time.perf_counter() - start)
    return times


def add_arguments(parser) -> None:
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--shape", type=int, nargs=2, default=(1536, 576))
    parser.add_argument("--count", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--skip-bf16", action="store_true", help="skip the bf16 Muon (minutes without bf16 matmuls)")


def run(args) -> dict:
    from trainer.train.optim import DtypeMuon

    if args.threads:
        torch.set_num_threads(args.threads)
    kw = dict(QUICK) if args.quick else dict(shape=tuple(args.shape), count=args.count, repeats=args.repeats)
    runs = {
        "AdamW": lambda ps: torch.optim.AdamW(ps, lr=1e-3),
        "Muon, float32 Newton-Schulz": lambda ps: DtypeMuon(ps, lr=1e-3, adjust_lr_fn="match_rms_adamw",
                                                             newton_schulz_dtype="float32"),
    }
    if not args.skip_bf16:
        runs["Muon, bfloat16 Newton-Schulz (torch.optim.Muon)"] = lambda ps: torch.optim.Muon(
            ps, lr=1e-3, adjust_lr_fn="match_rms_adamw")
    shape = kw["shape"]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"CPU capability {torch.backends.cpu.get_cpu_capability()}; {kw['count']} x {shape[0]}x{shape[1]}")
    base = None
    medians, table = {}, []
    for name, make in runs.items():
        median = statistics.median(step_seconds(make, **kw))
        base = base or median
        medians[name] = median
        print(f"{name:50s} {median * 1e3:10.1f} ms/step  ({median / base:7.1f}x AdamW)")
        table.append([name, median * 1e3, "ms/step", f"{median / base:.1f}x AdamW"])
    return {"shape": list(shape), "count": kw["count"], "repeats": kw["repeats"], "threads": torch.get_num_threads(),
            "median_step_s": medians, "table": table}


if __name__ == "__main__":
    common.main(sys.modules[__name__])
