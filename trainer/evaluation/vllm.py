"""Serving evaluation: a drafter's acceptance and speed measured where it is served, a running vLLM server.

    python -m trainer evaluate-vllm --server http://127.0.0.1:8000 --baseline http://127.0.0.1:8001 \
        --compare gemma-4-E4B-it-assistant=http://127.0.0.1:8002 --prompts RedHatAI/speculator_benchmarks \
        --max-new-tokens 256 --temperature 0 --drafter me/gemma-4-E4B-it-dspark --out out/eval-vllm.json

For each subset (`<subset>.jsonl` prompt sets, as trainer/evaluation/in_process.py reads them): scrape `/metrics`, send
the subset's prompts one at a time (concurrency 1, streamed chat completions, timed on the client), scrape
again. From the counter deltas, summed over the server's engines (vLLM's `vllm:spec_decode_*_total`):

    acceptance_length = 1 + Δaccepted / Δdrafts        pos_k = Δaccepted_per_pos[k] / Δdrafts

The per-position counters count the drafts that accepted at least k+1 tokens, so they give the exact histogram
of tokens committed per verification step (`committed_histogram`), which goes through the same reduction (the
`dspark_acceptance` evaluate metric, trainer/evaluation/results.py) as the in-process backend: the same
`dspark-acceptance/1` file, table and model card. Output tokens/s = the server's completion tokens over the
client's wall time, summed over the prompts. `--baseline` (the verifier alone) runs the same prompts for
`baseline_tokens_per_s` and `speedup`; each `--compare NAME=URL` (another drafter's server, e.g. Gemma's MTP
assistant) gives `other_drafters.NAME.<subset>` (acceptance, pos, tokens/s, speedup), which the card tabulates.

A server whose `/metrics` has no spec-decode counters (no drafter, or `--disable-log-stats`), or that counted
no drafts for a subset, is reported, never read as an acceptance of 1. vLLM drafts greedily unless the server's
speculative config says `draft_sample_method: probabilistic`; pass `--draft-method` to record which one the
server ran (the default, greedy, is vLLM's).
"""

from __future__ import annotations

import argparse
import os
import sys

from trainer.errors import Parser, UsageError, run_cli
from trainer.evaluation.results import DRAFT_METHODS, AcceptanceStats, build_results, with_provenance, write_results
from trainer.serving.http import VLLMServerError, check_serves, request_json, scrape_metrics, stream_chat

PROG = "python -m trainer evaluate-vllm"

DRAFTS = "vllm:spec_decode_num_drafts_total"
ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"
PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
VLLM_DRAFT_METHODS = DRAFT_METHODS[:2]  # greedy, probabilistic: what vLLM's draft_sample_method offers


def spec_counters(url: str) -> dict:
    """`{"drafts": n, "accepted": n, "per_pos": [n_0 .. n_{K-1}]}` summed over engines, or one sentence when
    the server exposes no spec-decode counters."""
    metrics = scrape_metrics(url)
    if DRAFTS not in metrics or PER_POS not in metrics:
        raise VLLMServerError(f"the vLLM server {url} exposes no spec-decode counters at /metrics ({DRAFTS} is "
                              f"missing): it serves no drafter, or it was started with --disable-log-stats; serve "
                              f"the drafter with speculative decoding and stats on.")
    per_pos: dict[int, float] = {}
    for labels, value in metrics[PER_POS].items():
        position = dict(labels).get("position")
        if position is not None:
            per_pos[int(position)] = per_pos.get(int(position), 0.0) + value
    return {"drafts": sum(metrics[DRAFTS].values()), "accepted": sum(metrics.get(ACCEPTED, {}).values()),
            "per_pos": [per_pos.get(k, 0.0) for k in range(max(per_pos) + 1 if per_pos else 0)]}


