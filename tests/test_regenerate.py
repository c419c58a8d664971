"""Response regeneration by the verifier: output schema, the verifier's own greedy text, and resumption."""

import json

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from trainer.regenerate import regenerate


def test_regenerates_with_the_verifier_and_resumes(chat_verifier_dir, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    rows = [{"id": "a", "subset": "qa", "split": "train", "prompt": "Name a colour."},
            {"id": "b", "subset": "qa", "split": "heldout", "prompt": "Name a fruit."},
            {"id": "c", "split": "train", "messages": [{"role": "user", "content": "Hi"},
                                                       {"role": "assistant", "content": "old answer"}]}]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out" / "conversations.jsonl"
    result = regenerate(chat_verifier_dir, str(prompts), str(out), split="train", max_new_tokens=6, batch_size=2,
                        temperature=0)
    assert result["written"] == 2 and result["skipped_existing"] == 0
    written = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert set(written) == {"a", "c"} and written["a"]["subset"] == "qa"
    assert [m["role"] for m in written["c"]["messages"]] == ["user", "assistant"]
    assert written["c"]["messages"][1]["content"] != "old answer"  # the old reply was replaced by the verifier's
    # the reply is the verifier's own greedy continuation
    tokenizer = AutoTokenizer.from_pretrained(chat_verifier_dir)
    model = AutoModelForCausalLM.from_pretrained(chat_verifier_dir).eval()
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "Name a colour."}], add_generation_prompt=True,
                                        return_tensors="pt", return_dict=True)["input_ids"]
    with torch.no_grad():
        greedy = model.generate(ids, max_new_tokens=6, do_sample=False, temperature=None, top_p=None, top_k=None)
    expected = tokenizer.decode(greedy[0, ids.shape[1]:], skip_special_tokens=True).strip()
    assert written["a"]["messages"][1]["content"] == expected
    again = regenerate(chat_verifier_dir, str(prompts), str(out), split="train", max_new_tokens=6, temperature=0)
    assert again["written"] == 0 and again["skipped_existing"] == 2  # nothing finished is redone or lost
    assert len(out.read_text().splitlines()) == 2
