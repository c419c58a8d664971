"""The training objective (docs/algorithm.md): which blocks are trained, what they are
trained toward, the loss, and the teacher-forced acceptance metrics.

Everything here is the single place for its concept: anchor sampling and the block supervision mask,
the teacher distribution (the verifier's own final norm, head and softcap), the confidence target, and the
loss/metric reductions. Training, evaluation and tests all call these functions.

The metrics measure what the verifier would accept, so they need the verifier's probabilities over its
*full* vocabulary V, not only over the draft vocabulary Vd: the loss adds a no-gradient pass over the full output
head for the verifier's log-normaliser and argmax. That pass costs V x H per distinct teacher position (8x the
draft head at V = 262,144, Vd = 32,000); `ObjectiveConfig.full_vocab_metrics=False` skips it on training batches
whose loss does not read it (`needs_full_vocabulary`). All teacher work (norm, draft-vocabulary logits, the
full-vocabulary pass) is done once per distinct position: the blocks of nearby anchors overlap, and the slots
that share a position are processed side by side (slots are sorted by position).

Speed and memory: the draft logits are a sum of linear maps (`DSparkDraftModel.logit_terms`), so `_DraftLoss`
computes, chunk by chunk of supervised slots, the draft and teacher logits once, the loss terms, and the
gradient of the loss w.r.t. the logits in closed form, which it multiplies straight into the gradients of the
hidden states, the Markov features and `markov_w2` before the next chunk. The backward is a scaling: nothing
is recomputed (the activation-checkpointed loss this replaces ran every chunk's forward twice) and no
`[positions, vocabulary]` tensor outlives its chunk. Chunks hold `chunk_rows(chunk_elements, Vd)` slots and the
full-vocabulary pass uses chunks of slots x vocabulary of the same size, so peak memory is `O(chunk_elements)`
whatever the number of slots and the vocabulary (Vd = 32,000 or V = 262,144 alike). Tests compare the loss,
every metric and every gradient with float64 autograd over unchunked reference formulas.
"""

import math

import torch
import torch.nn.functional as F

from trainer.config import (
    LOSS_NAMES,
    ObjectiveConfig,
)
from trainer.train.anchors import block_supervision, decay_weights
from trainer.verifier.teacher import FullVocabulary, Teacher, upcast

# Below this many slots per chunk, the logit matmuls over a large head are bound by reading the head's weights
# (each chunk reads the [Vd, H] head three times), not by arithmetic.
MIN_CHUNK_ROWS = 64


def chunk_rows(chunk_elements: int, vocab: int) -> int:
    """Supervised slots per loss chunk: the memory budget over the draft vocabulary, at least `MIN_CHUNK_ROWS`
    (tests pass tiny budgets to force one slot per chunk: a budget below one row is taken literally)."""
    rows = chunk_elements // vocab
    return max(1, rows) if chunk_elements < vocab else max(rows, MIN_CHUNK_ROWS)


def needs_full_vocabulary(config: ObjectiveConfig) -> bool:
    """Whether a batch needs the pass over the verifier's full output head: for the full-vocabulary metrics, a
    full-vocabulary teacher, or a confidence target that reads `p_full` (all but "sampled_restricted")."""
    return config.full_vocab_metrics or config.teacher_vocab == "full" or config.confidence_target != "sampled_restricted"


class _LossPlan:
    """Everything the draft-logit loss reads besides the logit terms, for `_DraftLoss` (one batch)."""

    def __init__(self, teacher, head_weight, normed, position_of_slot, full_pass, data_targets, slot_weights,
                 loss_weights, teacher_vocab, confidence_target, full, rows, draft_to_verifier):
        # `normed`: the teacher's normalised states, one per distinct position; `position_of_slot[i]` indexes it
        # (non-decreasing: slots are in position order). `full_pass`: the verifier's full-vocabulary
        # (log-normaliser, argmax id) per distinct position, or None (not needed, or Vd = V).
        self.teacher, self.head_weight, self.normed = teacher, head_weight, normed
        self.position_of_slot, self.full_pass = position_of_slot, full_pass
        self.data_targets, self.slot_weights = data_targets, slot_weights
        self.lw = {name: float(loss_weights.get(name, 0.0)) for name in LOSS_NAMES}
        self.teacher_vocab, self.confidence_target = teacher_vocab, confidence_target
        self.full, self.rows = full, rows
        self.draft_to_verifier = draft_to_verifier


