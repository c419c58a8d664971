"""Chat data -> loss-masked conversations -> packed rows, with the real SmolLM2 tokenizer and chat template."""

import copy
import json
import pickle
import random
from collections import Counter

import datasets
import pytest
import torch

from trainer.data.load import load_chat_dataset
from trainer.data.packing import DSparkCollator, PackedDataset, pack_conversations, supervised_token_counts
from trainer.data.render import (
    PrepStats,
    normalize_messages,
    prepare_conversations,
    render_conversation,
    split_train_validation,
)
from trainer.errors import UsageError, run_cli

END_OF_TURN = "<|im_end|>\n"  # what SmolLM2's template appends after every message's content


@pytest.fixture(scope="session")
def tokenizer(smollm2_tokenizer):
    return smollm2_tokenizer


def masked_spans(tokenizer, input_ids, loss_mask):
    """Decoded maximal runs of supervised tokens, the brute-force view of a loss mask."""
    spans, start = [], None
    for i, m in enumerate([*loss_mask, 0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            spans.append(tokenizer.decode(input_ids[start:i]))
            start = None
    return spans


def unmasked_text(tokenizer, input_ids, loss_mask):
    return tokenizer.decode([t for t, m in zip(input_ids, loss_mask) if not m])


MULTI_TURN = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name a prime number."},
    {"role": "assistant", "content": "Seven is prime."},
    {"role": "user", "content": "And an even one?"},
    {"role": "assistant", "content": "Two, the only even prime."},
]


def as_sharegpt(messages):
    names = {"system": "system", "user": "human", "assistant": "gpt"}
    return [{"from": names[m["role"]], "value": m["content"]} for m in messages]


# ------------------------------------------------------------------------------------------------ rendering


def test_single_turn_mask_is_assistant_content_plus_end_of_turn(tokenizer):
    messages = [
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "Paris."},
    ]
    row = render_conversation(tokenizer, messages, max_seq_length=512)
    assert row["status"] == "ok" and not row["truncated"]
    full = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False)
    assert row["input_ids"] == list(full)
    assert len(row["loss_mask"]) == len(row["input_ids"])
    assert masked_spans(tokenizer, row["input_ids"], row["loss_mask"]) == ["Paris." + END_OF_TURN]


def test_multi_turn_supervises_every_assistant_turn_and_nothing_else(tokenizer):
    row = render_conversation(tokenizer, MULTI_TURN, max_seq_length=512)
    assert row["status"] == "ok"
    expected = [m["content"] + END_OF_TURN for m in MULTI_TURN if m["role"] == "assistant"]
    assert masked_spans(tokenizer, row["input_ids"], row["loss_mask"]) == expected
    prompt_side = unmasked_text(tokenizer, row["input_ids"], row["loss_mask"])
    for m in MULTI_TURN:
        assert (m["content"] in prompt_side) == (m["role"] != "assistant")


def test_turns_after_the_last_assistant_and_empty_assistant_turns_are_unsupervised(tokenizer):
    messages = [
        {"role": "user", "content": "First?"},
        {"role": "assistant", "content": "   "},
        {"role": "user", "content": "Second?"},
        {"role": "assistant", "content": "Answer two."},
        {"role": "user", "content": "A trailing question that nobody answers."},
    ]
    row = render_conversation(tokenizer, messages, max_seq_length=512)
    assert masked_spans(tokenizer, row["input_ids"], row["loss_mask"]) == ["Answer two." + END_OF_TURN]
    assert "nobody answers" not in tokenizer.decode(row["input_ids"])


def test_sharegpt_and_messages_forms_render_identically(tokenizer):
    assert normalize_messages(as_sharegpt(MULTI_TURN)) == MULTI_TURN
    assert render_conversation(tokenizer, as_sharegpt(MULTI_TURN), 512) == render_conversation(
        tokenizer, MULTI_TURN, 512
    )
    a, _ = prepare_conversations(datasets.Dataset.from_list([{"messages": MULTI_TURN}]), tokenizer, 512)
    b, _ = prepare_conversations(
        datasets.Dataset.from_list([{"conversations": as_sharegpt(MULTI_TURN)}]), tokenizer, 512
    )
    assert a.to_list() == b.to_list()


