"""Chat data -> tokenised conversations with assistant-only loss masks -> packed training rows.

Data flow: chat rows are rendered with the *verifier's* chat template, because the drafter
must learn the verifier's distribution over exactly the token sequences it sees at serving time; the loss
mask marks the assistant tokens (including the end-of-turn tokens the template appends) since only those
are ever drafted. Conversations are then bin-packed into rows of `total_seq_length` tokens carrying
`document_ids` and per-document `position_ids`, so the verifier and the drafter can treat every
conversation as its own sequence inside one row.

Tokenisation goes through `datasets.Dataset.map`, so it is cached by fingerprint and can run in several
processes; packing and batching read the arrow table by index and never load the dataset into Python.
"""

from __future__ import annotations

import functools
import logging
import os
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import datasets
import huggingface_hub
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch
from datasets.exceptions import DatasetGenerationError
from tqdm.auto import tqdm

from modeling_dspark import positions_from_document_ids
from trainer.data_files import (
    check_bad_line_ratio,
    check_parquet_file,
    json_paths,
    root_cause,
    scan_json_files,
    unreadable_parquet_file,
)
from trainer.errors import UsageError

logger = logging.getLogger(__name__)

DATA_FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}
"""Local file suffixes `load_chat_dataset` accepts, and the `datasets` builder that reads each."""

ROLE_ALIASES = {
    "system": "system",
    "user": "user",
    "human": "user",
    "assistant": "assistant",
    "gpt": "assistant",
    "model": "assistant",
    "tool": "tool",
    "function": "tool",
    "observation": "tool",
}
"""ShareGPT / OpenAI / Gemma role names -> the roles chat templates expect."""

KEPT_STATUSES = ("ok", "inconsistent_template")
SKIP_STATUSES = ("no_assistant", "empty", "prompt_too_long", "malformed")

_PREPARED_FEATURES = datasets.Features(
    {
        "input_ids": datasets.List(datasets.Value("int32")),
        "loss_mask": datasets.List(datasets.Value("int8")),
        "length": datasets.Value("int32"),
        "num_supervised": datasets.Value("int32"),
        "status": datasets.Value("string"),
        "error": datasets.Value("string"),
        "truncated": datasets.Value("bool"),
    }
)
_STATS_COLUMNS = ("status", "error", "truncated")


# --------------------------------------------------------------------------------------------------------------
# Loading


def load_chat_dataset(
    source: str | os.PathLike | Sequence[str | os.PathLike],
    split: str = "train",
    max_samples: int | None = None,
    *,
    max_bad_line_ratio: float = 0.01,
) -> datasets.Dataset:
    """Load chat rows from a Hub dataset id, local .jsonl/.json/.parquet file(s), or a local directory.

    A directory is read as a `save_to_disk` dataset when it looks like one, otherwise as every data file
    found under it (sorted, so the row order is reproducible). The schema is checked here so a wrong file
    fails before any tokenisation; `max_samples` keeps the first rows (deterministic, unlike sampling).

    Local JSON files are pre-scanned line by line (`trainer.data_files.scan_json_file`) before `datasets` reads them, so that
    anything unreadable is reported with its file and line. Unreadable lines (invalid JSON or UTF-8, a
    truncated last line, JSON that is not an object) are skipped, counted and logged once when they are at
    most `max_bad_line_ratio` of the non-blank lines of all the files together; otherwise the load is refused
    with a `UsageError` quoting the first one. A file with skipped lines is read through a clean copy in the
    `datasets` cache, keyed by the file's content hash, so files without bad lines are read exactly as before.
    Files that cannot be read at all (empty, only blank lines, a .json document that is not rows, a corrupt
    Parquet file) and missing paths are always a `UsageError`. Hub ids are handed to `datasets` unchanged.
    """
    ratio = check_bad_line_ratio(max_bad_line_ratio)
    if isinstance(source, (list, tuple)):
        if not source:
            raise UsageError("the data source list is empty; pass at least one .jsonl/.json/.parquet file.")
        dataset = _load_files([Path(s).expanduser() for s in source], split, ratio)
    else:
        text = os.fspath(source)
        path = Path(text).expanduser()
        if path.is_dir():
            dataset = _load_directory(path, split, ratio)
        elif path.is_file():
            dataset = _load_files([path], split, ratio)
        elif path.suffix.lower() in DATA_FILE_BUILDERS or text.startswith((".", "/", "~")):
            raise UsageError(
                f"data path {text} does not exist; pass an existing .jsonl/.json/.parquet file, a directory of "
                "them, or a Hub dataset id."
            )
        else:
            try:
                dataset = datasets.load_dataset(text, split=split)
            except Exception as err:  # offline, a typo, no access, a missing split: bad input either way
                offline = " (the Hub is offline: HF_HUB_OFFLINE=1)" if huggingface_hub.constants.HF_HUB_OFFLINE else ""
                reason = " ".join(f"{type(err).__name__}: {err}".split())[:200]
                raise UsageError(
                    f"data {text!r} is not a local path, and loading it as a Hub dataset (split {split!r}) failed"
                    f"{offline} ({reason}); check the path or the dataset id and split."
                ) from err
    if not isinstance(dataset, datasets.Dataset):
        raise TypeError(f"{source} loaded as {type(dataset).__name__}; pass a map-style dataset (not streaming).")
    conversation_column(dataset.column_names)
    if len(dataset) == 0:
        raise UsageError(f"{source} (split {split!r}) holds no rows; point the data source at non-empty chat data.")
    if max_samples is not None:
        if max_samples < 1:
            raise UsageError(f"max_samples={max_samples} must be >= 1; pass None to use every row.")
        dataset = dataset.select(range(min(max_samples, len(dataset))))
    return dataset


