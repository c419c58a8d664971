"""`dspark_acceptance`: acceptance length and per-position acceptance of speculative decoding, as an
`evaluate` metric module.

Every evaluation backend (in-process speculative generation, a vLLM server) reduces what it measured
through this one module, so the numbers in a `dspark-acceptance/1` results file and in a model card
always mean the same thing.

Input, one entry per verification step:

* `committed`: tokens the step committed, the accepted drafts plus the verifier's corrected or bonus
  token, so an integer in 1..B+1 for block size B;
* `subset`: the prompt subset the step belongs to (any string; `""` for a single unnamed set).

Output per subset (`subsets[name]`):

* `acceptance_length` = mean committed tokens per step (1.0 .. B+1);
* `pos[k]` = share of steps that accepted at least k+1 drafts (`committed - 1 >= k + 1`), k = 0..B-1,
  vLLM's per-position acceptance;
* `steps`;

and over all subsets `weighted_acceptance_length` (each subset weighted by its steps, which equals the
mean over all steps), `unweighted_acceptance_length` (the plain mean of the subset means) and
`total_steps`. Subsets listed in `subsets=` that have no steps are reported with null values.

    metric = evaluate.load("trainer/evaluation/metrics/dspark_acceptance")
    metric.compute(committed=[3, 1, 5], subset=["qa", "qa", "rag"], block_size=4)
"""

import datasets
import evaluate

_CITATION = ""
_KWARGS = """
Args:
    committed (`list[int]`): tokens committed by each verification step (1..block_size+1).
    subset (`list[str]`): the subset of each step.
    block_size (`int`): drafts per step, B.
    subsets (`list[str]`, optional): subsets to report even when they have no steps.
Returns:
    `dict` with `subsets` ({name: {acceptance_length, pos, steps}}), `weighted_acceptance_length`,
    `unweighted_acceptance_length` and `total_steps`.
"""


def reduce_subset(committed: list[int], block_size: int) -> dict:
    """Acceptance length, `pos` and step count of one subset's per-step committed counts."""
    steps = len(committed)
    return {
        "acceptance_length": sum(committed) / steps if steps else None,
        "pos": [sum(c - 1 >= k + 1 for c in committed) / steps if steps else None for k in range(block_size)],
        "steps": steps,
    }


def means(subsets: dict[str, dict]) -> dict:
    """Weighted (by verification steps) and unweighted means of acceptance length over measured subsets."""
    measured = [v for v in subsets.values() if v.get("steps")]
    total = sum(v["steps"] for v in measured)
    return {
        "weighted_acceptance_length": sum(v["acceptance_length"] * v["steps"] for v in measured) / total
        if total else None,
        "unweighted_acceptance_length": sum(v["acceptance_length"] for v in measured) / len(measured)
        if measured else None,
        "total_steps": total,
    }


@evaluate.utils.file_utils.add_start_docstrings(__doc__, _KWARGS)
class DsparkAcceptance(evaluate.Metric):
    def _info(self) -> evaluate.MetricInfo:
        return evaluate.MetricInfo(
            description=__doc__,
            citation=_CITATION,
            inputs_description=_KWARGS,
            features=datasets.Features({"committed": datasets.Value("int64"), "subset": datasets.Value("string")}),
        )

    def _compute(self, committed, subset, block_size: int, subsets=None):
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive integer (got {block_size!r}); pass the drafter's.")
        bad = [c for c in committed if not 1 <= c <= block_size + 1]
        if bad:
            raise ValueError(f"a verification step committed {bad[0]} tokens, outside 1..{block_size + 1}; pass the "
                             f"tokens committed per step (accepted drafts + 1) for block size {block_size}.")
        per_subset: dict[str, list[int]] = {name: [] for name in (subsets or [])}
        for c, name in zip(committed, subset):
            per_subset.setdefault(name, []).append(int(c))
        reduced = {name: reduce_subset(values, block_size) for name, values in per_subset.items()}
        return {"subsets": reduced, **means(reduced)}
