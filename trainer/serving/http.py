"""Talking to a running vLLM OpenAI-compatible server: one home for the requests, the errors and the checks
that every vLLM backend shares (hidden states, regeneration, serving evaluation). llama.cpp's llama-server
(trainer/serving/llamacpp.py) goes through the same requests and `/metrics` reader, named by `engine`.

    request_json(url, route, body)     GET (body None) or POST JSON; failures as one sentence naming the URL
    checked_url(url)                   `url`, refused when it carries credentials (every message names the URL)
    served_models(url)                 the `/v1/models` entries
    check_serves(url, names)           `/v1/models` lists one of `names` (as id or root), else one sentence
    stream_chat(url, body)             a streamed chat completion: text, completion tokens, seconds, finish reason
    stream_events(url, route, body)    the JSON payloads of any streamed answer, in order
    scrape_metrics(url)                `/metrics` (Prometheus text) as {name: {labels: value}}

Only the standard library: these run in the trainer's processes, which need no HTTP package of their own.
"""

from __future__ import annotations

import http.client
import json
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

from trainer.errors import DSparkError, UsageError


class VLLMServerError(DSparkError):
    """A vLLM server is unreachable, answered an error, or is not the server the run needs (exit status 1).

    `reason` is the short cause (for logs and "last error" summaries), `status` the HTTP status when the server
    answered, and `retryable` says whether the same request may succeed later (connection errors, timeouts, 429
    and 5xx) rather than never (another 4xx, an answer that is not JSON, a misconfigured server)."""

    def __init__(self, message: str, reason: str = "", status: int | None = None, retryable: bool = False):
        super().__init__(message)
        self.reason, self.status, self.retryable = reason or message, status, retryable