def _load_files(files: list[Path], split: str, max_bad_line_ratio: float = 0.01) -> datasets.Dataset:
    for f in files:
        if f.is_dir():
            raise UsageError(f"data file {f} is a directory; pass the directory alone, or list its data files.")
        if not f.is_file():
            raise UsageError(f"data file {f} does not exist; check the path (expected a .jsonl, .json or .parquet file).")
    builders = {DATA_FILE_BUILDERS.get(f.suffix.lower()) for f in files}
    if None in builders:
        bad = next(f for f in files if f.suffix.lower() not in DATA_FILE_BUILDERS)
        raise UsageError(f"cannot read {bad}: unsupported suffix {bad.suffix!r}; use .jsonl, .json or .parquet files.")
    if len(builders) > 1:
        raise UsageError("the data files mix JSON and Parquet; convert them to one format or load them separately.")
    if builders == {"parquet"}:
        for f in files:
            check_parquet_file(f)
        try:
            return _read_data_files("parquet", files, split)
        except _READ_ERRORS as err:
            culprit = unreadable_parquet_file(files)
            if culprit is not None:
                path, cause = culprit
                raise UsageError(
                    f"data file {path} is not a readable Parquet file ({cause}); re-export it or remove it from "
                    "the data."
                ) from err
            raise _build_error(files, err) from err
    scans = scan_json_files(files, max_bad_line_ratio)
    paths = json_paths(scans)
    try:
        return _read_data_files("json", paths, split)
    except _READ_ERRORS as err:
        if not any(s.blank_lines for s in scans):
            raise _build_error(paths, err) from err
        # `datasets` fails on blank lines in files whose fields mix types (string vs list-of-parts content):
        # read those files through a copy without the blank lines
        logger.info("reading the JSON files again without their blank lines (%s)", root_cause(err))
        paths = json_paths(scans, drop_blank_lines=True)
        try:
            return _read_data_files("json", paths, split)
        except _READ_ERRORS as err2:
            raise _build_error(paths, err2) from err2


_READ_ERRORS = (DatasetGenerationError, pa.ArrowException, ValueError)
"""What `datasets` raises on data it cannot turn into a table (its JSON reader raises bare ValueErrors)."""


def _read_data_files(builder: str, files: list[Path], split: str) -> datasets.Dataset:
    return datasets.load_dataset(builder, data_files={split: [str(f) for f in files]}, split=split)


def _build_error(files: list[Path], err: BaseException) -> UsageError:
    where = f"data file {files[0]}" if len(files) == 1 else f"the {len(files)} data files {files[0]}, ..."
    return UsageError(
        f"could not build a dataset from {where} ({root_cause(err)}); every file must hold rows with the same "
        "columns and value types, so fix or remove the odd rows or files."
    )


