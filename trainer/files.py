"""Files on disk, the one way: atomic writes under one durability policy, and whether a name is a local path or a
Hub id. Everything in trainer/ (and push_to_hub.py) that replaces a file or folder, or decides between a path and
a Hub id, comes here; this module imports only the standard library (the Hub-id syntax is read lazily from
`configuration_dspark`, so fault injection can patch these functions before anything heavy is imported).

The durability policy: the new content goes to a temporary file in the same directory (so the rename never
crosses filesystems), the temporary file is flushed and fsynced, `os.replace` moves it over the old name, and the
directory is fsynced so the rename itself survives a power loss. A reader therefore sees the old file or the new
one, never half of one; a failed write removes its temporary file and leaves the old file as it was.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator

TMP_SUFFIX = ".tmp"

# The extensions of local data files: a name ending in one is a path (a missing one is an error), never a Hub id.
DATA_EXTENSIONS = (".json", ".jsonl", ".parquet", ".csv", ".arrow")


# ------------------------------------------------------------------------------------------ durability
def fsync_dir(directory: str | os.PathLike) -> None:
    """Make a rename in `directory` durable (best effort: not every filesystem lets a directory be fsynced)."""
    try:
        fd = os.open(os.fspath(directory) or ".", os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def temp_path(path: str | os.PathLike, unique: bool = False) -> str:
    """The temporary name `path` is written under: `<path>.tmp`, or `<path>.<pid>.tmp` when several processes
    (DDP ranks) may write the same file at once and must not share one temporary file."""
    path = os.fspath(path)
    return f"{path}.{os.getpid()}{TMP_SUFFIX}" if unique else path + TMP_SUFFIX


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, unique: bool = False) -> Iterator[str]:
    """Yield a temporary path for the caller to write `path`'s new content to (by any means: a file object, a
    library that takes a file name); on a clean exit it is fsynced and renamed over `path`, on an exception it is
    removed and `path` is left untouched."""
    path = os.fspath(path)
    tmp = temp_path(path, unique)
    try:
        yield tmp
        with open(tmp, "rb") as f:  # any descriptor of the file flushes its pages, whoever wrote them
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
        raise
    fsync_dir(os.path.dirname(path))


def write_bytes_atomic(path: str | os.PathLike, data: bytes, unique: bool = False) -> None:
    with atomic_path(path, unique) as tmp, open(tmp, "wb") as f:
        f.write(data)


def write_text_atomic(path: str | os.PathLike, text: str, unique: bool = False) -> None:
    write_bytes_atomic(path, text.encode("utf-8"), unique)


def write_json_atomic(path: str | os.PathLike, data: dict, indent: int | None = 2) -> None:
    """Write `data` as JSON under the durability policy (`indent=None`: one compact line)."""
    write_text_atomic(path, json.dumps(data, indent=indent))


def replace_durably(source: str | os.PathLike, target: str | os.PathLike) -> None:
    """`os.replace` a finished file, link or folder onto `target`, then fsync the directories involved, so the
    rename survives a power loss (folders are renamed whole; their files were written by the caller)."""
    os.replace(source, target)
    parents = {os.path.dirname(os.path.abspath(p)) for p in (source, target)}
    for parent in sorted(parents):
        fsync_dir(parent)


# ------------------------------------------------------------------------------------------ path or Hub id
def is_local(source: str | os.PathLike) -> bool:
    """Whether a data or prompt source names a local path rather than a Hub id: it exists, starts like a path
    (`.`, `/`, `~`), ends in a data-file extension, or is not a valid Hub repo id. A missing local path is the
    caller's error to report; everything else is handed to the Hub."""
    from configuration_dspark import is_hub_id

    text = os.fspath(source)
    return os.path.lexists(text) or text.startswith((".", "/", "~")) or text.lower().endswith(DATA_EXTENSIONS) or \
        not is_hub_id(text)
