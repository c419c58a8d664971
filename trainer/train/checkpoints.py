"""The run directory: every file a training run writes, which checkpoints are complete, which one
`latest`, `best`, `final` and `OUTPUT_DIR:<step>` mean, and whether a checkpoint can be resumed.

    <output_dir>/
      checkpoint-N/                 a servable drafter (see trainer/contract.py) plus the Trainer's state
        dspark_checkpoint.json      completion marker, written last and atomically: without it the save
                                    was interrupted, and the directory is moved aside as incomplete-checkpoint-N
        dspark_run_config.yaml      the run configuration (reproduce the run, describe it in a model card)
        dspark_data_stats.json      what the training data held
        dspark_calibration.json     the best checkpoint only: the confidence calibration folded into its weights
        adapter/                    LoRA runs only: the adapter to resume from (the weights are merged)
      damaged-checkpoint-N/         a complete checkpoint whose files no longer read back, set aside by a resume
      checkpoint-best -> checkpoint-N   symlink to the checkpoint with the highest validation accept_len
      config.json, model.safetensors, ...   the final drafter (written when the run finishes; with
                                    dspark_calibration.json when its confidence head was calibrated)
      dspark_train_summary.json     the run's closing summary, written last: the run is finished
      batches-rank<r>.jsonl         with train.record_batches: the rows each rank trained on
      .dspark-run.lock              held (flock) by the run in progress: its pid, host and start time; a second
                                    run into the same output_dir is refused, a dead owner's lock is taken over

Everything that reads or writes these names imports them from here.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import re
import shutil
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from configuration_dspark import RUNTIME_ONLY_KEYS
from trainer.config import RUN_CONFIG_FILE
from trainer.contract import (
    REMOTE_CODE_FILES,
    WEIGHTS_FILE,
    WEIGHTS_INDEX_FILE,
    ServingError,
    check_folder,
    read_json,
)
from trainer.errors import UsageError
from trainer.files import replace_durably, temp_path, write_json_atomic

CHECKPOINT_PREFIX = "checkpoint"  # transformers' PREFIX_CHECKPOINT_DIR: the Trainer names and rotates these
COMPLETE_MARKER = "dspark_checkpoint.json"
DATA_STATS_FILE = "dspark_data_stats.json"
CALIBRATION_FILE = "dspark_calibration.json"  # trainer/train/calibration.py writes it, trainer/export/card.py reads it
SUMMARY_FILE = "dspark_train_summary.json"
ADAPTER_DIR = "adapter"
BEST_LINK = f"{CHECKPOINT_PREFIX}-best"
INCOMPLETE_PREFIX = "incomplete-"
DAMAGED_PREFIX = "damaged-"
TRAINING_ARGS_FILE = "training_args.bin"
TRAINER_STATE_FILE = "trainer_state.json"
SELECTORS = ("best", "latest", "final")
# What a run writes at the top of its output_dir (the final drafter and the run's own files).
_RUN_FILES = {"config.json", WEIGHTS_FILE, WEIGHTS_INDEX_FILE, *REMOTE_CODE_FILES, RUN_CONFIG_FILE, DATA_STATS_FILE,
              CALIBRATION_FILE, SUMMARY_FILE, TRAINING_ARGS_FILE, BEST_LINK, ADAPTER_DIR}
RUN_LOCK_FILE = ".dspark-run.lock"
_CHECKPOINT_DIR = re.compile(rf"^{CHECKPOINT_PREFIX}-(\d+)$")
_SELECTOR = re.compile(r"^(best|latest|final|\d+)$")


logger = logging.getLogger(__name__)


class CheckpointError(UsageError):
    """A checkpoint or run directory that cannot be used as asked; one sentence with cause and fix."""


def batch_log_file(output_dir: str, rank: int) -> str:
    return os.path.join(output_dir, f"batches-rank{rank}.jsonl")


# ------------------------------------------------------------------------------------------ completeness
def mark_complete(directory: str, step: int) -> None:
    """Write the completion marker last and atomically: a checkpoint without it was interrupted mid-save."""
    write_json_atomic(os.path.join(directory, COMPLETE_MARKER), {"step": step, "complete": True, "time": time.time()})


def is_complete(directory: str) -> bool:
    return os.path.isfile(os.path.join(directory, COMPLETE_MARKER))


def checkpoints(output_dir: str) -> list[str]:
    """`checkpoint-N` directories (not the best link) in step order."""
    if not os.path.isdir(output_dir):
        return []
    found = []
    for name in os.listdir(output_dir):
        path = os.path.join(output_dir, name)
        if _CHECKPOINT_DIR.match(name) and os.path.isdir(path) and not os.path.islink(path):
            found.append(path)
    return sorted(found, key=lambda p: int(p.rsplit("-", 1)[-1]))


def latest_checkpoint(output_dir: str) -> str | None:
    """The newest *complete* checkpoint (interrupted saves never count)."""
    complete = [p for p in checkpoints(output_dir) if is_complete(p)]
    return complete[-1] if complete else None


def latest_usable_checkpoint(output_dir: str) -> str | None:
    """The newest complete checkpoint whose drafter files read back (`--resume_from_checkpoint latest`). A newer
    one that was damaged after it completed (a truncated or corrupt weights file, a broken config) is moved aside
    as `damaged-checkpoint-N`, with a warning naming the problem, and the one before it is used instead."""
    for path in reversed([p for p in checkpoints(output_dir) if is_complete(p)]):
        try:
            check_folder(Path(path))
        except ServingError as e:
            target = os.path.join(output_dir, DAMAGED_PREFIX + os.path.basename(path))
            shutil.rmtree(target, ignore_errors=True)
            replace_durably(path, target)
            logger.warning("%s is damaged (%s); moved aside as %s, resuming from the checkpoint before it", path, e,
                           os.path.basename(target))
            continue
        return path
    return None


def quarantine_incomplete(output_dir: str) -> list[str]:
    """Move interrupted saves aside (`incomplete-checkpoint-N`), so neither resuming nor rotation picks them up."""
    moved = []
    for path in checkpoints(output_dir):
        if not is_complete(path):
            target = os.path.join(output_dir, INCOMPLETE_PREFIX + os.path.basename(path))
            shutil.rmtree(target, ignore_errors=True)
            replace_durably(path, target)
            moved.append(target)
    return moved


def rotate_checkpoints(output_dir: str, limit: int | None, best: str | None) -> list[str]:
    """Delete the oldest complete checkpoints beyond `limit`; returns what was deleted.

    Called only after the newest checkpoint's completion marker exists, so a kill at any point leaves a
    complete checkpoint at least as new as the previous latest. The `checkpoint-best` link never counts, the
    best checkpoint and the newest one are always kept (even beyond the limit), and interrupted saves are left
    for `quarantine_incomplete` (they are not checkpoints). `limit` None keeps everything."""
    if not limit:
        return []
    complete = [p for p in checkpoints(output_dir) if is_complete(p)]
    keep = {complete[-1]} if complete else set()
    if best and os.path.isdir(best):
        keep.add(os.path.join(output_dir, os.path.basename(os.path.normpath(os.path.realpath(best)))))
    deleted = []
    for path in complete:
        if len(complete) - len(deleted) <= max(limit, len(keep)):
            break
        if path in keep:
            continue
        shutil.rmtree(path)
        deleted.append(path)
    return deleted


def update_best_link(output_dir: str, best: str | None) -> None:
    """Point `<output_dir>/checkpoint-best` at `best` (relative symlink, replaced atomically)."""
    if not (best and os.path.isdir(best)):
        return
    link = os.path.join(output_dir, BEST_LINK)
    tmp = temp_path(link)
    if os.path.lexists(tmp):
        os.remove(tmp)
    os.symlink(os.path.basename(os.path.normpath(best)), tmp)
    replace_durably(tmp, link)


def write_summary(output_dir: str, summary: dict) -> None:
    write_json_atomic(os.path.join(output_dir, SUMMARY_FILE), summary)


def read_summary(run_dir: str | os.PathLike) -> dict | None:
    path = Path(run_dir) / SUMMARY_FILE
    return read_json(path) if path.exists() else None


def write_data_stats(directory: str, stats: dict) -> None:
    write_json_atomic(os.path.join(directory, DATA_STATS_FILE), stats)


# ------------------------------------------------------------------------------------------ a new run
def previous_run(output_dir: str) -> list[str]:
    """What a previous run left in `output_dir` (checkpoints, a final model, a summary), by name."""
    if not os.path.isdir(output_dir):
        return []
    found = [os.path.basename(p) for p in checkpoints(output_dir)]
    found += [name for name in (SUMMARY_FILE, "config.json", WEIGHTS_FILE) if os.path.exists(os.path.join(output_dir, name))]
    return found


def check_output_dir(output_dir: str, resume: str | None, overwrite: bool, check_lock: bool = True) -> None:
    """A fresh run never silently replaces a previous one: refuse a file, a directory a run is training into
    (`check_lock`: only the process that will take the lock asks), and a directory holding checkpoints or a
    finished run unless the run resumes it or `overwrite_output_dir` says to replace it."""
    if os.path.exists(output_dir) and not os.path.isdir(output_dir):
        raise CheckpointError(f"train.output_dir {output_dir} is a file, not a directory; pass a new directory.")
    if check_lock:
        RunLock(output_dir).check()
    found = previous_run(output_dir)
    if found and not resume and not overwrite:
        shown = ", ".join(found[:4]) + (f" and {len(found) - 4} more" if len(found) > 4 else "")
        raise CheckpointError(f"train.output_dir {output_dir} already holds a run ({shown}); resume it with "
                              f"--resume_from_checkpoint latest, replace it with --overwrite_output_dir true, or "
                              f"choose another output_dir.")


def clear_run(output_dir: str) -> list[str]:
    """Remove what a previous run wrote into `output_dir` (`overwrite_output_dir`); other files are left alone."""
    removed = []
    if not os.path.isdir(output_dir):
        return removed
    for name in sorted(os.listdir(output_dir)):
        path = os.path.join(output_dir, name)
        ours = (_CHECKPOINT_DIR.match(name) or name.startswith(INCOMPLETE_PREFIX + CHECKPOINT_PREFIX)
                or name.startswith(DAMAGED_PREFIX + CHECKPOINT_PREFIX)
                or name in _RUN_FILES or name.startswith("batches-rank"))
        if not ours:
            continue
        if os.path.islink(path) or not os.path.isdir(path):
            os.remove(path)
        else:
            shutil.rmtree(path)
        removed.append(name)
    return removed


class RunLock:
    """Exclusive ownership of an output_dir for one run (its main process), so two runs never train into one
    directory and rotate away each other's checkpoints.

    The kernel's `flock` is the lock: it is released when the owner exits however it dies (kill -9 included), so
    a lock left by a dead run is simply taken over. The file's contents (pid, host, start time, command) only
    name the owner in the refusal and in the takeover warning. The file is never deleted (deleting a lock file
    that another process has open lets two processes lock two different files); releasing empties it."""

    def __init__(self, output_dir: str):
        self.path = os.path.join(output_dir, RUN_LOCK_FILE)
        self.fd: int | None = None

    def check(self) -> None:
        """Refuse now, without creating anything, if a live run holds the lock (what `acquire` would refuse)."""
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except FileNotFoundError:
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._refuse(fd)
        finally:
            os.close(fd)  # closing drops a lock this probe took

    def _refuse(self, fd: int):
        raise CheckpointError(f"train.output_dir {os.path.dirname(self.path)} is in use by a run in progress "
                              f"({_describe_owner(_lock_owner(fd))}); wait for it to finish, stop it, or pass "
                              f"another --output_dir.") from None

    def acquire(self) -> RunLock:
        output_dir = os.path.dirname(self.path) or "."
        if os.path.exists(output_dir) and not os.path.isdir(output_dir):
            raise CheckpointError(f"train.output_dir {output_dir} is a file, not a directory; pass a new directory.")
        os.makedirs(output_dir, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            try:
                self._refuse(fd)
            finally:
                os.close(fd)
        previous = _lock_owner(fd)
        if previous.get("pid"):
            logger.warning("train.output_dir %s: taking over the lock of a run that is no longer running (%s)",
                           os.path.dirname(self.path), _describe_owner(previous))
        owner = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%d %H:%M:%S"),
                 "argv": sys.argv}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(owner) + "\n").encode(), 0)
        os.fsync(fd)
        self.fd = fd
        return self

    def release(self) -> None:
        if self.fd is None:
            return
        os.ftruncate(self.fd, 0)  # a finished run leaves no owner to report
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)
        self.fd = None

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def _lock_owner(fd: int) -> dict:
    try:
        owner = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
    except (OSError, ValueError):
        return {}
    return owner if isinstance(owner, dict) else {}


def _describe_owner(owner: dict) -> str:
    if not owner.get("pid"):
        return "owner unknown"
    return f"pid {owner['pid']} on host {owner.get('host', '?')}, started {owner.get('started', '?')}"


# ------------------------------------------------------------------------------------------ resume
def check_resume_compatible(checkpoint: str, config) -> None:
    """Refuse to resume into a drafter that differs from the checkpoint's.

    The comparison is the whole drafter config (`DSparkConfig.to_dict()`, layer config included) minus the
    keys `configuration_dspark.RUNTIME_ONLY_KEYS` declares as not part of the drafter (versions, the local
    verifier path, the attention backend), so a new architecture field is covered without touching this."""
    try:
        saved = check_folder(Path(checkpoint))
    except ServingError as e:
        raise CheckpointError(f"cannot resume from {checkpoint}: {e}") from e
    diffs = config_diff(saved, config.to_dict())
    if diffs:
        raise CheckpointError(
            f"cannot resume from {checkpoint}: the drafter changed ({'; '.join(diffs)}); resume with the "
            f"checkpoint's model settings or start a new output_dir."
        )


def config_diff(saved: dict, current: dict, prefix: str = "") -> list[str]:
    """`key: saved -> current` for every differing key outside `RUNTIME_ONLY_KEYS` (nested dicts recursed)."""
    diffs = []
    for key in sorted(set(saved) | set(current)):
        name = prefix + key
        if name in RUNTIME_ONLY_KEYS or key in RUNTIME_ONLY_KEYS:
            continue
        a, b = saved.get(key), current.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            diffs += config_diff(a, b, prefix=f"{name}.")
        elif a != b:
            diffs.append(f"{name}: {a} -> {b}")
    return diffs


# ------------------------------------------------------------------------------------------ selection
@dataclass
class Checkpoint:
    """A resolved drafter directory. `kind` is "checkpoint" (a `checkpoint-N` dir) or "final" (the model the
    run saved into its output_dir); `step` is the optimizer step its weights come from, when recorded."""

    path: Path
    kind: str
    step: int | None
    run_dir: Path | None  # the training output_dir, for the run summary


def resolve_checkpoint(spec: str | os.PathLike) -> Checkpoint:
    """One complete drafter directory from a `checkpoint-N` dir, a final model, or a run's output_dir.

    An output_dir means its `checkpoint-best` when present, else its own final model, else its latest complete
    checkpoint; `OUTPUT_DIR:best`, `OUTPUT_DIR:latest`, `OUTPUT_DIR:final` and `OUTPUT_DIR:<step>` select
    explicitly. Symlinks are resolved; incomplete checkpoints are refused."""
    spec = os.fspath(spec)
    selector = None
    head, sep, tail = spec.rpartition(":")
    if sep and head and _SELECTOR.match(tail) and not os.path.exists(spec):
        spec, selector = head, tail
    path = Path(spec)
    if not path.exists():
        raise CheckpointError(f"checkpoint path {spec} does not exist; pass a checkpoint-N directory or a training "
                              f"output_dir (optionally OUTPUT_DIR:best|latest|final|<step>).")
    if not path.is_dir():
        raise CheckpointError(f"checkpoint path {spec} is not a directory; pass a checkpoint-N directory or a "
                              f"training output_dir.")
    path = path.resolve()
    if selector is not None:
        return _select(path, selector)
    if _CHECKPOINT_DIR.match(path.name) or (path / COMPLETE_MARKER).exists():
        return _as_checkpoint(path)
    if (path / BEST_LINK).is_dir():
        return _as_checkpoint((path / BEST_LINK).resolve())
    if (path / "config.json").exists():
        return _as_final(path)
    latest = latest_checkpoint(str(path))
    if latest is None:
        raise CheckpointError(f"{spec} holds no drafter (no config.json, no {BEST_LINK} and no complete "
                              f"checkpoint-N); pass the output_dir of a run that saved a checkpoint, or a checkpoint "
                              f"directory.")
    return _as_checkpoint(Path(latest))


def _select(run_dir: Path, selector: str) -> Checkpoint:
    """The explicit `OUTPUT_DIR:best|latest|final|<step>` choice; each miss names what is there instead."""
    if selector == "best":
        if not (run_dir / BEST_LINK).is_dir():
            raise CheckpointError(f"{run_dir} has no {BEST_LINK} (the run had no validation split or has not "
                                  f"evaluated yet); use {run_dir}:latest or {run_dir}:final.")
        return _as_checkpoint((run_dir / BEST_LINK).resolve())
    if selector == "latest":
        latest = latest_checkpoint(str(run_dir))
        if latest is None:
            raise CheckpointError(f"{run_dir} has no complete checkpoint-N directory; use {run_dir}:final or pass "
                                  f"the run's output_dir once it has saved a checkpoint.")
        return _as_checkpoint(Path(latest))
    if selector == "final":
        if not (run_dir / "config.json").exists():
            raise CheckpointError(f"{run_dir} has no final model (no config.json; the run has not finished); use "
                                  f"{run_dir}:latest.")
        return _as_final(run_dir)
    target = run_dir / f"{CHECKPOINT_PREFIX}-{selector}"
    if not target.is_dir():
        steps = [Path(p).name.split("-")[1] for p in checkpoints(str(run_dir))]
        raise CheckpointError(f"{run_dir} has no {CHECKPOINT_PREFIX}-{selector}; pick one of the available steps "
                              f"{steps or 'none'}.")
    return _as_checkpoint(target.resolve())


def _as_checkpoint(path: Path) -> Checkpoint:
    marker = path / COMPLETE_MARKER
    if not marker.exists():
        raise CheckpointError(f"{path} is an incomplete checkpoint (no {COMPLETE_MARKER}: its save was interrupted); "
                              f"pass an earlier complete checkpoint or the run's output_dir.")
    _check_is_drafter(path)
    step = read_json(marker).get("step")
    match = _CHECKPOINT_DIR.match(path.name)
    if step is None and match:
        step = int(match.group(1))
    return Checkpoint(path=path, kind="checkpoint", step=step, run_dir=path.parent)


def _as_final(path: Path) -> Checkpoint:
    _check_is_drafter(path)
    summary = read_summary(path) or {}
    step = summary.get("global_step")
    best = summary.get("best_checkpoint")
    if best and _CHECKPOINT_DIR.match(Path(best).name):  # load_best_model_at_end: the final weights are the best's
        step = int(Path(best).name.split("-")[1])
    return Checkpoint(path=path, kind="final", step=step, run_dir=path)


def _check_is_drafter(path: Path) -> None:
    try:
        check_folder(path)
    except ServingError as e:
        raise CheckpointError(str(e)) from e