def _load_directory(path: Path, split: str, max_bad_line_ratio: float = 0.01) -> datasets.Dataset:
    if any((path / name).is_file() for name in ("dataset_info.json", "state.json", "dataset_dict.json")):
        loaded = datasets.load_from_disk(str(path))
        if isinstance(loaded, datasets.DatasetDict):
            if split not in loaded:
                raise UsageError(f"{path} has splits {sorted(loaded)} but not {split!r}; pass one of those as split.")
            loaded = loaded[split]
        return loaded
    files = sorted(
        p
        for p in path.rglob("*")
        if p.is_file()
        and p.suffix.lower() in DATA_FILE_BUILDERS
        and not any(part.startswith(".") for part in p.relative_to(path).parts)
    )
    if not files:
        raise UsageError(
            f"data directory {path} contains no .jsonl/.json/.parquet files (hidden ones are skipped) and is not a "
            "save_to_disk dataset; put chat data files in it, or point at a file or a Hub dataset id."
        )
    return _load_files(files, split, max_bad_line_ratio)


# --------------------------------------------------------------------------------------------------------------
# Schema


def conversation_column(column_names: Sequence[str]) -> str:
    """Name of the column holding the turns: `messages` (role/content) or ShareGPT `conversations` (from/value)."""
    for name in ("messages", "conversations"):
        if name in column_names:
            return name
    raise UsageError(
        f"rows have columns {list(column_names)}; expected a `messages` column (role/content) "
        "or a ShareGPT `conversations` column (from/value)."
    )


def normalize_messages(turns: Any) -> list[dict[str, str]]:
    """Turn one row's turns (OpenAI `role`/`content` or ShareGPT `from`/`value`) into role/content messages.

    Roles are mapped through `ROLE_ALIASES` (`human` -> user, `gpt`/`model` -> assistant, ...). Content given
    as a list of parts keeps its text parts joined with newlines (as vLLM does for string-content templates);
    other parts (images, audio) are dropped because the drafter is text-only. Raises ValueError on a malformed
    row; `render_conversation` turns that into a counted skip.
    """
    if isinstance(turns, Mapping) or not isinstance(turns, Sequence) or isinstance(turns, (str, bytes)):
        raise ValueError(f"the turns are a {type(turns).__name__}, not a list of messages")
    messages = []
    for turn in turns:
        if not isinstance(turn, Mapping):
            raise ValueError(f"a turn is a {type(turn).__name__}, not a dict with role/content or from/value")
        role = turn.get("role") if turn.get("role") is not None else turn.get("from")
        if not isinstance(role, str) or role.strip().lower() not in ROLE_ALIASES:
            raise ValueError(f"unknown role {role!r}; use one of {sorted(ROLE_ALIASES)}")
        content = turn.get("content") if turn.get("content") is not None else turn.get("value")
        messages.append({"role": ROLE_ALIASES[role.strip().lower()], "content": _content_text(content)})
    return messages


def _content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence) and not isinstance(content, bytes):
        texts = []
        for part in content:
            if isinstance(part, str):
                texts.append(part)
            elif isinstance(part, Mapping):
                if part.get("type", "text") == "text" and part.get("text") is not None:
                    texts.append(str(part["text"]))
            else:
                raise ValueError(f"a content part is a {type(part).__name__}, not a dict or string")
        return "\n".join(texts)
    raise ValueError(f"content is a {type(content).__name__}; use a string or a list of text parts")


# --------------------------------------------------------------------------------------------------------------
# Rendering with the verifier's chat template


def _check_chat_template(tokenizer, chat_template: str | None) -> None:
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        raise ValueError(
            f"tokenizer {name} has no chat template; use the instruction-tuned verifier's tokenizer "
            "or pass a chat template (chat_template=...)."
        )