def checked_url(url: str, what: str = "the vLLM server URL") -> str:
    """`url`, unless it carries credentials (`http://user:secret@host`). These clients send none (no
    Authorization header, so no vLLM `--api-key` either; urllib ignores them and fails to resolve the host), and
    every error and retry warning names the URL, so a secret in it would be printed; the refusal masks it."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        scheme, rest = "", url
    authority, slash, path = rest.partition("/")
    if "@" not in authority:
        return url
    masked = f"{scheme}{sep}***@{authority.rpartition('@')[2]}{slash}{path}"
    raise UsageError(f"{what} {masked} carries credentials (user:password@), which this client never sends and "
                     f"would print in its messages; pass the server's address without them.")


def _open(url: str, route: str, body: dict | None, timeout: float, hint: str = "", engine: str = "vLLM"):
    checked_url(url)
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url.rstrip("/") + route, data=data, headers={"Content-Type": "application/json"})
    try:
        return urllib.request.urlopen(request, timeout=timeout)
    except urllib.error.HTTPError as e:
        detail = " ".join(e.read()[:300].decode(errors="replace").split())
        reason = f"HTTP {e.code}: {detail}" if detail else f"HTTP {e.code}"
        raise VLLMServerError(f"the {engine} server {url} answered {route} with HTTP {e.code} ({detail}); check the "
                              f"request and the server's log.", reason, e.code, e.code >= 500 or e.code == 429) from e
    except (urllib.error.URLError, OSError, http.client.HTTPException) as e:
        reason = str(getattr(e, "reason", "") or e) or type(e).__name__
        raise VLLMServerError(f"the {engine} server {url} is unreachable ({reason}); "
                              f"{hint or 'start it, or pass the URL of a running one'}.", reason, None, True) from e


def request_json(url: str, route: str, body: dict | None = None, timeout: float = 300.0, hint: str = "",
                 engine: str = "vLLM") -> dict:
    try:
        with _open(url, route, body, timeout, hint, engine) as response:
            raw = response.read()
    except (OSError, http.client.HTTPException) as e:  # a timeout or reset while the answer was being read
        reason = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
        raise VLLMServerError(f"the {engine} server {url} broke off its answer to {route} ({reason}); check the "
                              f"server's log.", reason, None, True) from e
    try:
        return json.loads(raw)
    except json.JSONDecodeError as e:
        raise VLLMServerError(f"the {engine} server {url} answered {route} with something other than JSON; is it "
                              f"a {engine} server?", "an answer that is not JSON") from e


def served_models(url: str, timeout: float = 60.0, hint: str = "") -> list[dict]:
    """The `/v1/models` entries of `url` (one per served model name)."""
    return [m for m in request_json(url, "/v1/models", timeout=timeout, hint=hint).get("data", [])
            if isinstance(m, dict)]


def check_serves(url: str, names: set[str], what: str = "the verifier", hint: str = "", timeout: float = 60.0,
                 models: list[dict] | None = None) -> dict:
    """The `/v1/models` entry of `url` whose id or root is one of `names`; otherwise one sentence naming what
    the server serves. Returns the entry (its `max_model_len` bounds the requests). `models`: the entries
    already fetched, when the caller reads them too."""
    models = served_models(url, timeout, hint) if models is None else models
    for model in models:
        if {str(model.get("id")), str(model.get("root"))} & names:
            return model
    found = ", ".join(sorted({str(m.get("id")) for m in models})) or "nothing"
    wanted = " or ".join(sorted(names))
    raise VLLMServerError(f"the vLLM server {url} serves {found}, not {what} {wanted}; "
                          f"{hint or 'point the command at a server of it'}.")


@dataclass
class StreamedCompletion:
    text: str
    completion_tokens: int  # the server's count (usage), not a re-tokenisation
    seconds: float  # from sending the request to the last chunk
    first_token_seconds: float | None
    finish_reason: str | None


def stream_chat(url: str, body: dict, timeout: float = 600.0) -> StreamedCompletion:
    """One streamed `/v1/chat/completions` request, timed on the client (what a user waits for)."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    started = time.perf_counter()
    first, text, tokens, finish = None, [], None, None
    with _open(url, "/v1/chat/completions", body, timeout) as response:
        for raw in response:
            line = raw.decode(errors="replace").strip()
            if not line.startswith("data:"):
                continue
            payload = line[5:].strip()
            if payload == "[DONE]":
                break
            chunk = json.loads(payload)
            for choice in chunk.get("choices") or []:
                piece = (choice.get("delta") or {}).get("content")
                if piece:
                    first = first if first is not None else time.perf_counter() - started
                    text.append(piece)
                finish = choice.get("finish_reason") or finish
            usage = chunk.get("usage")
            if usage:
                tokens = int(usage.get("completion_tokens") or 0)
    seconds = time.perf_counter() - started
    if tokens is None:
        raise VLLMServerError(f"the vLLM server {url} streamed no usage counts (stream_options.include_usage); use "
                              f"a vLLM version that supports it (0.31 or newer).")
    return StreamedCompletion("".join(text), tokens, seconds, first, finish)


def stream_events(url: str, route: str, body: dict, timeout: float = 600.0, engine: str = "vLLM"):
    """The JSON payloads of a server-sent-events answer (`data: {...}` lines), in order, until `[DONE]` or the end."""
    with _open(url, route, body, timeout, engine=engine) as response:
        for raw in response:
            line = raw.decode(errors="replace").strip()
            if not line.startswith("data:"):
                continue
            payload = line[5:].strip()
            if payload == "[DONE]":
                return
            try:
                yield json.loads(payload)
            except json.JSONDecodeError as e:
                raise VLLMServerError(f"the {engine} server {url} streamed something other than JSON on {route}; is "
                                      f"it a {engine} server?", "a streamed line that is not JSON") from e


def scrape_metrics(url: str, timeout: float = 60.0, engine: str = "vLLM") -> dict[str, dict[tuple, float]]:
    """`/metrics` as `{metric name: {sorted label pairs: value}}` (comments skipped)."""
    with _open(url, "/metrics", None, timeout, engine=engine) as response:
        text = response.read().decode(errors="replace")
    out: dict[str, dict[tuple, float]] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        name, labels = head, ()
        if "{" in head:
            name, rest = head.split("{", 1)
            pairs = []
            for item in rest.rstrip("}").split('",'):
                if "=" in item:
                    key, val = item.split("=", 1)
                    pairs.append((key.strip(), val.strip().strip('"')))
            labels = tuple(sorted(pairs))
        try:
            out.setdefault(name, {})[labels] = float(value)
        except ValueError:
            continue
    return out