def test_a_file_mixing_messages_and_sharegpt_rows_keeps_both(tokenizer, tmp_path):
    """One JSONL may hold both forms: every row is read from its own column, none skipped as malformed."""
    path = tmp_path / "mixed.jsonl"
    rows = [{"messages": MULTI_TURN}, {"conversations": as_sharegpt(MULTI_TURN)}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    prepared, stats = prepare_conversations(load_chat_dataset(str(path)), tokenizer, 512)
    assert stats.kept == 2 and not stats.errors, stats.summary()
    assert prepared[0]["input_ids"] == prepared[1]["input_ids"] and prepared[0]["loss_mask"] == prepared[1]["loss_mask"]


def test_role_aliases():
    turns = [{"from": "human", "value": "q"}, {"from": "model", "value": "a"}, {"role": "tool", "content": "r"}]
    assert [m["role"] for m in normalize_messages(turns)] == ["user", "assistant", "tool"]


def test_list_of_parts_content_joins_text_parts(tokenizer):
    parts = [
        {"role": "user", "content": [{"type": "text", "text": "Describe"}, {"type": "image", "url": "x.png"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "A cat."}, {"type": "text", "text": "It sleeps."}]},
    ]
    assert normalize_messages(parts)[1]["content"] == "A cat.\nIt sleeps."
    plain = [{"role": "user", "content": "Describe"}, {"role": "assistant", "content": "A cat.\nIt sleeps."}]
    assert render_conversation(tokenizer, parts, 512) == render_conversation(tokenizer, plain, 512)


def test_mixed_string_and_parts_content_from_jsonl(tokenizer, tmp_path):
    # A JSON file mixing string and list-of-parts content loads as a Json feature (datasets >= 4.7).
    rows = [
        {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]},
        {
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
                {"role": "assistant", "content": "Hello."},
            ]
        },
    ]
    path = tmp_path / "mixed.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    prepared, stats = prepare_conversations(load_chat_dataset(str(path)), tokenizer, 512)
    assert stats.kept == 2
    assert prepared[0]["input_ids"] == prepared[1]["input_ids"]


def test_skipped_rows_are_counted_not_fatal(tokenizer):
    rows = [
        {"messages": MULTI_TURN},
        {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "no answer"}]},
        {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": ""}]},
        {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": " \n "}]},
        {"messages": [{"role": "narrator", "content": "q"}, {"role": "assistant", "content": "a"}]},
    ]
    statuses = [render_conversation(tokenizer, r["messages"], 512)["status"] for r in rows]
    assert statuses == ["ok", "no_assistant", "empty", "empty", "malformed"]
    prepared, stats = prepare_conversations(datasets.Dataset.from_list(rows), tokenizer, 512)
    assert len(prepared) == 1 and prepared.column_names == ["input_ids", "loss_mask", "length", "num_supervised"]
    assert (stats.total, stats.kept, stats.no_assistant, stats.empty, stats.malformed) == (5, 1, 1, 2, 1)
    assert "unknown role 'narrator'" in stats.errors[0]
    assert "no_assistant 1" in stats.summary() and "empty 2" in stats.summary()


def test_all_rows_unusable_is_fatal(tokenizer):
    ds = datasets.Dataset.from_list([{"messages": [{"role": "user", "content": "only a question"}]}])
    with pytest.raises(ValueError, match="no usable conversation"):
        prepare_conversations(ds, tokenizer, 512)


def test_prompt_too_long_rule_is_exact(tokenizer):
    messages = [{"role": "user", "content": "word " * 40}, {"role": "assistant", "content": "Short answer."}]
    full = render_conversation(tokenizer, messages, 10_000)
    first = full["loss_mask"].index(1)  # index of the first supervised token = prompt length
    kept = render_conversation(tokenizer, messages, first + 1)  # room for exactly one supervised token
    assert kept["status"] == "ok" and kept["truncated"] and sum(kept["loss_mask"]) == 1
    assert kept["input_ids"] == full["input_ids"][: first + 1]
    dropped = render_conversation(tokenizer, messages, first)
    assert dropped["status"] == "prompt_too_long" and dropped["input_ids"] == []
    ds = datasets.Dataset.from_list([{"messages": messages}, {"messages": MULTI_TURN}])
    prepared, stats = prepare_conversations(ds, tokenizer, first)
    assert stats.prompt_too_long == 1 and stats.kept == 1 and len(prepared) == 1


def test_truncation_keeps_a_prefix(tokenizer):
    full = render_conversation(tokenizer, MULTI_TURN, 10_000)
    cut = render_conversation(tokenizer, MULTI_TURN, len(full["input_ids"]) - 5)
    assert cut["truncated"] and cut["status"] == "ok"
    assert cut["input_ids"] == full["input_ids"][:-5] and cut["loss_mask"] == full["loss_mask"][:-5]
    window = full["loss_mask"].index(1) + 3  # cuts into the first assistant turn
    prepared, stats = prepare_conversations(datasets.Dataset.from_list([{"messages": MULTI_TURN}]), tokenizer, window)
    assert stats.truncated == 1 and prepared[0]["length"] == window == len(prepared[0]["input_ids"])
    assert prepared[0]["input_ids"] == full["input_ids"][:window]
    assert stats.total_tokens == window and stats.supervised_tokens == 3 == prepared[0]["num_supervised"]


# A template that drops reasoning from assistant turns in the history but keeps it in the last turn,
# like several reasoning models do: the prefix renders then disagree with the full render.
THINK_STRIPPING_TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- if m.role == 'assistant' and not loop.last -%}"
    "{{ '<|im_start|>assistant\n' + (m.content.split('</think>')[-1] | trim) + '<|im_end|>\n' }}"
    "{%- else -%}{{ '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}{%- endif -%}"
    "{%- endfor -%}{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\n' }}{%- endif -%}"
)