def _render(tokenizer, messages, chat_template, add_generation_prompt: bool) -> list[int]:
    ids = tokenizer.apply_chat_template(
        messages,
        chat_template=chat_template,
        add_generation_prompt=add_generation_prompt,
        tokenize=True,
        return_dict=False,
    )
    if isinstance(ids, Mapping):  # transformers v5 returns a BatchEncoding unless return_dict=False is honoured
        ids = ids["input_ids"]
    return [int(t) for t in ids]


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def render_conversation(
    tokenizer, messages: Any, max_seq_length: int, chat_template: str | None = None
) -> dict[str, Any]:
    """Render one conversation with the verifier's chat template and mark the assistant tokens.

    Returns `input_ids`, `loss_mask` (same length, 1 on supervised tokens), `status` and, for bookkeeping,
    `error` (why a row is malformed) and `truncated`. Kept rows have status "ok" or "inconsistent_template";
    skipped rows ("no_assistant", "empty", "prompt_too_long", "malformed") have empty `input_ids`.

    The mask is derived from renders of prefixes rather than from a hand-written template: for assistant
    turn j, P_j = render(messages[:j], add_generation_prompt=True) and F_j = render(messages[:j+1]); when
    P_j is a prefix of F_j and F_j of the full render F, the turn's tokens are F[len(P_j):len(F_j)], i.e. the
    content plus whatever end-of-turn tokens the template appends. Templates that render history
    differently from the last turn (e.g. stripping reasoning) fail that check; then the span is
    F[lcp(P_j, F):lcp(F_j, F)] (lcp = longest common prefix), which never reaches beyond where the turn's
    own render agrees with F, and the row is kept with status "inconsistent_template".

    Turns after the last non-empty assistant turn are dropped (they could never be supervised), empty
    assistant turns and a leading assistant turn (no prompt) are left unsupervised.

    Length rule: the drafter anchors at positions p with loss_mask[p+1] == 1, so a row is useful only if it
    keeps a supervised token at some index >= 1. A conversation is right-truncated to `max_seq_length`
    tokens; if that leaves no supervised token at an index >= 1 (the prompt before the first assistant
    content fills the window: first supervised index >= max_seq_length) it is dropped as "prompt_too_long".
    """
    if max_seq_length < 2:
        raise ValueError(f"max_seq_length={max_seq_length} leaves no room for an anchor and its target; use >= 2.")
    _check_chat_template(tokenizer, chat_template)
    try:
        msgs = normalize_messages(messages)
    except ValueError as err:
        return _skipped("malformed", str(err))
    turns = [j for j, m in enumerate(msgs) if m["role"] == "assistant" and j > 0]
    if not turns:
        return _skipped("no_assistant")
    turns = [j for j in turns if msgs[j]["content"].strip()]
    if not turns:
        return _skipped("empty")
    last = turns[-1]
    msgs = msgs[: last + 1]
    try:
        full = _render(tokenizer, msgs, chat_template, add_generation_prompt=False)
        loss_mask = [0] * len(full)
        inconsistent = False
        for j in turns:
            prompt = _render(tokenizer, msgs[:j], chat_template, add_generation_prompt=True)
            turn = full if j == last else _render(tokenizer, msgs[: j + 1], chat_template, add_generation_prompt=False)
            if turn[: len(prompt)] == prompt and full[: len(turn)] == turn:
                start, end = len(prompt), len(turn)
            else:
                inconsistent = True
                start, end = _common_prefix(prompt, full), _common_prefix(turn, full)
            for t in range(start, end):
                loss_mask[t] = 1
    except Exception as err:  # a template may raise anything on odd rows (TemplateError, TypeError, ...)
        return _skipped("malformed", f"the chat template failed on this row ({type(err).__name__}: {err})")
    if not any(loss_mask[1:]):
        return _skipped("malformed", "no assistant tokens could be located in the rendered conversation")
    truncated = len(full) > max_seq_length
    input_ids, loss_mask = full[:max_seq_length], loss_mask[:max_seq_length]
    if not any(loss_mask[1:]):
        return _skipped("prompt_too_long")
    return {
        "input_ids": input_ids,
        "loss_mask": loss_mask,
        "status": "inconsistent_template" if inconsistent else "ok",
        "error": "",
        "truncated": truncated,
    }


def _skipped(status: str, error: str = "") -> dict[str, Any]:
    return {"input_ids": [], "loss_mask": [], "status": status, "error": error, "truncated": False}


# --------------------------------------------------------------------------------------------------------------
# Preparing a dataset


@dataclass
class PrepStats:
    """What `prepare_conversations` kept and why it skipped the rest (skips are counted, never fatal)."""

    total: int = 0
    kept: int = 0
    no_assistant: int = 0
    empty: int = 0
    prompt_too_long: int = 0
    malformed: int = 0
    inconsistent_template: int = 0  # kept rows whose mask came from the longest-common-prefix fallback
    truncated: int = 0  # kept rows right-truncated to max_seq_length
    total_tokens: int = 0  # over kept rows, after truncation
    supervised_tokens: int = 0
    errors: list[str] = field(default_factory=list)  # a few distinct reasons for malformed rows

    def summary(self) -> str:
        skipped = ", ".join(f"{name} {getattr(self, name)}" for name in SKIP_STATUSES if getattr(self, name))
        share = self.supervised_tokens / self.total_tokens if self.total_tokens else 0.0
        text = (
            f"kept {self.kept}/{self.total} conversations"
            + (f" (skipped: {skipped})" if skipped else "")
            + f"; {self.truncated} truncated, {self.inconsistent_template} with inconsistent template renders; "
            + f"{self.total_tokens} tokens, {self.supervised_tokens} supervised ({share:.1%})"
        )
        if self.errors:
            text += f"; first malformed row: {self.errors[0]}"
        return text


