"""Serving evaluation through llama.cpp: a drafter's acceptance and speed where llama-server serves it, on a CPU.

    python -m trainer export-gguf --drafter out/demo/drafter --out out/demo/gguf
    python -m trainer evaluate-llamacpp --gguf out/demo/gguf --verifier HuggingFaceTB/SmolLM2-135M-Instruct \
        --prompts data/demo/heldout --max-new-tokens 64 --temperature 0 --out out/demo/eval-llamacpp.json

With `--gguf` (export-gguf's folder) the command starts llama-server twice on 127.0.0.1, the verifier with the
drafter (`--spec-type draft-dspark`) and the verifier alone (the baseline, same binary, same GGUF), and stops both
on every exit path; `--server URL` (and `--baseline URL`) measure servers already running instead. Every prompt is
sent as the token ids of the verifier's chat template (`chat_prompt_ids`, as the in-process evaluator builds them),
one at a time (concurrency 1), streamed with per-token timings: the server's own running draft counters give each
request's verification steps in order (trainer/serving/llamacpp.py `complete`), which go through the same
reduction and `dspark-acceptance/1` file as the in-process and vLLM backends (trainer/evaluation/results.py). Per
subset the steps are checked against the server's `/metrics` counters (drafts, accepted tokens, per position); a
server that exposes none, or counted no drafts, is reported and never read as an acceptance of 1.

How the last block counts: llama.cpp drafts at most the tokens a request has left, so its steps are counted
"clamped" (`last_block` in the results; vLLM and the in-process default count "full"): compare it with
`python -m trainer evaluate --last-block clamped`. `--p-min P` is llama-server's `--spec-draft-p-min`: each block is
cut at the first slot whose confidence is below P (the confidence head this package calibrates).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from trainer.errors import Parser, UsageError, run_cli
from trainer.evaluation.results import AcceptanceStats, build_results, with_provenance, write_results

PROG = "python -m trainer evaluate-llamacpp"


def padded(counters: dict, length: int) -> dict:
    """Counters with `per_pos` padded with zeros to `length` (llama.cpp exposes no per-position counter before
    its first speculative request has finished)."""
    per_pos = list(counters["per_pos"]) + [0.0] * max(0, length - len(counters["per_pos"]))
    return {**counters, "per_pos": per_pos}


def evaluate_llamacpp(url: str, prompt_ids: dict[str, list[list[int]]], *, sampling: dict, max_new_tokens: int,
                      baseline: str | None = None, seed: int = 0, timeout: float = 600.0,
                      progress: bool = True, block_size: int | None = None,
                      threshold: bool = False) -> tuple[dict, dict[str, list]]:
    """`(results, generations)`: a `dspark-acceptance/1` dict (provenance not added) for the drafter served at `url`,
    and per subset the `Completion` of each prompt (tokens and steps, for comparisons).

    `block_size` is the drafter's B (default: the number of per-position counters the server exposes). With
    `threshold` (the server cuts blocks at a confidence threshold) a subset whose every block was cut to nothing
    has no verification steps and is recorded so; otherwise a subset without drafts means the server does not
    speculate, which is an error, never an acceptance of 1."""
    from tqdm.auto import tqdm

    from trainer.evaluation.vllm import committed_histogram
    from trainer.serving.llamacpp import ENGINE, LlamaCppError, complete, spec_counters

    spec_counters(url)  # before any prompt: a server without counters is reported, not measured
    stats: dict[str, AcceptanceStats] = {}
    generations: dict[str, list] = {}
    block = 0
    bar = tqdm(total=sum(map(len, prompt_ids.values())) * (1 + bool(baseline)), desc="llama.cpp evaluation",
               unit="prompt", disable=not progress)
    for subset, prompts in prompt_ids.items():
        before = spec_counters(url)
        done = []
        for i, ids in enumerate(prompts):
            done.append(complete(url, ids, max_new_tokens, sampling, seed=seed + i, timeout=timeout))
            bar.update(1)
        after = spec_counters(url)
        block = block or block_size or len(after["per_pos"])
        if after["drafts"] == before["drafts"]:
            if not threshold:  # a server that does not speculate: reported, never read as acceptance 1
                committed_histogram(before, after, url, subset, engine=ENGINE)
            counted = []  # every block of the subset was cut below the confidence threshold: no step to count
        elif not block or len(after["per_pos"]) != block:
            raise LlamaCppError(f"the llama.cpp server {url} exposes {len(after['per_pos'])} per-position draft "
                                f"counters after subset {subset}, not one per slot of a {block}-token block; serve "
                                f"the drafter with --spec-type draft-dspark and --spec-draft-n-max {block or 'B'}.")
        else:
            counted = committed_histogram(padded(before, block), padded(after, block), url, subset, engine=ENGINE)
        streamed = [c for g in done for c in g.committed]
        if sorted(counted) != sorted(streamed):
            raise LlamaCppError(f"the llama.cpp server {url} streamed {len(streamed)} verification steps for subset "
                                f"{subset} but its /metrics counted {len(counted)} (or another histogram); was "
                                f"another client using the server?")
        s = stats[subset] = AcceptanceStats(block)
        for g in done:
            s.add(g.committed, len(g.tokens), g.seconds)
        if baseline:
            for i, ids in enumerate(prompts):
                alone = complete(baseline, ids, max_new_tokens, sampling, seed=seed + i, timeout=timeout)
                s.baseline_tokens += len(alone.tokens)
                s.baseline_seconds += alone.seconds
                bar.update(1)
            s.paired_tokens, s.paired_seconds = s.generated_tokens, s.seconds
        generations[subset] = done
    bar.close()
    greedy = not sampling.get("temperature")
    results = build_results(stats, backend="llama.cpp", block_size=block, sampling=sampling,
                            max_new_tokens=max_new_tokens, concurrency=1, draft_method="greedy" if greedy else None,
                            last_block="clamped")
    results.update(server=url, baseline_server=baseline)
    return results, generations


def gguf_pair(folder: str, outtype: str) -> tuple[Path, Path]:
    """`(verifier GGUF, drafter GGUF)` of an export-gguf folder."""
    verifier, drafter = Path(folder) / f"verifier-{outtype}.gguf", Path(folder) / f"drafter-{outtype}.gguf"
    missing = [str(p) for p in (verifier, drafter) if not p.is_file()]
    if missing:
        raise UsageError(f"{missing[0]} does not exist; write the {outtype} pair with `python -m trainer export-gguf "
                         f"--outtypes {outtype} --out {folder}`.")
    return verifier, drafter


def main(argv: list[str] | None = None) -> dict:
    from trainer.evaluation.prompts import chat_prompt_ids, load_prompt_sets

    parser = Parser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gguf", default=None, help="export-gguf's folder: start llama-server on its pair (and the "
                                                     "verifier alone as the baseline) and stop them at the end")
    parser.add_argument("--outtype", default="f32", help="which pair of --gguf to serve (default f32)")
    parser.add_argument("--server", default=None, help="URL of a running llama-server that serves the drafter")
    parser.add_argument("--baseline", default=None, help="with --server: URL of a llama-server of the verifier alone")
    parser.add_argument("--no-baseline", dest="with_baseline", action="store_false",
                        help="with --gguf: do not time the verifier alone")
    parser.add_argument("--verifier", required=True,
                        help="the verifier's directory or Hub id (its tokenizer and chat template build the prompts)")
    parser.add_argument("--drafter", default=None,
                        help="the drafter checkpoint the GGUF was converted from (provenance: its weights sha256)")
    parser.add_argument("--prompts", default="RedHatAI/speculator_benchmarks",
                        help="directory of <subset>.jsonl files or a Hub dataset id")
    parser.add_argument("--subsets", default=None, help="comma-separated subset names (default: all nine)")
    parser.add_argument("--max-prompts", type=int, default=None, help="first N prompts of each subset")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--p-min", type=float, default=0.0,
                        help="llama-server's --spec-draft-p-min, the confidence below which a drafted block is cut "
                             "(0: never): with --gguf the server is started with it, with --server say the one it "
                             "runs with (a subset whose every block was cut is then recorded, not refused)")
    parser.add_argument("--kv-type", default=None, choices=("f32", "f16", "bf16", "q8_0"),
                        help="with --gguf: the KV cache type of both models (llama.cpp's default: f16)")
    parser.add_argument("--threads", type=int, default=None, help="with --gguf: llama-server's -t")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    parser.add_argument("--out", required=True, help="results JSON (a Markdown table is written beside it)")
    args = parser.parse_args(argv)
    if (args.gguf is None) == (args.server is None):
        raise UsageError("pass either --gguf <export-gguf folder> (the command starts llama-server) or --server <URL "
                         "of a running one>.")
    if args.max_new_tokens < 2 or (args.max_prompts is not None and args.max_prompts < 1):
        raise UsageError("--max-new-tokens must be at least 2 (llama.cpp drafts only with tokens left) and "
                         "--max-prompts positive.")
    if args.temperature < 0 or not 0.0 <= args.p_min <= 1.0:
        raise UsageError(f"--temperature {args.temperature} or --p-min {args.p_min} is out of range; pass a "
                         f"temperature >= 0 and a --p-min between 0 and 1.")
    if os.path.isdir(args.out):
        raise UsageError(f"--out {args.out} is a directory; pass the path of the results JSON file to write.")

    from transformers import AutoTokenizer

    from trainer.verifier.loading import local_folder

    tokenizer = AutoTokenizer.from_pretrained(local_folder(args.verifier, "verifier"))
    subsets = [s.strip() for s in args.subsets.split(",")] if args.subsets else None
    prompt_sets = load_prompt_sets(args.prompts, subsets, args.max_prompts)
    prompt_ids = {name: [chat_prompt_ids(tokenizer, p) for p in prompts] for name, prompts in prompt_sets.items()}
    sampling = {"temperature": args.temperature}
    if args.temperature > 0:
        sampling.update({k: v for k, v in (("top_k", args.top_k), ("top_p", args.top_p)) if v is not None})
    kwargs = dict(sampling=sampling, max_new_tokens=args.max_new_tokens, seed=args.seed, timeout=args.timeout)
    served: dict = {}
    if args.server:
        results, _ = evaluate_llamacpp(args.server, prompt_ids, baseline=args.baseline, threshold=args.p_min > 0,
                                       **kwargs)
    else:
        results, served, _ = serve_and_evaluate(args.gguf, args.outtype, prompt_ids, p_min=args.p_min,
                                             kv_type=args.kv_type, threads=args.threads,
                                             with_baseline=args.with_baseline, **kwargs)
    from trainer.serving.llamacpp import VERSION

    results["llamacpp"] = {"version": VERSION, "p_min": args.p_min, "kv_type": args.kv_type, **served}
    results = with_provenance(results, args.drafter or served.get("drafter_gguf") or args.server, args.verifier,
                              args.prompts)
    print(write_results(results, args.out))
    return results


def serve_and_evaluate(folder: str, outtype: str, prompt_ids: dict[str, list[list[int]]], *, p_min: float = 0.0,
                       kv_type: str | None = None, threads: int | None = None, with_baseline: bool = True,
                       **kwargs) -> tuple[dict, dict, dict]:
    """Start llama-server on an export-gguf pair (and the verifier alone), evaluate, stop them (also on failure).
    Returns the results, what was served, and the generations (`evaluate_llamacpp`)."""
    from contextlib import ExitStack

    from trainer.serving.llamacpp import LlamaServer, gguf_metadata, locate

    llamacpp = locate()
    verifier_gguf, drafter_gguf = gguf_pair(folder, outtype)
    block = int(gguf_metadata(drafter_gguf, llamacpp).get("dflash.block_size") or 0) or None
    longest = max((len(ids) for prompts in prompt_ids.values() for ids in prompts), default=0)
    ctx = max(512, longest + kwargs["max_new_tokens"] + (block or 16) + 8)
    logs = Path(folder)
    with ExitStack() as stack:
        drafter = stack.enter_context(LlamaServer(llamacpp, verifier_gguf, drafter_gguf, block_size=block,
                                                  p_min=p_min, ctx_size=ctx, kv_type=kv_type, threads=threads,
                                                  log_path=logs / f"llama-server-{outtype}-drafter.log"))
        alone = stack.enter_context(LlamaServer(llamacpp, verifier_gguf, ctx_size=ctx, kv_type=kv_type,
                                                threads=threads, log_path=logs / f"llama-server-{outtype}-alone.log")
                                    ) if with_baseline else None
        results, generations = evaluate_llamacpp(drafter.url, prompt_ids, baseline=alone.url if alone else None,
                                                 block_size=block, threshold=p_min > 0, **kwargs)
    served = {"drafter_gguf": str(drafter_gguf), "verifier_gguf": str(verifier_gguf), "outtype": outtype,
              "block_size": block}
    return results, served, generations


if __name__ == "__main__":
    sys.exit(run_cli(main))
