"""Response regeneration by the verifier: output schema, the verifier's own greedy text turn by turn, resumption,
order-preserving output, the summary counts, and the vLLM backend's client (server checks, retries, failures,
what each request sends) against a closed port and a scripted stand-in server. Real vLLM servers:
tests/vllm/test_vllm_regenerate.py."""

import json
import socket
import threading

import pytest
import torch
from stand_in import StandIn
from transformers import AutoModelForCausalLM, AutoTokenizer

from trainer.data.regenerate import main, regenerate
from trainer.data.replies import OrderedWriter, conversation_record, conversation_turns, request_seed, turn_messages
from trainer.errors import DSparkError, UsageError, run_cli
from trainer.serving.http import VLLMServerError


def user(text):
    return {"role": "user", "content": text}


def assistant(text):
    return {"role": "assistant", "content": text}


SYSTEM = {"role": "system", "content": "You are concise."}


def write_rows(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def greedy(model, tokenizer, messages, max_new_tokens):
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                        return_dict=True)["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, temperature=None, top_p=None,
                             top_k=None)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip()


def test_regenerates_with_the_verifier_and_resumes(chat_verifier_dir, tmp_path):
    rows = [{"id": "a", "subset": "qa", "split": "train", "prompt": "Name a colour."},
            {"id": "b", "subset": "qa", "split": "heldout", "prompt": "Name a fruit."},
            {"id": "c", "split": "train", "messages": [user("Hi"), assistant("old answer")]}]
    prompts = write_rows(tmp_path / "prompts.jsonl", rows)
    out = tmp_path / "out" / "conversations.jsonl"
    result = regenerate(chat_verifier_dir, prompts, str(out), split="train", max_new_tokens=6, batch_size=2,
                        temperature=0)
    assert result["written"] == 2 and result["skipped_existing"] == 0 and result["failed"] == 0
    written = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in written] == ["a", "c"] and written[0]["subset"] == "qa"  # input order
    assert [m["role"] for m in written[1]["messages"]] == ["user", "assistant"]
    assert written[1]["messages"][1]["content"] != "old answer"  # the old reply was replaced by the verifier's
    # the reply is the verifier's own greedy continuation
    tokenizer = AutoTokenizer.from_pretrained(chat_verifier_dir)
    model = AutoModelForCausalLM.from_pretrained(chat_verifier_dir).eval()
    assert written[0]["messages"][1]["content"] == greedy(model, tokenizer, [user("Name a colour.")], 6)
    again = regenerate(chat_verifier_dir, prompts, str(out), split="train", max_new_tokens=6, temperature=0)
    assert again["written"] == 0 and again["skipped_existing"] == 2  # nothing finished is redone or lost
    assert again["turns"] == again["new_tokens"] == 0
    assert len(out.read_text().splitlines()) == 2


def test_turns_of_a_conversation():
    # every assistant reply is a turn to regenerate; the trailing user turn asks for one more
    assert conversation_turns([SYSTEM, user("u1"), assistant("a1"), user("u2"), assistant("a2")]) == \
        [[SYSTEM, user("u1")], [user("u2")]]
    assert conversation_turns([user("u1"), assistant("a1"), user("u2")]) == [[user("u1")], [user("u2")]]
    # consecutive replies are one reply; a leading assistant message is context of the first turn
    assert conversation_turns([assistant("hello"), user("u1"), assistant("a"), assistant("b")]) == \
        [[assistant("hello"), user("u1")]]
    assert conversation_turns([assistant("only")]) == [] and conversation_turns([SYSTEM]) == [[SYSTEM]]
    turns = [[SYSTEM, user("u1")], [user("u2")], [user("u3")]]
    # each request sees the regenerated replies before it, never the original ones
    assert turn_messages(turns, []) == [SYSTEM, user("u1")]
    assert turn_messages(turns, ["r1", "r2"]) == [SYSTEM, user("u1"), assistant("r1"), user("u2"), assistant("r2"),
                                                  user("u3")]
    record = conversation_record({"id": "x", "subset": "s", "turns": turns}, ["r1", "r2", "r3"])
    assert record == {"id": "x", "subset": "s", "messages": [SYSTEM, user("u1"), assistant("r1"), user("u2"),
                                                             assistant("r2"), user("u3"), assistant("r3")]}
    # per-request seeds depend on the row and the turn only
    assert request_seed(0, "x", 1) == request_seed(0, "x", 1) != request_seed(0, "x", 0) != request_seed(1, "x", 0)


