"""The offline hidden-state cache's on-disk format: the verifier's states of every training document, computed once before
training and read back by `document_key`, so a run (or many runs over the same data) never runs the verifier.

Data flow:

    run config --prepare_data--> train + validation conversations (one document each, its `input_ids`)
        --write_cache(source)--> DIR (any DocumentStateSource: the in-process verifier here, vLLM servers later)
    training: OfflineCache(DIR)           every document from the cache (a missing one is an error)
              HybridSource(cache, vllm)  cached documents from the cache, the rest from the online source

File layout of DIR:

    plan.json                  written first: format version, aux_layer_ids, hidden_size, dtype, shard_tokens,
                               full_vocabulary and, per shard, its file name and its documents' keys and lengths
                               (the documents deduplicated by key, in input order, cut into shards of about
                               shard_tokens tokens)
    shard-00000.safetensors    aux [sum n, k*H], last [sum n, H] (before the final norm), offsets [docs + 1] int64,
    shard-00001.safetensors    and with full_vocabulary: log_z [sum n] fp32, argmax [sum n] int64 (the verifier's
    ...                        full-vocabulary log-normaliser and argmax at each position, `Teacher.full_vocabulary`
                               of the stored last states); metadata: format version, aux ids, hidden size and the
                               keys (json), so each shard describes itself; written to a .tmp file, fsynced, then
                               renamed into place
    COMPLETE                   written last (json totals): a reader refuses a directory without it

Why the full-vocabulary pass is stored: the default objective (greedy confidence target, full-vocabulary metrics)
needs the verifier's log-normaliser and argmax over its whole head at every supervised position, a V x H pass per
position that costs more than the rest of a small drafter's step. It depends on the position's state alone, so it is
computed once here, where the states are, and every epoch of every run over the cache reads it (12 bytes a token).
A format-1 cache (written before it was stored) is still read; the loss then computes the pass per step.

A rerun with the same plan resumes: every shard under its final name is validated (header, keys, shapes,
offsets, file size) and skipped, a truncated or foreign one is redone, leftover .tmp files are removed. A rerun
whose plan differs (other data, aux ids, hidden size, dtype, shard size) is refused rather than mixed in.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import struct
from collections.abc import Sequence

import torch
from safetensors import SafetensorError, safe_open

from trainer.errors import UsageError
from trainer.files import atomic_path
from trainer.states.source import document_key

logger = logging.getLogger("dspark")


FORMAT_VERSION = 2  # 2: the full-vocabulary pass (log_z, argmax) beside the states


READABLE_FORMAT_VERSIONS = (1, 2)


PLAN_FILE = "plan.json"


COMPLETE_FILE = "COMPLETE"


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
              shard_tokens: int, keys: Sequence[str] | None = None, full_vocabulary: bool = True) -> dict:
    """The deterministic plan of a cache: documents deduplicated by key (first occurrence wins, order kept),
    cut into consecutive shards of at most `shard_tokens` tokens (a longer document gets a shard of its own).
    `keys`: the documents' `document_key`s when the caller has them already; `full_vocabulary`: the shards also
    hold the verifier's full-vocabulary pass per position."""
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
            "dtype": dtype, "shard_tokens": int(shard_tokens), "full_vocabulary": bool(full_vocabulary),
            "documents": len(seen),
            "tokens": sum(s["tokens"] for s in shards), "shards": shards}


def plan_difference(old: dict, new: dict) -> str | None:
    """What makes two plans different, as a phrase for the refusal, or None when they are the same plan."""
    for field, what in (("format_version", "cache format version"), ("aux_layer_ids", "aux_layer_ids"),
                        ("hidden_size", "hidden size"), ("dtype", "dtype"),
                        ("full_vocabulary", "full_vocabulary")):
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


# ---------------------------------------------------------------------------------------------------- shards
FULL_VOCABULARY_BYTES = 4 + 8  # per token: log_z fp32, argmax int64


def shard_bytes(shard: dict, width: int, hidden_size: int, element_size: int, full_vocabulary: bool = True) -> int:
    """The tensor bytes of a planned shard (its header adds about 40 bytes per document)."""
    per_token = (width + hidden_size) * element_size + (FULL_VOCABULARY_BYTES if full_vocabulary else 0)
    return shard["tokens"] * per_token + (len(shard["keys"]) + 1) * 8


def shard_metadata(plan: dict, shard: dict) -> dict[str, str]:
    return {"format_version": str(FORMAT_VERSION), "aux_layer_ids": json.dumps(plan["aux_layer_ids"]),
            "hidden_size": str(plan["hidden_size"]), "dtype": plan["dtype"], "keys": json.dumps(shard["keys"])}


def write_safetensors(path: str, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> int:
    """Write a safetensors file atomically (`trainer.files.atomic_path`: a .tmp file beside it, fsynced, renamed), so a
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
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for t in tensors.values():
            if t.numel():
                f.write(memoryview(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()))
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
        if plan.get("full_vocabulary"):
            expected.update(log_z=([shard["tokens"]], "F32"), argmax=([shard["tokens"]], "I64"))
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