def committed_histogram(before: dict, after: dict, url: str, subset: str, engine: str = "vLLM") -> list[int]:
    """The tokens committed by each verification step between two scrapes, rebuilt from the counters: a step
    that accepted j drafts added 1 to positions 0..j-1, so `per_pos[j-1] - per_pos[j]` steps accepted exactly j
    (and `drafts - per_pos[0]` none); each committed j + 1 tokens (the bonus or corrected one included)."""
    drafts = round(after["drafts"] - before["drafts"])
    if drafts <= 0:
        raise VLLMServerError(f"the {engine} server {url} counted no drafts during subset {subset}: it did not "
                              f"speculate (a drafter that is switched off, or prompts that end at once); check "
                              f"its speculative config.")
    at_least = [drafts] + [round(a - b) for a, b in zip(after["per_pos"], before["per_pos"])] + [0]
    committed = []
    for j in range(len(at_least) - 1):
        exactly = at_least[j] - at_least[j + 1]
        if exactly < 0:
            raise VLLMServerError(f"the {engine} spec-decode counters of {url} are inconsistent during subset {subset} "
                                  f"(position {j} accepted more often than position {j - 1}); was another client "
                                  f"using the server?")
        committed += [j + 1] * exactly
    accepted = round(after["accepted"] - before["accepted"])
    if sum(committed) - len(committed) != accepted:
        raise VLLMServerError(f"the {engine} spec-decode counters of {url} disagree during subset {subset} (accepted "
                              f"{accepted}, per position {sum(committed) - len(committed)}); was another client "
                              f"using the server?")
    return committed


def run_prompts(url: str, model: str, prompts: list[str], sampling: dict, max_new_tokens: int, seed: int,
                timeout: float) -> tuple[int, float]:
    """Send the prompts one at a time (concurrency 1); `(completion tokens, seconds)` summed over them."""
    tokens, seconds = 0, 0.0
    for i, prompt in enumerate(prompts):
        body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_new_tokens,
                "seed": seed + i, **sampling}
        out = stream_chat(url, body, timeout=timeout)
        tokens += out.completion_tokens
        seconds += out.seconds
    return tokens, seconds


def served_model(url: str, name: str | None, timeout: float) -> str:
    """The model id to request: `name` when given (checked against `/v1/models`), else the only one served."""
    if name:
        return str(check_serves(url, {name}, what="the model", timeout=timeout)["id"])
    models = [m for m in request_json(url, "/v1/models", timeout=timeout).get("data", []) if isinstance(m, dict)]
    if len(models) != 1:
        raise UsageError(f"the vLLM server {url} serves {len(models)} models; pass --model to pick one.")
    return str(models[0]["id"])


def evaluate_server(url: str, prompt_sets: dict[str, list[str]], *, sampling: dict, max_new_tokens: int,
                    model: str | None = None, baseline: str | None = None, compare: dict[str, str] | None = None,
                    draft_method: str = "greedy", seed: int = 0, timeout: float = 600.0,
                    progress: bool = True) -> dict:
    """A `dspark-acceptance/1` results dict for the drafter served at `url` (provenance not added)."""
    from tqdm.auto import tqdm

    servers = {"drafter": url, **{f"compare:{k}": v for k, v in (compare or {}).items()}}
    names = {role: served_model(u, model, timeout) for role, u in servers.items()}
    for u in servers.values():
        spec_counters(u)  # before any prompt: a server without counters is reported, not measured
    baseline_model = served_model(baseline, model, timeout) if baseline else None
    measured: dict[str, dict[str, AcceptanceStats]] = {role: {} for role in servers}
    blocks: dict[str, int] = {}  # K per server: the number of per-position counters it exposes
    bar = tqdm(total=sum(len(p) for p in prompt_sets.values()) * (len(servers) + bool(baseline)),
               desc="serving evaluation", unit="prompt", disable=not progress)
    for subset, prompts in prompt_sets.items():
        baseline_tokens = baseline_seconds = 0
        if baseline:
            baseline_tokens, baseline_seconds = run_prompts(baseline, baseline_model, prompts, sampling,
                                                            max_new_tokens, seed, timeout)
            bar.update(len(prompts))
        for role, u in servers.items():
            before = spec_counters(u)
            tokens, seconds = run_prompts(u, names[role], prompts, sampling, max_new_tokens, seed, timeout)
            after = spec_counters(u)
            k = blocks.setdefault(role, len(after["per_pos"]))
            stats = AcceptanceStats(k)
            committed = committed_histogram(before, after, u, subset)
            stats.committed, stats.prompts, stats.generated_tokens, stats.seconds = committed, len(prompts), tokens, \
                seconds
            if baseline:
                stats.baseline_tokens, stats.baseline_seconds = baseline_tokens, baseline_seconds
                stats.paired_tokens, stats.paired_seconds = tokens, seconds
            measured[role][subset] = stats
            bar.update(len(prompts))
    bar.close()
    results = build_results(measured["drafter"], backend="vllm", block_size=blocks["drafter"], sampling=sampling,
                            max_new_tokens=max_new_tokens, concurrency=1, draft_method=draft_method)
    results.update(server=url, baseline_server=baseline)
    others = {}
    for role in servers:
        if role == "drafter":
            continue
        reduced = build_results(measured[role], backend="vllm", block_size=blocks[role], sampling=sampling,
                                max_new_tokens=max_new_tokens)
        others[role.split(":", 1)[1]] = {
            name: {key: v[key] for key in ("acceptance_length", "pos", "steps", "tokens_per_s", "speedup") if key in v}
            for name, v in reduced["subsets"].items()}
    if others:
        results["other_drafters"] = others
    return results


