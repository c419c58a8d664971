"""The offline hidden-state cache: the verifier's states of every training document, computed once before
training and read back by `document_key`, so a run (or many runs over the same data) never runs the verifier.

    python -m trainer.states_cache --config configs/smollm2-135m.yaml --cache_dir DIR [--shard_tokens N] [--key value]

Data flow:

    run config --prepare_data--> train + validation conversations (one document each, its `input_ids`)
        --write_cache(source)--> DIR (any DocumentStateSource: the in-process verifier here, vLLM servers later)
    training: StatesCache(DIR)           every document from the cache (a missing one is an error)
              HybridSource(cache, vllm)  cached documents from the cache, the rest from the online source

File layout of DIR:

    plan.json                  written first: format version, aux_layer_ids, hidden_size, dtype, shard_tokens
                               and, per shard, its file name and its documents' keys and lengths (the documents
                               deduplicated by key, in input order, cut into shards of about shard_tokens tokens)
    shard-00000.safetensors    aux [sum n, k*H], last [sum n, H] (before the final norm), offsets [docs + 1] int64;
    shard-00001.safetensors    metadata: format version, aux ids, hidden size and the keys (json), so each shard
    ...                        describes itself; written to a .tmp file, fsynced, then renamed into place
    COMPLETE                   written last (json totals): a reader refuses a directory without it

A rerun with the same plan resumes: every shard under its final name is validated (header, keys, shapes,
offsets, file size) and skipped, a truncated or foreign one is redone, leftover .tmp files are removed. A rerun
whose plan differs (other data, aux ids, hidden size, dtype, shard size) is refused rather than mixed in.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import shutil
import struct
import sys
import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence

import torch
from safetensors import SafetensorError, safe_open
from tqdm.auto import tqdm

from trainer.errors import DSparkError, UsageError, is_disk_full, run_cli
from trainer.hidden_states import DocumentStateSource, aux_layer_ids_for_config, document_key
from trainer.objective import Teacher

logger = logging.getLogger("dspark")

FORMAT_VERSION = 1
PLAN_FILE = "plan.json"
COMPLETE_FILE = "COMPLETE"
TMP_SUFFIX = ".tmp"
# 64k tokens: 1.3 GiB per shard for Gemma 4 E4B (3 aux layers of 2560, bf16), 0.6 GiB for SmolLM2 in fp32. A
# shard is assembled in memory before it is written, so this is also the writer's peak memory for states.
DEFAULT_SHARD_TOKENS = 1 << 16
DEFAULT_TOKENS_PER_CALL = 16384  # tokens per `document_states` call (one in-process forward group, or one fan-out)
DISK_MARGIN_BYTES = 16 << 20  # plus 1% of the need: headers, the filesystem's own overhead
MAX_HEADER_BYTES = 100 << 20
SAFETENSORS_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
                      torch.int64: "I64"}
STORABLE_DTYPES = ("float32", "bfloat16", "float16")


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.safetensors"


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} GiB"


def dtype_name(dtype: torch.dtype | str) -> str:
    """`torch.bfloat16` or `"bfloat16"` -> `"bfloat16"`, refusing what a cache cannot hold."""
    name = dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")
    if name not in STORABLE_DTYPES:
        raise UsageError(f"a hidden-state cache stores {', '.join(STORABLE_DTYPES)}, not {name}; pass one of those "
                         f"as dtype.")
    return name


# ---------------------------------------------------------------------------------------------------- plan
def make_plan(documents: Sequence[torch.Tensor], aux_layer_ids: list[int], hidden_size: int, dtype: str,
              shard_tokens: int, keys: Sequence[str] | None = None) -> dict:
    """The deterministic plan of a cache: documents deduplicated by key (first occurrence wins, order kept),
    cut into consecutive shards of at most `shard_tokens` tokens (a longer document gets a shard of its own).
    `keys`: the documents' `document_key`s when the caller has them already."""
    shards: list[dict] = []
    seen: set[str] = set()
    current: dict | None = None
    for i, d in enumerate(documents):
        key = keys[i] if keys is not None else document_key(d)
        if key in seen:
            continue
        seen.add(key)
        n = int(d.numel())
        if current is None or (current["lengths"] and current["tokens"] + n > shard_tokens):
            current = {"file": shard_name(len(shards)), "keys": [], "lengths": [], "tokens": 0}
            shards.append(current)
        current["keys"].append(key)
        current["lengths"].append(n)
        current["tokens"] += n
    return {"format_version": FORMAT_VERSION, "aux_layer_ids": list(aux_layer_ids), "hidden_size": int(hidden_size),
            "dtype": dtype, "shard_tokens": int(shard_tokens), "documents": len(seen),
            "tokens": sum(s["tokens"] for s in shards), "shards": shards}


