"""The training objective (docs/algorithm.md): which blocks are trained, what they are
trained toward, the loss, and the teacher-forced acceptance metrics.

Everything here is the single place for its concept: anchor sampling and the block supervision mask,
the teacher distribution (the verifier's own final norm, head and softcap), the confidence target, and the
loss/metric reductions. Training, evaluation and tests all call these functions.

The metrics measure what the verifier would accept, so they need the verifier's probabilities over its
*full* vocabulary V, not only over the draft vocabulary Vd: per slot, the loss adds a no-gradient pass over
the full output head for the log-normaliser (and argmax) of the tokens outside Vd.

Memory: no `[positions, vocabulary]` fp32 tensor is ever built for more than a chunk. Draft and teacher logits
are computed chunk by chunk of supervised slots under activation checkpointing, and the full-vocabulary pass
in chunks of slots x chunks of vocabulary of the same size, so peak memory is `O(chunk_elements)` whatever the
number of slots and the vocabulary (Vd = 32,000 or V = 262,144 alike).
"""

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from modeling_dspark import index_within_runs

LOSS_NAMES = ("ce", "tv", "kl")
# What the loss compares the draft with: "draft" = the verifier's distribution renormalised over the draft
# vocabulary; "full" = the verifier's full-vocabulary probabilities of the draft tokens (not renormalised).
TEACHER_VOCABS = ("draft", "full")
DEFAULT_TEACHER_VOCAB = "draft"  # the one place the default lives (TrainArgs and ObjectiveConfig read it)
# The acceptance probability the confidence head predicts, by how the server drafts (vLLM drafts greedily by
# default, also when the verifier samples): "greedy" = p_full(argmax q) (verifier sampling), "greedy_t0" =
# 1[argmax q == argmax p_full] (verifier greedy), "sampled" = sum_{Vd} min(p_full, q) (probabilistic drafting).
CONFIDENCE_TARGETS = ("greedy", "greedy_t0", "sampled")
DEFAULT_CONFIDENCE_TARGET = "greedy"


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


def decay_weights(block_size: int, gamma: float, device=None, dtype=torch.float32) -> torch.Tensor:
    """Per-slot loss weights `exp(-k / gamma)`, k = 0..B-1."""
    return torch.exp(-torch.arange(block_size, device=device, dtype=torch.float64) / gamma).to(dtype)