def main(argv: list[str] | None = None) -> dict:
    from trainer.evaluation.prompts import load_prompt_sets

    parser = Parser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--server", required=True, help="URL of the vLLM server that serves the drafter")
    parser.add_argument("--baseline", default=None, help="URL of a server of the verifier alone (for the speedup)")
    parser.add_argument("--compare", action="append", default=[], metavar="NAME=URL",
                        help="another drafter's server on the same prompts (repeatable)")
    parser.add_argument("--model", default=None, help="model id to request (default: the one each server serves)")
    parser.add_argument("--prompts", default="RedHatAI/speculator_benchmarks",
                        help="directory of <subset>.jsonl files or a Hub dataset id")
    parser.add_argument("--subsets", default=None, help="comma-separated subset names (default: all nine)")
    parser.add_argument("--max-prompts", type=int, default=None, help="first N prompts of each subset")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--draft-method", choices=VLLM_DRAFT_METHODS, default="greedy",
                        help="the server's draft_sample_method, recorded in the results (vLLM's default: greedy)")
    parser.add_argument("--drafter", default=None,
                        help="the served drafter's directory or Hub id (provenance: a local directory's weights "
                             "sha256, and for a push_to_hub.py export its checkpoint's, pair the results with the "
                             "checkpoint push_to_hub.py exports)")
    parser.add_argument("--verifier", default=None, help="the verifier's Hub id (provenance)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    parser.add_argument("--out", required=True, help="results JSON (a Markdown table is written beside it)")
    args = parser.parse_args(argv)
    if args.max_new_tokens < 1 or (args.max_prompts is not None and args.max_prompts < 1):
        raise UsageError("--max-new-tokens and --max-prompts must be positive.")
    if args.temperature < 0:
        raise UsageError(f"--temperature is {args.temperature}; pass 0 (greedy) or a positive temperature.")
    if os.path.isdir(args.out):
        raise UsageError(f"--out {args.out} is a directory; pass the path of the results JSON file to write.")
    compare = {}
    for item in args.compare:
        name, sep, url = item.partition("=")
        if not sep or not name or not url:
            raise UsageError(f"--compare {item!r} is not NAME=URL; pass e.g. --compare mtp=http://127.0.0.1:8002.")
        compare[name] = url
    subsets = [s.strip() for s in args.subsets.split(",")] if args.subsets else None
    prompt_sets = load_prompt_sets(args.prompts, subsets, args.max_prompts)
    sampling = {"temperature": args.temperature}
    if args.temperature > 0:
        sampling.update({k: v for k, v in (("top_k", args.top_k), ("top_p", args.top_p)) if v is not None})
    results = evaluate_server(args.server, prompt_sets, sampling=sampling, max_new_tokens=args.max_new_tokens,
                              model=args.model, baseline=args.baseline, compare=compare,
                              draft_method=args.draft_method, seed=args.seed, timeout=args.timeout)
    results = with_provenance(results, args.drafter or args.server, args.verifier or args.model or "", args.prompts)
    print(write_results(results, args.out))
    return results


if __name__ == "__main__":
    sys.exit(run_cli(main))