def test_inconsistent_template_falls_back_to_common_prefix(tokenizer):
    messages = [
        {"role": "user", "content": "Q1"},
        {"role": "assistant", "content": "<think>ponder</think>A1"},
        {"role": "user", "content": "Q2"},
        {"role": "assistant", "content": "A2"},
    ]
    row = render_conversation(tokenizer, messages, 512, chat_template=THINK_STRIPPING_TEMPLATE)
    assert row["status"] == "inconsistent_template"
    # Turn 1 is rendered without its reasoning in the full conversation, and its own render starts with the
    # reasoning, so nothing of it can be attributed safely; the last turn is consistent and fully supervised.
    assert masked_spans(tokenizer, row["input_ids"], row["loss_mask"]) == ["A2" + END_OF_TURN]
    ds = datasets.Dataset.from_list([{"messages": messages}, {"messages": MULTI_TURN}])
    _, stats = prepare_conversations(ds, tokenizer, 512, chat_template=THINK_STRIPPING_TEMPLATE)
    assert stats.kept == 2 and stats.inconsistent_template == 1


def test_unknown_schema_is_fatal(tokenizer):
    ds = datasets.Dataset.from_list([{"text": "hello", "id": 1}])
    with pytest.raises(ValueError, match=r"rows have columns \['text', 'id'\]; expected a `messages` column"):
        prepare_conversations(ds, tokenizer, 512)


def test_tokenizer_without_chat_template_is_fatal(tokenizer):
    bare = copy.deepcopy(tokenizer)
    bare.chat_template = None
    with pytest.raises(ValueError, match="has no chat template; use the instruction-tuned verifier's tokenizer"):
        render_conversation(bare, MULTI_TURN, 512)
    with pytest.raises(ValueError, match="has no chat template"):
        prepare_conversations(datasets.Dataset.from_list([{"messages": MULTI_TURN}]), bare, 512)
    row = render_conversation(bare, MULTI_TURN, 512, chat_template=tokenizer.chat_template)
    assert row == render_conversation(tokenizer, MULTI_TURN, 512)


