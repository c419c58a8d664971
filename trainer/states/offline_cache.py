"""The offline cache's writer and reader: `write_cache` runs any per-document source over a run's documents and
writes the shards durably and resumably; `OfflineCache` serves them back by `document_key` during training.
The on-disk format (plan, shards, completion marker) is in trainer/states/cache_format.py.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import shutil
import time
from collections import OrderedDict
from collections.abc import Iterable

import torch
from safetensors import SafetensorError, safe_open
from tqdm.auto import tqdm

from trainer.config import DEFAULT_CHUNK_ELEMENTS
from trainer.errors import DSparkError, UsageError, is_disk_full
from trainer.files import TMP_SUFFIX, write_json_atomic
from trainer.states.cache_format import (
    COMPLETE_FILE,
    DEFAULT_SHARD_TOKENS,
    DEFAULT_TOKENS_PER_CALL,
    DISK_MARGIN_BYTES,
    FORMAT_VERSION,
    PLAN_FILE,
    READABLE_FORMAT_VERSIONS,
    check_plan,
    dtype_name,
    human_bytes,
    make_plan,
    read_plan,
    shard_bytes,
    shard_metadata,
    shard_problem,
    write_safetensors,
)
from trainer.states.source import DocumentStateSource, document_key
from trainer.verifier.teacher import Teacher

logger = logging.getLogger("dspark")


# ---------------------------------------------------------------------------------------------------- writer
def as_document(d) -> torch.Tensor:
    t = torch.as_tensor(d, dtype=torch.long).reshape(-1) if not isinstance(d, torch.Tensor) else d.to(torch.long)
    if t.dim() != 1:
        raise UsageError(f"a document must be a 1-D tensor of token ids, got shape {list(t.shape)}; pass each "
                         f"conversation's input_ids.")
    return t.cpu()


def write_cache(source: DocumentStateSource, documents: Iterable, cache_dir: str, *,
                shard_tokens: int = DEFAULT_SHARD_TOKENS, dtype: torch.dtype | str | None = None, progress: bool = True,
                tokens_per_call: int = DEFAULT_TOKENS_PER_CALL, full_vocabulary: bool = True,
                chunk_elements: int = DEFAULT_CHUNK_ELEMENTS) -> dict:
    """Precompute `source`'s states of `documents` (1-D token id tensors or lists) into `cache_dir` (layout in
    trainer/states/cache_format.py), resuming a previous run of the same plan. With `full_vocabulary` (the
    default) the shards also hold the verifier's full-vocabulary log-normaliser and argmax at every position,
    computed by the source's teacher from the states as stored, in head chunks of `chunk_elements` logits.
    Returns the summary: shards written and skipped, documents, tokens (all, and written now), bytes (written
    now, and the whole cache), seconds, tokens/s."""
    started = time.time()
    if shard_tokens < 1 or tokens_per_call < 1:
        raise UsageError(f"shard_tokens ({shard_tokens}) and tokens_per_call ({tokens_per_call}) must be >= 1; pass "
                         f"e.g. --shard_tokens {DEFAULT_SHARD_TOKENS}.")
    teacher = source.teacher() if full_vocabulary else None
    if teacher is not None and teacher.output_weight is None:
        raise UsageError(f"the hidden-state source ({type(source).__name__}) has no full output head to compute the "
                         f"full-vocabulary pass with; give its teacher the verifier's head, or pass "
                         f"full_vocabulary=False.")
    docs = [as_document(d) for d in documents]
    for i, d in enumerate(docs):
        if d.numel() == 0:
            raise UsageError(f"document {i} has no tokens; drop empty documents before caching their states.")
    stored = getattr(torch, dtype_name(dtype if dtype is not None else source.dtype))
    keys = [document_key(d) for d in docs]
    plan = make_plan(docs, source.aux_layer_ids, source.hidden_size, dtype_name(stored), shard_tokens, keys,
                     full_vocabulary=teacher is not None)
    by_key, first_index = {}, {}  # a key's document and its index in the input (for error messages)
    for i, (key, d) in enumerate(zip(keys, docs)):
        first_index.setdefault(key, i)
        by_key.setdefault(key, d)

    os.makedirs(cache_dir, exist_ok=True)
    old = check_plan(cache_dir, plan)

    width, hidden = len(plan["aux_layer_ids"]) * plan["hidden_size"], plan["hidden_size"]
    element = torch.empty((), dtype=stored).element_size()
    todo, damaged = [], []
    for i, shard in enumerate(plan["shards"]):
        path = os.path.join(cache_dir, shard["file"])
        problem = shard_problem(path, plan, shard)
        if problem is None:
            continue
        if problem != "missing":
            logger.warning("cache %s: %s is unusable (%s); redoing it", cache_dir, shard["file"], problem)
            damaged.append(path)
        todo.append(i)
    leftovers = [os.path.join(cache_dir, f) for f in os.listdir(cache_dir) if f.endswith(TMP_SUFFIX)]
    reclaim = sum(os.path.getsize(p) for p in damaged + leftovers)  # removed before any shard is written

    need = sum(shard_bytes(plan["shards"][i], width, hidden, element, plan["full_vocabulary"]) for i in todo)
    need_with_margin = need + (DISK_MARGIN_BYTES + need // 100 if todo else 0)
    free = shutil.disk_usage(cache_dir).free + reclaim
    remaining_tokens = sum(plan["shards"][i]["tokens"] for i in todo)
    logger.info("cache %s: %d documents, %d tokens in %d shards; %d shards (%d tokens) to write, needs %s, %s free",
                cache_dir, plan["documents"], plan["tokens"], len(plan["shards"]), len(todo), remaining_tokens,
                human_bytes(need_with_margin), human_bytes(free))
    if need_with_margin > free:
        raise UsageError(f"cache {cache_dir} needs {human_bytes(need_with_margin)} for the {len(todo)} shards still to "
                         f"write but its disk has {human_bytes(free)} free; free some space or pass a cache_dir on a "
                         f"larger disk.")

    for p in leftovers:
        logger.warning("cache %s: removing %s, left half-written by an interrupted run", cache_dir, os.path.basename(p))
        os.remove(p)
    for p in damaged:
        os.remove(p)
    complete = os.path.join(cache_dir, COMPLETE_FILE)
    if todo and os.path.exists(complete):
        os.remove(complete)
    if old is None:
        write_json_atomic(os.path.join(cache_dir, PLAN_FILE), plan, indent=None)

    written_bytes = 0
    bar = tqdm(total=remaining_tokens, unit="tok", unit_scale=True, desc="caching hidden states", disable=not progress)
    try:
        for done, i in enumerate(todo):
            shard = plan["shards"][i]
            aux = torch.empty(shard["tokens"], width, dtype=stored)
            last = torch.empty(shard["tokens"], hidden, dtype=stored)
            full = {"log_z": torch.empty(shard["tokens"], dtype=torch.float32),
                    "argmax": torch.empty(shard["tokens"], dtype=torch.int64)} if teacher is not None else {}
            shard_keys = shard["keys"]
            position, j = 0, 0
            while j < len(shard_keys):
                group, tokens = [], 0
                while j < len(shard_keys) and (not group or tokens + shard["lengths"][j] <= tokens_per_call):
                    group.append(shard_keys[j])
                    tokens += shard["lengths"][j]
                    j += 1
                results = source.document_states([by_key[k] for k in group])
                if len(results) != len(group):
                    raise DSparkError(f"the hidden-state source returned {len(results)} results for {len(group)} "
                                      f"documents; fix the source ({type(source).__name__}) to answer every document.")
                group_start = position
                for key, (a, x) in zip(group, results):
                    n = int(by_key[key].numel())
                    check_states(a, x, n, width, hidden, first_index[key], key, source)
                    aux[position : position + n] = a.to("cpu", stored)
                    last[position : position + n] = x.to("cpu", stored)
                    position += n
                if full:
                    # from the states as stored (what training reads back), on the head's device
                    head = teacher.output_weight
                    states = last[group_start:position].to(head.device)
                    log_z, argmax = teacher.full_vocabulary(teacher.normed(states), chunk_elements)
                    full["log_z"][group_start:position] = log_z.to("cpu", torch.float32)
                    full["argmax"][group_start:position] = argmax.cpu()
                bar.update(tokens)
            offsets = torch.tensor([0, *itertools.accumulate(shard["lengths"])], dtype=torch.int64)
            path = os.path.join(cache_dir, shard["file"])
            try:
                written_bytes += write_safetensors(path, {"aux": aux, "last": last, **full, "offsets": offsets},
                                                   shard_metadata(plan, shard))
            except OSError as e:
                if is_disk_full(e):
                    raise DSparkError(f"the disk of cache {cache_dir} filled up while writing {shard['file']} "
                                      f"({len(plan['shards']) - len(todo) + done} of {len(plan['shards'])} shards are "
                                      f"finished and kept); free some space and rerun the same command to resume."
                                      ) from e
                raise
            del aux, last, full
    finally:
        bar.close()

    total_bytes = sum(os.path.getsize(os.path.join(cache_dir, s["file"])) for s in plan["shards"])
    seconds = time.time() - started
    summary = {"cache_dir": cache_dir, "shards": len(plan["shards"]), "written": len(todo),
               "skipped": len(plan["shards"]) - len(todo), "documents": plan["documents"], "tokens": plan["tokens"],
               "tokens_written": remaining_tokens, "bytes_written": written_bytes, "bytes": total_bytes,
               "seconds": seconds, "tokens_per_s": remaining_tokens / seconds if seconds > 0 else 0.0}
    if todo or not os.path.exists(complete):
        write_json_atomic(complete, {k: summary[k] for k in ("shards", "documents", "tokens", "bytes")} |
                          {"format_version": FORMAT_VERSION}, indent=None)
    logger.info("cache %s complete: %d shards written, %d skipped (already done); %d tokens written (%d in all), %s "
                "written (%s in all), %.1f s, %.0f tokens/s", cache_dir, summary["written"], summary["skipped"],
                remaining_tokens, plan["tokens"], human_bytes(written_bytes), human_bytes(total_bytes), seconds,
                summary["tokens_per_s"])
    return summary


def check_states(aux: torch.Tensor, last: torch.Tensor, n: int, width: int, hidden: int, index: int, key: str,
                 source: DocumentStateSource) -> None:
    """One document's states from the source are what the cache will claim they are: the right shapes, finite."""
    if tuple(aux.shape) != (n, width) or tuple(last.shape) != (n, hidden):
        raise DSparkError(f"the hidden-state source ({type(source).__name__}) returned states of shapes "
                          f"{list(aux.shape)} and {list(last.shape)} for document {index} (key {key}, {n} tokens), "
                          f"expected [{n}, {width}] and [{n}, {hidden}]; check that it serves aux layers "
                          f"{source.aux_layer_ids} of a verifier with hidden size {hidden}.")
    if not (bool(torch.isfinite(aux).all()) and bool(torch.isfinite(last).all())):
        raise DSparkError(f"the hidden-state source ({type(source).__name__}) returned non-finite states for "
                          f"document {index} (key {key}, {n} tokens); check the verifier's dtype (fp16 overflows) or "
                          f"the server, then rerun (finished shards are kept).")


