"""Acceptance evaluation: the `dspark_acceptance` evaluate metric, the results module, prompt-set layout and the
in-process backend."""

import json
import random

import evaluate
import pytest

from tiny import tiny_drafter
from trainer.errors import UsageError
from trainer.evaluation.in_process import evaluate_in_process
from trainer.evaluation.prompts import load_prompt_sets
from trainer.evaluation.results import (
    ACCEPTANCE_METRIC,
    DRAFT_METHODS,
    SCHEMA,
    SUBSETS,
    AcceptanceStats,
    ResultsError,
    format_table,
    ordered,
    read_results,
    reduce,
    summarize,
    write_results,
)


def test_metrics_against_hand_computed_values():
    s = AcceptanceStats(block_size=3)
    s.add([1, 4, 2], generated_tokens=8, seconds=2.0)
    s.add([3], generated_tokens=3, seconds=1.0)
    d = reduce({"x": s}, 3)["subsets"]["x"]
    assert d["acceptance_length"] == pytest.approx((1 + 4 + 2 + 3) / 4)
    # pos_k: share of steps accepting at least k+1 drafts (committed - 1 >= k + 1)
    assert d["pos"] == pytest.approx([3 / 4, 2 / 4, 1 / 4])
    assert d["steps"] == 4 and d["prompts"] == 2 and d["tokens_per_s"] == pytest.approx(11 / 3)
    assert d["acceptance_length"] == pytest.approx(1 + sum(d["pos"]))  # the two views agree
    with pytest.raises(ValueError, match="committed 5 tokens, outside 1..4"):
        s.add([5], 5, 1.0)


def test_evaluate_metric_matches_brute_force_per_subset_and_overall():
    """The evaluate module against a direct float reference: per-subset mean and pos_k, the weighted mean is the
    mean over all steps, the unweighted one the mean of subset means; listed subsets without steps are null."""
    rng = random.Random(3)
    B = 5
    committed = [rng.randint(1, B + 1) for _ in range(400)]
    names = [rng.choice(["qa", "rag", "writing"]) for _ in committed]
    out = evaluate.load(ACCEPTANCE_METRIC).compute(committed=committed, subset=names, block_size=B,
                                                   subsets=["qa", "rag", "writing", "empty"])
    for name in ("qa", "rag", "writing"):
        mine = [c for c, n in zip(committed, names) if n == name]
        got = out["subsets"][name]
        assert got["steps"] == len(mine) and got["acceptance_length"] == pytest.approx(sum(mine) / len(mine))
        assert got["pos"] == pytest.approx([sum(1 for c in mine if c - 1 > k) / len(mine) for k in range(B)])
    assert out["subsets"]["empty"] == {"acceptance_length": None, "pos": [None] * B, "steps": 0}
    assert out["weighted_acceptance_length"] == pytest.approx(sum(committed) / len(committed))
    means = [out["subsets"][n]["acceptance_length"] for n in ("qa", "rag", "writing")]
    assert out["unweighted_acceptance_length"] == pytest.approx(sum(means) / 3) and out["total_steps"] == 400
    with pytest.raises(ValueError, match="committed 7 tokens, outside 1..6"):
        evaluate.load(ACCEPTANCE_METRIC).compute(committed=[7], subset=["qa"], block_size=B)


def test_results_round_trip_through_the_reader(tmp_path):
    """What the writer writes, the reader (the model card's only source) reads back, in the canonical order."""
    stats = {name: AcceptanceStats(block_size=2) for name in ("qa", "my_subset", "math_reasoning")}
    stats["qa"].add([1, 3, 2], 5, 1.0)
    stats["my_subset"].add([2], 1, 1.0)
    stats["math_reasoning"].add([3, 3], 5, 1.0)
    from trainer.evaluation.results import build_results

    results = build_results(stats, backend="transformers", block_size=2, sampling={"temperature": 0.0},
                            max_new_tokens=8)
    write_results(results, str(tmp_path / "r.json"))
    read = read_results(tmp_path / "r.json", block_size=2)
    assert [s.name for s in read.subsets] == ["math_reasoning", "qa", "my_subset"]
    assert [s.name for s in read.subsets][:2] == [n for n, _ in ordered(results["subsets"])][:2]
    assert read.weighted == pytest.approx((6 + 6 + 2) / 6) and read.total_steps == 6 and read.greedy
    assert read.subsets[1].pos == pytest.approx([2 / 3, 1 / 3])
    with pytest.raises(ResultsError, match="measured with block size 2 but this drafter has block size 4"):
        read_results(tmp_path / "r.json", block_size=4)
    assert SUBSETS[0] == "math_reasoning" and len(SUBSETS) == 9