def _upcast(x: torch.Tensor) -> torch.Tensor:
    """At least fp32 (bf16 logits are upcast; a float64 run, as the reference tests use, stays float64)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


# ------------------------------------------------------------------------------------------------ teacher
class Teacher:
    """The verifier's own next-token distribution, `softcap(final_norm(last_hidden) @ W_out^T)`.

    Two heads read the same normalised state. The draft-vocabulary rows are the drafter's frozen `lm_head`
    (filled from the verifier by `attach_verifier`, so the loss needs no second copy): they give the teacher
    logits the draft is compared with. The verifier's full output head (`output_weight`, the verifier's own
    tensor, shared and never copied) gives the mass on the tokens *outside* the draft vocabulary, which the
    drafter can never propose but the verifier may still want: without it the metrics would count that mass
    as acceptable. Logits are computed in each head's dtype (the verifier's, for the full head) and softcapped
    per logit, exactly as the verifier does.
    """

    def __init__(self, final_norm: torch.nn.Module, softcap: float | None, output_weight: torch.Tensor | None = None):
        self.final_norm = final_norm
        self.softcap = softcap
        self.output_weight = output_weight

    @torch.no_grad()
    def normed(self, last_hidden: torch.Tensor) -> torch.Tensor:
        """The verifier's final norm of its pre-norm last-layer states, in the norm's dtype."""
        norm_weight = next(self.final_norm.parameters(), None)
        return self.final_norm(last_hidden.to(norm_weight.dtype if norm_weight is not None else last_hidden.dtype))

    @torch.no_grad()
    def head_logits(self, normed: torch.Tensor, head_weight: torch.Tensor) -> torch.Tensor:
        """Softcapped logits (at least fp32) of the rows `head_weight`, computed in that weight's dtype, as the
        verifier computes its own."""
        logits = _upcast(F.linear(normed.to(head_weight.dtype), head_weight))
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    @torch.no_grad()
    def logits(self, last_hidden: torch.Tensor, head_weight: torch.Tensor) -> torch.Tensor:
        return self.head_logits(self.normed(last_hidden), head_weight)

    @torch.no_grad()
    def outside(self, normed: torch.Tensor, in_draft: torch.Tensor, chunk_elements: int):
        """Log-normaliser, largest logit and its verifier id over the tokens outside the draft vocabulary
        (`in_draft`, the drafter's `t2d`), each `[n]`, computed over the full head in vocabulary chunks of
        `chunk_elements // n` rows so no `[n, V]` tensor exists. The draft rows are masked out rather than
        skipped (contiguous row slices are views of the shared head, never copies); their share of the
        normaliser comes from the draft-row logits the loss computes anyway, so `logZ_full =
        logaddexp(logZ_draft, logZ_outside)` and the draft vocabulary's mass never exceeds 1 by rounding."""
        weight = self.output_weight
        vocab, n = weight.shape[0], normed.shape[0]
        device = normed.device
        h = normed.to(weight.dtype)
        dtype = torch.promote_types(weight.dtype, torch.float32)
        log_z = torch.full((n,), -math.inf, device=device, dtype=dtype)
        best = torch.full((n,), -math.inf, device=device, dtype=dtype)
        best_id = torch.full((n,), vocab, dtype=torch.long, device=device)
        step = max(1, chunk_elements // max(n, 1))
        for start in range(0, vocab, step):
            rows = weight[start : start + step]
            drafted = in_draft[start : start + rows.shape[0]].to(device)
            logits = self.head_logits(h, rows).masked_fill(drafted, -math.inf)
            log_z = torch.logaddexp(log_z, torch.logsumexp(logits, dim=-1))
            value, index = logits.max(dim=-1)
            better = value > best  # strict: the lowest id wins a tie, as argmax over the whole vocabulary
            best = torch.where(better, value, best)
            best_id = torch.where(better, index + start, best_id)
        return log_z, best, best_id


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
    teacher_vocab: str = DEFAULT_TEACHER_VOCAB  # what CE/TV/KL compare the draft with (TEACHER_VOCABS)
    confidence_target: str = DEFAULT_CONFIDENCE_TARGET  # what the confidence head predicts (CONFIDENCE_TARGETS)

    def __post_init__(self):
        unknown = set(self.loss_weights) - set(LOSS_NAMES)
        if unknown:
            raise ValueError(f"unknown loss terms {sorted(unknown)}; use a dict over {list(LOSS_NAMES)}, "
                             f'e.g. {{"ce": 0.1, "tv": 0.9}}.')
        if self.ce_target not in ("teacher", "data"):
            raise ValueError(f"ce_target must be 'teacher' or 'data' (got {self.ce_target!r}).")
        if self.max_anchors < 1:
            raise ValueError(f"max_anchors must be at least 1 (got {self.max_anchors}).")
        if self.teacher_vocab not in TEACHER_VOCABS:
            raise ValueError(f"teacher_vocab must be one of {list(TEACHER_VOCABS)} (got {self.teacher_vocab!r}).")
        if self.confidence_target not in CONFIDENCE_TARGETS:
            raise ValueError(f"confidence_target must be one of {list(CONFIDENCE_TARGETS)} "
                             f"(got {self.confidence_target!r}).")


def stat_names(block_size: int) -> list[str]:
    """Layout of the per-batch statistics vector: additive sums, reduced across batches and processes.

    Acceptance sums are against the full-vocabulary teacher (what the verifier accepts); `restricted_*` against
    the teacher renormalised over the draft vocabulary (the pre-full-vocabulary meaning, kept to show the gap);
    `conf_*` compare the confidence head with its target (`ObjectiveConfig.confidence_target`)."""
    names = ["slots", "blocks", "loss_sum", "ce_sum", "tv_sum", "kl_sum", "bce_sum", "accept_len_sum",
             "greedy_len_sum", "accept_rate_sum", "greedy_sum", "restricted_len_sum", "restricted_rate_sum",
             "coverage_sum", "conf_target_sum", "conf_target_len_sum", "conf_abs_err_sum", "conf_pred_sum",
             "conf_cumprod_bias_sum"]
    for k in range(block_size):
        names += [f"slots_{k}", f"accept_rate_sum_{k}", f"greedy_sum_{k}", f"pos_sum_{k}", f"conf_pred_sum_{k}",
                  f"conf_target_sum_{k}", f"conf_cumprod_bias_sum_{k}"]
    return names


def _slot_terms(drafter, teacher: Teacher, hidden, previous, normed, data_targets, outside_log_z, outside_max,
                outside_id, teacher_vocab: str, confidence_target: str):
    """One chunk of supervised slots: the loss terms (CE vs the teacher argmax or the data token, overlap
    `sum_{Vd} min(p, q)` and `KL = sum_{Vd} p (log p - log q)` against the training teacher) and, without
    gradient, `[n, 5]` metrics: full-vocabulary overlap, restricted overlap, greedy agreement with the
    full-vocabulary argmax, draft-vocabulary coverage and the confidence target."""
    logits = _upcast(drafter.compute_logits(hidden, previous))
    log_q = torch.log_softmax(logits, dim=-1)
    q = log_q.exp()
    with torch.no_grad():
        t = teacher.head_logits(normed, drafter.lm_head.weight)
        t_max, t_arg = t.max(dim=-1)
        log_z_draft = torch.logsumexp(t, dim=-1)
        log_coverage = log_z_draft - torch.logaddexp(log_z_draft, outside_log_z)  # log sum_{Vd} p_full, <= 0
        log_p_draft = t - log_z_draft.unsqueeze(-1)
        del t
        log_p_full = log_p_draft + log_coverage.unsqueeze(-1)
        p_draft, p_full = log_p_draft.exp(), log_p_full.exp()
        q_const = q.detach()
        q_arg = logits.detach().argmax(dim=-1)
        # The verifier's argmax is a draft token iff the best draft logit beats the best outside one (ties: lower id).
        t_id = drafter.draft_to_verifier_ids(t_arg)
        argmax_in_draft = (t_max > outside_max) | ((t_max == outside_max) & (t_id < outside_id))
        greedy = ((q_arg == t_arg) & argmax_in_draft).float()
        overlap_full = torch.minimum(q_const, p_full).sum(dim=-1)
        overlap_draft = torch.minimum(q_const, p_draft).sum(dim=-1)
        if confidence_target == "greedy":
            conf_target = log_p_full.gather(-1, q_arg.unsqueeze(-1)).squeeze(-1).exp()
        elif confidence_target == "greedy_t0":
            conf_target = greedy
        else:
            conf_target = overlap_full
        metrics = torch.stack([overlap_full, overlap_draft, greedy, log_coverage.exp(), conf_target], dim=-1)
    log_p, p = (log_p_full, p_full) if teacher_vocab == "full" else (log_p_draft, p_draft)
    target = torch.where(data_targets >= 0, data_targets, t_arg)
    ce = -log_q.gather(-1, target.unsqueeze(-1)).squeeze(-1)
    overlap = torch.minimum(q, p).sum(dim=-1)
    kl = (p * (log_p - log_q)).sum(dim=-1)
    return ce, overlap, kl, metrics


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
    return_blocks: bool = False,
):
    """Loss of one batch and its statistics vector (see `stat_names`); with `return_blocks`, also the
    `[R, N, B]` grids `supervised`, `confidence` (logits, None without a head) and `target` (the confidence
    target), which the post-training calibration collects.

    `loss = (sum_k w_k [sum_t lambda_t term_t] + alpha sum_k w_k BCE_k) / S` over the S supervised slots,
    `w_k = exp(-k / gamma)`. The terms compare the draft with the teacher over the draft vocabulary,
    renormalised there (`teacher_vocab="draft"`) or as the verifier's full-vocabulary probabilities
    (`"full"`, not renormalised). The confidence target (no gradient) is the acceptance probability of the
    configured drafting mode; the confidence loss is not detached from the backbone. `drafter` is the
    unwrapped model (its heads recompute logits per chunk).
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
    normed = teacher.normed(teacher_hidden[idx[0], positions])
    if config.ce_target == "data":
        data_targets = drafter.verifier_to_draft_ids(input_ids[idx[0], positions + 1])
    else:
        data_targets = torch.full_like(slot, -1)
    in_draft = drafter.t2d if drafter.config.uses_draft_vocab else None  # None: the draft vocabulary is all of V
    if in_draft is not None and teacher.output_weight is None:
        raise ValueError("the teacher has no full-vocabulary output head, which a drafter with a reduced draft "
                         "vocabulary needs; build it as "
                         "Teacher(norm, softcap, verifier.get_output_embeddings().weight).")

    dtype = torch.promote_types(outputs.last_hidden_state.dtype, torch.float32)
    ce = torch.zeros(S, device=device, dtype=dtype)
    overlap, kl = torch.zeros_like(ce), torch.zeros_like(ce)
    metrics = torch.zeros(S, 5, device=device, dtype=dtype)
    vocab = drafter.lm_head.weight.shape[0]
    chunk = max(1, config.chunk_elements // vocab)
    pieces = []
    for start in range(0, S, chunk):
        sl = slice(start, start + chunk)
        n = normed[sl].shape[0]
        if in_draft is None:
            outside = (torch.full((n,), -math.inf, device=device, dtype=dtype),
                       torch.full((n,), -math.inf, device=device, dtype=dtype),
                       torch.full((n,), drafter.config.vocab_size, dtype=torch.long, device=device))
        else:  # no gradient and outside the checkpoint: the full-vocabulary pass is never recomputed in backward
            outside = teacher.outside(normed[sl], in_draft, config.chunk_elements)
        args = (drafter, teacher, hidden[sl], previous[sl], normed[sl], data_targets[sl], *outside,
                config.teacher_vocab, config.confidence_target)
        if torch.is_grad_enabled():
            pieces.append(checkpoint(_slot_terms, *args, use_reentrant=False))
        else:
            pieces.append(_slot_terms(*args))
    if pieces:
        ce, overlap, kl, metrics = (torch.cat(t) for t in zip(*pieces))
    acceptance, restricted, greedy, coverage, conf_target = metrics.clamp(0.0, 1.0).unbind(-1)
    tv = 1.0 - overlap
    weights = decay_weights(B, config.decay_gamma, device, ce.dtype)[slot]
    lw = config.loss_weights
    per_slot = lw.get("ce", 0.0) * ce + lw.get("tv", 0.0) * tv + lw.get("kl", 0.0) * kl
    total = (weights * per_slot).sum()

    def grid(values: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(rows, n_anchors, B, device=device, dtype=values.dtype)
        out[idx] = values
        return out

    conf_logits = outputs.confidence_logits
    bce = torch.zeros_like(ce)
    pred = torch.zeros_like(ce)
    has_head = conf_logits is not None
    if has_head and S:
        c = _upcast(conf_logits[idx])
        bce = F.binary_cross_entropy_with_logits(c, conf_target, reduction="none")
        total = total + config.confidence_weight * (weights * bce).sum()
        pred = torch.sigmoid(c.detach())
    if S == 0:  # no supervised slot in this batch: a zero loss that still reaches every parameter (DDP)
        total = sum((p.float().sum() for p in drafter.parameters() if p.requires_grad), torch.zeros((), device=device)) * 0.0
    loss = total / max(S, 1)

    with torch.no_grad():
        valid_blocks = supervised[..., 0]
        sup = supervised.float()
        survival = grid(acceptance).cumprod(dim=-1)  # masked slots are 0 and end the chain
        restricted_survival = grid(restricted).cumprod(dim=-1)
        greedy_run = grid(greedy).cumprod(dim=-1).sum(-1)
        target_survival = grid(conf_target).cumprod(dim=-1)
        # prod_{j<=k} sigmoid(c_j) - prod_{j<=k} target_j, at every supervised slot (zero without a head)
        bias = (grid(pred).cumprod(dim=-1) - target_survival) * sup if has_head else torch.zeros_like(sup)
        n_blocks = valid_blocks.sum()
        conf_abs = (pred - conf_target).abs().sum() if has_head else torch.zeros((), device=device, dtype=dtype)
        head = [
            torch.tensor(float(S), device=device, dtype=dtype), n_blocks, loss.detach() * S,
            (weights * ce).sum().detach(), (weights * tv).sum().detach(), (weights * kl).sum().detach(),
            (weights * bce).sum().detach(), (1.0 + survival.sum(-1))[valid_blocks].sum(),
            (1.0 + greedy_run)[valid_blocks].sum(), acceptance.sum(), greedy.sum(),
            (1.0 + restricted_survival.sum(-1))[valid_blocks].sum(), restricted.sum(), coverage.sum(),
            conf_target.sum(), (1.0 + target_survival.sum(-1))[valid_blocks].sum(), conf_abs, pred.sum(), bias.sum(),
        ]
        per_k = []
        for k in range(B):
            at_k = slot == k
            per_k += [at_k.sum(), acceptance[at_k].sum(), greedy[at_k].sum(), survival[..., k][valid_blocks].sum(),
                      pred[at_k].sum(), conf_target[at_k].sum(), bias[..., k].sum()]
        # float64: sums over a whole evaluation stay exact enough, and a float64 run keeps its precision
        stats = torch.stack([x.to(torch.float64) for x in head + per_k])
    if not return_blocks:
        return loss, stats
    blocks = {"supervised": supervised, "target": grid(conf_target.detach()),
              "confidence": grid(_upcast(conf_logits[idx].detach())) if has_head else None}
    return loss, stats, blocks


def reduce_stats(stats: torch.Tensor, block_size: int) -> dict[str, float]:
    """Turn summed statistics (over batches and processes) into metrics.

    Acceptance is what the verifier would give, against its full-vocabulary distribution `p_full`:
    `accept_rate_k` = mean `sum_{v in Vd} min(p_full, q)` = `1 - TV(p_full, q)` (sampled drafts);
    `accept_len` = mean over blocks of `1 + sum_k prod_{j<=k} accept_j` (expected accepted length under teacher
    forcing, bonus included); `pos_k` = mean survival to slot k (vLLM's per-position acceptance); the greedy
    variants count argmax agreement with the verifier's full-vocabulary argmax (a draft can only match when that
    argmax is a draft token). `restricted_accept_*` are the same against the teacher renormalised over the draft
    vocabulary (an upper bound that ignores the verifier's mass elsewhere); `draft_vocab_coverage` is the mean of
    that mass inside the draft vocabulary. `confidence_*` compare `sigmoid(confidence)` with the confidence
    target; `confidence_target_accept_len` is the accepted length that target implies (the configured drafting
    mode), `confidence_cumprod_bias_k` the mean over blocks reaching slot k of
    `prod_{j<=k} sigmoid(c_j) - prod_{j<=k} target_j`.
    """
    s = dict(zip(stat_names(block_size), stats.double().tolist()))
    slots, blocks = max(s["slots"], 1.0), max(s["blocks"], 1.0)
    out = {
        "loss": s["loss_sum"] / slots,
        "accept_len": s["accept_len_sum"] / blocks,
        "accept_rate": s["accept_rate_sum"] / slots,
        "greedy_accept_len": s["greedy_len_sum"] / blocks,
        "greedy_accept_rate": s["greedy_sum"] / slots,
        "restricted_accept_len": s["restricted_len_sum"] / blocks,
        "restricted_accept_rate": s["restricted_rate_sum"] / slots,
        "draft_vocab_coverage": s["coverage_sum"] / slots,
        "ce": s["ce_sum"] / slots,
        "tv": s["tv_sum"] / slots,
        "kl": s["kl_sum"] / slots,
        "confidence_bce": s["bce_sum"] / slots,
        "confidence_abs_error": s["conf_abs_err_sum"] / slots,
        "confidence_pred_mean": s["conf_pred_sum"] / slots,
        "confidence_target_mean": s["conf_target_sum"] / slots,
        "confidence_target_accept_len": s["conf_target_len_sum"] / blocks,
        "confidence_cumprod_bias": s["conf_cumprod_bias_sum"] / blocks,
        "supervised_slots": s["slots"],
        "blocks": s["blocks"],
    }
    for k in range(block_size):
        n_k = max(s[f"slots_{k}"], 1.0)
        out[f"accept_rate_{k}"] = s[f"accept_rate_sum_{k}"] / n_k
        out[f"greedy_accept_rate_{k}"] = s[f"greedy_sum_{k}"] / n_k
        out[f"pos_{k}"] = s[f"pos_sum_{k}"] / blocks
        out[f"confidence_pred_mean_{k}"] = s[f"conf_pred_sum_{k}"] / n_k
        out[f"confidence_target_mean_{k}"] = s[f"conf_target_sum_{k}"] / n_k
        out[f"confidence_cumprod_bias_{k}"] = s[f"conf_cumprod_bias_sum_{k}"] / n_k
    return {k: (v if math.isfinite(v) else float("nan")) for k, v in out.items()}
