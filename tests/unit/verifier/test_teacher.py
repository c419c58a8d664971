"""The teacher's full-vocabulary pass against a float64 reference over the whole vocabulary at once."""

import torch
import torch.nn.functional as F

from trainer.verifier.teacher import VOCAB_ALIGNMENT, Teacher


def test_full_vocabulary_chunks_are_aligned_and_exact(monkeypatch):
    """Vocabulary chunks are whole multiples of `VOCAB_ALIGNMENT` rows once the budget allows one (cuBLAS is slow
    on unaligned bf16 rows), the last chunk takes the rest, and the log-normaliser and argmax (the first id on a
    tie, also across chunks) are the whole vocabulary's."""
    g = torch.Generator().manual_seed(0)
    n, vocab, hidden = 37, 1000, 16
    weight = torch.randn(vocab, hidden, generator=g, dtype=torch.float64)
    weight[700] = weight[3]  # a tie across chunks: id 3 must win
    normed = torch.randn(n, hidden, generator=g, dtype=torch.float64)
    normed[0] = weight[3] * 10  # make ids 3 and 700 the maximum of row 0
    teacher = Teacher(torch.nn.Identity(), 30.0, weight)
    widths = []
    original = F.linear

    def spy(x, w, *args):
        widths.append(w.shape[0])
        return original(x, w, *args)

    monkeypatch.setattr("trainer.verifier.teacher.F.linear", spy)
    chunk_elements = n * 300  # 300 rows of budget: 256 aligned rows per chunk
    log_z, argmax = teacher.full_vocabulary(normed, chunk_elements)
    assert widths == [256, 256, 256, 232] and all(w % VOCAB_ALIGNMENT == 0 for w in widths[:-1])
    logits = torch.tanh(normed @ weight.T / 30.0) * 30.0
    assert torch.allclose(log_z, logits.logsumexp(-1), atol=1e-12, rtol=0)
    assert torch.equal(argmax, logits.argmax(-1)) and argmax[0] == 3
    widths.clear()
    teacher.full_vocabulary(normed, n * 100)  # a budget under one aligned chunk is taken as it is
    assert widths[0] == 100