# ------------------------------------------------------------------------------------------------ loading


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def chat_rows(n, offset=0):
    return [
        {"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]}
        for i in range(offset, offset + n)
    ]


def test_load_files_directories_and_saved_datasets(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", chat_rows(3))
    b = write_jsonl(tmp_path / "b.jsonl", chat_rows(2, offset=3))
    assert len(load_chat_dataset(str(a))) == 3
    assert len(load_chat_dataset([str(a), str(b)])) == 5
    assert len(load_chat_dataset(str(tmp_path))) == 5
    assert len(load_chat_dataset(str(tmp_path), max_samples=4)) == 4

    parquet_dir = tmp_path / "pq"
    parquet_dir.mkdir()
    datasets.Dataset.from_list(chat_rows(4)).to_parquet(str(parquet_dir / "x.parquet"))
    assert load_chat_dataset(str(parquet_dir / "x.parquet"))[0]["messages"][1]["content"] == "a0"

    saved = tmp_path / "saved"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(chat_rows(2))}).save_to_disk(str(saved))
    assert len(load_chat_dataset(str(saved))) == 2
    with pytest.raises(ValueError, match="has splits \\['train'\\] but not 'test'"):
        load_chat_dataset(str(saved), split="test")


def test_load_errors_are_one_sentence(tmp_path):
    with pytest.raises(UsageError, match="does not exist; pass an existing .jsonl/.json/.parquet file"):
        load_chat_dataset(str(tmp_path / "missing.jsonl"))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(UsageError, match="contains no .jsonl/.json/.parquet files"):
        load_chat_dataset(str(empty))
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "p", "completion": "c"}])
    with pytest.raises(ValueError, match="expected a `messages` column"):
        load_chat_dataset(str(bad))


# ------------------------------------------------------------------------------- unreadable local data files


@pytest.fixture
def datasets_cache(tmp_path, monkeypatch):
    """A private `datasets` cache, where clean copies of files with skipped lines are written."""
    cache = tmp_path / "hf-datasets-cache"
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", cache)
    return cache


def chat_lines(n, offset=0):
    return [json.dumps(r) for r in chat_rows(n, offset)]


def write_lines(path, lines, end="\n"):
    path.write_bytes(b"".join((x if isinstance(x, bytes) else x.encode()) + b"\n" for x in lines[:-1])
                     + (lines[-1] if isinstance(lines[-1], bytes) else lines[-1].encode()) + end.encode())
    return path


def usage_error(source, **kwargs) -> str:
    """The message of the UsageError that loading `source` raises; it must be exactly a UsageError, on one line."""
    with pytest.raises(UsageError) as excinfo:
        load_chat_dataset(source, **kwargs)
    assert excinfo.type is UsageError
    message = str(excinfo.value)
    assert "\n" not in message and message.endswith(".")
    return message


