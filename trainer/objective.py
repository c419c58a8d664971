"""The training objective (docs/algorithm.md): which blocks are trained, what they are
trained toward, the loss, and the teacher-forced acceptance metrics.

Everything here is the single place for its concept: anchor sampling and the block supervision mask,
the teacher distribution (the verifier's own final norm, draft-vocabulary head rows and softcap), and the
loss/metric reductions. Training, evaluation and tests all call these functions.

Memory: no `[positions, vocabulary]` fp32 tensor is ever built for more than a chunk of supervised slots.
Draft and teacher logits are computed chunk by chunk under activation checkpointing, so peak memory is
`O(chunk x Vd)` whatever the number of slots and the vocabulary (Vd = 32,000 or V = 262,144 alike).
"""

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from modeling_dspark import index_within_runs

LOSS_NAMES = ("ce", "tv", "kl")


# ------------------------------------------------------------------------------------------------ anchors
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


def decay_weights(block_size: int, gamma: float, device=None) -> torch.Tensor:
    """Per-slot loss weights `exp(-k / gamma)`, k = 0..B-1."""
    return torch.exp(-torch.arange(block_size, device=device, dtype=torch.float32) / gamma)


# ------------------------------------------------------------------------------------------------ teacher
class Teacher:
    """The verifier's own next-token distribution restricted to the draft vocabulary:
    `softcap(final_norm(last_hidden) @ W_out[draft rows]^T)`. The draft rows are the drafter's frozen
    `lm_head` (filled from the verifier by `attach_verifier`), so no second copy is kept."""

    def __init__(self, final_norm: torch.nn.Module, softcap: float | None):
        self.final_norm = final_norm
        self.softcap = softcap

    @torch.no_grad()
    def logits(self, last_hidden: torch.Tensor, head_weight: torch.Tensor) -> torch.Tensor:
        norm_weight = next(self.final_norm.parameters(), None)
        x = last_hidden.to(norm_weight.dtype if norm_weight is not None else last_hidden.dtype)
        h = self.final_norm(x)
        logits = F.linear(h.to(head_weight.dtype), head_weight).float()
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


# ------------------------------------------------------------------------------------------------ loss
@dataclass
class ObjectiveConfig:
    """Loss configuration (seed recipe defaults)."""

    block_size: int = 8
    max_anchors: int = 512
    loss_weights: dict = field(default_factory=lambda: {"ce": 0.1, "tv": 0.9})
    confidence_weight: float = 1.0
    decay_gamma: float = 4.0
    ce_target: str = "teacher"  # or "data": x_{p+k+1} when it is in the draft vocabulary
    chunk_elements: int = 1 << 26  # logits elements per chunk (rows = chunk_elements // vocabulary)

    def __post_init__(self):
        unknown = set(self.loss_weights) - set(LOSS_NAMES)
        if unknown:
            raise ValueError(f"unknown loss terms {sorted(unknown)}; use a dict over {list(LOSS_NAMES)}, "
                             f'e.g. {{"ce": 0.1, "tv": 0.9}}.')
        if self.ce_target not in ("teacher", "data"):
            raise ValueError(f"ce_target must be 'teacher' or 'data' (got {self.ce_target!r}).")
        if self.max_anchors < 1:
            raise ValueError(f"max_anchors must be at least 1 (got {self.max_anchors}).")


def stat_names(block_size: int) -> list[str]:
    """Layout of the per-batch statistics vector: additive sums, reduced across batches and processes."""
    names = ["slots", "blocks", "loss_sum", "ce_sum", "tv_sum", "kl_sum", "bce_sum", "accept_len_sum",
             "greedy_len_sum", "accept_rate_sum", "greedy_sum", "conf_abs_err_sum", "conf_pred_sum",
             "conf_cumprod_bias_sum"]
    for k in range(block_size):
        names += [f"slots_{k}", f"accept_rate_sum_{k}", f"greedy_sum_{k}", f"pos_sum_{k}"]
    return names


