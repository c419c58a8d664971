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

      python -m trainer.regenerate --verifier HuggingFaceTB/SmolLM2-135M-Instruct \\
          --prompts data/demo/prompts.jsonl --split train --out out/demo/conversations.jsonl --temperature 0

* `vllm`: a running OpenAI-compatible vLLM server of the verifier (`vllm serve google/gemma-4-E4B-it`), sent
  `/v1/chat/completions` requests with the turn's messages; the server applies the verifier's chat template
  (for SmolLM2 it gives exactly the prompt tokens of the local rendering: tests/test_vllm_regenerate.py).
  Requests run concurrently (`--concurrency` rows in flight, each row's turns in order), with retries and
  exponential backoff on connection errors, timeouts and 5xx (`--retries`, `--timeout`). Before any work the
  server must answer `/v1/models` and list the verifier (or `--served-model-name`) as a model id or root.

      python -m trainer.regenerate --backend vllm --server http://127.0.0.1:8000 \\
          --verifier google/gemma-4-E4B-it --prompts data/prompts.jsonl --out out/conversations.jsonl --concurrency 64

Sampling is the verifier's own unless `--temperature/--top-p/--top-k` override it (`--temperature 0` is greedy).
In process that is its `generation_config` (`modeling_dspark.sampling_defaults`). Through vLLM only the values
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
import asyncio
import hashlib
import json
import logging
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from configuration_dspark import is_hub_id  # noqa: E402
from trainer.data import normalize_messages  # noqa: E402
from trainer.data_files import read_jsonl_objects  # noqa: E402
from trainer.errors import DSparkError, Parser, UsageError, run_cli  # noqa: E402
from trainer.vllm_http import VLLMServerError, checked_url, request_json, served_models  # noqa: E402

logger = logging.getLogger("dspark")
BACKENDS = ("transformers", "vllm")
WINDOW_BATCHES = 8  # transformers: rows are taken in input order, WINDOW_BATCHES batches at a time


# ------------------------------------------------------------------------------------------ prompts and turns
def prompt_rows(source: str, split: str | None = None, max_samples: int | None = None) -> list[dict]:
    """Rows with an `id`, a `subset` and the `turns` to answer (`conversation_turns`)."""
    local = os.path.exists(source) or source.endswith((".json", ".jsonl", ".parquet")) or \
        source.startswith((".", "/", "~")) or not is_hub_id(source)
    if local and not os.path.exists(source):
        raise UsageError(f"prompt file {source} does not exist; pass a JSONL file with a `prompt` column, chat rows, "
                         f"or a Hub dataset id.")
    if source.endswith(".jsonl") and os.path.isfile(source):
        raw = _read_jsonl(source)
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


def conversation_turns(messages: list[dict]) -> list[list[dict]]:
    """The messages before each reply to regenerate: a run of assistant messages after other turns is one
    reply (replaced), the non-assistant messages after the last reply ask for one more, and assistant messages
    before any other turn stay as context of the first. `[sys, u1, a1, u2, a2]` -> `[[sys, u1], [u2]]`."""
    turns, current, seen_other = [], [], False
    for message in messages:
        if message["role"] != "assistant":
            current.append(message)
            seen_other = True
        elif not seen_other:
            current.append(message)  # a leading assistant message: context, nothing asked it
        elif current:
            turns.append(current)
            current = []
    if current and any(m["role"] != "assistant" for m in current):
        turns.append(current)
    return turns


def turn_messages(turns: list[list[dict]], replies: list[str]) -> list[dict]:
    """The conversation the next reply is generated for: every earlier turn with its regenerated reply, then
    the next turn's messages."""
    messages = []
    for turn, reply in zip(turns, replies):
        messages += [*turn, {"role": "assistant", "content": reply}]
    return messages + list(turns[len(replies)])


def conversation_record(row: dict, replies: list[str]) -> dict:
    """The output row: the whole conversation with the regenerated replies (plus the subset, when known)."""
    messages = []
    for turn, reply in zip(row["turns"], replies):
        messages += [*turn, {"role": "assistant", "content": reply}]
    record = {"id": row["id"], "messages": messages}
    if row.get("subset"):
        record["subset"] = row["subset"]
    return record


def request_seed(seed: int, row_id: str, turn: int) -> int:
    """A per-request seed that depends only on the run seed, the row and the turn (not on order)."""
    digest = hashlib.sha256(f"{seed}:{row_id}:{turn}".encode()).digest()
    return int.from_bytes(digest[:4], "big") & 0x7FFFFFFF


# ------------------------------------------------------------------------------------------ output
def _read_jsonl(path: str) -> list[dict]:
    return [row for _, row in read_jsonl_objects(path)]


def _read_finished(path: str) -> list[dict]:
    """Rows already written by an earlier run; a truncated last line (a kill mid-write) is dropped from the file
    so it is regenerated, any other unreadable line is refused (the file is not ours to rewrite)."""
    with open(path, "rb") as f:
        data = f.read()
    if data and not data.endswith(b"\n"):
        cut = data.rfind(b"\n") + 1
        with open(path, "r+b") as f:
            f.truncate(cut)
    return _read_jsonl(path)


class OrderedWriter:
    """Writes rows in input order although they complete out of order: a completed row waits until every
    earlier one is done (written, or failed: `None`, skipped), then the contiguous prefix is written and
    flushed, a whole line per row (so a kill leaves at most one cut line, which a rerun drops)."""

    def __init__(self, f):
        self.f, self.next, self.pending, self.written = f, 0, {}, 0

    def add(self, index: int, record: dict | None) -> int:
        """Row `index` is finished; returns how many rows this wrote."""
        self.pending[index] = record
        lines = []
        while self.next in self.pending:
            done = self.pending.pop(self.next)
            self.next += 1
            if done is not None:
                lines.append(json.dumps(done, ensure_ascii=False) + "\n")
        return self._write(lines)

    def close(self) -> int:
        """A stopped run: rows still waiting for an earlier one are written anyway (in input order), so nothing
        finished is lost; the rerun appends the missing rows after them."""
        lines = [json.dumps(self.pending[i], ensure_ascii=False) + "\n" for i in sorted(self.pending)
                 if self.pending[i] is not None]
        self.pending = {}
        return self._write(lines)

    def _write(self, lines: list[str]) -> int:
        if lines:
            self.f.write("".join(lines))
            self.f.flush()
            self.written += len(lines)
        return len(lines)


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
        done = {str(r.get("id")) for r in _read_finished(out)}
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


def _progress(bar, stats: dict, started: float, rows: int) -> None:
    bar.update(rows)
    bar.set_postfix(tok_s=f"{stats['new_tokens'] / max(time.time() - started, 1e-6):.0f}", failed=stats["failed"])


# ------------------------------------------------------------------------------------------ transformers
class TransformersGenerator:
    """The verifier in this process: each window of rows (in input order) is answered turn by turn, every round
    batched longest prompt first (fewer pad tokens per batch), and written when the window is done."""

    def __init__(self, verifier: str, dtype: str, temperature, top_p, top_k, batch_size: int):
        from transformers import AutoTokenizer

        from trainer.verifier import generation_kwargs, load_verifier, resolve_pretrained, resolve_sampling

        path, _ = resolve_pretrained(verifier, "verifier")
        tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left")
        if tokenizer.chat_template is None:
            raise UsageError(f"the tokenizer of {verifier} has no chat template; regenerate with an instruction-tuned "
                             f"verifier.")
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
        self.model = load_verifier(path, dtype=dtype)
        self.tokenizer, self.batch_size = tokenizer, batch_size
        self.sampling = resolve_sampling(self.model, temperature, top_k=top_k, top_p=top_p)
        self._kwargs = lambda n: generation_kwargs(self.sampling, n, tokenizer.pad_token_id)
        eos = getattr(self.model.generation_config, "eos_token_id", None)
        self.eos = {int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos]) if e is not None}
        if tokenizer.eos_token_id is not None:
            self.eos.add(int(tokenizer.eos_token_id))
        self.description = f"with {os.path.basename(path.rstrip('/'))}"

    def run(self, todo: list[dict], writer: OrderedWriter, stats: dict, bar, max_new_tokens: int, seed: int | None,
            started: float) -> None:
        import torch

        torch.manual_seed(seed or 0)
        window = self.batch_size * WINDOW_BATCHES
        for start in range(0, len(todo), window):
            indices = range(start, min(start + window, len(todo)))
            replies = {i: [] for i in indices}
            while True:
                asks = [(i, turn_messages(todo[i]["turns"], replies[i])) for i in indices
                        if len(replies[i]) < len(todo[i]["turns"])]
                if not asks:
                    break
                texts = [self.tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=False)
                         for _, m in asks]
                order = sorted(range(len(asks)), key=lambda k: -len(texts[k]))
                for b in range(0, len(order), self.batch_size):
                    batch = order[b : b + self.batch_size]
                    for k, (text, tokens, cut) in zip(batch, self.generate([texts[k] for k in batch], max_new_tokens)):
                        i = asks[k][0]
                        replies[i].append(text)
                        stats["turns"] += 1
                        stats["truncated"] += cut
                        stats["new_tokens"] += tokens
                        if len(replies[i]) == len(todo[i]["turns"]):
                            writer.add(i, conversation_record(todo[i], replies[i]))
                            _progress(bar, stats, started, 1)

    def generate(self, texts: list[str], max_new_tokens: int) -> list[tuple[str, int, bool]]:
        """`(reply, generated tokens up to and including the end of turn, cut at max_new_tokens)` per prompt."""
        import torch

        enc = self.tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(self.model.device)
        with torch.no_grad():
            output = self.model.generate(**enc, **self._kwargs(max_new_tokens))
        results = []
        for ids in output[:, enc["input_ids"].shape[1]:].tolist():
            end = next((n for n, t in enumerate(ids) if t in self.eos), None)
            kept = ids if end is None else ids[: end + 1]
            text = self.tokenizer.decode(kept, skip_special_tokens=True).strip()
            results.append((text, len(kept), end is None and len(ids) >= max_new_tokens))
        return results


