"""Reading chat rows: a Hub dataset id, local .jsonl/.json/.parquet files, or a local directory, into a
`datasets.Dataset`, with the bad-line policy of `data.max_bad_line_ratio` (trainer/data/files.py scans the files)
and one sentence for a file `datasets` cannot read.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path

import datasets
import huggingface_hub
import pyarrow as pa
from datasets.exceptions import DatasetGenerationError

from trainer.data.files import (
    check_bad_line_ratio,
    check_parquet_file,
    json_paths,
    root_cause,
    scan_json_files,
    unreadable_parquet_file,
)
from trainer.data.render import conversation_column
from trainer.errors import UsageError
from trainer.files import is_local

logger = logging.getLogger("dspark")

DATA_FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}


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

    Local JSON files are pre-scanned line by line (`trainer.data.files.scan_json_file`) before `datasets` reads them, so that
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
        elif is_local(text):
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