def _render_batch(batch, *, tokenizer, max_seq_length: int, column: str, chat_template: str | None):
    out: dict[str, list] = {name: [] for name in _PREPARED_FEATURES}
    for turns in batch[column]:
        row = render_conversation(tokenizer, turns, max_seq_length, chat_template=chat_template)
        for name in ("input_ids", "loss_mask", "status", "error", "truncated"):
            out[name].append(row[name])
        out["length"].append(len(row["input_ids"]))
        out["num_supervised"].append(sum(row["loss_mask"]))
    return out


def _is_kept(statuses: list[str]) -> list[bool]:
    return [s in KEPT_STATUSES for s in statuses]


def prepare_conversations(
    dataset: datasets.Dataset,
    tokenizer,
    max_seq_length: int,
    num_proc: int = 1,
    desc: str = "rendering conversations with the chat template",
    chat_template: str | None = None,
) -> tuple[datasets.Dataset, PrepStats]:
    """Tokenise chat rows into `input_ids`, `loss_mask`, `length`, `num_supervised`, dropping unusable rows.

    Runs as a `datasets` map, so the result is cached by fingerprint (dataset, tokenizer, template, length)
    and reused across runs and ranks; the caller wraps it in `main_process_first()` under DDP. Raises if no
    row survives, since training on nothing is never what was meant.
    """
    column = conversation_column(dataset.column_names)
    _check_chat_template(tokenizer, chat_template)
    if max_seq_length < 2:
        raise ValueError(f"max_seq_length={max_seq_length} leaves no room for an anchor and its target; use >= 2.")
    render = functools.partial(
        _render_batch, tokenizer=tokenizer, max_seq_length=max_seq_length, column=column, chat_template=chat_template
    )
    rendered = dataset.map(
        render,
        batched=True,
        batch_size=256,
        num_proc=num_proc if num_proc > 1 else None,
        remove_columns=dataset.column_names,
        features=_PREPARED_FEATURES,
        desc=desc,
    )
    stats = _collect_stats(rendered)
    if stats.total and not stats.kept:
        raise UsageError(f"no usable conversation in the data ({stats.summary()}); check the data's roles and content.")
    if stats.kept < stats.total:
        logger.warning("data preparation: %s", stats.summary())
    kept = rendered.filter(_is_kept, input_columns=["status"], batched=True, desc="dropping skipped conversations")
    return kept.remove_columns(list(_STATS_COLUMNS)), stats


def _collect_stats(rendered: datasets.Dataset) -> PrepStats:
    columns = ["status", "error", "truncated", "length", "num_supervised"]
    table = rendered.select_columns(columns).with_format("arrow")[:]
    stats = PrepStats(total=table.num_rows)
    counts = {row["values"]: row["counts"] for row in pc.value_counts(table.column("status")).to_pylist()}
    for status in KEPT_STATUSES + SKIP_STATUSES:
        if status != "ok":
            setattr(stats, status, int(counts.get(status, 0)))
    stats.kept = sum(int(counts.get(s, 0)) for s in KEPT_STATUSES)
    kept = pc.is_in(table.column("status"), value_set=pa.array(KEPT_STATUSES))
    stats.truncated = int(pc.sum(pc.and_(kept, table.column("truncated"))).as_py() or 0)
    stats.total_tokens = int(pc.sum(pc.filter(table.column("length"), kept)).as_py() or 0)
    stats.supervised_tokens = int(pc.sum(pc.filter(table.column("num_supervised"), kept)).as_py() or 0)
    if stats.malformed:
        errors = pc.unique(pc.filter(table.column("error"), pc.equal(table.column("status"), "malformed")))
        stats.errors = errors.to_pylist()[:5]
    return stats


