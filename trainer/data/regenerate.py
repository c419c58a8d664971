"""Regenerate chat responses with the verifier itself, in process (transformers) or through a vLLM server.

A drafter learns to predict the verifier, so its training conversations should be the verifier's own
outputs (the seed recipe regenerated every Open PerfectBlend response with gemma-4-E4B-it). This tool takes
prompts (a `prompt` column, or `messages`/ShareGPT conversations) and writes chat JSONL in `messages` form that
`trainer/run.py` reads directly.

Data flow. Every row becomes a list of turns: the non-assistant messages (system, user, tool) before each
assistant reply, and the final ones when the row does not end with a reply. Every assistant turn is
regenerated in order, each conditioned on the regenerated earlier turns (the verifier never sees the original
replies, which would not be its own), so a row with three user turns costs three generations and comes back
with three new replies. Leading assistant messages (before any other turn) are kept as context.

Two backends generate the replies:

* `transformers` (default): the verifier in this process, rendered with its chat template, batched
  (`--batch-size`, longest prompts first within windows of rows), one round of batches per turn. For small
  models and CPUs.

      python -m trainer regenerate --verifier HuggingFaceTB/SmolLM2-135M-Instruct \\
          --prompts data/demo/prompts.jsonl --split train --out out/demo/conversations.jsonl --temperature 0

* `vllm`: a running OpenAI-compatible vLLM server of the verifier (`vllm serve google/gemma-4-E4B-it`), sent
  `/v1/chat/completions` requests with the turn's messages; the server applies the verifier's chat template
  (for SmolLM2 it gives exactly the prompt tokens of the local rendering: tests/vllm/test_vllm_regenerate.py).
  Requests run concurrently (`--concurrency` rows in flight, each row's turns in order), with retries and
  exponential backoff on connection errors, timeouts and 5xx (`--retries`, `--timeout`). Before any work the
  server must answer `/v1/models` and list the verifier (or `--served-model-name`) as a model id or root.

      python -m trainer regenerate --backend vllm --server http://127.0.0.1:8000 \\
          --verifier google/gemma-4-E4B-it --prompts data/prompts.jsonl --out out/conversations.jsonl --concurrency 64

Sampling is the verifier's own unless `--temperature/--top-p/--top-k` override it (`--temperature 0` is greedy).
In process that is its `generation_config` (`generation_dspark.sampling_defaults`). Through vLLM only the values
the user gave are sent: vLLM (0.32, `--generation-config auto`, its default) takes temperature, top_p and
top_k from the same `generation_config.json` for every request that leaves them out, but it ignores
`do_sample`, so a verifier whose config does not sample (greedy under transformers, SmolLM2) would be sampled
at temperature 1; when its config is readable here and does not sample, temperature 0 is sent as well. With
`--seed`, each request carries a seed derived from (seed, row id, turn), so sampled rows reproduce whatever
the concurrency and order.

Rows are written in input order (completed rows are buffered until every earlier row is done, and whatever
is buffered is written if the run stops), and a rerun skips ids already in `--out`, so an interrupted run
loses nothing. A request that still fails after its retries is counted as failed and its row is not written
(a rerun retries it; rerun rows are appended after the earlier ones); `--max-failures` failed requests in a
row stop the run (a server that died). The returned summary (printed as one JSON line): rows written, skipped
(already in --out) and failed, replies generated (`turns`) and cut at `--max-new-tokens` (`truncated`),
generated tokens (end-of-turn token included), seconds and tokens/s.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time

from trainer.data.files import read_jsonl_objects
from trainer.data.generators import TransformersGenerator, VLLMChatClient, vllm_sampling
from trainer.data.render import normalize_messages
from trainer.data.replies import OrderedWriter, conversation_turns, read_finished
from trainer.errors import Parser, UsageError, run_cli
from trainer.files import is_local

logger = logging.getLogger("dspark")


BACKENDS = ("transformers", "vllm")




# ------------------------------------------------------------------------------------------ prompts and turns
def prompt_rows(source: str, split: str | None = None, max_samples: int | None = None) -> list[dict]:
    """Rows with an `id`, a `subset` and the `turns` to answer (`conversation_turns`)."""
    if is_local(source) and not os.path.exists(source):
        raise UsageError(f"prompt file {source} does not exist; pass a JSONL file with a `prompt` column, chat rows, "
                         f"or a Hub dataset id.")
    if source.endswith(".jsonl") and os.path.isfile(source):
        raw = [row for _, row in read_jsonl_objects(source)]
    else:  # a Hub dataset or local files: prompts-only sets are fine here, unlike for training
        from datasets import load_dataset

        raw = list(load_dataset(source, split="train")) if not os.path.exists(source) else \
            list(load_dataset("json" if source.endswith((".json", ".jsonl")) else "parquet", data_files=source,
                              split="train"))
    rows = []
    for i, row in enumerate(raw):
        if split and row.get("split", split) != split:
            continue
        if "prompt" in row:
            messages = [{"role": "user", "content": row["prompt"]}]
        elif "messages" in row or "conversations" in row:
            try:
                messages = normalize_messages(row.get("messages") or row.get("conversations"))
            except ValueError as e:
                raise UsageError(f"row {i} of {source} is not a readable conversation ({e}); fix or drop it.") from e
        else:
            raise UsageError(f"row {i} of {source} has neither a `prompt` nor a `messages`/`conversations` field; "
                             f"give prompts as JSONL with a `prompt` column or chat rows.")
        turns = conversation_turns(messages)
        if not turns:
            continue
        rows.append({"id": str(row.get("id", i)), "subset": row.get("subset"), "turns": turns})
        if max_samples and len(rows) >= max_samples:
            break
    return rows
















# ------------------------------------------------------------------------------------------ the run
def regenerate(
    verifier: str,
    prompts: str,
    out: str,
    split: str | None = None,
    max_new_tokens: int = 256,
    batch_size: int = 16,
    temperature: float | None = None,
    max_samples: int | None = None,
    seed: int | None = None,
    dtype: str = "auto",
    *,
    top_p: float | None = None,
    top_k: int | None = None,
    backend: str = "transformers",
    server: str | None = None,
    served_model_name: str | None = None,
    concurrency: int = 16,
    retries: int = 3,
    timeout: float = 600.0,
    max_failures: int = 8,
    backoff: float = 1.0,
) -> dict:
    """Regenerate every row of `prompts` not yet in `out` (see the module docstring); returns the summary."""
    if backend not in BACKENDS:
        raise UsageError(f"--backend must be one of {', '.join(BACKENDS)} (got {backend!r}).")
    if backend == "vllm" and not server:
        raise UsageError("--backend vllm needs the server's URL; pass --server http://HOST:PORT of a running "
                         "`vllm serve` of the verifier.")
    if backend == "transformers" and (server or served_model_name):
        raise UsageError("--server and --served-model-name only apply to --backend vllm; add --backend vllm (or drop "
                         "them to generate in this process).")
    for name, value, least in (("--max-new-tokens", max_new_tokens, 1), ("--batch-size", batch_size, 1),
                               ("--concurrency", concurrency, 1), ("--retries", retries, 0),
                               ("--max-failures", max_failures, 1)):
        if value < least:
            raise UsageError(f"{name} must be at least {least} (got {value}).")
    if timeout <= 0:
        raise UsageError(f"--timeout must be a positive number of seconds (got {timeout}).")
    rows = prompt_rows(prompts, split=split, max_samples=max_samples)  # bad prompts are refused before any load
    if os.path.isdir(out):
        raise UsageError(f"--out {out} is a directory; pass the path of the chat JSONL file to write.")

    if backend == "vllm":
        client = VLLMChatClient(server, served_model_name or verifier, timeout=timeout, retries=retries,
                                backoff=backoff, max_failures=max_failures, concurrency=concurrency)
        client.check(verifier, max_new_tokens)  # before any work: reachable, serving this verifier
        client.sampling = vllm_sampling(verifier, temperature, top_p, top_k)
        generator, sampling = client, dict(client.sampling)  # what every request sends; the server's for the rest
    else:
        generator = TransformersGenerator(verifier, dtype, temperature, top_p, top_k, batch_size)
        sampling = generator.sampling

    done = set()
    if os.path.exists(out):  # a rerun resumes: finished ids are skipped (a line cut by a kill is redone)
        done = {str(r.get("id")) for r in read_finished(out)}
    todo = [r for r in rows if r["id"] not in done]
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    stats = {"turns": 0, "truncated": 0, "failed": 0, "new_tokens": 0, "retries": 0}
    from tqdm.auto import tqdm

    started = time.time()
    bar = tqdm(total=len(todo), desc=f"regenerating {generator.description}", unit="row")
    with open(out, "a", encoding="utf-8") as f:
        writer = OrderedWriter(f)
        try:
            generator.run(todo, writer, stats, bar, max_new_tokens, seed, started)
        finally:
            writer.close()
            bar.close()
    seconds = time.time() - started
    return {"written": writer.written, "skipped_existing": len(rows) - len(todo), "failed": stats["failed"],
            "turns": stats["turns"], "truncated": stats["truncated"], "new_tokens": stats["new_tokens"],
            "retries": stats["retries"], "seconds": seconds,
            "tokens_per_second": stats["new_tokens"] / seconds if seconds > 0 else 0.0,
            "backend": backend, "sampling": sampling, "out": out}




def main(argv: list[str] | None = None) -> None:
    parser = Parser(prog="python -m trainer regenerate", description=__doc__,
                    formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--verifier", required=True, help="Hub id or local directory of the verifier")
    parser.add_argument("--prompts", required=True, help="JSONL with a `prompt` column, chat JSONL, or a Hub dataset")
    parser.add_argument("--out", required=True, help="output chat JSONL (appended; existing ids are skipped)")
    parser.add_argument("--split", default=None, help="keep rows whose `split` field equals this (e.g. train)")
    parser.add_argument("--max-new-tokens", type=int, default=256, help="per reply")
    parser.add_argument("--temperature", type=float, default=None, help="0 = greedy; default: the verifier's")
    parser.add_argument("--top-p", type=float, default=None, help="default: the verifier's")
    parser.add_argument("--top-k", type=int, default=None, help="default: the verifier's")
    parser.add_argument("--max-samples", type=int, default=None)
    parser.add_argument("--seed", type=int, default=None, help="sampling seed (vLLM: one per row and turn)")
    parser.add_argument("--backend", choices=BACKENDS, default="transformers",
                        help="transformers: the verifier in this process; vllm: a running vLLM server (--server)")
    parser.add_argument("--batch-size", type=int, default=16, help="transformers: prompts per generate() call")
    parser.add_argument("--server", default=None, help="vllm: the server's URL, e.g. http://127.0.0.1:8000")
    parser.add_argument("--served-model-name", default=None,
                        help="vllm: the name the server serves the verifier under (default: --verifier)")
    parser.add_argument("--concurrency", type=int, default=16, help="vllm: rows in flight")
    parser.add_argument("--retries", type=int, default=3, help="vllm: retries per request (exponential backoff)")
    parser.add_argument("--timeout", type=float, default=600.0, help="vllm: seconds per request")
    parser.add_argument("--max-failures", type=int, default=8,
                        help="vllm: stop after this many failed requests in a row")
    args = parser.parse_args(argv)
    result = regenerate(args.verifier, args.prompts, args.out, split=args.split, max_new_tokens=args.max_new_tokens,
                        batch_size=args.batch_size, temperature=args.temperature, max_samples=args.max_samples,
                        seed=args.seed, top_p=args.top_p, top_k=args.top_k, backend=args.backend, server=args.server,
                        served_model_name=args.served_model_name, concurrency=args.concurrency, retries=args.retries,
                        timeout=args.timeout, max_failures=args.max_failures)
    print(json.dumps(result))


if __name__ == "__main__":
    sys.exit(run_cli(main))