def _rowdot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`(a * b).sum(-1)` for `[n, V]` rows as a batched matmul, which allocates no `[n, V]` product."""
    return torch.bmm(a.unsqueeze(1), b.unsqueeze(2)).view(-1)


def _chunk_terms(plan: _LossPlan, terms, sl: slice, span: tuple[int, int], want_grad: bool):
    """One chunk of supervised slots: per-slot CE (to the teacher argmax or the data token), overlap
    `sum_{Vd} min(p, q)` and `KL = sum_{Vd} p (log p - log q)` against the training teacher, the `[n, 5]` metrics
    (full-vocabulary overlap, restricted overlap, greedy agreement with the full-vocabulary argmax, draft-vocabulary
    coverage, confidence target; the three full-vocabulary ones NaN when `plan.full` is off) and, with
    `want_grad`, the gradient of `sum_i w_i (l_ce ce_i + l_tv (1 - overlap_i) + l_kl kl_i)` w.r.t. the logits,
    written analytically (`q - onehot`, `q s - q 1[q < p]` with `s = sum_{q < p} q`, `q sum p - p`). `span` is the
    chunk's first and last distinct position (read by the caller for every chunk at once: one synchronisation)."""
    logits = None
    for x, weight in terms:
        part = upcast(F.linear(x[sl], weight))
        logits = part if logits is None else logits.add_(part.to(logits.dtype))
    q_arg = logits.argmax(dim=-1)
    log_q = logits.sub_(torch.logsumexp(logits, dim=-1, keepdim=True))  # in place: `logits` is this chunk's own
    q = log_q.exp()
    n, device, dtype = q.shape[0], q.device, q.dtype
    # The teacher once per distinct position of the chunk (`u`), then gathered per slot: overlapping blocks share
    # positions, and their slots sit side by side because the slots are in position order.
    at = plan.position_of_slot[sl]
    first, last = span
    u = at - first
    log_p_u = plan.teacher.head_logits(plan.normed[first : last + 1], plan.head_weight)
    t_arg_u = log_p_u.argmax(dim=-1)
    log_z_u = torch.logsumexp(log_p_u, dim=-1)
    log_p_u.sub_(log_z_u.unsqueeze(-1))  # in place: the draft-vocabulary log-probabilities
    p_draft = log_p_u[u].exp_()
    t_arg, log_z_draft = t_arg_u[u], log_z_u[u]
    overlap_draft = torch.minimum(q, p_draft).sum(dim=-1)
    nan = torch.full((n,), math.nan, device=device, dtype=dtype)
    log_coverage = None
    if plan.full:
        if plan.full_pass is None:  # the draft vocabulary is all of V: its normaliser and argmax are the verifier's
            log_z_full, full_id = log_z_draft, plan.draft_to_verifier(t_arg)
        else:
            log_z_full, full_id = (x[at] for x in plan.full_pass)
        # log sum_{Vd} p_full; clamped at 0 because the two heads' logits of the draft rows may round apart
        log_coverage = (log_z_draft - log_z_full).clamp_(max=0.0)
        coverage = log_coverage.exp()
        overlap_full = torch.minimum(q, p_draft * coverage.unsqueeze(-1)).sum(dim=-1)
        greedy = (plan.draft_to_verifier(q_arg) == full_id).to(dtype)  # the draft's token is the verifier's argmax
    else:
        overlap_full = greedy = coverage = nan
    if plan.confidence_target == "greedy":
        conf_target = (log_p_u[u, q_arg] + log_coverage).exp()
    elif plan.confidence_target == "greedy_t0":
        conf_target = greedy
    elif plan.confidence_target == "sampled":
        conf_target = overlap_full
    else:  # "sampled_restricted"
        conf_target = overlap_draft
    metrics = torch.stack([overlap_full, overlap_draft, greedy, coverage, conf_target], dim=-1)

    # sum p log p over the draft vocabulary, once per position (`firsts`: each position's first slot)
    if log_p_u.shape[0] == n:
        entropy = _rowdot(p_draft, log_p_u)
    else:
        firsts = torch.searchsorted(u, torch.arange(log_p_u.shape[0], device=device))
        entropy = _rowdot(p_draft[firsts], log_p_u)[u]
    del log_p_u
    if plan.teacher_vocab == "full":  # p_full = c p_draft, log p_full = log p_draft + log c (c: the coverage)
        p = p_draft.mul_(coverage.unsqueeze(-1))
        entropy = coverage * (entropy + log_coverage)
        overlap = overlap_full
    else:
        p, overlap = p_draft, overlap_draft
    data_targets = plan.data_targets[sl]
    target = torch.where(data_targets >= 0, data_targets, t_arg)
    ce = -log_q.gather(-1, target.unsqueeze(-1)).squeeze(-1)
    kl = entropy - _rowdot(p, log_q)  # sum p (log p - log q), without two more [n, Vd] temporaries
    grad = None
    if want_grad:
        lw = plan.lw
        below = q.where(q < p, 0.0)  # q 1[q < p]: the slots' share of the overlap that q controls
        coef = lw["ce"] + lw["tv"] * below.sum(dim=-1) + lw["kl"] * p.sum(dim=-1)
        grad = torch.mul(q, coef.unsqueeze(-1), out=log_q)  # log_q is no longer needed: reuse its memory
        grad.add_(below, alpha=-lw["tv"])
        del below
        if lw["kl"]:
            grad.add_(p, alpha=-lw["kl"])
        if lw["ce"]:
            grad[torch.arange(n, device=device), target] -= lw["ce"]
        grad.mul_(plan.slot_weights[sl].to(dtype).unsqueeze(-1))
    return ce, overlap, kl, metrics, grad


