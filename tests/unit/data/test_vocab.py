"""The draft vocabulary rule (trainer/data/vocab.py): the replies' most frequent tokens, ties to the lower id, a short
list filled with the lowest unused ids; checked against the rule spelled out by brute force, and against speculators
0.9.0's own `build_vocab_mappings_from_distribution` in its venv (the recipe benchmark gives speculators this
package's choice as its `--d2t-path/--t2d-path`, on the claim that its own rule would choose the same).
"""

import json
import os
import random
import subprocess

import pytest
import torch
from conftest import speculators_python

from trainer.data.vocab import draft_vocab_from_counts
from trainer.errors import UsageError


def brute_force_draft_vocab(counts: list[int], size: int) -> list[int]:
    """Every id with a count, by count (higher first) then id; then every other id, lowest first; the first
    `size`, sorted."""
    ids = range(len(counts))
    ranked = sorted((i for i in ids if counts[i] > 0), key=lambda i: (-counts[i], i))
    ranked += [i for i in ids if counts[i] == 0]
    return sorted(ranked[:size])


def random_counts(seed: int, vocab: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.choice([0, 0, 0, 1, 1, 2, 3, 7, 40]) for _ in range(vocab)]  # many ties, many unseen ids


@pytest.mark.parametrize("seed", range(5))
def test_draft_vocab_is_the_most_frequent_then_the_lowest_unused_ids(seed):
    counts = random_counts(seed, 60)
    seen = sum(c > 0 for c in counts)
    for size in (1, 7, seen - 1, seen, seen + 1, 59, 60):
        got = draft_vocab_from_counts(torch.tensor(counts), size)
        assert got.dtype == torch.long and got.tolist() == brute_force_draft_vocab(counts, size), size


def test_draft_vocab_size_out_of_range_is_a_usage_error():
    with pytest.raises(UsageError, match="draft_vocab_size"):
        draft_vocab_from_counts(torch.ones(10, dtype=torch.long), 11)


SPECULATORS_RULE = """
import json, sys
from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution
out = []
for counts, size in json.load(sys.stdin):
    d2t, t2d = build_vocab_mappings_from_distribution({i: c for i, c in enumerate(counts) if c > 0}, size, len(counts))
    out.append([d2t.tolist(), t2d.tolist()])
print(json.dumps(out))
"""


@pytest.mark.speculators
def test_speculators_own_rule_chooses_the_same_vocabulary(tmp_path):
    """What the recipe benchmark writes for speculators (`write_speculators_vocab_mapping` of our choice) is what
    speculators' own rule computes from the same counts."""
    import numpy as np

    from benchmarks.common import write_speculators_vocab_mapping

    cases = [(random_counts(seed, 300), size) for seed in range(4) for size in (5, 64, 150, 299)]
    cases += [([0] * 40 + [3] * 10, 20)]  # fewer seen ids than the size, none of them among the lowest ids
    env = {**os.environ, "PYTHONPATH": ""}
    proc = subprocess.run([speculators_python(), "-c", SPECULATORS_RULE], input=json.dumps(cases), capture_output=True,
                          text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    theirs = json.loads(proc.stdout.strip().splitlines()[-1])
    for (counts, size), (d2t, t2d) in zip(cases, theirs, strict=True):
        write_speculators_vocab_mapping(tmp_path, draft_vocab_from_counts(torch.tensor(counts), size), len(counts))
        assert np.load(tmp_path / "d2t.npy").tolist() == d2t, (size, counts)
        assert np.load(tmp_path / "t2d.npy").tolist() == t2d, (size, counts)
