"""Which blocks are trained (docs/algorithm.md): the supervised tokens (the replies, or every token), anchor
candidates and their sampling (up to N per document, on supervised positions), the block supervision mask and the
per-position decay `exp(-k/gamma)`. Training and the teacher-forced evaluation both sample anchors here.
"""

import torch

from modeling_dspark import index_within_runs


# ------------------------------------------------------------------------------------------------ anchors
def training_loss_mask(loss_mask: torch.Tensor, document_ids: torch.Tensor, on_prompts: bool) -> torch.Tensor:
    """The tokens a training step supervises: the data's `loss_mask` (the replies), or with `on_prompts` every
    token of every document (prompts, system and tool turns too).

    Why prompts help: the teacher is the verifier's distribution, which exists at every position, so a prompt
    token is as valid a training target as a reply token. On a small training set the replies alone are learnt
    by heart within a few epochs; the prompts' text (passages to summarise, code, documents a reply quotes) is more
    of the same language and gives the drafter more to generalise from (benchmarks/RESULTS.md measures it on the
    SmolLM2 demo). Evaluation keeps the replies' mask: replies are what a served drafter proposes.
    """
    if not on_prompts:
        return loss_mask
    return (document_ids >= 0).to(loss_mask.dtype)


def anchor_candidates(loss_mask: torch.Tensor, document_ids: torch.Tensor) -> torch.Tensor:
    """`[R, T]` bool: position p can anchor a block iff the token slot 0 predicts (p+1) is supervised and in
    the same document as p."""
    cand = torch.zeros_like(loss_mask, dtype=torch.bool)
    same_doc = (document_ids[:, 1:] == document_ids[:, :-1]) & (document_ids[:, :-1] >= 0)
    cand[:, :-1] = same_doc & loss_mask[:, 1:].bool()
    return cand


def sample_anchors(
    loss_mask: torch.Tensor,
    document_ids: torch.Tensor,
    max_anchors: int,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Up to `max_anchors` anchors **per document**, uniformly without replacement among the candidates,
    sorted ascending per row; `[R, N]` with `-1` padding (N = the largest count over rows).

    Fresh randomness on every call (the trainer calls it every step); pass `generator` for reproducible
    draws (evaluation does).
    """
    cand = anchor_candidates(loss_mask, document_ids)
    rows, length = cand.shape
    scores = torch.rand(rows, length, generator=generator, device="cpu").to(cand.device)
    # Rank candidates within their document by their random score: sort by (document, score).
    docs = document_ids.clamp(min=0).to(torch.float64)
    key = torch.where(cand, docs * 2.0 + scores.to(torch.float64), torch.full_like(docs, float("inf")))
    order = key.argsort(dim=1)
    sorted_docs = document_ids.gather(1, order)
    sorted_cand = cand.gather(1, order)
    keep_sorted = sorted_cand & (index_within_runs(sorted_docs) < max_anchors)
    keep = torch.zeros_like(cand).scatter(1, order, keep_sorted)
    counts = keep.sum(dim=1)
    n = int(counts.max()) if rows else 0
    anchors = torch.full((rows, max(n, 1)), -1, dtype=torch.long, device=cand.device)
    for r in range(rows):
        chosen = keep[r].nonzero().flatten()
        anchors[r, : chosen.numel()] = chosen
    return anchors


def block_supervision(
    loss_mask: torch.Tensor, document_ids: torch.Tensor, anchors: torch.Tensor, block_size: int
) -> torch.Tensor:
    """`[R, N, B]` bool: slot k of the block at anchor p is supervised iff token p+k+1 exists, is in the
    anchor's document, is supervised (`loss_mask`), and every earlier slot of the block is supervised."""
    rows, length = loss_mask.shape
    valid = anchors >= 0
    p = anchors.clamp(min=0)
    target = p.unsqueeze(-1) + 1 + torch.arange(block_size, device=anchors.device)  # [R, N, B]
    inside = target < length
    t = target.clamp(max=length - 1).view(rows, -1)
    same_doc = document_ids.gather(1, t).view_as(target) == document_ids.gather(1, p).unsqueeze(-1)
    supervised = loss_mask.gather(1, t).view_as(target).bool()
    ok = inside & same_doc & supervised & valid.unsqueeze(-1)
    return ok.long().cumprod(dim=-1).bool()


def decay_weights(block_size: int, gamma: float, device=None, dtype=torch.float32) -> torch.Tensor:
    """Per-slot loss weights `exp(-k / gamma)`, k = 0..B-1."""
    return torch.exp(-torch.arange(block_size, device=device, dtype=torch.float64) / gamma).to(dtype)