def test_empty_file_and_blank_lines_only_are_refused(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_bytes(b"")
    assert usage_error(str(empty)) == (
        f"data file {empty} is empty (no rows); remove it from the data, or write chat rows into it."
    )
    blank = tmp_path / "blank.jsonl"
    blank.write_bytes(b"\n  \n\t\r\n\n")
    assert f"data file {blank} has only blank lines (no rows)" in usage_error(str(blank))
    # inside a directory the empty file is named too, even among good files
    write_jsonl(tmp_path / "good.jsonl", chat_rows(3))
    assert f"data file {blank} has only blank lines" in usage_error(str(tmp_path))


def test_file_that_is_not_json_at_all(tmp_path):
    path = tmp_path / "notes.jsonl"
    path.write_text("These are my notes.\nNot JSON at all.\n")
    message = usage_error(str(path))
    assert message.startswith(f"data file {path} line 1 is not valid JSON (Expecting value: column 1): "
                              "'These are my notes.'; 2 of 2 non-blank lines (100%) of the data are unreadable")
    assert message.endswith("fix or delete the bad lines, or raise data.max_bad_line_ratio.")


def test_one_bad_line_in_200_is_skipped_counted_and_logged_once(tmp_path, datasets_cache, caplog):
    lines = chat_lines(200)
    lines[100] = '{"messages": [{"role": "user", "content": "q"}' + "'"  # line 101
    path = write_lines(tmp_path / "chat.jsonl", lines)
    with caplog.at_level("WARNING", logger="trainer.data.render"):
        ds = load_chat_dataset(str(path))
    assert len(ds) == 199
    expected = [r["messages"][0]["content"] for i, r in enumerate(chat_rows(200)) if i != 100]
    assert [r["messages"][0]["content"] for r in ds] == expected  # order kept, only the bad line dropped
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1
    assert warnings[0].startswith("skipping 1 unreadable line(s) of 200 (0.5%, within max_bad_line_ratio=0.01)")
    assert f"data file {path} line 101 is not valid JSON (" in warnings[0]
    # the clean copy lives in the datasets cache, keyed by content, and is reused (so is the datasets cache)
    copies = list((datasets_cache / "dspark_clean_jsonl").glob("*.jsonl"))
    assert len(copies) == 1 and copies[0].read_text().count("\n") == 199
    mtime = copies[0].stat().st_mtime_ns
    assert load_chat_dataset(str(path)).to_list() == ds.to_list()
    assert copies[0].stat().st_mtime_ns == mtime and path.read_text().count("\n") == 200  # source untouched


def test_five_bad_lines_in_100_are_refused_quoting_the_first(tmp_path, datasets_cache):
    lines = chat_lines(100)
    for i in (9, 30, 50, 70, 90):
        lines[i] = '{"messages": [{"role": "user", "content": "' + "x" * 200 + '"}], oops}'
    path = write_lines(tmp_path / "chat.jsonl", lines)
    message = usage_error(str(path))
    quote = "'" + lines[9][:77] + "...'"
    assert message == (
        f"data file {path} line 10 is not valid JSON (Expecting property name enclosed in double quotes: "
        f"column 249): {quote}; 5 of 100 non-blank lines (5%) of the data are unreadable, more than "
        "max_bad_line_ratio=0.01 allows; fix or delete the bad lines, or raise data.max_bad_line_ratio."
    )
    assert len(load_chat_dataset(str(path), max_bad_line_ratio=0.05)) == 95  # the threshold is configurable
    lines = chat_lines(300)
    lines[7] = "not json"
    path = write_lines(tmp_path / "strict.jsonl", lines)
    assert f"{path} line 8 is not valid JSON" in usage_error(str(path), max_bad_line_ratio=0)
    assert "is not a share in [0, 1]" in usage_error(str(path), max_bad_line_ratio=2)


def test_bad_line_share_is_over_all_files_of_the_load(tmp_path, datasets_cache):
    data = tmp_path / "data"
    data.mkdir()
    write_lines(data / "a.jsonl", chat_lines(150))
    b = write_lines(data / "b.jsonl", [*chat_lines(49, offset=150), "{"])  # 1 bad of 50, 1 of 200 overall
    ds = load_chat_dataset(str(data))
    assert len(ds) == 199 and ds[-1]["messages"][0]["content"] == "q198"
    assert f"data file {b} line 50 is not valid JSON" in usage_error([str(b)])  # alone it is 2%: refused


def test_truncated_last_line(tmp_path, datasets_cache, caplog):
    lines = chat_lines(200)
    path = write_lines(tmp_path / "cut.jsonl", [*lines, lines[0][:40]], end="")
    with caplog.at_level("WARNING", logger="trainer.data.render"):
        assert len(load_chat_dataset(str(path))) == 200
    assert f"data file {path} line 201 is truncated (the file ends inside a JSON value" in caplog.text
    small = write_lines(tmp_path / "small.jsonl", [*lines[:5], lines[0][:40]], end="")
    message = usage_error(str(small))
    assert message.startswith(f"data file {small} line 6 is truncated (the file ends inside a JSON value: ")
    assert f"'{lines[0][:40]}'" in message


def test_invalid_utf8_names_the_line(tmp_path):
    lines = [line.encode() for line in chat_lines(4)]
    lines[2] = b'{"messages": "caf\xe9 \xff"}'
    path = write_lines(tmp_path / "latin1.jsonl", lines)
    message = usage_error(str(path))
    assert message.startswith(f"data file {path} line 3 is not valid UTF-8 (byte 0xe9 at byte 18): "
                              "'{\"messages\": \"caf\\xe9 \\xff\"}'; 1 of 4 non-blank lines (25%)")


def test_json_line_that_is_not_an_object(tmp_path):
    path = write_lines(tmp_path / "mixed.jsonl", [*chat_lines(2), '[{"role": "user", "content": "q"}]', "3"])
    message = usage_error(str(path))
    assert message.startswith(f"data file {path} line 3 is an array, not a JSON object (one chat row per line): "
                              "'[{\"role\": \"user\", \"content\": \"q\"}]'; 2 of 4 non-blank lines (50%)")


def test_json_files_holding_one_object_or_an_array(tmp_path):
    rows = chat_rows(3)
    one_line = tmp_path / "one.json"
    one_line.write_text(json.dumps(rows[0]))
    assert load_chat_dataset(str(one_line)).to_list() == rows[:1]
    pretty = tmp_path / "pretty.json"
    pretty.write_text(json.dumps(rows[1], indent=2))
    assert load_chat_dataset(str(pretty)).to_list() == rows[1:2]
    array = tmp_path / "array.json"
    array.write_text(json.dumps(rows, indent=2))
    assert load_chat_dataset(str(array)).to_list() == rows

    scalar = tmp_path / "scalar.json"
    scalar.write_text("42\n")
    assert usage_error(str(scalar)) == (
        f"data file {scalar} holds a number, not an array of rows or one row object; a .json file must be one "
        "JSON array of row objects or one row object, otherwise write one JSON object per line (.jsonl)."
    )
    strings = tmp_path / "strings.json"
    strings.write_text('["hello", "world"]')
    assert f"data file {strings} is an array whose element 0 is a string, not a row object" in usage_error(
        str(strings)
    )
    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps(rows, indent=2).replace("}\n", "\n", 1))
    assert usage_error(str(broken)).startswith(f"data file {broken} is not valid JSON (Expecting ',' delimiter: line ")
    truncated = tmp_path / "truncated.json"
    truncated.write_text(json.dumps(rows, indent=2)[:-30])
    assert "is not valid JSON (Unterminated string" in usage_error(str(truncated))
    assert "(the file ends early: truncated?)" in usage_error(str(truncated))


