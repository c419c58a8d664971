"""Local data files before `datasets` reads them: a strict pre-scan of JSON / JSONL / Parquet files (the bad-line
policy of `data.max_bad_line_ratio`, one sentence per unreadable file or line, clean copies of JSONL files with a
few bad lines skipped) and the strict reader of small JSONL files (prompt sets, regeneration outputs).

`trainer/data/render.py` calls the pre-scan from `load_chat_dataset`; nothing here tokenises or packs.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import datasets
import pyarrow as pa
import pyarrow.parquet as pq

from trainer.errors import UsageError
from trainer.files import atomic_path

logger = logging.getLogger(__name__)

def check_bad_line_ratio(ratio: float) -> float:
    try:
        value = float(ratio)
    except (TypeError, ValueError):
        value = float("nan")
    if isinstance(ratio, bool) or not 0.0 <= value <= 1.0:
        raise UsageError(
            f"data.max_bad_line_ratio={ratio!r} is not a share in [0, 1]; use e.g. 0.01 (skip up to 1% unreadable "
            "lines), or 0 to refuse any."
        )
    return value


def root_cause(err: BaseException, limit: int = 240) -> str:
    while err.__cause__ is not None or (err.__context__ is not None and not err.__suppress_context__):
        err = err.__cause__ if err.__cause__ is not None else err.__context__
    text = " ".join(f"{type(err).__name__}: {err}".split())
    return text if len(text) <= limit else text[: limit - 3] + "..."



_BLANK = b" \t\r\n"
_BOM = b"\xef\xbb\xbf"
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
_JSON_KINDS = {list: "an array", str: "a string", bool: "a boolean", int: "a number", float: "a number"}
_CLEAN_COPY_VERSION = "1"  # bump when the clean-copy rule changes, so stale copies are not reused


class _DuplicateKeyError(ValueError):
    pass


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    # pyarrow refuses an object that repeats a key ("Column(/n) was specified twice"); json.loads keeps the last
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen: set[str] = set()
        raise _DuplicateKeyError(next(k for k, _ in pairs if k in seen or seen.add(k)))
    return obj


_DECODER = json.JSONDecoder(object_pairs_hook=_no_duplicate_keys)


def _json_kind(value: Any) -> str:
    return "null" if value is None else _JSON_KINDS.get(type(value), type(value).__name__)


def excerpt(text: str, limit: int = 80) -> str:
    """A data line as an error message quotes it: stripped, control characters escaped, and at most `limit`
    characters (ending in `...` when cut), so that a long row never floods the one-line error."""
    text = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text.strip())
    return text if len(text) <= limit else text[: limit - 3] + "..."


@dataclass
class BadLine:
    """One unreadable line of a local JSON Lines file: where it is, why it cannot be read, and what it says."""

    path: Path
    line: int  # 1-based physical line number, blank lines included
    reason: str  # e.g. "is not valid JSON (Expecting ',' delimiter: column 40)"
    text: str  # the line, invalid UTF-8 bytes shown as \\xNN

    def describe(self) -> str:
        return f"data file {self.path} line {self.line} {self.reason}: '{excerpt(self.text)}'"


@dataclass
class JsonFileScan:
    """What `scan_json_file` found in one local .jsonl/.json file."""

    path: Path
    lines: int = 0  # non-blank lines of a JSON Lines file (or rows of a JSON array / object document)
    bad_lines: list[int] = field(default_factory=list)  # 1-based numbers of the unreadable lines
    blank_lines: int = 0  # empty or whitespace-only lines (skipped by `datasets`, and by the clean copy)
    first_bad: BadLine | None = None
    sha256: str = ""  # of the file's bytes, keys the clean copy
    document: bool = False  # one JSON array of rows / one JSON object, not JSON Lines


def _parse_line(raw: bytes, is_last: bool) -> str | None:
    """Why one non-blank JSON Lines line cannot become rows, or None when it is one or more JSON objects."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        return f"is not valid UTF-8 (byte 0x{raw[err.start]:02x} at byte {err.start + 1})"
    text = text.strip()
    pos, values = 0, []
    while pos < len(text):  # pyarrow also reads several objects written on one line
        try:
            value, end = _DECODER.raw_decode(text, pos)
        except _DuplicateKeyError as err:
            return f"repeats the key {str(err)!r} inside one object"
        except json.JSONDecodeError as err:
            at_end = err.pos >= len(text) or err.msg.startswith("Unterminated string")
            if is_last and at_end and not raw.endswith(b"\n"):
                return f"is truncated (the file ends inside a JSON value: {err.msg}: column {err.colno})"
            return f"is not valid JSON ({err.msg}: column {err.colno})"
        if not isinstance(value, dict):
            return f"is {_json_kind(value)}, not a JSON object (one chat row per line)"
        values.append(value)
        pos = end
        while pos < len(text) and text[pos] in " \t\r\n":
            pos += 1
    if _SURROGATE_ESCAPE.search(text):  # pyarrow refuses a lone surrogate escape; json.loads keeps it
        try:
            for value in values:
                json.dumps(value, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            return "has an unpaired UTF-16 surrogate escape (\\ud800-\\udfff) in a string"
    return None


def _first_content_byte(path: Path) -> bytes:
    with open(path, "rb") as f:
        head = f.read(1 << 16)
        if head.startswith(_BOM):
            head = head[len(_BOM) :]
        while head:
            stripped = head.lstrip(_BLANK)
            if stripped:
                return stripped[:1]
            head = f.read(1 << 16)
    return b""


def _document_error(path: Path, problem: str) -> UsageError:
    return UsageError(
        f"data file {path} {problem}; a .json file must be one JSON array of row objects or one row object, "
        "otherwise write one JSON object per line (.jsonl)."
    )


def _parse_json_document(path: Path) -> tuple[int, str | None, bool]:
    """(rows, problem, more_values) for a file read as one JSON document: an array of row objects (rows = its
    length) or one object (1 row). `problem` says why it is not that; `more_values` is set when a first JSON
    value parsed and more text followed it, i.e. the file is probably JSON Lines."""
    data = path.read_bytes()
    if data.startswith(_BOM):
        data = data[len(_BOM) :]
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data.count(b"\n", 0, err.start) + 1
        return 0, f"is not valid UTF-8 (byte 0x{data[err.start]:02x} on line {line})", False
    del data
    try:
        value = _DECODER.decode(text)
    except _DuplicateKeyError as err:
        return 0, f"repeats the key {str(err)!r} inside one object", False
    except json.JSONDecodeError as err:
        at_end = err.pos >= len(text.rstrip()) or err.msg.startswith("Unterminated string")
        cut = " (the file ends early: truncated?)" if at_end else ""
        problem = f"is not valid JSON ({err.msg}: line {err.lineno} column {err.colno}){cut}"
        return 0, problem, err.msg == "Extra data"
    if isinstance(value, dict):
        return 1, None, False
    if not isinstance(value, list):
        return 0, f"holds {_json_kind(value)}, not an array of rows or one row object", False
    if not value:
        return 0, "holds an empty array (no rows)", False
    for i, row in enumerate(value):
        if not isinstance(row, dict):
            return 0, f"is an array whose element {i} is {_json_kind(row)}, not a row object", False
    return len(value), None, False


def scan_json_file(path: str | os.PathLike, max_bad_line_ratio: float = 0.01) -> JsonFileScan:
    """Check that a local .jsonl/.json file can be read by `datasets`, naming the line of anything unreadable.

    A file whose first non-blank character is `[` is one JSON document (an array of row objects); otherwise it
    is JSON Lines, read as a stream (never whole): every non-blank line must be a JSON object in UTF-8, and
    the unreadable ones are listed (they are skipped or refused by the caller). A pretty-printed single
    object (a file starting with `{` whose lines fail one by one) is read as a one-row document. Raises a `UsageError` for a
    file that holds no rows at all: empty, only blank lines, or a document that is not rows.
    """
    path = Path(path)
    scan = JsonFileScan(path)
    first = _first_content_byte(path)
    if not first:
        what = "is empty" if path.stat().st_size == 0 else "has only blank lines"
        raise UsageError(f"data file {path} {what} (no rows); remove it from the data, or write chat rows into it.")
    if first == b"[":
        rows, problem, more_values = _parse_json_document(path)
        if problem is None:
            return JsonFileScan(path, lines=rows, document=True)
        if not more_values:  # an array followed by more values is JSON Lines with a bad line: scan the lines
            raise _document_error(path, problem)
    digest = hashlib.sha256()
    first_line_bad, number = False, 0
    with open(path, "rb") as f:
        line = f.readline()
        while line:
            following = f.readline()
            number += 1
            digest.update(line)
            raw = line[len(_BOM) :] if number == 1 and line.startswith(_BOM) else line
            if not raw.strip(_BLANK):
                scan.blank_lines += 1
            else:
                reason = _parse_line(raw, is_last=not following)
                if reason is not None:
                    first_line_bad = first_line_bad or scan.lines == 0
                    scan.bad_lines.append(number)
                    if scan.first_bad is None:
                        scan.first_bad = BadLine(path, number, reason, raw.decode("utf-8", "backslashreplace"))
                scan.lines += 1
            line = following
    scan.sha256 = digest.hexdigest()
    is_json = path.suffix.lower() == ".json"
    suspect = (is_json and first != b"[") or (first == b"{" and first_line_bad)  # `[`: tried as a document above
    if suspect and len(scan.bad_lines) > max_bad_line_ratio * scan.lines:
        # too many bad lines to skip: maybe the file is one pretty-printed object (a one-row document, which
        # `datasets` reads whole), or a .json file that is not rows at all
        rows, problem, more_values = _parse_json_document(path)
        if problem is None:
            return JsonFileScan(path, lines=rows, sha256=scan.sha256, document=True)
        if is_json and not more_values:
            raise _document_error(path, problem)
    return scan


def scan_json_files(files: Sequence[str | os.PathLike], max_bad_line_ratio: float = 0.01) -> list[JsonFileScan]:
    """Scan every JSON file of one load and apply the bad-line policy to all of them together.

    Unreadable lines are tolerated when they are at most `max_bad_line_ratio` of the non-blank lines of all
    the files (they are then logged once, with their count and the first one); more is a `UsageError` that
    quotes the first unreadable line with its file and line number.
    """
    ratio = check_bad_line_ratio(max_bad_line_ratio)
    scans = [scan_json_file(f, ratio) for f in files]
    total = sum(s.lines for s in scans)
    bad = sum(len(s.bad_lines) for s in scans)
    if not bad:
        return scans
    first = next(s.first_bad for s in scans if s.first_bad is not None)
    share = bad / total
    if bad > ratio * total:
        raise UsageError(
            f"{first.describe()}; {bad} of {total} non-blank lines ({100 * share:.3g}%) of the data are unreadable, more "
            f"than max_bad_line_ratio={ratio:g} allows; fix or delete the bad lines, or raise data.max_bad_line_ratio."
        )
    if bad == total:
        raise UsageError(f"{first.describe()}; no line of the data is readable, so fix the data files.")
    logger.warning(
        "skipping %d unreadable line(s) of %d (%.3g%%, within max_bad_line_ratio=%g); the first: %s",
        bad, total, 100 * share, ratio, first.describe(),
    )
    return scans


def json_paths(scans: list[JsonFileScan], drop_blank_lines: bool = False) -> list[Path]:
    """The files `datasets` should read: each scanned file, or its clean copy when lines must be dropped."""
    paths = []
    for s in scans:
        if s.bad_lines or (drop_blank_lines and s.blank_lines):
            if len(s.bad_lines) < s.lines:  # a file with no readable line at all is left out
                paths.append(_clean_copy(s))
        else:
            paths.append(s.path)
    return paths


def _clean_copy(scan: JsonFileScan) -> Path:
    """The file's readable non-blank lines, written once to the `datasets` cache under its content hash."""
    folder = Path(datasets.config.HF_DATASETS_CACHE) / "dspark_clean_jsonl"
    target = folder / f"{scan.path.stem}-{scan.sha256[:20]}-v{_CLEAN_COPY_VERSION}.jsonl"
    if target.is_file():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    skip = set(scan.bad_lines)
    with atomic_path(target, unique=True) as tmp, open(scan.path, "rb") as src, open(tmp, "wb") as dst:
        for number, line in enumerate(src, 1):
            if number in skip or not line.strip(_BLANK):
                continue
            if number == 1 and line.startswith(_BOM):
                line = line[len(_BOM) :]
            dst.write(line if line.endswith(b"\n") else line + b"\n")
    logger.info("reading %s through a copy without its %d unreadable and %d blank line(s): %s",
                scan.path, len(scan.bad_lines), scan.blank_lines, target)
    return target


def check_parquet_file(path: Path) -> None:
    try:
        with pq.ParquetFile(path) as parquet:  # reads the footer: magic bytes, metadata, schema
            parquet.schema_arrow  # noqa: B018
    except (pa.ArrowException, OSError) as err:
        raise UsageError(
            f"data file {path} is not a readable Parquet file ({root_cause(err)}); re-export it or remove it "
            "from the data."
        ) from err


def unreadable_parquet_file(files: list[Path]) -> tuple[Path, str] | None:
    """The first Parquet file whose row groups cannot be decoded (read batch by batch), with why."""
    for f in files:
        try:
            with pq.ParquetFile(f) as parquet:
                for _ in parquet.iter_batches(batch_size=4096):
                    pass
        except (pa.ArrowException, OSError) as err:
            return f, root_cause(err)
    return None


def read_jsonl_objects(path: str) -> list[tuple[int, dict]]:
    """`(line number, object)` for every non-blank line of a small JSONL file (prompt sets, regeneration
    outputs), strictly: any unreadable line is one sentence naming the file and line. Training data goes through
    `load_chat_dataset` instead, whose pre-scan may skip a small share of bad lines."""
    rows = []
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise UsageError(f"{path} line {number} is not valid UTF-8 ({e.reason}); save the file as UTF-8.") from e
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise UsageError(f"{path} line {number} is not valid JSON ({e.msg}, column {e.colno}): "
                                 f"'{excerpt(line)}'; fix or delete that line.") from e
            if not isinstance(row, dict):
                raise UsageError(f"{path} line {number} is a JSON {type(row).__name__}, not an object; write one "
                                 f"object per line.")
            rows.append((number, row))
    return rows
