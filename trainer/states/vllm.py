"""Verifier hidden states from running vLLM servers, fetched on demand and deleted after use.

    collator (one batch ahead) ── prefetch(batch) ──> thread pool: one request per document
        POST <url>/v1/completions {prompt: token ids, max_tokens: 1}   (spread over the URLs, retried)
        <- kv_transfer_params.hidden_states_path        the server's connector writes the file
        flock(<file>.lock, shared)                      the writer holds it exclusively until the file is complete
        load + validate (token ids equal the request, [n, k+1, H], finite), delete the file and its lock
    trainer step ── states(batch) ──> the documents' futures (or fresh requests) packed into the batch's rows

The servers run the command `python -m trainer vllm-server` prints (extract_hidden_states, the aux ids plus
the last layer). `check()` runs before the first step and reports, one sentence each, a server that is down,
serves another model or a too-short context, was started without the connector or with other layers (the
exact ids when the server names them, as that command's servers do; else their number, from a probe file's
shape), or writes to a directory this machine cannot see. The last layer is checked against the verifier itself: the
teacher's next-token choice on the probe must be the server's own generated token. Failures are retried with
backoff on the next URL, and a URL that just failed is skipped (for a cool-down that doubles while it keeps failing)
as long as another one is not cooling down, so a killed server's documents go to the others. `max_failures`
consecutive failures, or one document failing all its attempts, stop the run with the last cause in one sentence;
the requests that were in flight together on a server when it died count as one failure, so the stop comes after
the retries' backoff (the wait for a server to come back), not at once. A document's states depend on its ids only,
so the source holds no per-row state.
"""

from __future__ import annotations

import fcntl
import logging
import os
import re
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from trainer.serving.http import VLLMServerError, check_serves, checked_url, request_json, served_models
from trainer.serving.server import LAYERS_TAG, layers_tag
from trainer.states.source import DocumentStateSource, document_key
from trainer.verifier.teacher import Teacher

logger = logging.getLogger("dspark")
# The connector's file name, `<request id>.safetensors` (vLLM's ids: `cmpl-<hex>-<n>`, maybe with a suffix).
STATES_FILE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*\.safetensors")
SERVER_HINT = "start it with the command `python -m trainer vllm-server --config <run config>` prints"
STOP_HINT = ("check the servers and their logs (restart one that died with the command `python -m trainer vllm-server "
             "--config <run config>` prints), then resume the run with --resume_from_checkpoint latest")
MAX_COOLDOWN = 60.0  # seconds a URL that keeps failing is skipped at most: a dead server is probed about once a minute


VLLMStatesError = VLLMServerError  # a server or its hidden-state files failed in a way retries did not fix

class BadStatesFile(Exception):
    """A hidden-state file that exists but cannot be used (retried: another request writes a new file)."""


