"""The model card says which draft method measured more at the verifier's sampling settings: real results files
(written by the results module's own builder and writer) read back and rendered through the card's usage section,
beside the other vLLM serving options."""

from pathlib import Path
from types import SimpleNamespace

import pytest

from trainer.evaluation.results import AcceptanceStats, build_results, read_results, with_provenance, write_results
from trainer.export.card_usage import usage_section

BLOCK = 3
T1 = {"temperature": 1.0, "top_p": 0.95, "top_k": 64}


def results_file(directory: Path, name: str, committed: dict[str, list[int]], sampling: dict,
                 draft_method: str) -> Path:
    """A results file as an evaluator writes it, from per-step committed counts per subset."""
    stats = {}
    for subset, steps in committed.items():
        stats[subset] = AcceptanceStats(BLOCK)
        stats[subset].add(steps, generated_tokens=sum(steps), seconds=1.0)
    results = build_results(stats, backend="transformers", block_size=BLOCK, sampling=sampling, max_new_tokens=64,
                            draft_method=draft_method)
    path = directory / f"{name}.json"
    write_results(with_provenance(results, str(directory / "drafter"), "org/verifier", str(directory / "heldout")),
                  str(path))
    return path


def card(paths: list[Path], tmp_path: Path) -> str:
    inputs = SimpleNamespace(repo_id="me/drafter", verifier_id="org/verifier", revision=None, run_config=None,
                             config={"block_size": BLOCK, "enable_confidence_head": False},
                             checkpoint=SimpleNamespace(path=tmp_path),
                             results=[read_results(p, BLOCK) for p in paths])
    return usage_section(inputs)


LOW = {"qa": [1, 2, 2, 3], "rag": [1, 1, 2]}  # weighted 12 / 7
HIGH = {"qa": [2, 3, 4, 4], "rag": [2, 3, 1]}  # weighted 19 / 7


@pytest.mark.parametrize("order", ["greedy first", "probabilistic first"])
def test_card_recommends_probabilistic_drafts_when_they_measured_more(tmp_path, order):
    greedy = results_file(tmp_path, "greedy", LOW, T1, "greedy")
    probabilistic = results_file(tmp_path, "probabilistic", HIGH, T1, "probabilistic")
    text = card([greedy, probabilistic] if order == "greedy first" else [probabilistic, greedy], tmp_path)
    assert ("At T = 1, top_p 0.95, top_k 64 (in-process, prompts `heldout`, up to 64 new tokens), probabilistic drafts "
            f"measured the higher weighted acceptance length: {19 / 7:.3f} against {12 / 7:.3f} with greedy drafts "
            "(vLLM's default). When serving at T > 0, consider `\"draft_sample_method\": \"probabilistic\"` in vLLM's "
            "speculative config (`--speculative-config`).") in text
    assert "greedy drafting is fine" not in text


@pytest.mark.parametrize("order", ["greedy first", "probabilistic first"])
def test_card_keeps_greedy_drafts_when_they_measured_more(tmp_path, order):
    greedy = results_file(tmp_path, "greedy", HIGH, T1, "greedy")
    probabilistic = results_file(tmp_path, "probabilistic", LOW, T1, "probabilistic")
    text = card([greedy, probabilistic] if order == "greedy first" else [probabilistic, greedy], tmp_path)
    assert ("At T = 1, top_p 0.95, top_k 64 (in-process, prompts `heldout`, up to 64 new tokens), greedy drafts "
            f"(vLLM's default) measured the higher weighted acceptance length: {19 / 7:.3f} against {12 / 7:.3f} with "
            "probabilistic drafts, so vLLM's default greedy drafting is fine when serving at T > 0 (no "
            "`draft_sample_method` to set).") in text
    assert "consider `\"draft_sample_method\"" not in text


def test_card_with_one_draft_method_says_only_that_one_was_measured(tmp_path):
    greedy = results_file(tmp_path, "greedy", LOW, T1, "greedy")
    t0 = results_file(tmp_path, "t0", HIGH, {"temperature": 0.0}, "greedy")
    text = card([t0, greedy], tmp_path)
    assert ("At T = 1, top_p 0.95, top_k 64 (in-process, prompts `heldout`, up to 64 new tokens), only greedy drafts "
            f"were measured (weighted acceptance length {12 / 7:.3f}).") in text
    assert "measured the higher" not in text and "consider `\"draft_sample_method\"" not in text
    assert "greedy drafting is fine" not in text
    # probabilistic drafts at other sampling settings are no comparison for these
    other = results_file(tmp_path, "t07", HIGH, {"temperature": 0.7}, "probabilistic")
    text = card([greedy, other], tmp_path)
    assert "only greedy drafts were measured" in text and "only probabilistic drafts were measured" in text
    assert "measured the higher" not in text
    assert "Which draft method" not in card([t0], tmp_path)  # greedy decoding only: nothing to choose