def test_weighted_and_unweighted_means():
    subsets = {"a": {"acceptance_length": 2.0, "steps": 30}, "b": {"acceptance_length": 4.0, "steps": 10},
               "c": {"acceptance_length": None, "steps": 0}}
    out = summarize(subsets)
    assert out["weighted_acceptance_length"] == pytest.approx((2 * 30 + 4 * 10) / 40)
    assert out["unweighted_acceptance_length"] == pytest.approx(3.0) and out["total_steps"] == 40


def test_prompt_sets_in_the_benchmark_layout(tmp_path):
    for name, prompts in (("qa", ["a?", "b?", "c?"]), ("writing", ["w"])):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    sets = load_prompt_sets(str(tmp_path), limit=2)
    assert sets == {"qa": ["a?", "b?"], "writing": ["w"]}
    with pytest.raises(UsageError, match="rag.jsonl does not exist"):
        load_prompt_sets(str(tmp_path), ["rag"])
    # a user's own subset is read too, after the benchmark's, unless --subsets names others
    (tmp_path / "support.jsonl").write_text(json.dumps({"prompt": "s?"}) + "\n")
    sets = load_prompt_sets(str(tmp_path))
    assert list(sets) == ["writing", "qa", "support"] and sets["support"] == ["s?"]
    assert list(load_prompt_sets(str(tmp_path), ["qa"])) == ["qa"]


def test_bundled_heldout_set_has_the_nine_subsets():
    import os

    sets = load_prompt_sets(os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__)))), "data", "demo", "heldout"))
    assert len(sets) == 9 and all(len(v) == 10 for v in sets.values())