def plan_difference(old: dict, new: dict) -> str | None:
    """What makes two plans different, as a phrase for the refusal, or None when they are the same plan."""
    for field, what in (("format_version", "cache format version"), ("aux_layer_ids", "aux_layer_ids"),
                        ("hidden_size", "hidden size"), ("dtype", "dtype")):
        if old.get(field) != new[field]:
            return f"{what} {old.get(field)!r}, not {new[field]!r}"
    old_keys = [k for s in old.get("shards", []) for k in s["keys"]]
    new_keys = [k for s in new["shards"] for k in s["keys"]]
    if old_keys != new_keys:
        common = len(set(old_keys) & set(new_keys))
        return (f"other documents ({old.get('documents')} documents of {old.get('tokens')} tokens, {common} of them "
                f"in this data's {new['documents']} documents of {new['tokens']} tokens)")
    if old.get("shard_tokens") != new["shard_tokens"] or old.get("shards") != new["shards"]:
        return (f"shard_tokens {old.get('shard_tokens')}, not {new['shard_tokens']} (pass --shard_tokens "
                f"{old.get('shard_tokens')} to resume it)")
    return None


def read_plan(cache_dir: str) -> dict | None:
    path = os.path.join(cache_dir, PLAN_FILE)
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            plan = json.load(f)
        if not isinstance(plan, dict) or not isinstance(plan.get("shards"), list):
            raise ValueError("not a cache plan")
    except (OSError, ValueError) as e:
        raise UsageError(f"{path} is unreadable ({' '.join(str(e).split())[:120]}); delete {cache_dir} and rebuild "
                         f"the cache.") from e
    return plan


def check_plan(cache_dir: str, plan: dict) -> dict | None:
    """Refuse to continue a cache planned differently (one sentence naming the difference); returns the plan
    already in `cache_dir`, or None when there is none yet."""
    old = read_plan(cache_dir)
    if old is not None:
        difference = plan_difference(old, plan)
        if difference:
            raise UsageError(f"cache {cache_dir} was planned with {difference}; write this cache into a new "
                             f"cache_dir, or delete {cache_dir} to rebuild it.")
    return old


def write_json_atomic(path: str, value: dict) -> None:
    tmp = path + TMP_SUFFIX
    with open(tmp, "w") as f:
        json.dump(value, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(path))