# ------------------------------------------------------------------------------------------ vLLM
def vllm_sampling(verifier: str, temperature: float | None, top_p: float | None, top_k: int | None) -> dict:
    """The sampling fields each request sends: only the user's, the server applying the verifier's
    generation_config to the rest, plus temperature 0 when the user gave none and the verifier's config,
    readable here, does not sample (vLLM ignores `do_sample`: it would sample at temperature 1)."""
    fields = {k: v for k, v in (("temperature", temperature), ("top_p", top_p), ("top_k", top_k)) if v is not None}
    if temperature is None:
        config = _local_generation_config(verifier)
        if config is None:
            logger.warning("regenerate: the generation config of %s is not readable here, so the server's sampling "
                           "defaults apply (vLLM ignores do_sample); pass --temperature to fix it", verifier)
        elif not getattr(config, "do_sample", False):
            fields["temperature"] = 0.0
    return fields


def _local_generation_config(verifier: str):
    """The verifier's GenerationConfig from a local directory, a registered small model or the local Hugging Face
    cache (never the network), or None."""
    from transformers import GenerationConfig

    from trainer.small_models import resolve_model

    try:
        path = resolve_model(verifier)
        if os.path.isdir(path):
            return GenerationConfig.from_pretrained(path) if os.path.isfile(
                os.path.join(path, "generation_config.json")) else GenerationConfig(do_sample=False)
        return GenerationConfig.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, RuntimeError):
        return None