def test_corrupt_parquet_file_is_named(tmp_path):
    garbage = tmp_path / "garbage.parquet"
    garbage.write_bytes(b"PAR1 this is not parquet")
    assert usage_error(str(garbage)).startswith(
        f"data file {garbage} is not a readable Parquet file (ArrowInvalid: Parquet magic bytes not found"
    )
    good = tmp_path / "good.parquet"
    datasets.Dataset.from_list(chat_rows(50)).to_parquet(str(good))
    cut = tmp_path / "cut.parquet"
    cut.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    message = usage_error([str(good), str(cut)])
    assert message.startswith(f"data file {cut} is not a readable Parquet file (")
    assert message.endswith("; re-export it or remove it from the data.")


def test_missing_paths_and_empty_directories(tmp_path):
    missing = tmp_path / "nowhere" / "train.jsonl"
    assert usage_error(str(missing)) == (
        f"data path {missing} does not exist; pass an existing .jsonl/.json/.parquet file, a directory of them, "
        "or a Hub dataset id."
    )
    assert f"data path {tmp_path / 'no_such_dir'} does not exist" in usage_error(str(tmp_path / "no_such_dir"))
    good = write_jsonl(tmp_path / "good.jsonl", chat_rows(2))
    assert usage_error([str(good), str(missing)]) == (
        f"data file {missing} does not exist; check the path (expected a .jsonl, .json or .parquet file)."
    )
    empty = tmp_path / "empty_dir"
    (empty / ".hidden").mkdir(parents=True)
    write_jsonl(empty / ".hidden" / "x.jsonl", chat_rows(2))
    (empty / "notes.txt").write_text("not data")
    assert usage_error(str(empty)) == (
        f"data directory {empty} contains no .jsonl/.json/.parquet files (hidden ones are skipped) and is not a "
        "save_to_disk dataset; put chat data files in it, or point at a file or a Hub dataset id."
    )


