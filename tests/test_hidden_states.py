"""The in-process verifier source: per-document isolation on packed rows, teacher parts, and the row cache."""

import torch

from modeling_dspark import positions_from_document_ids, verifier_hidden_states
from tiny import VOCAB
from trainer.hidden_states import CachedStates, InProcessVerifier


def packed(seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (2, 30), generator=g)
    docs = torch.tensor([[0] * 11 + [1] * 19, [0] * 7 + [1] * 9 + [2] * 8 + [-1] * 6])
    return {"input_ids": ids, "document_ids": docs, "position_ids": positions_from_document_ids(docs),
            "row_index": torch.tensor([5, 9])}


def test_packed_rows_equal_separate_documents(gemma4_verifier):
    """Each document is run on its own, so no state leaks across documents of a packed row."""
    source = InProcessVerifier(gemma4_verifier, [2, 3], max_tokens_per_forward=25)  # forces several forwards
    batch = packed()
    states = source.states(batch)
    for r in range(2):
        docs = batch["document_ids"][r]
        for d in docs.unique().tolist():
            if d < 0:
                assert not states.aux_hidden_states[r, docs == d].any()  # padding stays zero
                continue
            ids = batch["input_ids"][r, docs == d].unsqueeze(0)
            aux, last = verifier_hidden_states(gemma4_verifier, [2, 3], ids)
            assert torch.allclose(states.aux_hidden_states[r, docs == d], aux[0], atol=1e-4, rtol=1e-4)  # batching noise only
            assert torch.allclose(states.last_hidden_state[r, docs == d], last[0], atol=1e-4, rtol=1e-4)
    teacher = source.teacher()
    assert teacher.softcap == 30.0 and teacher.final_norm is gemma4_verifier.model.language_model.norm


def test_row_cache_returns_the_same_states_and_respects_its_budget(qwen3_verifier):
    inner = InProcessVerifier(qwen3_verifier, [1, 3])
    calls = {"n": 0}
    real = inner.states

    def counting(batch):
        calls["n"] += 1
        return real(batch)

    inner.states = counting
    cache = CachedStates(inner, max_bytes=1 << 30)
    batch = packed(1)
    first = cache.states(batch)
    # the same rows again, in another order and padded to a longer batch
    again = {k: v.flip(0) for k, v in batch.items()}
    again = {**again, "input_ids": torch.nn.functional.pad(again["input_ids"], (0, 4)),
             "document_ids": torch.nn.functional.pad(again["document_ids"], (0, 4), value=-1)}
    second = cache.states(again)
    assert calls["n"] == 1
    assert torch.equal(second.aux_hidden_states[:, :30].flip(0), first.aux_hidden_states)
    assert torch.equal(second.last_hidden_state[:, :30].flip(0), first.last_hidden_state)
    tiny = CachedStates(inner, max_bytes=10)
    tiny.states(batch)
    tiny.states(batch)
    assert calls["n"] == 3 and tiny.bytes == 0  # over budget: nothing kept, recomputed