def test_multi_turn_rows_are_regenerated_turn_by_turn(chat_verifier_dir, tmp_path):
    conversation = [SYSTEM, user("Name a colour."), assistant("old one"), user("And a fruit?"), assistant("old two")]
    prompts = write_rows(tmp_path / "prompts.jsonl", [{"id": "m", "messages": conversation},
                                                       {"id": "s", "prompt": "Name a city."}])
    out = tmp_path / "out.jsonl"
    result = regenerate(chat_verifier_dir, prompts, str(out), max_new_tokens=5, batch_size=2, temperature=0)
    (multi, single) = [json.loads(line) for line in out.read_text().splitlines()]
    assert [m["role"] for m in multi["messages"]] == ["system", "user", "assistant", "user", "assistant"]
    tokenizer = AutoTokenizer.from_pretrained(chat_verifier_dir)
    model = AutoModelForCausalLM.from_pretrained(chat_verifier_dir).eval()
    first = greedy(model, tokenizer, conversation[:2], 5)
    second = greedy(model, tokenizer, [*conversation[:2], assistant(first), conversation[3]], 5)
    assert multi["messages"][2]["content"] == first and multi["messages"][4]["content"] == second
    assert "old" not in first + second
    assert single["messages"][1]["content"] == greedy(model, tokenizer, [user("Name a city.")], 5)
    # the random tiny verifier never ends a turn within 5 tokens: every reply is cut and costs 5 tokens
    assert result["turns"] == 3 and result["truncated"] == 3 and result["new_tokens"] == 15
    assert result["written"] == 2 and result["tokens_per_second"] > 0 and result["backend"] == "transformers"


def test_rows_are_written_in_input_order(tmp_path):
    path = tmp_path / "rows.jsonl"
    with open(path, "w") as f:
        writer = OrderedWriter(f)
        assert writer.add(2, {"id": "2"}) == 0 and writer.add(1, None) == 0  # waiting for row 0; row 1 failed
        assert writer.add(0, {"id": "0"}) == 2  # the prefix 0, (1 skipped), 2 goes out at once
        assert writer.add(4, {"id": "4"}) == 0
        assert path.read_text().splitlines() == ['{"id": "0"}', '{"id": "2"}']
        assert writer.close() == 1  # a stopped run keeps what finished behind the gap
    assert [json.loads(x)["id"] for x in path.read_text().splitlines()] == ["0", "2", "4"] and writer.written == 3


def test_a_line_cut_by_a_kill_is_regenerated(chat_verifier_dir, tmp_path):
    prompts = write_rows(tmp_path / "prompts.jsonl", [{"id": "a", "prompt": "Name a colour."},
                                                       {"id": "b", "prompt": "Name a fruit."}])
    out = tmp_path / "out.jsonl"
    regenerate(chat_verifier_dir, prompts, str(out), max_new_tokens=4, temperature=0)
    complete = out.read_text()
    out.write_text(complete[: complete.index("\n") + 20])  # row b cut mid-line
    again = regenerate(chat_verifier_dir, prompts, str(out), max_new_tokens=4, temperature=0)
    assert again["written"] == 1 and again["skipped_existing"] == 1 and out.read_text() == complete


# ------------------------------------------------------------------------------------------ the vLLM client
def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens there once the socket is closed


def test_an_unreachable_server_is_one_sentence(tmp_path, capsys):
    prompts = write_rows(tmp_path / "prompts.jsonl", [{"id": "a", "prompt": "Hi"}])
    url = f"http://127.0.0.1:{closed_port()}"
    code = run_cli(main, ["--backend", "vllm", "--server", url, "--verifier", "HuggingFaceTB/SmolLM2-135M-Instruct",
                          "--prompts", prompts, "--out", str(tmp_path / "out.jsonl")])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == 1 and err.startswith(f"error: the vLLM server {url} is unreachable (") and "refused" in err
    assert err.endswith("start it (`vllm serve HuggingFaceTB/SmolLM2-135M-Instruct`) or fix --server.")
    assert not (tmp_path / "out.jsonl").exists()  # refused before any work
    with pytest.raises(UsageError, match="--backend vllm needs the server's URL; pass --server"):
        regenerate("x", prompts, str(tmp_path / "out.jsonl"), backend="vllm")
    with pytest.raises(UsageError, match="--server 127.0.0.1:8000 is not an http"):
        regenerate("x", prompts, str(tmp_path / "out.jsonl"), backend="vllm", server="127.0.0.1:8000")
    with pytest.raises(UsageError, match="only apply to --backend vllm"):
        regenerate("x", prompts, str(tmp_path / "out.jsonl"), server=url)


def completion(text, tokens, finish="stop"):
    return {"choices": [{"message": {"role": "assistant", "content": text}, "finish_reason": finish}],
            "usage": {"completion_tokens": tokens}}


def last_user(body):
    return body["messages"][-1]["content"]


