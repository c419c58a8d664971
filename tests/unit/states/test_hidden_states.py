"""The in-process verifier source: per-document isolation on packed rows, teacher parts, and the row cache."""

import torch

from modeling_dspark import positions_from_document_ids
from tiny import VOCAB
from trainer.states.in_process import InProcessVerifier, verifier_hidden_states
from trainer.states.memory import MemoryRowCache


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
    cache = MemoryRowCache(inner, max_bytes=1 << 30)
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
    tiny = MemoryRowCache(inner, max_bytes=10)
    tiny.states(batch)
    tiny.states(batch)
    assert calls["n"] == 3 and tiny.bytes == 0  # over budget: nothing kept, recomputed


def test_row_cache_keeps_what_the_loss_learns_of_the_full_vocabulary_pass(qwen3_verifier):
    """The loss writes the positions it computes into the batch's `FullVocabulary`; the next batch with the same
    rows (another order, another length) starts from them, and each batch's writes are kept in turn."""
    cache = MemoryRowCache(InProcessVerifier(qwen3_verifier, [1, 3]), max_bytes=1 << 30)
    batch = packed(1)
    first = cache.states(batch).full_vocabulary
    assert first.log_z.shape == (2, 30) and first.log_z.isnan().all() and (first.argmax == -1).all()
    first.log_z[0, 3], first.argmax[0, 3] = 1.5, 7  # what a loss would write for row 5, position 3
    again = {k: v.flip(0) for k, v in batch.items()}
    again = {**again, "input_ids": torch.nn.functional.pad(again["input_ids"], (0, 4)),
             "document_ids": torch.nn.functional.pad(again["document_ids"], (0, 4), value=-1)}
    second = cache.states(again).full_vocabulary
    assert second.log_z.shape == (2, 34)
    assert second.log_z[1, 3] == 1.5 and second.argmax[1, 3] == 7  # row 5 is now the second row
    assert (second.argmax >= 0).sum() == 1
    second.argmax[0, 0], second.log_z[0, 0] = 2, 0.25  # row 9, position 0, learnt in the second batch
    third = cache.states(batch).full_vocabulary
    assert third.argmax[0, 3] == 7 and third.argmax[1, 0] == 2 and third.log_z[1, 0] == 0.25
    assert first.argmax[1, 0] == -1  # each batch gets its own tensors; the cache follows the latest


def test_verifier_shell_holds_exactly_the_embedding_norm_and_head(verifier, tmp_path):
    """The trainer's verifier when states come from servers or a cache: the tensors the drafter and the teacher
    read are the checkpoint's, everything else stays on meta (Gemma 4's composite layout and tied head too)."""
    from modeling_dspark import verifier_decoder
    from trainer.verifier.loading import load_verifier_shell
    from trainer.verifier.teacher import verifier_teacher

    verifier.save_pretrained(tmp_path)
    shell = load_verifier_shell(str(tmp_path), "float32", "cpu")
    assert torch.equal(shell.get_input_embeddings().weight, verifier.get_input_embeddings().weight)
    assert torch.equal(shell.get_output_embeddings().weight, verifier.get_output_embeddings().weight)
    assert torch.equal(verifier_decoder(shell).norm.weight, verifier_decoder(verifier).norm.weight)
    assert all(p.is_meta for p in verifier_decoder(shell).layers.parameters())
    states = InProcessVerifier(verifier, [1, 2]).states({
        "input_ids": torch.randint(0, VOCAB, (1, 12)), "document_ids": torch.zeros(1, 12, dtype=torch.long)})
    ours, ref = verifier_teacher(shell), verifier_teacher(verifier)
    assert ours.softcap == ref.softcap
    assert torch.equal(ours.head_logits(ours.normed(states.last_hidden_state), ours.output_weight),
                       ref.head_logits(ref.normed(states.last_hidden_state), ref.output_weight))
