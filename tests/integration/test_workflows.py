"""The README's workflow for a user's own data, end to end through the user-facing commands only (each in its own
process, exactly as a user types it): regenerate the replies with the verifier, train a drafter on them, measure
it on held-out prompts, and stage the Hub repo with its model card (`--dry-run`, no network)."""

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from huggingface_hub import ModelCard
from safetensors.torch import load_file

from tiny import TINY_RUN
from trainer.train.checkpoints import COMPLETE_MARKER, DATA_STATS_FILE, SUMMARY_FILE

ROOT = Path(__file__).resolve().parents[2]
VERIFIER = "HuggingFaceTB/SmolLM2-135M-Instruct"
BLOCK = 4  # TINY_RUN's --block_size
STEPS = 30

# A user's own chat data: rows in `messages` form (one with a system prompt) and one ShareGPT row, with replies
# that are not the verifier's (regeneration replaces them).
USER_PROMPTS = [
    "What is the capital of France?", "Give me three tips for better sleep.",
    "Write a Python function that adds two numbers.", "What is 12 times 7?", "Translate 'good morning' into Spanish.",
    "Summarize the water cycle in two sentences.", "Name three planets in our solar system.",
    "How do I boil an egg?", "What is photosynthesis?", "Count from 1 to 30.", "List the days of the week.",
]
SHAREGPT_PROMPT = "Why is the sky blue?"
OLD_REPLY = "(an answer written by someone else)"
HELDOUT = {"qa": ["What is the capital of Italy?", "How many legs does a spider have?"],
           "math_reasoning": ["Count from 1 to 20."]}