def split_train_validation(
    dataset: datasets.Dataset, validation_ratio: float, seed: int
) -> tuple[datasets.Dataset, datasets.Dataset]:
    """Split whole conversations into train and validation with a fixed seed (never a row across both).

    Ratio 0 gives an empty validation set; any positive ratio on >= 2 rows gives at least one validation
    conversation (and leaves at least one for training), so a tiny run still evaluates.
    """
    if not 0.0 <= validation_ratio < 1.0:
        raise ValueError(f"validation_ratio={validation_ratio} is outside [0, 1); use e.g. 0.02, or 0 for none.")
    n = len(dataset)
    if validation_ratio == 0.0 or n < 2:
        return dataset, dataset.select([])
    n_validation = min(n - 1, max(1, round(validation_ratio * n)))
    parts = dataset.train_test_split(test_size=n_validation, shuffle=True, seed=seed)
    return parts["train"], parts["test"]


# --------------------------------------------------------------------------------------------------------------
# Packing


def pack_conversations(lengths: Sequence[int], total_seq_length: int, seed: int) -> list[list[int]]:
    """Bin-pack conversation indices into rows of at most `total_seq_length` tokens (best-fit decreasing).

    Longest conversations are placed first, each into the open row with the least room that still fits it,
    which wastes little padding; equal lengths are ordered by a `seed`-ed shuffle, so the result is a
    deterministic function of (lengths, total_seq_length, seed). Rows list indices longest first.
    """
    lengths = [int(n) for n in lengths]
    for i, n in enumerate(lengths):
        if not 1 <= n <= total_seq_length:
            raise ValueError(
                f"conversation {i} has {n} tokens, which does not fit a packed row of total_seq_length="
                f"{total_seq_length}; prepare the data with max_seq_length <= total_seq_length."
            )
    order = list(range(len(lengths)))
    random.Random(seed).shuffle(order)
    order.sort(key=lambda i: -lengths[i])  # stable: ties keep the seeded order

    # Open rows are bucketed by their remaining room; a segment tree over room sizes 0..total_seq_length
    # finds the smallest room >= n in O(log T), so packing millions of conversations stays fast.
    size = 1 << total_seq_length.bit_length()
    tree = [0] * (2 * size)
    buckets: dict[int, list[int]] = {}

    def add(room: int, delta: int) -> None:
        node = room + size
        while node:
            tree[node] += delta
            node >>= 1

    def smallest_room_at_least(n: int) -> int:
        node = n + size
        if tree[node]:
            return n
        while node > 1:
            if not node & 1 and tree[node + 1]:
                node += 1
                while node < size:
                    node = 2 * node if tree[2 * node] else 2 * node + 1
                return node - size
            node >>= 1
        return -1

    rows: list[list[int]] = []
    for i in order:
        n = lengths[i]
        room = smallest_room_at_least(n)
        if room < 0:
            row, room = len(rows), total_seq_length
            rows.append([])
        else:
            row = buckets[room].pop()
            add(room, -1)
        rows[row].append(i)
        room -= n
        if room > 0:
            buckets.setdefault(room, []).append(row)
            add(room, 1)
    return rows


class PackedDataset(torch.utils.data.Dataset):
    """Packed training rows over a tokenised dataset; item i concatenates the conversations of `rows[i]`.

    Items are unpadded 1-D LongTensors: `input_ids`, `loss_mask`, `document_ids` (0, 1, ... per conversation
    in the row), `position_ids` (restarting at 0 per conversation), and `row_index`. Each access reads only
    its conversations from the memory-mapped arrow table, so the dataset is never materialised in Python.
    """

    def __init__(self, dataset: datasets.Dataset, rows: Sequence[Sequence[int]]):
        missing = {"input_ids", "loss_mask"} - set(dataset.column_names)
        if missing:
            raise ValueError(f"the dataset lacks columns {sorted(missing)}; pass the output of prepare_conversations.")
        self.rows = [[int(i) for i in row] for row in rows]
        n = len(dataset)
        for r, row in enumerate(self.rows):
            if not row or min(row) < 0 or max(row) >= n:
                raise ValueError(
                    f"packed row {r} = {row} is empty or indexes outside the dataset's {n} rows; repack it."
                )
        self._table = dataset.select_columns(["input_ids", "loss_mask"]).with_format("arrow")
        if "length" in dataset.column_names:
            lengths = dataset.select_columns(["length"]).with_format("numpy")[:]["length"]
        else:
            lengths = pc.list_value_length(self._table[:].column("input_ids")).to_numpy()
        lengths = np.asarray(lengths, dtype=np.int64)
        self.row_lengths = [int(lengths[row].sum()) for row in self.rows]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        row = self.rows[index]
        table = self._table[row]
        input_ids = table.column("input_ids")
        doc_lengths = pc.list_value_length(input_ids).to_numpy().astype(np.int64)
        ids = pc.list_flatten(input_ids).to_numpy().astype(np.int64)
        mask = pc.list_flatten(table.column("loss_mask")).to_numpy().astype(np.int64)
        documents = torch.from_numpy(np.repeat(np.arange(len(row), dtype=np.int64), doc_lengths))
        return {
            "input_ids": torch.from_numpy(ids),
            "loss_mask": torch.from_numpy(mask),
            "document_ids": documents,
            "position_ids": positions_from_document_ids(documents.unsqueeze(0))[0],
            "row_index": torch.tensor(index, dtype=torch.long),
        }