def _slot_terms(drafter, teacher: Teacher, hidden, previous, teacher_hidden, data_targets):
    """Per-slot CE (vs teacher argmax or data), overlap sum(min(p, q)) and KL(p||q) for one chunk."""
    logits = drafter.compute_logits(hidden, previous).float()
    log_q = torch.log_softmax(logits, dim=-1)
    with torch.no_grad():
        teacher_logits = teacher.logits(teacher_hidden, drafter.lm_head.weight)
        log_p = torch.log_softmax(teacher_logits, dim=-1)
        p = log_p.exp()
        teacher_argmax = teacher_logits.argmax(dim=-1)
        greedy = (logits.argmax(dim=-1) == teacher_argmax).float()
    target = torch.where(data_targets >= 0, data_targets, teacher_argmax)
    ce = -log_q.gather(-1, target.unsqueeze(-1)).squeeze(-1)
    overlap = torch.minimum(log_q.exp(), p).sum(dim=-1)
    kl = (p * (log_p - log_q)).sum(dim=-1)
    return ce, overlap, kl, greedy


def dspark_loss(
    drafter,
    outputs,
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    document_ids: torch.Tensor,
    anchors: torch.Tensor,
    teacher_hidden: torch.Tensor,
    teacher: Teacher,
    config: ObjectiveConfig,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Loss of one batch and its statistics vector (see `stat_names`).

    `loss = (sum_k w_k [sum_t lambda_t term_t] + alpha sum_k w_k BCE_k) / S` over the S supervised slots,
    `w_k = exp(-k / gamma)`; the confidence target is `1 - TV` (no gradient), and the confidence loss is
    not detached from the backbone. `drafter` is the unwrapped model (its heads recompute logits per chunk).
    """
    B = config.block_size
    device = outputs.last_hidden_state.device
    supervised = block_supervision(loss_mask, document_ids, anchors, B)  # [R, N, B]
    rows, n_anchors = anchors.shape
    idx = supervised.nonzero(as_tuple=True)  # (r, j, k)
    slot = idx[2]
    S = slot.numel()
    positions = anchors.clamp(min=0)[idx[0], idx[1]] + slot  # p + k: the teacher's position
    hidden = outputs.last_hidden_state[idx]
    previous = outputs.previous_token_ids[idx]
    t_hidden = teacher_hidden[idx[0], positions]
    if config.ce_target == "data":
        data_targets = drafter.verifier_to_draft_ids(input_ids[idx[0], positions + 1])
    else:
        data_targets = torch.full_like(slot, -1)

    ce = torch.zeros(S, device=device)
    overlap, kl, greedy = torch.zeros_like(ce), torch.zeros_like(ce), torch.zeros_like(ce)
    vocab = drafter.lm_head.weight.shape[0]
    chunk = max(1, config.chunk_elements // vocab)
    pieces = []
    for start in range(0, S, chunk):
        sl = slice(start, start + chunk)
        args = (drafter, teacher, hidden[sl], previous[sl], t_hidden[sl], data_targets[sl])
        if torch.is_grad_enabled():
            pieces.append(checkpoint(_slot_terms, *args, use_reentrant=False))
        else:
            pieces.append(_slot_terms(*args))
    if pieces:
        ce, overlap, kl, greedy = (torch.cat(t) for t in zip(*pieces))
    tv = 1.0 - overlap
    weights = decay_weights(B, config.decay_gamma, device)[slot]
    lw = config.loss_weights
    per_slot = lw.get("ce", 0.0) * ce + lw.get("tv", 0.0) * tv + lw.get("kl", 0.0) * kl
    total = (weights * per_slot).sum()

    acceptance = overlap.detach().clamp(0.0, 1.0)
    conf_logits = outputs.confidence_logits
    bce = torch.zeros_like(ce)
    conf_stats = torch.zeros(3, device=device)
    if conf_logits is not None and S:
        c = conf_logits[idx].float()
        bce = F.binary_cross_entropy_with_logits(c, acceptance, reduction="none")
        total = total + config.confidence_weight * (weights * bce).sum()
        pred = torch.sigmoid(c.detach())
        grid_pred = torch.zeros(rows, n_anchors, B, device=device)
        grid_pred[idx] = pred
        grid_true = torch.zeros_like(grid_pred)
        grid_true[idx] = acceptance
        valid_blocks = supervised[..., 0]
        bias = ((grid_pred.cumprod(-1) - grid_true.cumprod(-1)) * supervised).sum(-1)
        conf_stats = torch.stack([(pred - acceptance).abs().sum(), pred.sum(), bias[valid_blocks].sum()])
    if S == 0:  # no supervised slot in this batch: a zero loss that still reaches every parameter (DDP)
        total = sum((p.float().sum() for p in drafter.parameters() if p.requires_grad), torch.zeros((), device=device)) * 0.0
    loss = total / max(S, 1)

    with torch.no_grad():
        grid = torch.zeros(rows, n_anchors, B, device=device)
        grid[idx] = acceptance
        survival = grid.cumprod(dim=-1)  # masked slots are 0 and end the chain
        ggrid = torch.zeros_like(grid)
        ggrid[idx] = greedy
        greedy_run = ggrid.cumprod(dim=-1).sum(-1)
        valid_blocks = supervised[..., 0]
        n_blocks = valid_blocks.sum()
        head = torch.stack([
            torch.tensor(float(S), device=device), n_blocks.float(), loss.detach() * S,
            (weights * ce).sum().detach(), (weights * tv).sum().detach(), (weights * kl).sum().detach(),
            (weights * bce).sum().detach(), (1.0 + survival.sum(-1))[valid_blocks].sum(),
            (1.0 + greedy_run)[valid_blocks].sum(), acceptance.sum(), greedy.sum(),
        ])
        per_k = []
        for k in range(B):
            at_k = slot == k
            per_k += [at_k.sum().float(), acceptance[at_k].sum(), greedy[at_k].sum(), survival[..., k][valid_blocks].sum()]
        stats = torch.cat([head, conf_stats, torch.stack(per_k)]).float()
    return loss, stats


def reduce_stats(stats: torch.Tensor, block_size: int) -> dict[str, float]:
    """Turn summed statistics (over batches and processes) into metrics.

    `accept_len` = mean over blocks of `1 + sum_k prod_{j<=k} (1 - TV_j)` (expected accepted length at
    temperature 1 under teacher forcing, bonus included); `pos_k` = mean survival to slot k (the meaning of
    vLLM's per-position acceptance); `accept_rate_k` = mean `1 - TV` at slot k; greedy variants use argmax
    agreement with the teacher.
    """
    s = dict(zip(stat_names(block_size), stats.double().tolist()))
    slots, blocks = max(s["slots"], 1.0), max(s["blocks"], 1.0)
    out = {
        "loss": s["loss_sum"] / slots,
        "accept_len": s["accept_len_sum"] / blocks,
        "accept_rate": s["accept_rate_sum"] / slots,
        "greedy_accept_len": s["greedy_len_sum"] / blocks,
        "greedy_accept_rate": s["greedy_sum"] / slots,
        "ce": s["ce_sum"] / slots,
        "tv": s["tv_sum"] / slots,
        "kl": s["kl_sum"] / slots,
        "confidence_bce": s["bce_sum"] / slots,
        "confidence_abs_error": s["conf_abs_err_sum"] / slots,
        "confidence_pred_mean": s["conf_pred_sum"] / slots,
        "confidence_cumprod_bias": s["conf_cumprod_bias_sum"] / blocks,
        "supervised_slots": s["slots"],
        "blocks": s["blocks"],
    }
    for k in range(block_size):
        n_k = max(s[f"slots_{k}"], 1.0)
        out[f"accept_rate_{k}"] = s[f"accept_rate_sum_{k}"] / n_k
        out[f"greedy_accept_rate_{k}"] = s[f"greedy_sum_{k}"] / n_k
        out[f"pos_{k}"] = s[f"pos_sum_{k}"] / blocks
    return {k: (v if math.isfinite(v) else float("nan")) for k, v in out.items()}
