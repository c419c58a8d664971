"""trainer/files.py: the one durability policy (the file and its directory fsynced, a failed write leaves the old
file and no temporary file) and the one local-path-or-Hub-id rule."""

import errno
import json
import os
import stat

import pytest

from trainer import files
from trainer.files import atomic_path, is_local, replace_durably, write_json_atomic, write_text_atomic


@pytest.fixture
def fsynced(monkeypatch):
    """What every os.fsync call was made on: ("file", path) or ("dir", path)."""
    calls = []
    real = os.fsync

    def spy(fd):
        target = os.readlink(f"/proc/self/fd/{fd}")
        calls.append(("dir" if stat.S_ISDIR(os.fstat(fd).st_mode) else "file", target))
        real(fd)

    monkeypatch.setattr(os, "fsync", spy)
    return calls


def test_an_atomic_write_fsyncs_the_file_then_the_directory(tmp_path, fsynced):
    target = tmp_path / "record.json"
    write_json_atomic(target, {"a": 1})
    assert json.loads(target.read_text()) == {"a": 1}
    assert fsynced == [("file", str(tmp_path / "record.json.tmp")), ("dir", str(tmp_path))]
    assert sorted(os.listdir(tmp_path)) == ["record.json"]


def test_a_file_written_by_a_library_is_fsynced_before_the_rename(tmp_path, fsynced):
    target = tmp_path / "counts.bin"
    with atomic_path(target, unique=True) as tmp:
        assert tmp == f"{target}.{os.getpid()}.tmp"
        with open(tmp, "wb") as f:  # as torch.save or safetensors would, by name
            f.write(b"new")
        assert not target.exists()
    assert target.read_bytes() == b"new"
    assert fsynced == [("file", tmp), ("dir", str(tmp_path))]


def test_a_failed_write_leaves_the_old_file_and_no_temporary_file(tmp_path):
    target = tmp_path / "plan.json"
    write_json_atomic(target, {"old": True})

    def full_disk(_fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with pytest.MonkeyPatch.context() as m:
        m.setattr(os, "fsync", full_disk)
        with pytest.raises(OSError, match="No space left"):
            write_json_atomic(target, {"new": True})
    with pytest.raises(RuntimeError, match="mid-write"), atomic_path(target) as tmp:
        with open(tmp, "w") as f:
            f.write('{"half')
        raise RuntimeError("killed mid-write")
    assert json.loads(target.read_text()) == {"old": True}
    assert sorted(os.listdir(tmp_path)) == ["plan.json"]


def test_json_and_text_keep_their_bytes(tmp_path):
    write_json_atomic(tmp_path / "indented.json", {"a": [1, 2]})
    write_json_atomic(tmp_path / "compact.json", {"a": [1, 2]}, indent=None)
    write_text_atomic(tmp_path / "table.md", "| a |\n")
    assert (tmp_path / "indented.json").read_text() == json.dumps({"a": [1, 2]}, indent=2)
    assert (tmp_path / "compact.json").read_text() == '{"a": [1, 2]}'
    assert (tmp_path / "table.md").read_text() == "| a |\n"


def test_a_folder_rename_fsyncs_both_parents(tmp_path, fsynced):
    (tmp_path / "staging").mkdir()
    (tmp_path / "aside").mkdir()
    (tmp_path / "staging" / "built").mkdir()
    replace_durably(tmp_path / "staging" / "built", tmp_path / "aside" / "final")
    assert (tmp_path / "aside" / "final").is_dir() and not (tmp_path / "staging" / "built").exists()
    assert sorted(fsynced) == [("dir", str(tmp_path / "aside")), ("dir", str(tmp_path / "staging"))]


def test_fsync_dir_is_best_effort(tmp_path):
    files.fsync_dir(tmp_path / "missing")  # no error: not every filesystem (or path) allows it


@pytest.mark.parametrize("source, local", [
    ("data/chats.jsonl", True),  # a data-file extension: a path, even when missing
    ("org/chats.JSONL", True),
    ("org/table.csv", True),
    ("./prompts", True),
    ("/abs/prompts", True),
    ("~/prompts", True),
    ("not a hub id", True),
    ("org--x/name", True),
    ("RedHatAI/speculator_benchmarks", False),
    ("HuggingFaceH4/ultrachat_200k", False),
    ("squad", False),
])
def test_local_or_hub(source, local):
    assert is_local(source) is local


def test_an_existing_path_is_local_whatever_its_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org").mkdir()
    (tmp_path / "org" / "prompts").mkdir()
    assert is_local("org/prompts") and not is_local("org/other")
