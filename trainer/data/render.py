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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import datasets
import pyarrow as pa
import pyarrow.compute as pc

from trainer.errors import UsageError

logger = logging.getLogger(__name__)


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
    # A file may mix `messages` and ShareGPT `conversations` rows: datasets gives each row both columns, the one it
    # lacks as None, so a row whose own column is empty is read from the other.
    other = next((name for name in ("messages", "conversations") if name != column and name in batch), None)
    fallback = batch[other] if other else [None] * len(batch[column])
    for own, theirs in zip(batch[column], fallback):
        turns = own if own is not None or theirs is None else theirs
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