class VLLMChatClient:
    """Chat completions against one vLLM server, `concurrency` rows at a time (asyncio, the blocking requests in
    a thread pool of that size), retried with exponential backoff."""

    def __init__(self, url: str, served_name: str, timeout: float = 600.0, retries: int = 3, backoff: float = 1.0,
                 max_failures: int = 8, concurrency: int = 16):
        url = checked_url(url, "--server")  # before any message names it
        if not url.startswith(("http://", "https://")):
            raise UsageError(f"--server {url} is not an http(s) URL; pass the server's address, e.g. "
                             f"http://127.0.0.1:8000.")
        self.url = url.rstrip("/").removesuffix("/v1")  # the OpenAI base URL form is accepted too
        self.served_name, self.model = served_name, served_name
        self.timeout, self.retries, self.backoff, self.max_failures = timeout, retries, backoff, max_failures
        self.concurrency, self.sampling = concurrency, {}
        self.description = f"through {self.url}"

    def check(self, verifier: str, max_new_tokens: int) -> None:
        """The server answers /v1/models, lists the served name as a model id or root (the model requests name is
        that entry's id), and its context leaves room for the replies."""

        served = served_models(self.url, timeout=min(self.timeout, 30.0),
                               hint=f"start it (`vllm serve {verifier}`) or fix --server")
        match = next((m for m in served if self.served_name in (str(m.get("id")), str(m.get("root")))), None)
        if match is None:
            found = ", ".join(sorted({str(m.get("id")) for m in served})) or "no model"
            raise VLLMServerError(f"the vLLM server {self.url} serves {found}, not {self.served_name}; point --server at "
                                  f"a server of {verifier}, or pass the name it serves it under as --served-model-name.")
        self.model = str(match.get("id"))
        context = int(match.get("max_model_len") or 0)
        if context and context <= max_new_tokens:
            raise VLLMServerError(f"the vLLM server {self.url} serves a context of {context} tokens, which leaves no "
                                  f"room for a prompt and --max-new-tokens {max_new_tokens}; lower --max-new-tokens or "
                                  f"restart the server with a larger --max-model-len.")

    def run(self, todo: list[dict], writer: OrderedWriter, stats: dict, bar, max_new_tokens: int, seed: int | None,
            started: float) -> None:
        asyncio.run(self._run(todo, writer, stats, bar, max_new_tokens, seed, started))

    async def _run(self, todo, writer, stats, bar, max_new_tokens, seed, started) -> None:
        pool = ThreadPoolExecutor(max_workers=self.concurrency, thread_name_prefix="regenerate")
        state = {"consecutive": 0, "error": None}  # error: the stop, raised once (other workers may fail too)
        pending = iter(range(len(todo)))

        async def one_row(index: int) -> None:
            row, replies = todo[index], []
            try:
                for turn in range(len(row["turns"])):
                    body = {"model": self.model, "messages": turn_messages(row["turns"], replies),
                            "max_tokens": max_new_tokens, **self.sampling}
                    if seed is not None:
                        body["seed"] = request_seed(seed, row["id"], turn)
                    text, tokens, finish = await self._complete(pool, body, stats)
                    state["consecutive"] = 0
                    replies.append(text)
                    stats["turns"] += 1
                    stats["truncated"] += finish == "length"
                    stats["new_tokens"] += tokens
                writer.add(index, conversation_record(row, replies))
            except VLLMServerError as e:
                stats["failed"] += 1
                state["consecutive"] += 1
                writer.add(index, None)
                logger.warning("regenerate: row %s failed: %s", row["id"], e.reason)
                if state["error"] is None and state["consecutive"] >= self.max_failures:
                    state["error"] = DSparkError(f"{state['consecutive']} requests to the vLLM server {self.url} failed in "
                                                 f"a row (last: {e.reason}); check that the server is up (its log), then rerun "
                                                 f"the same command to continue (finished rows are kept).")
                    raise state["error"] from e
            _progress(bar, stats, started, 1)

        async def worker() -> None:
            for index in pending:  # one shared iterator: each row is taken by one worker, in input order
                if state["error"] is not None:
                    return
                await one_row(index)

        tasks = [asyncio.create_task(worker()) for _ in range(min(self.concurrency, len(todo)))]
        try:
            if tasks:
                finished, unfinished = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
                for task in unfinished:
                    task.cancel()
                await asyncio.gather(*unfinished, return_exceptions=True)
                if state["error"] is not None:
                    raise state["error"]
                for task in finished:
                    if task.exception() is not None:
                        raise task.exception()
        finally:
            for task in tasks:
                task.cancel()
            pool.shutdown(wait=False, cancel_futures=True)

    async def _complete(self, pool, body: dict, stats: dict) -> tuple[str, int, str]:
        """One chat completion with retries: `(reply, completion tokens, finish_reason)`."""
        loop = asyncio.get_running_loop()
        for attempt in range(self.retries + 1):
            try:
                answer = await loop.run_in_executor(pool, request_json, self.url, "/v1/chat/completions", body,
                                                    self.timeout)
                choice = (answer.get("choices") or [None])[0] if isinstance(answer, dict) else None
                if not isinstance(choice, dict):
                    raise VLLMServerError(f"the vLLM server {self.url} answered without choices.",
                                          "an answer without choices")
                text = ((choice.get("message") or {}).get("content") or "").strip()
                tokens = int((answer.get("usage") or {}).get("completion_tokens") or 0)
                return text, tokens, str(choice.get("finish_reason"))
            except VLLMServerError as e:
                if not e.retryable or attempt == self.retries:
                    raise
                stats["retries"] += 1
                await asyncio.sleep(self.backoff * 2**attempt)
        raise AssertionError("unreachable")


def main(argv: list[str] | None = None) -> None:
    parser = Parser(prog="python -m trainer.regenerate", description=__doc__,
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