def test_the_vllm_client_keeps_order_retries_and_counts(chat_verifier_dir, tmp_path):
    flaky, lock = {"p3": 2}, threading.Lock()  # p3 answers 503 twice, then succeeds; p5 always fails
    r7_written = threading.Event()  # set when the writer receives r7, not when the server answers it

    def answer(body):
        prompt = last_user(body)
        if prompt == "p5":
            return 500, {"error": "boom"}, 0.0
        with lock:
            if flaky.get(prompt):
                flaky[prompt] -= 1
                return 503, {"error": "busy"}, 0.0
        if prompt == "follow-up":  # the second turn sees the regenerated first reply
            assert body["messages"][-2] == assistant("reply to p0")
            return 200, completion("second reply", 3), 0.0
        if prompt == "p0":  # p0 started first but is answered only once the last row reached the writer
            assert r7_written.wait(timeout=120)
        finish = "length" if prompt == "p1" else "stop"
        return 200, completion(f" reply to {prompt} ", 8 if finish == "length" else 4, finish), 0.0

    server = StandIn(lambda path, body: answer(body))
    rows = [{"id": "r0", "messages": [user("p0"), assistant("old"), user("follow-up")]},
            *({"id": f"r{i}", "prompt": f"p{i}"} for i in range(1, 8))]
    prompts = write_rows(tmp_path / "prompts.jsonl", rows)
    out = tmp_path / "out.jsonl"
    completed, add = [], OrderedWriter.add

    def recording_add(self, index, record):
        completed.append(index)
        if index == 7:
            r7_written.set()
        return add(self, index, record)

    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(OrderedWriter, "add", recording_add)
            result = regenerate(chat_verifier_dir, prompts, str(out), backend="vllm", server=server.url + "/v1",
                                served_model_name="demo/model", max_new_tokens=8, concurrency=4, retries=2,
                                backoff=0.01, seed=7)
        assert completed.index(0) > completed.index(7)  # r0 completed after r7 ...
        written = [json.loads(line) for line in out.read_text().splitlines()]
        assert [r["id"] for r in written] == ["r0", "r1", "r2", "r3", "r4", "r6", "r7"]  # ... yet input order; r5 failed
        assert written[0]["messages"] == [user("p0"), assistant("reply to p0"), user("follow-up"),
                                          assistant("second reply")]
        assert result["written"] == 7 and result["failed"] == 1 and result["turns"] == 8 and result["truncated"] == 1
        assert result["new_tokens"] == 3 + 4 + 8 + 4 * 5 and result["retries"] == 2 + 2  # p3 twice, p5 twice
        # each request: the served name, max_tokens, temperature 0 (the tiny verifier's config does not sample:
        # vLLM would ignore do_sample), and a seed of its own row and turn
        first = next(b for b in server.bodies if last_user(b) == "p0")
        assert {k: v for k, v in first.items() if k != "messages"} == {
            "model": "demo/model", "max_tokens": 8, "temperature": 0.0, "seed": request_seed(7, "r0", 0)}
        assert result["sampling"] == {"temperature": 0.0}
        # a rerun retries only the failed row
        server.answer = lambda path, body: (200, completion("now fine", 2), 0.0)
        again = regenerate(chat_verifier_dir, prompts, str(out), backend="vllm", server=server.url,
                           served_model_name="demo/model", max_new_tokens=8, temperature=0.7, top_p=0.9)
        assert again["written"] == 1 and again["skipped_existing"] == 7 and again["failed"] == 0
        assert {k: server.bodies[-1][k] for k in ("temperature", "top_p")} == {"temperature": 0.7, "top_p": 0.9}
        assert "top_k" not in server.bodies[-1] and "seed" not in server.bodies[-1]  # only what was given
        assert json.loads(out.read_text().splitlines()[-1])["id"] == "r5"
    finally:
        server.close()


def test_the_vllm_client_stops_when_the_server_keeps_failing(chat_verifier_dir, tmp_path):
    server = StandIn(lambda path, body: (200, completion("ok", 1), 0.0) if last_user(body) == "p0" else
                     (502, {"error": "engine dead"}, 0.0))
    prompts = write_rows(tmp_path / "prompts.jsonl", [{"id": f"r{i}", "prompt": f"p{i}"} for i in range(40)])
    out = tmp_path / "out.jsonl"
    try:
        with pytest.raises(DSparkError, match=rf"^5 requests to the vLLM server {server.url} failed in a row \(last: "
                                              r"HTTP 502: .*engine dead.*\); check that the server is up"):
            regenerate(chat_verifier_dir, prompts, str(out), backend="vllm", server=server.url,
                       served_model_name="demo/model", concurrency=2, retries=1, backoff=0.01, max_failures=5)
        assert [json.loads(x)["id"] for x in out.read_text().splitlines()] == ["r0"]  # finished rows kept
        assert len(server.bodies) < 20  # stopped early, not after trying all 40 rows
        with pytest.raises(VLLMServerError, match=rf"the vLLM server {server.url} serves demo/model, not "
                                             r"HuggingFaceTB/SmolLM2-135M-Instruct; point --server at a server of "
                                             r"HuggingFaceTB/SmolLM2-135M-Instruct, or pass the name"):
            regenerate("HuggingFaceTB/SmolLM2-135M-Instruct", prompts, str(out), backend="vllm", server=server.url)
        with pytest.raises(VLLMServerError, match="serves a context of 2048 tokens, which leaves no room"):
            regenerate(chat_verifier_dir, prompts, str(out), backend="vllm", server=server.url,
                       served_model_name="demo/model", max_new_tokens=4096)
    finally:
        server.close()