def read_states_file(path: str, token_ids: torch.Tensor, num_layers: int, hidden_size: int,
                     lock_timeout: float = 60.0) -> torch.Tensor:
    """Wait for the writer's lock, load `hidden_states [n, num_layers, H]` and check it against the request:
    the token ids it was computed for, its shape and finite values. Raises `BadStatesFile` with one sentence."""
    lock = path + ".lock"
    deadline = time.monotonic() + lock_timeout
    try:
        with open(lock) as handle:
            while True:
                try:
                    fcntl.flock(handle, fcntl.LOCK_SH | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise BadStatesFile(f"{path} was still being written after {lock_timeout:.0f} s (its lock is "
                                            f"held); the server may be overloaded or stuck.") from None
                    time.sleep(0.005)
            data = load_file(path)
    except FileNotFoundError as e:
        raise BadStatesFile(f"{e.filename} does not exist (truncated, deleted, or written elsewhere).") from e
    except (SafetensorError, OSError) as e:
        raise BadStatesFile(f"{path} is not a readable safetensors file ({' '.join(str(e).split())[:120]}); it is "
                            f"truncated or corrupt.") from e
    states, ids = data.get("hidden_states"), data.get("token_ids")
    if states is None or ids is None:
        raise BadStatesFile(f"{path} holds {sorted(data)}, not hidden_states and token_ids.")
    if ids.shape != token_ids.shape or not torch.equal(ids.to(torch.long), token_ids.to(torch.long)):
        raise BadStatesFile(f"{path} holds the states of other token ids than the request's ({ids.numel()} ids, "
                            f"{token_ids.numel()} sent).")
    if tuple(states.shape) != (token_ids.numel(), num_layers, hidden_size):
        raise BadStatesFile(f"{path} holds hidden_states of shape {list(states.shape)}, not "
                            f"[{token_ids.numel()}, {num_layers}, {hidden_size}].")
    if not bool(torch.isfinite(states).all()):
        raise BadStatesFile(f"{path} holds non-finite hidden states.")
    return states


def remove_states_file(path: str) -> None:
    for p in (path, path + ".lock"):
        try:
            os.remove(p)
        except FileNotFoundError:
            pass


def urls_for_rank(urls: list[str], rank: int, world_size: int, per_rank: bool) -> list[str]:
    """The URLs one training process uses. `per_rank`: one server per group of consecutive ranks (rank r of W
    uses `urls[r * len(urls) // W]`), so with one server per node, listed in node order, every rank talks to its
    own node's server (and reads its node-local files). Otherwise all of them, starting at a rank-dependent one so
    the ranks do not all queue on the first server."""
    urls = [u.rstrip("/") for u in urls]
    if per_rank:
        return [urls[rank * len(urls) // max(world_size, 1)]]
    start = rank % len(urls)
    return urls[start:] + urls[:start]


class VLLMStateSource(DocumentStateSource):
    def __init__(self, urls: list[str], states_dir: str, aux_layer_ids: list[int], num_layers: int, hidden_size: int,
                 teacher: Teacher, served_name: str, dtype: torch.dtype = torch.float32, *, max_document_length:
                 int | None = None, concurrency: int = 8, timeout: float = 300.0, retries: int = 3,
                 max_failures: int = 8, backoff: float = 0.5):
        if not urls:
            raise ValueError("no vLLM server URLs; pass train.vllm_urls.")
        self.urls = [checked_url(u, "train.vllm_urls entry") for u in urls]  # before any message names them
        self.states_dir = states_dir
        self.aux_layer_ids = list(aux_layer_ids)
        self.num_layers = num_layers
        self.hidden_size = hidden_size
        self.dtype = dtype
        self._teacher = teacher
        self.served_name = served_name
        self.max_document_length = max_document_length
        self.timeout, self.retries, self.max_failures, self.backoff = timeout, retries, max_failures, backoff
        self._pool = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="dspark-vllm")
        self._pending: dict[str, Future] = {}
        self._lock = threading.Lock()
        self._next_url = 0
        self._consecutive_failures = 0
        # Per URL: its consecutive failures, until when it is skipped, and when its last counted failure happened.
        self._url_failures = dict.fromkeys(self.urls, 0)
        self._down_until = dict.fromkeys(self.urls, 0.0)
        self._counted_at = dict.fromkeys(self.urls, float("-inf"))
        self.stats = {"requests": 0, "retries": 0, "tokens": 0, "seconds_waiting": 0.0}

    # ------------------------------------------------------------------------------------------ interface
    def teacher(self) -> Teacher:
        return self._teacher

    def prefetch(self, batch: dict[str, torch.Tensor]) -> None:
        for ids in self.documents(batch)[1]:
            self._submit(ids)

    def document_states(self, documents: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        futures = [self._submit(ids) for ids in documents]
        started = time.monotonic()
        out = []
        for ids, future in zip(documents, futures):
            try:
                states = future.result()
            finally:
                with self._lock:
                    if self._pending.get(document_key(ids)) is future:
                        del self._pending[document_key(ids)]
            out.append(self._split(states))
        self.stats["seconds_waiting"] += time.monotonic() - started
        return out

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------------------------------ checks
    def check(self) -> None:
        """Before the first step: every URL is up, serves this verifier with a long enough context, and
        extracts exactly this run's layers into a directory this machine sees (one probe request each)."""
        for url in self.urls:
            hint = f"point train.vllm_urls at a server of this verifier ({SERVER_HINT})"
            models = served_models(url, timeout=min(self.timeout, 60.0), hint=hint)
            model = check_serves(url, {self.served_name}, hint=hint, models=models)
            expected = layers_tag([*self.aux_layer_ids, self.num_layers])
            tags = [str(m.get("id")) for m in models if str(m.get("id")).startswith(LAYERS_TAG)]
            if tags and expected not in tags:  # a server started by trainer.serving.server names its layers
                found = tags[0][len(LAYERS_TAG):].replace("-", ", ")
                raise VLLMStatesError(f"the vLLM server {url} extracts the layers [{found}], but this run needs "
                                      f"{[*self.aux_layer_ids, self.num_layers]}; restart it with this run's config "
                                      f"({SERVER_HINT}).")
            context = int(model.get("max_model_len") or 0)
            if self.max_document_length and context and context < self.max_document_length + 1:
                raise VLLMStatesError(f"the vLLM server {url} serves a context of {context} tokens, shorter than this "
                                      f"run's documents of up to {self.max_document_length} + 1; restart it with "
                                      f"--max-model-len {self.max_document_length + 1} or more.")
            probe = torch.arange(8, dtype=torch.long) + 100
            response = self._post_completion(url, probe)
            path = self._local_path(url, response)
            try:
                try:
                    states = read_states_file(path, probe, len(self.aux_layer_ids) + 1, self.hidden_size, self.timeout)
                except BadStatesFile as e:
                    if "shape" in str(e):
                        raise VLLMStatesError(
                            f"the vLLM server {url} extracts other layers than this run needs ({str(e).rstrip('.')}); "
                            f"restart it with "
                            f"the layer ids {self.aux_layer_ids} + the last layer ({SERVER_HINT}).") from e
                    raise VLLMStatesError(f"the vLLM server {url} wrote an unusable probe file: {e}") from e
            finally:
                remove_states_file(path)
            self._check_last_layer(url, states, response)
        logger.info("vLLM hidden states: %d server(s) %s, files in %s, layers %s + last", len(self.urls),
                    ", ".join(self.urls), self.states_dir, self.aux_layer_ids)

    def _check_last_layer(self, url: str, states: torch.Tensor, response: dict) -> None:
        """The last extracted layer must be the verifier's last (pre-norm): its next-token logits, through this
        run's teacher, must rank the server's own greedy token at the top (within a tie margin for bf16)."""
        generated = (response.get("choices") or [{}])[0].get("token_ids") or []
        weight = self._teacher.output_weight
        if not generated or weight is None:
            return
        normed = self._teacher.normed(states[-1:, -1].to(weight.device))
        logits = self._teacher.head_logits(normed, weight)[0].float()
        margin = logits.max() - logits[int(generated[0])]
        if float(margin) > 1e-2 * max(1.0, float(logits.abs().max())):
            raise VLLMStatesError(f"the last layer the vLLM server {url} extracts is not this verifier's last layer "
                                  f"(its greedy token {generated[0]} is not the teacher's top choice); restart it with "
                                  f"the layer ids {self.aux_layer_ids} + {self.num_layers} ({SERVER_HINT}).")

    # ------------------------------------------------------------------------------------------ requests
    def _submit(self, ids: torch.Tensor) -> Future:
        key = document_key(ids)
        with self._lock:
            future = self._pending.get(key)
            if future is None:
                future = self._pool.submit(self._fetch, ids.clone())
                self._pending[key] = future
        return future

    def _fetch(self, ids: torch.Tensor) -> torch.Tensor:
        attempts, last_error, error = self.retries + 1, "", None
        for attempt in range(attempts):
            url = self._url()
            sent = time.monotonic()
            try:
                response = self._post_completion(url, ids)
                path = self._local_path(url, response)
                try:
                    states = read_states_file(path, ids, len(self.aux_layer_ids) + 1, self.hidden_size, self.timeout)
                finally:
                    remove_states_file(path)
                with self._lock:
                    self._consecutive_failures = 0
                    self._url_failures[url], self._down_until[url] = 0, 0.0
                    self.stats["requests"] += 1
                    self.stats["tokens"] += ids.numel()
                return states
            except (BadStatesFile, VLLMStatesError, OSError, ValueError) as e:
                # The short cause (a server error's reason, a bad file's sentence without its period), so the stop
                # below stays one sentence with one fix.
                cause = e.reason if isinstance(e, VLLMServerError) else str(e)
                last_error = f"{url}: {' '.join(cause.split()).rstrip('.')[:300]}"
                failures = self._failed(url, sent)
                if failures >= self.max_failures:
                    raise VLLMStatesError(f"{failures} hidden-state requests to the vLLM servers failed in a row (last: "
                                          f"{last_error}); {STOP_HINT}.") from e
                error = e
                logger.warning("hidden-state request failed (attempt %d of %d): %s", attempt + 1, attempts, last_error)
                if attempt + 1 < attempts:  # no wait after the last attempt: the run stops at once
                    time.sleep(self.backoff * 2**attempt)
        raise VLLMStatesError(f"a document of {ids.numel()} tokens failed all {attempts} hidden-state requests (last: "
                              f"{last_error}); {STOP_HINT}.") from error

    def _failed(self, url: str, sent: float) -> int:
        """Record a failed request to `url` sent at `sent`; returns the run's consecutive failures."""
        with self._lock:
            now = time.monotonic()
            self.stats["retries"] += 1
            self._url_failures[url] += 1
            cooldown = self.backoff * 2 ** min(self._url_failures[url] - 1, 16)
            self._down_until[url] = now + min(cooldown, max(MAX_COOLDOWN, self.backoff))
            # Requests that were in flight on a server when it died all fail at once: they are one failure of the
            # run (the first counts), not one each, or `concurrency` of them would stop it without any retry.
            if self._counted_at[url] < sent:
                self._counted_at[url] = now
                self._consecutive_failures += 1
            return self._consecutive_failures

    def _url(self) -> str:
        """The next URL in turn that is not cooling down after a failure; when all are, the one back soonest
        (the caller's backoff is then the wait for a server to come back)."""
        with self._lock:
            now = time.monotonic()
            order = [self.urls[(self._next_url + i) % len(self.urls)] for i in range(len(self.urls))]
            skip = next((i for i, u in enumerate(order) if self._down_until[u] <= now), None)
            if skip is None:
                skip = min(range(len(order)), key=lambda i: self._down_until[order[i]])
            self._next_url += skip + 1
            return order[skip]

    def _post_completion(self, url: str, ids: torch.Tensor) -> dict:
        body = {"model": self.served_name, "prompt": ids.tolist(), "max_tokens": 1, "temperature": 0.0,
                "return_token_ids": True}
        return self._request(url, "/v1/completions", body)

    def _local_path(self, url: str, response: dict) -> str:
        """The file as this machine sees it: the server's file name inside `states_dir` (the server may mount
        the shared directory elsewhere, so its directory is never used). Only a bare `<request id>.safetensors`
        name is taken from the answer, and only when it and its lock resolve (links followed) to entries of
        `states_dir` itself: the trainer reads and deletes these files, so a server's answer must not be able to
        point it anywhere else. A missing lock means the trainer does not see the server's directory."""
        params = response.get("kv_transfer_params") if isinstance(response, dict) else None
        remote = params.get("hidden_states_path") if isinstance(params, dict) else None
        if not remote:
            raise VLLMStatesError(f"the vLLM server {url} answered without a hidden_states_path: it was started "
                                  f"without the hidden-states connector or the extract_hidden_states method; "
                                  f"{SERVER_HINT}.")
        name = os.path.basename(remote) if isinstance(remote, str) else ""
        # The connector writes `os.path.join(storage path, request id + ".safetensors")`, and this package's server
        # command passes an absolute storage path, so a `..` anywhere in the answer is not one of its files.
        if not STATES_FILE_NAME.fullmatch(name) or ".." in remote.split("/"):
            raise VLLMStatesError(f"the vLLM server {url} named the hidden-states file {str(remote)[:200]!r}, which is "
                                  f"not a `<request id>.safetensors` file of its states directory, so it is neither "
                                  f"read nor deleted; point train.vllm_urls at a server of this run ({SERVER_HINT}).")
        local = os.path.join(self.states_dir, name)
        root = os.path.realpath(self.states_dir)
        for path in (local, local + ".lock"):
            if os.path.dirname(os.path.realpath(path)) != root:
                raise VLLMStatesError(f"the hidden-states file {path} that the vLLM server {url} named links to "
                                      f"{os.path.realpath(path)}, outside train.vllm_states_dir {self.states_dir}, so "
                                      f"it is neither read nor deleted; remove the link and leave that directory to "
                                      f"the server's files.")
        if not os.path.exists(local + ".lock") and not os.path.exists(local):
            raise VLLMStatesError(f"the vLLM server {url} writes its hidden states to {os.path.dirname(remote)}, "
                                  f"which this machine does not see as train.vllm_states_dir {self.states_dir}; "
                                  f"start the server with that directory (shared storage) or point "
                                  f"vllm_states_dir at the server's.")
        return local

    def _request(self, url: str, route: str, body: dict | None) -> dict:
        return request_json(url, route, body, timeout=self.timeout, hint=f"{SERVER_HINT}, or fix train.vllm_urls")

    def _split(self, states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`[n, k+1, H]` -> aux `[n, k*H]` (ascending ids, as the drafter concatenates them) and the last layer."""
        states = states.to(self.dtype)
        return states[:, :-1].reshape(states.shape[0], -1), states[:, -1]


def source_for_config(config, verifier, aux_layer_ids: list[int], rank: int = 0, world_size: int = 1,
                      check: bool = True) -> VLLMStateSource:
    """The online source of a run config (`train.vllm_*`) for one training process, checked against the servers
    unless `check` is false. `verifier` is the full verifier or `load_verifier_shell`'s (only its config,
    embedding dtype and teacher tensors are read). Used by training and by the cache writer."""
    from trainer.verifier.teacher import verifier_teacher

    t = config.train
    text = verifier.config.get_text_config()
    source = VLLMStateSource(
        urls_for_rank(t.vllm_urls, rank, world_size, t.vllm_url_per_rank), t.vllm_states_dir, aux_layer_ids,
        text.num_hidden_layers, text.hidden_size, verifier_teacher(verifier), served_name=config.model.verifier,
        dtype=verifier.get_input_embeddings().weight.dtype, max_document_length=config.data.max_seq_length,
        concurrency=t.vllm_concurrency, timeout=t.vllm_timeout, retries=t.vllm_retries,
        max_failures=t.vllm_max_failures)
    if check:
        source.check()
    return source