def fsync_dir(directory: str) -> None:
    """Make a rename durable (best effort: not every filesystem lets a directory be fsynced)."""
    try:
        fd = os.open(directory or ".", os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------------------------------- shards
def shard_bytes(shard: dict, width: int, hidden_size: int, element_size: int) -> int:
    """The tensor bytes of a planned shard (its header adds about 40 bytes per document)."""
    return shard["tokens"] * (width + hidden_size) * element_size + (len(shard["keys"]) + 1) * 8


def shard_metadata(plan: dict, shard: dict) -> dict[str, str]:
    return {"format_version": str(FORMAT_VERSION), "aux_layer_ids": json.dumps(plan["aux_layer_ids"]),
            "hidden_size": str(plan["hidden_size"]), "dtype": plan["dtype"], "keys": json.dumps(shard["keys"])}


def write_safetensors(path: str, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> int:
    """Write a safetensors file atomically: a .tmp file in the same directory, fsynced, renamed into place, so a
    crash never leaves a partial file under the final name. Written here rather than by `save_file` so the
    tensors stream from memory without a second copy and a full disk raises `OSError(ENOSPC)`. Returns bytes."""
    header: dict = {}
    offset = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset,
                                                                                                       offset + nbytes]}
        offset += nbytes
    header["__metadata__"] = metadata
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    tmp = path + TMP_SUFFIX
    try:
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(raw)))
            f.write(raw)
            for t in tensors.values():
                if t.numel():
                    f.write(memoryview(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    fsync_dir(os.path.dirname(path))
    return 8 + len(raw) + offset


def shard_problem(path: str, plan: dict, shard: dict) -> str | None:
    """Why the file at `path` is not the finished `shard` of `plan` (missing, truncated, unreadable, other keys,
    shapes or offsets), or None when it is. Reads the header and the offsets only."""
    if not os.path.exists(path):
        return "missing"
    size = os.path.getsize(path)
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                return f"truncated ({size} bytes)"
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER_BYTES or 8 + n > size:
                return f"truncated or not safetensors (header of {n} bytes in a file of {size})"
            header = json.loads(f.read(n))
        end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
        if size != 8 + n + end:
            return f"truncated ({size} of {8 + n + end} bytes)"
        metadata = header.get("__metadata__") or {}
        if metadata.get("format_version") != str(FORMAT_VERSION) or json.loads(metadata.get("keys", "null")) != \
                shard["keys"]:
            return "its documents are not the plan's"
        width, hidden = len(plan["aux_layer_ids"]) * plan["hidden_size"], plan["hidden_size"]
        expected = {"aux": ([shard["tokens"], width], SAFETENSORS_DTYPES[getattr(torch, plan["dtype"])]),
                    "last": ([shard["tokens"], hidden], SAFETENSORS_DTYPES[getattr(torch, plan["dtype"])]),
                    "offsets": ([len(shard["keys"]) + 1], "I64")}
        for name, (shape, dtype) in expected.items():
            got = header.get(name)
            if got is None or got["shape"] != shape or got["dtype"] != dtype:
                return f"tensor {name} is {got and (got['dtype'], got['shape'])}, expected {(dtype, shape)}"
        with safe_open(path, "pt") as f:
            offsets = f.get_tensor("offsets").tolist()
    except (OSError, ValueError, KeyError, TypeError, struct.error, SafetensorError) as e:
        return f"unreadable ({' '.join(str(e).split())[:120]})"
    if offsets != [0, *itertools.accumulate(shard["lengths"])]:
        return "its offsets are not the plan's document lengths"
    return None


# ---------------------------------------------------------------------------------------------------- writer
def as_document(d) -> torch.Tensor:
    t = torch.as_tensor(d, dtype=torch.long).reshape(-1) if not isinstance(d, torch.Tensor) else d.to(torch.long)
    if t.dim() != 1:
        raise UsageError(f"a document must be a 1-D tensor of token ids, got shape {list(t.shape)}; pass each "
                         f"conversation's input_ids.")
    return t.cpu()


def write_cache(source: DocumentStateSource, documents: Iterable, cache_dir: str, *,
                shard_tokens: int = DEFAULT_SHARD_TOKENS, dtype: torch.dtype | str | None = None, progress: bool = True,
                tokens_per_call: int = DEFAULT_TOKENS_PER_CALL) -> dict:
    """Precompute `source`'s states of `documents` (1-D token id tensors or lists) into `cache_dir` (layout in
    the module docstring), resuming a previous run of the same plan. Returns the summary: shards written and
    skipped, documents, tokens (all, and written now), bytes (written now, and the whole cache), seconds,
    tokens/s."""
    started = time.time()
    if shard_tokens < 1 or tokens_per_call < 1:
        raise UsageError(f"shard_tokens ({shard_tokens}) and tokens_per_call ({tokens_per_call}) must be >= 1; pass "
                         f"e.g. --shard_tokens {DEFAULT_SHARD_TOKENS}.")
    docs = [as_document(d) for d in documents]
    for i, d in enumerate(docs):
        if d.numel() == 0:
            raise UsageError(f"document {i} has no tokens; drop empty documents before caching their states.")
    stored = getattr(torch, dtype_name(dtype if dtype is not None else source.dtype))
    keys = [document_key(d) for d in docs]
    plan = make_plan(docs, source.aux_layer_ids, source.hidden_size, dtype_name(stored), shard_tokens, keys)
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

    need = sum(shard_bytes(plan["shards"][i], width, hidden, element) for i in todo)
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
        write_json_atomic(os.path.join(cache_dir, PLAN_FILE), plan)

    written_bytes = 0
    bar = tqdm(total=remaining_tokens, unit="tok", unit_scale=True, desc="caching hidden states", disable=not progress)
    try:
        for done, i in enumerate(todo):
            shard = plan["shards"][i]
            aux = torch.empty(shard["tokens"], width, dtype=stored)
            last = torch.empty(shard["tokens"], hidden, dtype=stored)
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
                for key, (a, x) in zip(group, results):
                    n = int(by_key[key].numel())
                    check_states(a, x, n, width, hidden, first_index[key], key, source)
                    aux[position : position + n] = a.to("cpu", stored)
                    last[position : position + n] = x.to("cpu", stored)
                    position += n
                bar.update(tokens)
            offsets = torch.tensor([0, *itertools.accumulate(shard["lengths"])], dtype=torch.int64)
            path = os.path.join(cache_dir, shard["file"])
            try:
                written_bytes += write_safetensors(path, {"aux": aux, "last": last, "offsets": offsets},
                                                   shard_metadata(plan, shard))
            except OSError as e:
                if is_disk_full(e):
                    raise DSparkError(f"the disk of cache {cache_dir} filled up while writing {shard['file']} "
                                      f"({len(plan['shards']) - len(todo) + done} of {len(plan['shards'])} shards are "
                                      f"finished and kept); free some space and rerun the same command to resume."
                                      ) from e
                raise
            del aux, last
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
                          {"format_version": FORMAT_VERSION})
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


class StatesCache(DocumentStateSource):
    """A finished cache directory as a hidden-state source. Rows are read lazily from memory-mapped shards
    (`get_slice`), so memory holds only the requested documents; at most `max_open_shards` shard handles stay
    open (least recently used closed first)."""

    def __init__(self, cache_dir: str, teacher: Teacher | None = None, aux_layer_ids: list[int] | None = None,
                 max_open_shards: int = 64):
        self.cache_dir = cache_dir
        plan = read_plan(cache_dir)
        if plan is None:
            raise UsageError(f"{cache_dir} holds no hidden-state cache (no {PLAN_FILE}); build it with `python -m "
                             f"trainer.states_cache --config ... --cache_dir {cache_dir}`.")
        if plan.get("format_version") != FORMAT_VERSION:
            raise UsageError(f"cache {cache_dir} has format version {plan.get('format_version')}, this code reads "
                             f"{FORMAT_VERSION}; rebuild it into a new cache_dir.")
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
            raise UsageError(f"the StatesCache on {self.cache_dir} was opened without a teacher; pass teacher= (e.g. "
                             f"trainer.hidden_states.verifier_teacher of the verifier shell) to train from it.")
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

    def document_states(self, documents: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        out = []
        for d in documents:
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
            out.append((handle.get_slice("aux")[start:end].clone(), handle.get_slice("last")[start:end].clone()))
        return out

    def __getstate__(self) -> dict:  # shard handles do not pickle (DataLoader workers, spawn): reopen lazily
        return {**self.__dict__, "_handles": OrderedDict()}


class HybridSource(DocumentStateSource):
    """Cached documents from the cache, the others from `fallback` (an online source), in one fallback call per
    batch; states come out in the cache's dtype. Counts what each side served (`served`, `share()`, `report()`)."""

    def __init__(self, cache: StatesCache, fallback: DocumentStateSource, fallback_name: str | None = None):
        if list(fallback.aux_layer_ids) != cache.aux_layer_ids or fallback.hidden_size != cache.hidden_size:
            raise UsageError(f"the cache {cache.cache_dir} holds aux layers {cache.aux_layer_ids} of hidden size "
                             f"{cache.hidden_size}, but the fallback serves {list(fallback.aux_layer_ids)} of "
                             f"{fallback.hidden_size}; rebuild the cache or configure both for the same layers.")
        self.cache = cache
        self.fallback = fallback
        names = {"VLLMStateSource": "vllm", "InProcessVerifier": "the in-process verifier"}
        known = [names[c.__name__] for c in type(fallback).__mro__ if c.__name__ in names]
        self.fallback_name = fallback_name or (known[0] if known else type(fallback).__name__)
        self.aux_layer_ids = cache.aux_layer_ids
        self.hidden_size = cache.hidden_size
        self.dtype = cache.dtype
        self.served = {"cache": {"documents": 0, "tokens": 0}, "fallback": {"documents": 0, "tokens": 0}}

    def teacher(self) -> Teacher:
        return self.fallback.teacher()

    def prefetch(self, batch: dict[str, torch.Tensor]) -> None:
        """Announce to the fallback only the documents the cache lacks, as a sub-batch of one document per row
        (`input_ids`, `document_ids`, `position_ids`), so it never fetches (or holds) a cached document."""
        missing = [d for d in self.documents(batch)[1] if not self.cache.contains(document_key(d))]
        if not missing:
            return
        length = max(int(d.numel()) for d in missing)
        sub = {"input_ids": torch.zeros(len(missing), length, dtype=torch.long),
               "document_ids": torch.full((len(missing), length), -1, dtype=torch.long),
               "position_ids": torch.zeros(len(missing), length, dtype=torch.long)}
        for i, d in enumerate(missing):
            n = int(d.numel())
            sub["input_ids"][i, :n] = d
            sub["document_ids"][i, :n] = 0
            sub["position_ids"][i, :n] = torch.arange(n)
        self.fallback.prefetch(sub)

    def document_states(self, documents: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        cached = [self.cache.contains(document_key(d)) for d in documents]
        hits = iter(self.cache.document_states([d for d, c in zip(documents, cached) if c]))
        missing = [d for d, c in zip(documents, cached) if not c]
        answered = self.fallback.document_states(missing) if missing else []
        if len(answered) != len(missing):
            raise DSparkError(f"the fallback ({self.fallback_name}) returned {len(answered)} results for "
                              f"{len(missing)} documents; fix the source to answer every document.")
        misses = iter(answered)
        out = []
        for d, c in zip(documents, cached):
            aux, last = next(hits) if c else next(misses)
            side = self.served["cache" if c else "fallback"]
            side["documents"] += 1
            side["tokens"] += int(d.numel())
            out.append((aux.to(self.dtype), last.to(self.dtype)))
        return out

    def share(self) -> float:
        """The share of served tokens that came from the cache (0.0 before anything was served)."""
        total = self.served["cache"]["tokens"] + self.served["fallback"]["tokens"]
        return self.served["cache"]["tokens"] / total if total else 0.0

    def report(self) -> str:
        c, f = self.served["cache"], self.served["fallback"]
        if not c["documents"] + f["documents"]:
            return "hidden states: nothing served yet"
        share = self.share()
        return (f"hidden states: {100 * share:.1f}% of tokens ({c['documents']} of {c['documents'] + f['documents']} "
                f"documents) from the cache, {100 * (1 - share):.1f}% from {self.fallback_name}")


# ---------------------------------------------------------------------------------------------------- command
def documents_for_config(config) -> list[torch.Tensor]:
    """Every document a run of `config` trains or evaluates on (train and validation conversations, each one's
    `input_ids`), through the run's own data path (`trainer.run.prepare_data`), so their keys are the ones
    training asks for."""
    import numpy as np
    import pyarrow.compute as pc
    from transformers import AutoTokenizer

    from trainer.run import prepare_data
    from trainer.verifier import resolve_pretrained

    path, _ = resolve_pretrained(config.model.verifier, "verifier")
    tokenizer = AutoTokenizer.from_pretrained(path)
    train_set, validation_set, _ = prepare_data(config, tokenizer)
    documents = []
    for split in (train_set, validation_set):
        if len(split) == 0:
            continue
        table = split.select_columns(["input_ids"]).with_format("arrow")
        for batch in table.iter(batch_size=4096):
            column = batch.column("input_ids")
            values = pc.list_flatten(column).to_numpy().astype(np.int64)
            ends = np.cumsum(pc.list_value_length(column).to_numpy())
            documents.extend(torch.from_numpy(v.copy()) for v in np.split(values, ends[:-1]))
    return documents


def parse_args(argv: list[str]) -> tuple[str | None, str | None, int, str, list[str]]:
    """`--config`, `--cache_dir`, `--shard_tokens` and `--source` (in_process, or vllm: the servers of the run
    config's train.vllm_urls) are the command's own; everything else overrides the run config (as for
    trainer/run.py)."""
    own = {"--config": None, "--cache_dir": None, "--shard_tokens": None, "--source": "in_process"}
    rest = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg in ("-h", "--help"):
            print(__doc__)
            raise SystemExit(0)
        name, eq, value = arg.partition("=")
        if name in own:
            if not eq:
                if i + 1 >= len(argv):
                    example = DEFAULT_SHARD_TOKENS if name == "--shard_tokens" else "DIR"
                    raise UsageError(f"{name} needs a value; pass e.g. {name} {example}.")
                value = argv[i + 1]
                i += 1
            own[name] = value
        else:
            rest.append(arg)
        i += 1
    shard_tokens = DEFAULT_SHARD_TOKENS
    if own["--shard_tokens"] is not None:
        try:
            shard_tokens = int(own["--shard_tokens"])
        except ValueError as e:
            raise UsageError(f"--shard_tokens {own['--shard_tokens']} is not an integer; pass e.g. 65536.") from e
    if own["--source"] not in ("in_process", "vllm"):
        raise UsageError(f"--source must be in_process or vllm (got {own['--source']!r}).")
    return own["--config"], own["--cache_dir"], shard_tokens, own["--source"], rest


def main(argv: list[str] | None = None) -> dict:
    config_path, cache_dir, shard_tokens, source_name, rest = parse_args(sys.argv[1:] if argv is None else argv)
    if not cache_dir:
        raise UsageError("no --cache_dir was given; pass the directory to write the cache into, e.g. --cache_dir "
                         "out/states-cache.")
    from trainer.config import RunConfig
    from trainer.hidden_states import InProcessVerifier
    from trainer.verifier import load_verifier, resolve_pretrained, torch_dtype

    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.INFO,
                        stream=sys.stdout)
    config = RunConfig.load(config_path, rest)
    path, verifier_config = resolve_pretrained(config.model.verifier, "verifier")
    aux_layer_ids = aux_layer_ids_for_config(config, verifier_config)
    documents = [as_document(d) for d in documents_for_config(config)]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch_dtype(config.model.verifier_dtype, device)
    hidden_size = verifier_config.get_text_config().hidden_size
    # a cache planned differently is refused before the verifier is loaded (minutes for a large one on a GPU)
    check_plan(cache_dir, make_plan(documents, aux_layer_ids, hidden_size, dtype_name(dtype), shard_tokens))
    if source_name == "vllm":
        from trainer.verifier import load_verifier_shell
        from trainer.vllm_states import source_for_config

        t = config.train
        if not (t.vllm_urls and t.vllm_states_dir):
            raise UsageError("--source vllm needs the servers: pass --vllm_urls '[http://host:port]' and "
                             "--vllm_states_dir DIR (or set them in the config's train section).")
        source = source_for_config(config, load_verifier_shell(path, config.model.verifier_dtype, device),
                                   aux_layer_ids)
    else:
        logger.info("loading the verifier %s (%s)", config.model.verifier, path)
        verifier = load_verifier(path, dtype=config.model.verifier_dtype, device=device)
        source = InProcessVerifier(verifier, aux_layer_ids,
                                   max_tokens_per_forward=config.train.verifier_max_tokens_per_forward)
    return write_cache(source, documents, cache_dir, shard_tokens=shard_tokens,
                       tokens_per_call=config.train.verifier_max_tokens_per_forward)


if __name__ == "__main__":
    sys.exit(run_cli(main))