def test_blank_lines_with_mixed_content_types_load(tmp_path, datasets_cache, tokenizer):
    # `datasets` fails ("Expected object or value") on blank lines when a field mixes strings and lists
    rows = chat_rows(6)
    rows[2]["messages"][1]["content"] = [{"type": "text", "text": "parts"}]
    path = write_lines(tmp_path / "gaps.jsonl", [json.dumps(r) for r in rows[:3]] + ["", "  "]
                       + [json.dumps(r) for r in rows[3:]] + [""])
    ds = load_chat_dataset(str(path))
    assert [r["messages"][0]["content"] for r in ds] == [f"q{i}" for i in range(6)]
    prepared, stats = prepare_conversations(ds, tokenizer, 512)
    assert stats.kept == 6 and len(prepared) == 6


def test_unreadable_data_is_one_error_line_from_the_cli(tmp_path, capsys):
    path = write_lines(tmp_path / "chat.jsonl", [*chat_lines(3), "oops"])
    assert run_cli(lambda argv: load_chat_dataset(argv[0]), [str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: data file {path} line 4 is not valid JSON")


def test_split_train_validation():
    ds = datasets.Dataset.from_dict({"i": list(range(50))})
    train, val = split_train_validation(ds, 0.0, seed=0)
    assert len(train) == 50 and len(val) == 0
    train, val = split_train_validation(ds, 0.001, seed=0)
    assert len(val) == 1 and len(train) == 49
    train, val = split_train_validation(ds, 0.2, seed=3)
    assert len(val) == 10 and sorted(list(train["i"]) + list(val["i"])) == list(range(50))
    assert list(split_train_validation(ds, 0.2, seed=3)[1]["i"]) == list(val["i"])
    assert len(split_train_validation(ds.select([0, 1]), 0.5, seed=0)[1]) == 1
    with pytest.raises(ValueError, match="outside \\[0, 1\\)"):
        split_train_validation(ds, 1.0, seed=0)


# ------------------------------------------------------------------------------------------------ packing


def test_packing_fits_uses_everything_once_and_is_deterministic():
    rng = random.Random(0)
    total = 256
    lengths = [rng.randint(1, total) for _ in range(300)] + [total, 1, 1, 7, 7, 7]
    rows = pack_conversations(lengths, total, seed=1)
    assert sorted(i for row in rows for i in row) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in row) <= total for row in rows)
    # Best fit only opens a row when nothing open can take the conversation, so an earlier row never has
    # room for the first conversation of a later one.
    for a in range(len(rows)):
        room = total - sum(lengths[i] for i in rows[a])
        assert all(room < lengths[rows[b][0]] for b in range(a + 1, len(rows)))
    assert len(rows) <= 1.25 * sum(lengths) / total + 2
    assert pack_conversations(lengths, total, seed=1) == rows
    with pytest.raises(ValueError, match="conversation 1 has 300 tokens, which does not fit"):
        pack_conversations([5, 300], 256, seed=0)


def reference_row(conversations, index):
    ids, mask, docs, pos = [], [], [], []
    for d, (i, m) in enumerate(conversations):
        ids += i
        mask += m
        docs += [d] * len(i)
        pos += list(range(len(i)))
    return {"input_ids": ids, "loss_mask": mask, "document_ids": docs, "position_ids": pos, "row_index": index}


