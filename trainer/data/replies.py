"""Regenerated conversations: splitting a conversation into the turns the verifier answers, the record written per
conversation, the per-request seed, and the writer that appends finished conversations in input order (so an
interrupted regeneration resumes from what it wrote). Both regeneration backends (trainer/data/generators.py)
write through it.
"""

from __future__ import annotations

import hashlib
import json
import time

from trainer.data.files import read_jsonl_objects  # noqa: E402

WINDOW_BATCHES = 8  # transformers: rows are taken in input order, WINDOW_BATCHES batches at a time


def conversation_turns(messages: list[dict]) -> list[list[dict]]:
    """The messages before each reply to regenerate: a run of assistant messages after other turns is one
    reply (replaced), the non-assistant messages after the last reply ask for one more, and assistant messages
    before any other turn stay as context of the first. `[sys, u1, a1, u2, a2]` -> `[[sys, u1], [u2]]`."""
    turns, current, seen_other = [], [], False
    for message in messages:
        if message["role"] != "assistant":
            current.append(message)
            seen_other = True
        elif not seen_other:
            current.append(message)  # a leading assistant message: context, nothing asked it
        elif current:
            turns.append(current)
            current = []
    if current and any(m["role"] != "assistant" for m in current):
        turns.append(current)
    return turns


def turn_messages(turns: list[list[dict]], replies: list[str]) -> list[dict]:
    """The conversation the next reply is generated for: every earlier turn with its regenerated reply, then
    the next turn's messages."""
    messages = []
    for turn, reply in zip(turns, replies):
        messages += [*turn, {"role": "assistant", "content": reply}]
    return messages + list(turns[len(replies)])


def conversation_record(row: dict, replies: list[str]) -> dict:
    """The output row: the whole conversation with the regenerated replies (plus the subset, when known)."""
    messages = []
    for turn, reply in zip(row["turns"], replies):
        messages += [*turn, {"role": "assistant", "content": reply}]
    record = {"id": row["id"], "messages": messages}
    if row.get("subset"):
        record["subset"] = row["subset"]
    return record


def request_seed(seed: int, row_id: str, turn: int) -> int:
    """A per-request seed that depends only on the run seed, the row and the turn (not on order)."""
    digest = hashlib.sha256(f"{seed}:{row_id}:{turn}".encode()).digest()
    return int.from_bytes(digest[:4], "big") & 0x7FFFFFFF


# ------------------------------------------------------------------------------------------ output
def read_finished(path: str) -> list[dict]:
    """Rows already written by an earlier run; a truncated last line (a kill mid-write) is dropped from the file
    so it is regenerated, any other unreadable line is refused (the file is not ours to rewrite)."""
    with open(path, "rb") as f:
        data = f.read()
    if data and not data.endswith(b"\n"):
        cut = data.rfind(b"\n") + 1
        with open(path, "r+b") as f:
            f.truncate(cut)
    return [row for _, row in read_jsonl_objects(path)]


class OrderedWriter:
    """Writes rows in input order although they complete out of order: a completed row waits until every
    earlier one is done (written, or failed: `None`, skipped), then the contiguous prefix is written and
    flushed, a whole line per row (so a kill leaves at most one cut line, which a rerun drops)."""

    def __init__(self, f):
        self.f, self.next, self.pending, self.written = f, 0, {}, 0

    def add(self, index: int, record: dict | None) -> int:
        """Row `index` is finished; returns how many rows this wrote."""
        self.pending[index] = record
        lines = []
        while self.next in self.pending:
            done = self.pending.pop(self.next)
            self.next += 1
            if done is not None:
                lines.append(json.dumps(done, ensure_ascii=False) + "\n")
        return self._write(lines)

    def close(self) -> int:
        """A stopped run: rows still waiting for an earlier one are written anyway (in input order), so nothing
        finished is lost; the rerun appends the missing rows after them."""
        lines = [json.dumps(self.pending[i], ensure_ascii=False) + "\n" for i in sorted(self.pending)
                 if self.pending[i] is not None]
        self.pending = {}
        return self._write(lines)

    def _write(self, lines: list[str]) -> int:
        if lines:
            self.f.write("".join(lines))
            self.f.flush()
            self.written += len(lines)
        return len(lines)


def progress(bar, stats: dict, started: float, rows: int) -> None:
    bar.update(rows)
    bar.set_postfix(tok_s=f"{stats['new_tokens'] / max(time.time() - started, 1e-6):.0f}", failed=stats["failed"])
