"""The two regeneration backends: `TransformersGenerator` (the verifier in this process, batched) and
`VLLMChatClient` (a running vLLM server, concurrent requests), each answering every assistant turn of a
conversation with the verifier's own reply. trainer/data/regenerate.py picks one.
"""

from __future__ import annotations

import asyncio
import logging
import os
from concurrent.futures import ThreadPoolExecutor

from trainer.data.replies import (
    WINDOW_BATCHES,
    OrderedWriter,
    conversation_record,
    progress,
    request_seed,
    turn_messages,
)
from trainer.errors import DSparkError, UsageError  # noqa: E402
from trainer.serving.http import VLLMServerError, checked_url, request_json, served_models  # noqa: E402

logger = logging.getLogger("dspark")


# ------------------------------------------------------------------------------------------ transformers
class TransformersGenerator:
    """The verifier in this process: each window of rows (in input order) is answered turn by turn, every round
    batched longest prompt first (fewer pad tokens per batch), and written when the window is done."""

    def __init__(self, verifier: str, dtype: str, temperature, top_p, top_k, batch_size: int):
        from transformers import AutoTokenizer

        from trainer.verifier.loading import (
            generation_kwargs,
            load_verifier,
            resolve_pretrained,
            resolve_sampling,
        )

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
                            progress(bar, stats, started, 1)

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

    from trainer.verifier.small_models import resolve_model

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
            progress(bar, stats, started, 1)

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