def test_packed_dataset_and_collator_match_brute_force():
    rng = random.Random(1)
    convs = []
    for _ in range(40):
        n = rng.randint(2, 30)
        convs.append(([rng.randrange(1000) for _ in range(n)], [rng.randint(0, 1) for _ in range(n)]))
    ds = datasets.Dataset.from_dict(
        {"input_ids": [c[0] for c in convs], "loss_mask": [c[1] for c in convs], "length": [len(c[0]) for c in convs]}
    )
    rows = pack_conversations(ds["length"], 64, seed=0)
    packed = PackedDataset(ds, rows)
    assert len(packed) == len(rows)
    items = [packed[i] for i in range(len(packed))]
    for i, item in enumerate(items):
        ref = reference_row([convs[j] for j in rows[i]], i)
        assert {k: v.tolist() for k, v in item.items()} == ref
        assert all(v.dtype == torch.long for v in item.values())
        assert packed.row_lengths[i] == len(ref["input_ids"])

    collate = DSparkCollator(pad_token_id=7, pad_to_multiple_of=8)
    batch = collate(items[:5])
    width = max(len(it["input_ids"]) for it in items[:5])
    width = -(-width // 8) * 8
    assert set(batch) == {"input_ids", "loss_mask", "document_ids", "position_ids", "row_index"}
    assert batch["row_index"].tolist() == [0, 1, 2, 3, 4]
    for r, item in enumerate(items[:5]):
        n = len(item["input_ids"])
        pad = width - n
        assert batch["input_ids"][r].tolist() == item["input_ids"].tolist() + [7] * pad
        assert batch["loss_mask"][r].tolist() == item["loss_mask"].tolist() + [0] * pad
        assert batch["document_ids"][r].tolist() == item["document_ids"].tolist() + [-1] * pad
        assert batch["position_ids"][r].tolist() == item["position_ids"].tolist() + [0] * pad
    assert DSparkCollator(0, pad_to_multiple_of=None)(items[:1])["input_ids"].shape == (1, len(items[0]["input_ids"]))


def test_packed_rows_from_real_prepared_data(tokenizer):
    ds = datasets.Dataset.from_list([{"messages": MULTI_TURN}, *chat_rows(6)])
    prepared, stats = prepare_conversations(ds, tokenizer, 128)
    rows = pack_conversations(prepared["length"], 128, seed=0)
    packed = PackedDataset(prepared, rows)
    assert sum(packed.row_lengths) == stats.total_tokens
    batch = DSparkCollator(tokenizer.pad_token_id)([packed[i] for i in range(len(packed))])
    assert int(batch["loss_mask"].sum()) == stats.supervised_tokens
    assert int((batch["document_ids"] >= 0).sum()) == stats.total_tokens
    for i in range(len(packed)):  # brute force: each conversation of a row starts again at position 0
        item, expected = packed[i], []
        for conversation in rows[i]:
            expected += list(range(prepared[conversation]["length"]))
        assert item["position_ids"].tolist() == expected
        assert item["input_ids"].tolist() == [t for c in rows[i] for t in prepared[c]["input_ids"]]


def test_supervised_token_counts_match_counter():
    rng = random.Random(2)
    ids = [[rng.randrange(50) for _ in range(rng.randint(1, 20))] for _ in range(30)]
    masks = [[rng.randint(0, 1) for _ in row] for row in ids]
    ds = datasets.Dataset.from_dict({"input_ids": ids, "loss_mask": masks})
    counts = supervised_token_counts(ds, vocab_size=64, batch_size=7)
    expected = Counter(t for row, m in zip(ids, masks) for t, keep in zip(row, m) if keep)
    assert counts.dtype == torch.long and counts.shape == (64,)
    assert counts.tolist() == [expected.get(t, 0) for t in range(64)]
    with pytest.raises(ValueError, match="outside the vocabulary of size 10"):
        supervised_token_counts(ds, vocab_size=10)


def test_prep_stats_summary_is_one_line():
    stats = PrepStats(total=3, kept=2, empty=1, total_tokens=100, supervised_tokens=25)
    assert "\n" not in stats.summary() and "kept 2/3" in stats.summary() and "25.0%" in stats.summary()


def test_packed_dataset_over_a_split_and_after_pickling(tokenizer):
    ds = datasets.Dataset.from_list(chat_rows(20))
    prepared, _ = prepare_conversations(ds, tokenizer, 128)
    train, _ = split_train_validation(prepared, 0.25, seed=0)  # a view with an indices mapping
    rows = pack_conversations(list(train["length"]), 96, seed=0)
    packed = pickle.loads(pickle.dumps(PackedDataset(train, rows)))  # DataLoader workers receive a pickled copy
    for i, row in enumerate(rows):
        convs = [(train[j]["input_ids"], train[j]["loss_mask"]) for j in row]
        assert {k: v.tolist() for k, v in packed[i].items()} == reference_row(convs, i)