class DSparkCollator:
    """Right-pads packed rows into a batch of [R, T] LongTensors (T = longest row rounded up to a multiple).

    Padding is inert by construction: loss_mask 0 (never supervised), document_ids -1 (belongs to no
    document, so no attention to or from it), position_ids 0, input_ids `pad_token_id`.
    """

    PAD_VALUES = {"loss_mask": 0, "document_ids": -1, "position_ids": 0}

    def __init__(self, pad_token_id: int, pad_to_multiple_of: int | None = 8, on_batch=None):
        if pad_token_id is None:
            raise ValueError("pad_token_id is None; pass tokenizer.pad_token_id (or the eos id if it has no pad).")
        if pad_to_multiple_of is not None and pad_to_multiple_of < 1:
            raise ValueError(f"pad_to_multiple_of={pad_to_multiple_of} must be >= 1 (or None for no rounding).")
        self.pad_token_id = int(pad_token_id)
        self.pad_to_multiple_of = pad_to_multiple_of
        # Called with every collated batch: a hidden-state source with latency starts fetching it here, one batch
        # before the trainer asks (the data loader collates the next batch while the current one trains).
        self.on_batch = on_batch

    def __call__(self, features: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        if not features:
            raise ValueError("the collator got an empty list of rows; use a batch size >= 1.")
        longest = max(int(f["input_ids"].numel()) for f in features)
        multiple = self.pad_to_multiple_of or 1
        width = -(-longest // multiple) * multiple
        batch = {}
        for key, pad in {"input_ids": self.pad_token_id, **self.PAD_VALUES}.items():
            out = torch.full((len(features), width), pad, dtype=torch.long)
            for r, f in enumerate(features):
                values = torch.as_tensor(f[key], dtype=torch.long)
                out[r, : values.numel()] = values
            batch[key] = out
        batch["row_index"] = torch.tensor([int(f["row_index"]) for f in features], dtype=torch.long)
        if self.on_batch is not None:
            self.on_batch(batch)
        return batch


# --------------------------------------------------------------------------------------------------------------
# Statistics


def supervised_token_counts(dataset: datasets.Dataset, vocab_size: int, batch_size: int = 1024) -> torch.Tensor:
    """Count each token id over the supervised (loss_mask == 1) positions: the draft vocabulary's input.

    Streams the arrow table in batches, so memory stays O(vocab_size) for any dataset size.
    """
    table = dataset.select_columns(["input_ids", "loss_mask"]).with_format("arrow")
    counts = np.zeros(vocab_size, dtype=np.int64)
    with tqdm(total=len(dataset), desc="counting supervised tokens", unit="conv") as progress:
        for batch in table.iter(batch_size=batch_size):
            ids = pc.list_flatten(batch.column("input_ids")).to_numpy().astype(np.int64)
            mask = pc.list_flatten(batch.column("loss_mask")).to_numpy().astype(bool)
            ids = ids[mask]
            if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
                bad = int(ids.max() if ids.max() >= vocab_size else ids.min())
                raise ValueError(
                    f"token id {bad} is outside the vocabulary of size {vocab_size}; tokenise with the verifier's "
                    "tokenizer and pass its vocab_size."
                )
            counts += np.bincount(ids, minlength=vocab_size)
            progress.update(batch.num_rows)
    return torch.from_numpy(counts)