def test_in_process_backend_writes_the_shared_schema(chat_verifier_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    verifier = AutoModelForCausalLM.from_pretrained(chat_verifier_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(chat_verifier_dir)
    drafter = tiny_drafter(verifier, draft_vocab_size=None, mask_token_id=0)
    prompts = {"qa": ["What is 2+2?", "Name a colour."], "writing": ["Write a haiku."]}
    results = evaluate_in_process(drafter, verifier, tokenizer, prompts, max_new_tokens=12, temperature=0,
                                  throughput=True, progress=False)
    assert results["schema"] == SCHEMA and results["block_size"] == 4 and results["sampling"] == {"temperature": 0.0}
    assert results["draft_method"] == "greedy"
    for name in prompts:
        sub = results["subsets"][name]
        assert sub["prompts"] == len(prompts[name]) and sub["steps"] >= 1
        assert 1.0 <= sub["acceptance_length"] <= 5.0 and len(sub["pos"]) == 4
        assert sub["baseline_tokens_per_s"] > 0 and sub["speedup"] > 0
    again = evaluate_in_process(drafter, verifier, tokenizer, prompts, max_new_tokens=12, temperature=0,
                                throughput=True, throughput_prompts=1, progress=False)
    # the baseline is timed on the first prompt of each subset only, and the speedup uses those same prompts
    assert "speedup" in again["subsets"]["qa"] and again["subsets"]["qa"]["tokens_per_s"] > 0
    for sub in again["subsets"].values():  # the speedup is the ratio of the two numbers the table shows for it
        assert sub["speedup"] == pytest.approx(sub["paired_tokens_per_s"] / sub["baseline_tokens_per_s"])
    row = next(line for line in format_table(again).splitlines() if line.startswith("| qa |"))
    paired, base, speedup = (c.strip() for c in row.strip("|").split("|")[-3:])
    assert "tokens/s, baseline's prompts" in format_table(again)
    assert float(speedup.rstrip("x")) == pytest.approx(float(paired) / float(base), abs=0.01 + 0.06 * float(paired) / float(base))
    assert again["subsets"]["qa"]["acceptance_length"] == results["subsets"]["qa"]["acceptance_length"]
    table = write_results({**results, "drafter": "d", "verifier": "v"}, str(tmp_path / "r.json"))
    assert json.loads((tmp_path / "r.json").read_text())["subsets"]["qa"]["steps"] == results["subsets"]["qa"]["steps"]
    assert "| qa |" in table and "Weighted mean acceptance length" in table
    assert (tmp_path / "r.md").read_text().strip() == format_table(results).strip()


def test_fidelity_fields_round_trip_and_older_files_still_read(tmp_path):
    """The fidelity check's fields go through the builder, writer, reader and table; a subset that was not
    checked reads as None, and a file written before the check existed reads unchanged."""
    from trainer.evaluation.results import build_results

    stats = {name: AcceptanceStats(block_size=2) for name in ("qa", "rag")}
    stats["qa"].add([1, 3, 3], 6, 1.0)
    stats["qa"].add_fidelity([1, 3], [1, 3])  # the last step was cut: not compared
    stats["rag"].add([2, 2], 3, 1.0)  # not checked (e.g. sampled)
    with pytest.raises(ValueError, match="a compared acceptance of 4 is outside 1..3"):
        stats["rag"].add_fidelity([4], [2])
    with pytest.raises(ValueError, match="2 teacher-forced values for 1 measured steps"):
        stats["rag"].add_fidelity([2, 2], [2])
    results = build_results(stats, backend="transformers", block_size=2, sampling={"temperature": 0.0},
                            max_new_tokens=8)
    qa, rag = results["subsets"]["qa"], results["subsets"]["rag"]
    assert (qa["teacher_forced_acceptance_length"], qa["fidelity_steps"], qa["fidelity_steps_differing"]) == (2.0, 2, 0)
    assert qa["measured_acceptance_length_compared"] == 2.0  # over the compared steps, as the teacher-forced one
    assert qa["acceptance_length"] == pytest.approx(7 / 3)  # over every step
    assert rag["teacher_forced_acceptance_length"] is rag["fidelity_steps"] is rag["fidelity_steps_differing"] is None
    assert rag["measured_acceptance_length_compared"] is None
    table = write_results(results, str(tmp_path / "r.json"))
    assert ("measured_acceptance_length_compared | teacher_forced_acceptance_length | fidelity_steps_differing |"
            in table.splitlines()[0])
    assert "| 3 | 2.000 | 2.000 | 0 of 2 |" in table and "| 2 | - | - | - |" in table  # steps, then the check
    assert "0 of 2 compared verification steps differ" in table
    read = {s.name: s for s in read_results(tmp_path / "r.json", block_size=2).subsets}
    assert (read["qa"].teacher_forced_acceptance_length, read["qa"].fidelity_steps,
            read["qa"].fidelity_steps_differing) == (2.0, 2, 0)
    assert read["rag"].teacher_forced_acceptance_length is None and read["rag"].fidelity_steps_differing is None

    older = json.loads((tmp_path / "r.json").read_text())
    for sub in older["subsets"].values():
        for key in ("teacher_forced_acceptance_length", "measured_acceptance_length_compared", "fidelity_steps",
                    "fidelity_steps_differing"):
            sub.pop(key)
    (tmp_path / "old.json").write_text(json.dumps(older))
    old = read_results(tmp_path / "old.json", block_size=2)
    assert [s.fidelity_steps for s in old.subsets] == [None, None] and old.weighted == pytest.approx(11 / 5)
    assert "teacher_forced" not in format_table(older) and "Fidelity" not in format_table(older)
    older["subsets"]["qa"]["fidelity_steps_differing"] = 1.5
    (tmp_path / "bad.json").write_text(json.dumps(older))
    with pytest.raises(ResultsError, match="subsets.qa.fidelity_steps_differing is 1.5, not a finite integer"):
        read_results(tmp_path / "bad.json", block_size=2)


def test_cli_fidelity_check_flag(chat_verifier_dir, tmp_path):
    """`--temperature 0` records the fidelity check; `--no-fidelity-check` records null."""
    from transformers import AutoModelForCausalLM

    from trainer.evaluation.in_process import main

    verifier = AutoModelForCausalLM.from_pretrained(chat_verifier_dir).eval()
    tiny_drafter(verifier, draft_vocab_size=None, mask_token_id=0).save_pretrained(tmp_path / "drafter")
    (tmp_path / "prompts").mkdir()
    (tmp_path / "prompts" / "qa.jsonl").write_text(json.dumps({"prompt": "What is 2+2?"}) + "\n")
    common = ["--drafter", str(tmp_path / "drafter"), "--verifier", chat_verifier_dir, "--prompts",
              str(tmp_path / "prompts"), "--temperature", "0", "--max-new-tokens", "6"]
    on = main([*common, "--out", str(tmp_path / "on.json")])["subsets"]["qa"]
    assert on["fidelity_steps"] >= 1 and on["fidelity_steps_differing"] == 0
    off = main([*common, "--no-fidelity-check", "--out", str(tmp_path / "off.json")])["subsets"]["qa"]
    assert off["fidelity_steps"] is None and off["teacher_forced_acceptance_length"] is None
    assert json.loads((tmp_path / "off.json").read_text())["subsets"]["qa"]["fidelity_steps_differing"] is None


def test_draft_method_is_recorded_read_and_rendered(tmp_path):
    """`draft_method` goes through the builder (normalised to greedy at T=0, refused when unknown), the table, the
    reader (title, short label) and the card's heading and setup line; files written before it existed read as
    what their backend drafted then: greedy at T=0, filtered in-process at T>0, greedy from a vLLM server."""
    import modeling_dspark
    from trainer.evaluation.results import build_results
    from trainer.export.card_sections import _drafts_line, _heading

    assert DRAFT_METHODS is modeling_dspark.DRAFT_METHODS  # one definition, the remote code's
    stats = {"qa": AcceptanceStats(block_size=2)}
    stats["qa"].add([1, 3, 2], 5, 1.0)
    t1 = {"temperature": 1.0, "top_p": 0.9, "top_k": None}

    def written(name, **kw) -> dict:
        results = build_results(stats, backend="transformers", block_size=2, max_new_tokens=8, **kw)
        write_results(results, str(tmp_path / f"{name}.json"))
        return results

    expected = {"greedy": "greedy drafts as vLLM serves by default",
                "probabilistic": "probabilistic drafts (temperature only) as vLLM samples them",
                "filtered": "top-k/top-p-filtered drafts, not what vLLM serves"}
    for method in DRAFT_METHODS:
        assert written(method, sampling=t1, draft_method=method)["draft_method"] == method
        assert f"Drafts: {method}, " in (tmp_path / f"{method}.md").read_text()
        r = read_results(tmp_path / f"{method}.json", block_size=2)
        assert (r.draft_method, r.draft_method_recorded) == (method, True)
        assert r.title == f"Sampling: temperature 1.0, top_p 0.9; {method} drafts"
        assert r.short == f"T=1.0, top_p=0.9, {method} drafts"
        assert _heading(r) == f"Acceptance (in-process; T = 1, top_p 0.9; {expected[method]})"
        assert _drafts_line(r).startswith(f"- Drafts: {method}, ") and "inferred" not in _drafts_line(r)
    assert written("t0", sampling={"temperature": 0.0}, draft_method="probabilistic")["draft_method"] == "greedy"
    r = read_results(tmp_path / "t0.json", block_size=2)
    assert (r.draft_method, r.title, r.short) == ("greedy", "Greedy decoding (temperature 0)", "greedy")
    assert _heading(r) == "Acceptance (in-process; T = 0: greedy decoding and greedy drafts)"
    assert "draft_method" not in written("unknown", sampling=t1)  # not known at T > 0: left out, not guessed
    with pytest.raises(ValueError, match="draft method 'sampled' is not one of greedy, probabilistic, filtered"):
        build_results(stats, backend="transformers", block_size=2, max_new_tokens=8, sampling=t1,
                      draft_method="sampled")

    older = json.loads((tmp_path / "filtered.json").read_text())
    older.pop("draft_method")
    for name, sampling, backend, method in (("old-t1", t1, "transformers", "filtered"),
                                            ("old-t0", {"temperature": 0.0}, "transformers", "greedy"),
                                            ("old-vllm", t1, "vllm", "greedy")):
        (tmp_path / f"{name}.json").write_text(json.dumps({**older, "sampling": sampling, "backend": backend}))
        r = read_results(tmp_path / f"{name}.json", block_size=2)
        assert (r.draft_method, r.draft_method_recorded) == (method, False), name
        assert "inferred from its backend and temperature" in _drafts_line(r), name
    assert _heading(read_results(tmp_path / "old-vllm.json", block_size=2)) == \
        f"Acceptance (vLLM server; T = 1, top_p 0.9; {expected['greedy']})"
    (tmp_path / "bad.json").write_text(json.dumps({**older, "draft_method": "argmax"}))
    with pytest.raises(ResultsError, match="record draft_method 'argmax', not one of greedy, probabilistic, filtered"):
        read_results(tmp_path / "bad.json", block_size=2)


def test_cli_draft_method_at_temperature_1(chat_verifier_dir, tmp_path, monkeypatch):
    """`--draft-method` reaches every `draft()` call and the results file, for each method at T=1 (the held-out
    comparison of the three); at T=0 any method is recorded as greedy."""
    from transformers import AutoModelForCausalLM

    from modeling_dspark import DSparkDraftModel
    from trainer.evaluation.in_process import main

    verifier = AutoModelForCausalLM.from_pretrained(chat_verifier_dir).eval()
    tiny_drafter(verifier, draft_vocab_size=None, mask_token_id=0).save_pretrained(tmp_path / "drafter")
    (tmp_path / "prompts").mkdir()
    (tmp_path / "prompts" / "qa.jsonl").write_text(json.dumps({"prompt": "What is 2+2?"}) + "\n")
    seen = []
    real = DSparkDraftModel.draft

    def spy(self, *args, **kwargs):
        seen.append(kwargs.get("draft_method"))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(DSparkDraftModel, "draft", spy)
    common = ["--drafter", str(tmp_path / "drafter"), "--verifier", chat_verifier_dir, "--prompts",
              str(tmp_path / "prompts"), "--max-new-tokens", "6"]
    for method in DRAFT_METHODS:
        seen.clear()
        out = tmp_path / f"{method}.json"
        results = main([*common, "--temperature", "1", "--draft-method", method, "--out", str(out)])
        assert results["draft_method"] == method and json.loads(out.read_text())["draft_method"] == method
        assert results["sampling"]["temperature"] == 1.0 and results["subsets"]["qa"]["fidelity_steps"] is None
        assert seen and set(seen) == {method}
    greedy = main([*common, "--temperature", "0", "--draft-method", "probabilistic", "--out", str(tmp_path / "g.json")])
    assert greedy["draft_method"] == "greedy"
    with pytest.raises(UsageError, match="argument --draft-method: invalid choice: 'sampled'"):
        main([*common, "--draft-method", "sampled", "--out", str(tmp_path / "x.json")])


def test_evaluate_reads_a_run_selector_as_push_to_hub_does(tmp_path):
    """`--drafter OUT:best` names what `push_to_hub.py --checkpoint OUT:best` names; other values pass through."""
    from trainer.evaluation.in_process import run_selection
    from trainer.train.checkpoints import CheckpointError

    run = tmp_path / "run"
    run.mkdir()
    with pytest.raises(CheckpointError, match="has no checkpoint-best"):
        run_selection(f"{run}:best")
    assert run_selection(str(run)) == str(run)
    assert run_selection("me/my-drafter") == "me/my-drafter"
    assert run_selection(f"{tmp_path}/missing:best") == f"{tmp_path}/missing:best"  # resolve_pretrained refuses it