class _DraftLoss(torch.autograd.Function):
    """`sum_i w_i (l_ce ce_i + l_tv tv_i + l_kl kl_i)` over the supervised slots from the logit terms
    `sum_j x_j W_j^T` (`DSparkDraftModel.logit_terms`), chunk by chunk of slots.

    The forward writes each chunk's logit gradient straight into the gradients of the terms (`dx_j = g W_j`,
    `dW_j += g^T x_j`), so the backward only scales them by the incoming gradient: no `[slots, Vd]` tensor is
    kept, and nothing (draft logits, teacher logits, softmaxes) is recomputed, unlike activation checkpointing,
    which would run the forward of every chunk twice. The per-slot terms and metrics are returned alongside,
    without gradient."""

    @staticmethod
    def forward(ctx, plan: _LossPlan, grad_for: tuple, *flat):
        terms = list(zip(flat[0::2], flat[1::2]))
        slots = flat[0].shape[0]
        want = any(grad_for)
        grads = [torch.zeros(t.shape, device=t.device, dtype=upcast(t).dtype) if g else None
                 for t, g in zip(flat, grad_for)]
        pieces = []
        starts = range(0, slots, plan.rows)
        # each chunk's first and last distinct position, read from the device once for all chunks
        ends = [min(start + plan.rows, slots) - 1 for start in starts]
        at = torch.tensor([*starts, *ends], device=plan.position_of_slot.device)
        spans = plan.position_of_slot[at].view(2, -1).t().tolist()
        for start, span in zip(starts, spans):
            sl = slice(start, start + plan.rows)
            ce, overlap, kl, metrics, g = _chunk_terms(plan, terms, sl, tuple(span), want)
            pieces.append((ce, overlap, kl, metrics))
            if g is not None:
                for j, (x, weight) in enumerate(terms):
                    if grads[2 * j] is not None:
                        grads[2 * j][sl] = torch.mm(g.to(weight.dtype), weight)
                    if grads[2 * j + 1] is not None:
                        buffer = grads[2 * j + 1]  # at least fp32, also for bf16 weights
                        buffer.addmm_(g.t().to(buffer.dtype), x[sl].to(buffer.dtype))
                del g
        ce, overlap, kl, metrics = (torch.cat(t) for t in zip(*pieces))
        lw = plan.lw
        w = plan.slot_weights.to(ce.dtype)
        total = (w * (lw["ce"] * ce + lw["tv"] * (1.0 - overlap) + lw["kl"] * kl)).sum()
        ctx.grads = [g.to(t.dtype) if g is not None else None for g, t in zip(grads, flat)]
        ctx.mark_non_differentiable(ce, overlap, kl, metrics)
        return total, ce, overlap, kl, metrics

    @staticmethod
    def backward(ctx, grad_total, *unused):
        if ctx.grads is None:
            raise RuntimeError("the DSpark loss was backpropagated twice; its gradients are computed once in the "
                               "forward and released by the first backward, so call the loss again instead of "
                               "retain_graph=True.")
        # Scaled in place: the stored gradients are this backward's alone, so no second [Vd, r] copy is made.
        grads = [g.mul_(grad_total.to(g.dtype)) if g is not None else None for g in ctx.grads]
        ctx.grads = None
        return (None, None, *grads)


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
    full_vocabulary: FullVocabulary | None = None,
):
    """Loss of one batch and its statistics vector (see `stat_names`); with `return_blocks`, also the
    `[R, N, B]` grids `supervised`, `confidence` (logits, None without a head) and `target` (the confidence
    target), which the post-training calibration collects.

    `loss = (sum_k w_k [sum_t lambda_t term_t] + alpha sum_k w_k BCE_k) / S` over the S supervised slots,
    `w_k = exp(-k / gamma)`. The terms compare the draft with the teacher over the draft vocabulary,
    renormalised there (`teacher_vocab="draft"`) or as the verifier's full-vocabulary probabilities
    (`"full"`, not renormalised). The confidence target (no gradient) is the acceptance probability of the
    configured drafting mode; the confidence loss is not detached from the backbone. `drafter` is the
    unwrapped model (its heads recompute logits per chunk). `full_vocabulary` (`VerifierStates.full_vocabulary`)
    supplies the full-vocabulary pass where a source already knows it, and receives the positions computed here.
    """
    B = config.block_size
    device = outputs.last_hidden_state.device
    supervised = block_supervision(loss_mask, document_ids, anchors, B)  # [R, N, B]
    rows, n_anchors = anchors.shape
    idx = supervised.nonzero(as_tuple=True)  # (r, j, k)
    S = idx[2].numel()
    length = teacher_hidden.shape[1]
    # Slots in (row, position) order: the slots of overlapping blocks that share a teacher position (p + k) sit side
    # by side, so the teacher's work (its norm, draft-vocabulary logits and the full-vocabulary pass) is done once
    # per distinct position, not once per slot. Every per-slot result is scattered back through `idx`.
    key = idx[0] * length + anchors.clamp(min=0)[idx[0], idx[1]] + idx[2]
    order = torch.argsort(key, stable=True)
    idx = tuple(i[order] for i in idx)
    slot, positions = idx[2], key[order] % length
    distinct, position_of_slot = torch.unique_consecutive(key[order], return_inverse=True)
    hidden = outputs.last_hidden_state[idx]
    previous = outputs.previous_token_ids[idx]
    normed = teacher.normed(teacher_hidden[distinct // length, distinct % length])
    if config.ce_target == "data":
        data_targets = drafter.verifier_to_draft_ids(input_ids[idx[0], positions + 1])
    else:
        data_targets = torch.full_like(slot, -1)
    reduced = drafter.config.uses_draft_vocab  # False: the draft vocabulary is all of V
    if reduced and teacher.output_weight is None:
        raise ValueError("the teacher has no full-vocabulary output head, which a drafter with a reduced draft "
                         "vocabulary needs; build it as "
                         "Teacher(norm, softcap, verifier.get_output_embeddings().weight).")

    dtype = torch.promote_types(outputs.last_hidden_state.dtype, torch.float32)
    weights = decay_weights(B, config.decay_gamma, device, dtype)[slot]
    vocab = drafter.lm_head.weight.shape[0]
    full = not reduced or needs_full_vocabulary(config)
    # no gradient, and computed once per distinct position for the whole batch (never again for the backward)
    full_pass = None
    if full and reduced and S:
        full_pass = (full_vocabulary.lookup(teacher, normed, distinct // length, distinct % length,
                                            config.chunk_elements) if full_vocabulary is not None
                     else teacher.full_vocabulary(normed, config.chunk_elements))
    plan = _LossPlan(teacher, drafter.lm_head.weight, normed, position_of_slot, full_pass, data_targets, weights,
                     config.loss_weights, config.teacher_vocab, config.confidence_target, full=full,
                     rows=chunk_rows(config.chunk_elements, vocab),
                     draft_to_verifier=drafter.draft_to_verifier_ids)
    if S:
        features = outputs.previous_features[idx] if outputs.previous_features is not None else None
        flat = [t for pair in drafter.logit_terms(hidden, previous, features) for t in pair]
        grad_for = tuple(torch.is_grad_enabled() and t.requires_grad for t in flat)
        total, ce, overlap, kl, metrics = _DraftLoss.apply(plan, grad_for, *flat)
    else:
        total = torch.zeros((), device=device, dtype=dtype)
        ce = overlap = kl = torch.zeros(0, device=device, dtype=dtype)
        metrics = torch.zeros(0, 5, device=device, dtype=dtype)
    acceptance, restricted, greedy, coverage, conf_target = metrics.clamp(0.0, 1.0).unbind(-1)
    tv = 1.0 - overlap

    def grid(values: torch.Tensor) -> torch.Tensor:
        """Per-slot values (`[S, ...]`) on the `[R, N, B, ...]` block grid, zero at unsupervised slots."""
        out = torch.zeros(rows, n_anchors, B, *values.shape[1:], device=device, dtype=values.dtype)
        out[idx] = values
        return out

    conf_logits = outputs.confidence_logits
    bce = torch.zeros_like(ce)
    pred = torch.zeros_like(ce)
    has_head = conf_logits is not None
    if has_head and S:
        c = upcast(conf_logits[idx])
        bce = F.binary_cross_entropy_with_logits(c, conf_target, reduction="none")
        total = total + config.confidence_weight * (weights * bce).sum()
        pred = torch.sigmoid(c.detach())
    if S == 0:  # no supervised slot in this batch: a zero loss that still reaches every parameter (DDP)
        total = sum((p.float().sum() for p in drafter.parameters() if p.requires_grad), torch.zeros((), device=device)) * 0.0
    loss = total / max(S, 1)

    # The statistics are a few whole-tensor reductions, in float64 (sums over a whole evaluation stay exact enough,
    # and a float64 run keeps its precision): no per-slot-index loop and no boolean indexing, each of which would
    # cost a launch and a device synchronisation on a GPU (they made the loss host-bound there).
    with torch.no_grad():
        f64 = torch.float64
        valid_blocks = supervised[..., 0]  # slots are supervised as a prefix: a block is valid iff its slot 0 is
        per_slot = torch.stack([acceptance, restricted, greedy, conf_target, pred], dim=-1).to(f64)  # [S, 5]
        on_grid = grid(per_slot)  # [R, N, B, 5]; unsupervised slots are 0 and end every chain
        chains = on_grid.cumprod(dim=2)
        survival, target_survival, pred_chain = chains[..., 0], chains[..., 3], chains[..., 4]
        # prod_{j<=k} sigmoid(c_j) - prod_{j<=k} target_j, at every supervised slot (zero without a head)
        bias = (pred_chain - target_survival) * supervised if has_head else torch.zeros_like(survival)
        # 1 + sum_k prod_{j<=k} x_j per valid block, summed: acceptance, restricted, greedy, target
        lengths = torch.where(valid_blocks.unsqueeze(-1), 1.0 + chains[..., :4].sum(dim=2), 0.0).sum(dim=(0, 1))
        sums = torch.stack([weights * ce, weights * tv, weights * kl, weights * bce.detach(), acceptance, greedy,
                            restricted, coverage, conf_target, (pred - conf_target).abs(), pred],
                           dim=-1).to(f64).sum(dim=0)
        w_ce, w_tv, w_kl, w_bce, acc_sum, greedy_sum, restricted_sum, coverage_sum, target_sum, abs_sum, pred_sum = \
            sums.unbind()
        head = torch.stack([
            torch.tensor(float(S), device=device, dtype=f64), valid_blocks.sum().to(f64), loss.detach().to(f64) * S,
            w_ce, w_tv, w_kl, w_bce, lengths[0], lengths[2], acc_sum, greedy_sum, lengths[1], restricted_sum,
            coverage_sum, target_sum, lengths[3], abs_sum if has_head else torch.zeros((), device=device, dtype=f64),
            pred_sum, bias.sum(),
        ])
        # per slot index k, in `stat_names` order: slots, acceptance, greedy, survival (invalid blocks hold 0),
        # prediction, target, cumulative-product bias
        at_k = on_grid.sum(dim=(0, 1))  # [B, 5]
        per_k = torch.stack([supervised.sum(dim=(0, 1)).to(f64), at_k[:, 0], at_k[:, 2], survival.sum(dim=(0, 1)),
                             at_k[:, 4], at_k[:, 3], bias.sum(dim=(0, 1))], dim=-1)
        stats = torch.cat([head, per_k.reshape(-1)])
    if not return_blocks:
        return loss, stats
    blocks = {"supervised": supervised, "target": grid(conf_target.detach()),
              "confidence": grid(upcast(conf_logits[idx].detach())) if has_head else None}
    return loss, stats, blocks