# ---------------------------------------------------------------------------------------------------- reader
class MissingStatesError(UsageError, KeyError):
    """A document the cache does not hold: a `KeyError` for lookups, a `UsageError` (one sentence) for the CLI."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class OfflineCache(DocumentStateSource):
    """A finished cache directory as a hidden-state source. Rows are read lazily from memory-mapped shards
    (`get_slice`), so memory holds only the requested documents; at most `max_open_shards` shard handles stay
    open (least recently used closed first)."""

    def __init__(self, cache_dir: str, teacher: Teacher | None = None, aux_layer_ids: list[int] | None = None,
                 max_open_shards: int = 64):
        self.cache_dir = cache_dir
        plan = read_plan(cache_dir)
        if plan is None:
            raise UsageError(f"{cache_dir} holds no hidden-state cache (no {PLAN_FILE}); build it with `python -m "
                             f"trainer.states.cache_format --config ... --cache_dir {cache_dir}`.")
        if plan.get("format_version") not in READABLE_FORMAT_VERSIONS:
            raise UsageError(f"cache {cache_dir} has format version {plan.get('format_version')}, this code reads "
                             f"{' and '.join(map(str, READABLE_FORMAT_VERSIONS))}; rebuild it into a new cache_dir.")
        if not os.path.exists(os.path.join(cache_dir, COMPLETE_FILE)):
            present = sum(os.path.exists(os.path.join(cache_dir, s["file"])) for s in plan["shards"])
            raise UsageError(f"cache {cache_dir} is incomplete ({present} of {len(plan['shards'])} shards); rerun the "
                             f"cache command to finish it.")
        if aux_layer_ids is not None and list(aux_layer_ids) != plan["aux_layer_ids"]:
            raise UsageError(f"cache {cache_dir} holds aux layers {plan['aux_layer_ids']}, but this run uses "
                             f"{list(aux_layer_ids)}; rebuild the cache with these ids or set "
                             f"model.aux_hidden_state_layer_ids to {plan['aux_layer_ids']}.")
        self.plan = plan
        self.aux_layer_ids = list(plan["aux_layer_ids"])
        self.hidden_size = int(plan["hidden_size"])
        self.dtype = getattr(torch, plan["dtype"])
        # format 1 (and a cache written without it) holds no full-vocabulary pass: the loss computes it per step
        self.full_vocabulary = bool(plan.get("full_vocabulary"))
        self._teacher = teacher
        self.max_open_shards = max(1, max_open_shards)
        self.index: dict[str, tuple[int, int, int]] = {}
        for s, shard in enumerate(plan["shards"]):
            start = 0
            for key, n in zip(shard["keys"], shard["lengths"]):
                self.index[key] = (s, start, start + n)
                start += n
        self._handles: OrderedDict[int, object] = OrderedDict()

    def __len__(self) -> int:
        return len(self.index)

    def contains(self, key: str) -> bool:
        return key in self.index

    __contains__ = contains

    def teacher(self) -> Teacher:
        if self._teacher is None:
            raise UsageError(f"the OfflineCache on {self.cache_dir} was opened without a teacher; pass teacher= (e.g. "
                             f"trainer.verifier.teacher.verifier_teacher of the verifier shell) to train from it.")
        return self._teacher

    def _shard(self, s: int):
        handle = self._handles.get(s)
        if handle is not None:
            self._handles.move_to_end(s)
            return handle
        shard = self.plan["shards"][s]
        path = os.path.join(self.cache_dir, shard["file"])
        try:
            handle = safe_open(path, "pt")
            keys = json.loads(handle.metadata().get("keys", "null"))
        except (OSError, ValueError, SafetensorError) as e:
            raise DSparkError(f"cannot read {path} ({' '.join(str(e).split())[:120]}); rerun the cache command to "
                              f"repair the cache.") from e
        if keys != shard["keys"]:
            raise DSparkError(f"{path} holds other documents than the cache's plan; rerun the cache command to "
                              f"repair the cache.")
        self._handles[s] = handle
        while len(self._handles) > self.max_open_shards:
            self._handles.popitem(last=False)
        return handle

    def _rows(self, d: torch.Tensor, names: tuple[str, ...]) -> tuple[torch.Tensor, ...]:
        """One document's rows of the named shard tensors, copied out of the memory map."""
        key = document_key(d)
        entry = self.index.get(key)
        n = int(d.numel())
        if entry is None:
            raise MissingStatesError(f"document {key} ({n} tokens) is not in cache {self.cache_dir}; rebuild the "
                                     f"cache for this data or use train.hidden_states: hybrid.")
        s, start, end = entry
        if end - start != n:
            raise DSparkError(f"document {key} has {n} tokens but cache {self.cache_dir} holds {end - start} for "
                              f"it; rebuild the cache.")
        handle = self._shard(s)
        # get_slice returns a view of the shard's memory map: copy the rows out, so a returned tensor is plain
        # memory (a shard truncated or deleted later cannot turn into a bus error in whoever holds it)
        return tuple(handle.get_slice(name)[start:end].clone() for name in names)

    def document_states(self, documents: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [self._rows(d, ("aux", "last")) for d in documents]

    def document_full_vocabulary(self, documents: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        """The stored full-vocabulary pass `(log_z [n], argmax [n])` of each document, None when the cache holds
        none."""
        if not self.full_vocabulary:
            return None
        return [self._rows(d, ("log_z", "argmax")) for d in documents]

    def __getstate__(self) -> dict:  # shard handles do not pickle (DataLoader workers, spawn): reopen lazily
        return {**self.__dict__, "_handles": OrderedDict()}