def write_user_data(directory: Path) -> tuple[Path, Path]:
    """The user's chat JSONL and held-out prompt directory (one `<subset>.jsonl` per subset, a `prompt` per line)."""
    chats = directory / "my_chats.jsonl"
    with open(chats, "w") as f:
        for i, prompt in enumerate(USER_PROMPTS):
            system = [{"role": "system", "content": "You are a helpful assistant."}] if i == 0 else []
            turns = [{"role": "user", "content": prompt}, {"role": "assistant", "content": OLD_REPLY}]
            f.write(json.dumps({"messages": system + turns}) + "\n")
        f.write(json.dumps({"conversations": [{"from": "human", "value": SHAREGPT_PROMPT},
                                              {"from": "gpt", "value": OLD_REPLY}]}) + "\n")
    heldout = directory / "heldout"
    heldout.mkdir()
    for subset, prompts in HELDOUT.items():
        (heldout / f"{subset}.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    return chats, heldout


def run(*args: str | Path) -> subprocess.CompletedProcess:
    """One user-facing command from the package root, offline, on one thread (two threads on a shared 2-core
    machine oversubscribe it: 3x slower, same numbers)."""
    cmd = [sys.executable, *map(str, args)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (f"`{shlex.join(cmd)}` exited with {proc.returncode}:\n"
                                  f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


def card_table(body: str, header: str) -> dict[str, list[str]]:
    """The rows of the Markdown table whose header line starts with `header`, by first cell."""
    lines = body.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    rows = {}
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows[cells[0]] = cells[1:]
    return rows


def assert_card_shows(card: ModelCard, results: dict) -> None:
    """The model card carries the measured numbers: in its metadata (model-index) and in its body's tables."""
    subsets = results["subsets"]
    assert card.data.base_model == VERIFIER
    # model-index: one acceptance length per subset and the weighted mean (4 decimals)
    indexed = {r.dataset_config: r.metric_value for r in card.data.eval_results}
    assert indexed == {**{n: pytest.approx(s["acceptance_length"], abs=5e-5) for n, s in subsets.items()},
                       None: pytest.approx(results["weighted_acceptance_length"], abs=5e-5)}
    # the body's per-subset table, the weighted mean with its step count, and the fidelity table
    table = card_table(card.text, "| subset | acceptance_length | pos_0 |")
    assert table == {n: [f"{s['acceptance_length']:.3f}", *(f"{100 * p:.1f}%" for p in s["pos"])]
                     for n, s in subsets.items()}
    mean = re.search(r"Weighted across all subsets: ([\d.]+) over ([\d,]+) verification steps", card.text)
    assert mean and (mean[1], mean[2]) == (f"{results['weighted_acceptance_length']:.3f}",
                                           f"{results['total_steps']:,}")
    fidelity = card_table(card.text, "| subset | steps compared |")
    assert {n: row[-1] for n, row in fidelity.items()} == {n: str(s["fidelity_steps_differing"])
                                                         for n, s in subsets.items()}


@pytest.mark.slow
def test_own_data_regenerate_train_evaluate_publish(smollm2_dir, tmp_path):
    chats, heldout = write_user_data(tmp_path)
    data, out, results_file, staged = (tmp_path / "train.jsonl", tmp_path / "my-drafter",
                                       tmp_path / "results" / "greedy.json", tmp_path / "exported")

    # 1. The replies become the verifier's own; both row formats are read.
    run("-m", "trainer", "regenerate", "--verifier", VERIFIER, "--prompts", chats, "--out", data,
        "--temperature", "0", "--max-new-tokens", "48")
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    assert [r["messages"][-2]["content"] for r in rows] == [*USER_PROMPTS, SHAREGPT_PROMPT]
    assert rows[0]["messages"][0] == {"role": "system", "content": "You are a helpful assistant."}
    replies = [r["messages"][-1] for r in rows]
    assert all(m["role"] == "assistant" and m["content"].strip() and m["content"] != OLD_REPLY for m in replies)

    # 2. Train a tiny drafter on them with the small-model recipe.
    run("trainer/run.py", "--config", "configs/smollm2-135m.yaml", "--train_data", data, "--output_dir", out,
        *TINY_RUN, "--max_steps", str(STEPS), "--eval_steps", "15", "--eval_at_start", "false",
        "--learning_rate", "1e-2")  # TINY_RUN's 3e-3 learns too little in 30 steps to accept a draft
    summary = json.loads((out / SUMMARY_FILE).read_text())
    assert summary["global_step"] == STEPS
    best = out / "checkpoint-best"
    assert best.resolve() == Path(summary["best_checkpoint"]).resolve()
    assert json.loads((best / COMPLETE_MARKER).read_text())["complete"] is True
    stats = json.loads((out / DATA_STATS_FILE).read_text())
    assert stats["total"] == stats["kept"] == len(USER_PROMPTS) + 1  # no row, the ShareGPT one included, was lost
    assert stats["validation_conversations"] >= 1

    # 3. Measure it on the held-out prompts by speculating at T = 0.
    run("-m", "trainer", "evaluate", "--drafter", f"{out}:best", "--prompts", heldout, "--temperature", "0",
        "--max-new-tokens", "24", "--out", results_file)
    results = json.loads(results_file.read_text())
    assert results["schema"] == "dspark-acceptance/1" and results["block_size"] == BLOCK
    assert results["sampling"]["temperature"] == 0 and results["verifier"] == VERIFIER
    subsets = results["subsets"]
    assert set(subsets) == set(HELDOUT)
    for name, s in subsets.items():
        assert s["prompts"] == len(HELDOUT[name]) and s["steps"] > 0
        assert 1.0 <= s["acceptance_length"] <= BLOCK + 1
        # tokens per step = 1 + accepted drafts, and pos_k = P(at least k+1 accepted)
        assert s["acceptance_length"] == pytest.approx(1 + sum(s["pos"]))
        # the training forward, teacher-forced on what was generated, predicts every step's acceptance (fp32)
        assert s["fidelity_steps"] >= s["steps"] - s["prompts"] and s["fidelity_steps_differing"] == 0
        assert s["teacher_forced_acceptance_length"] == pytest.approx(s["measured_acceptance_length_compared"])
    total = sum(s["steps"] for s in subsets.values())
    assert results["total_steps"] == total
    assert results["weighted_acceptance_length"] == pytest.approx(
        sum(s["acceptance_length"] * s["steps"] for s in subsets.values()) / total)
    # the drafter learned to predict the verifier: some drafts were accepted (an untrained one gives exactly 1.0)
    assert results["weighted_acceptance_length"] > 1.0
    assert results_file.with_suffix(".md").exists()

    # 4. Stage the Hub repo with its card; nothing leaves the machine.
    proc = run("push_to_hub.py", "--checkpoint", f"{out}:best", "--repo-id", "me/my-drafter", "--verifier-id", VERIFIER,
               "--eval-results", results_file, "--dry-run", staged)
    assert "nothing was uploaded" in proc.stdout
    assert {p.relative_to(staged).as_posix() for p in staged.rglob("*") if p.is_file()} == {
        "config.json", "model.safetensors", "configuration_dspark.py", "modeling_dspark.py",
        "custom_generate/generate.py", "README.md", "acceptance_per_position.png", "confidence_reliability.png"}
    config = json.loads((staged / "config.json").read_text())
    assert config["speculators_config"]["verifier"]["name_or_path"] == VERIFIER
    assert not config.get("verifier_local_path")
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == BLOCK
    exported, trained = load_file(staged / "model.safetensors"), load_file(best / "model.safetensors")
    assert set(exported) == set(trained)
    for name, tensor in exported.items():  # the checkpoint's weights, in bf16 (the vocabulary maps keep their dtype)
        expected = trained[name] if not trained[name].is_floating_point() else trained[name].to(torch.bfloat16)
        assert tensor.dtype == expected.dtype and torch.equal(tensor, expected), name
    assert_card_shows(ModelCard.load(staged / "README.md"), results)
