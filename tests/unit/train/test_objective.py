"""Anchors, block supervision, teacher, loss and metrics against brute-force reference formulas."""

import itertools
import math
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from modeling_dspark import positions_from_document_ids, verifier_decoder
from tiny import VOCAB, tiny_drafter
from trainer.config import ObjectiveConfig
from trainer.states.in_process import verifier_hidden_states
from trainer.train.anchors import anchor_candidates, block_supervision, sample_anchors
from trainer.train.loss import dspark_loss, needs_full_vocabulary
from trainer.train.stats import reduce_stats
from trainer.verifier.teacher import Teacher

DOCS = torch.tensor([[0] * 10 + [1] * 12 + [-1] * 4, [0] * 5 + [1] * 7 + [2] * 14])
MASK = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 0, 1, 1] + [0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 0, 1] + [0] * 4,
                     [0, 1, 1, 1, 1] + [0, 0, 0, 1, 1, 0, 1] + [0, 0] + [1] * 12])


def reference_candidates(mask, docs):
    R, T = mask.shape
    out = torch.zeros(R, T, dtype=torch.bool)
    for r in range(R):
        for p in range(T - 1):
            out[r, p] = bool(docs[r, p] >= 0 and docs[r, p + 1] == docs[r, p] and mask[r, p + 1] == 1)
    return out


def test_anchor_candidates_equal_brute_force():
    assert torch.equal(anchor_candidates(MASK, DOCS), reference_candidates(MASK, DOCS))


@pytest.mark.parametrize("max_anchors", [1, 2, 3, 100])
def test_sampled_anchors_are_per_document_sorted_and_valid(max_anchors):
    cand = reference_candidates(MASK, DOCS)
    seen = set()
    for seed in range(30):
        anchors = sample_anchors(MASK, DOCS, max_anchors, generator=torch.Generator().manual_seed(seed))
        for r in range(2):
            chosen = [int(a) for a in anchors[r] if a >= 0]
            assert chosen == sorted(chosen) and len(set(chosen)) == len(chosen)
            assert all(cand[r, a] for a in chosen)
            assert bool((anchors[r, len(chosen):] == -1).all())  # padding only at the end
            for doc in set(DOCS[r].tolist()) - {-1}:
                in_doc = [a for a in chosen if DOCS[r, a] == doc]
                available = int((cand[r] & (DOCS[r] == doc)).sum())
                assert len(in_doc) == min(max_anchors, available)  # up to N per *document*
            seen.add((r, tuple(chosen)))
    if max_anchors < 100:
        assert len(seen) > 4  # resampled: different draws for different seeds


def test_sampling_is_uniform_over_candidates():
    counts = torch.zeros(2, 26)
    for seed in range(400):
        anchors = sample_anchors(MASK, DOCS, 1, generator=torch.Generator().manual_seed(seed))
        for r in range(2):
            for a in anchors[r]:
                if a >= 0:
                    counts[r, a] += 1
    doc1 = reference_candidates(MASK, DOCS)[0] & (DOCS[0] == 1)  # 7 candidates sharing one anchor
    freq = counts[0][doc1] / 400
    assert torch.allclose(freq, torch.full_like(freq, 1 / int(doc1.sum())), atol=0.06)


def reference_supervision(mask, docs, anchors, B):
    R, N = anchors.shape
    T = mask.shape[1]
    out = torch.zeros(R, N, B, dtype=torch.bool)
    for r in range(R):
        for j in range(N):
            p = int(anchors[r, j])
            if p < 0:
                continue
            for k in range(B):
                t = p + k + 1
                if t >= T or docs[r, t] != docs[r, p] or mask[r, t] != 1:
                    break
                out[r, j, k] = True
    return out


def test_block_supervision_equals_brute_force():
    anchors = torch.tensor([[2, 3, 7, 8, 13, 20, -1], [0, 3, 4, 10, 14, 21, 24]])
    for B in (1, 3, 5):
        assert torch.equal(block_supervision(MASK, DOCS, anchors, B), reference_supervision(MASK, DOCS, anchors, B))


def batch(verifier, drafter, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (2, 26), generator=g)
    positions = positions_from_document_ids(DOCS)
    aux, last = verifier_hidden_states(verifier, drafter.config.aux_hidden_state_layer_ids, ids)
    anchors = sample_anchors(MASK, DOCS, 3, generator=g)
    return ids, positions, aux, last, anchors


def full_head(verifier) -> torch.Tensor:
    return verifier.get_output_embeddings().weight


def teacher_of(verifier) -> Teacher:
    return Teacher(verifier_decoder(verifier).norm, verifier.config.get_text_config().final_logit_softcapping,
                   full_head(verifier))


def reference_loss(drafter, verifier, ids, positions, aux, last, anchors, cfg):
    """Straight float64 formulas over full (unchunked) logits and a softmax over the verifier's whole vocabulary:
    `p_full = softmax(softcap(norm(last) @ W_out^T))` over all V, its draft-vocabulary entries `pf`, and the
    renormalised `pd = pf / sum(pf)`. Returns the loss (a graph, for gradients) and every metric."""
    out = drafter(ids, aux, anchors, document_ids=DOCS, position_ids=positions)
    norm = verifier_decoder(verifier).norm
    W = full_head(verifier).double()
    cap = verifier.config.get_text_config().final_logit_softcapping
    draft_ids = drafter.draft_vocab_ids
    sup = reference_supervision(MASK, DOCS, anchors, cfg.block_size)
    B, lw = cfg.block_size, cfg.loss_weights
    total, slots, blocks = 0.0, [], []
    for r in range(2):
        for j in range(anchors.shape[1]):
            if not sup[r, j, 0]:
                continue
            block = []
            for k in range(B):
                if not sup[r, j, k]:
                    break
                logits = norm(last[r, int(anchors[r, j]) + k]).double() @ W.T
                if cap:
                    logits = torch.tanh(logits / cap) * cap
                p_full = torch.softmax(logits, -1)
                pf = p_full[draft_ids]
                pd = pf / pf.sum()
                p = pf if cfg.teacher_vocab == "full" else pd
                log_q = torch.log_softmax(out.logits[r, j, k].double(), -1)
                q = log_q.exp()
                ce = -log_q[pd.argmax()]
                tv = 1 - torch.minimum(p, q).sum()
                kl = (p * (p.log() - log_q)).sum()
                acceptance = float(torch.minimum(pf, q.detach()).sum())
                greedy = float(draft_ids[q.argmax()] == p_full.argmax())
                restricted = float(torch.minimum(pd, q.detach()).sum())
                target = {"greedy": float(pf[q.argmax()]), "greedy_t0": greedy, "sampled": acceptance,
                          "sampled_restricted": restricted}[cfg.confidence_target]
                c = out.confidence_logits[r, j, k].double()
                bce = -(target * torch.log(torch.sigmoid(c)) + (1 - target) * torch.log(1 - torch.sigmoid(c)))
                w = math.exp(-k / cfg.decay_gamma)
                total = total + w * (lw.get("ce", 0) * ce + lw.get("tv", 0) * tv + lw.get("kl", 0) * kl) \
                    + cfg.confidence_weight * w * bce
                slot = dict(k=k, ce=w * float(ce.detach()), tv=w * float(tv.detach()), kl=w * float(kl.detach()),
                            bce=w * float(bce.detach()),
                            acceptance=acceptance, restricted=restricted,
                            greedy=greedy, coverage=float(pf.sum()), target=target,
                            pred=float(torch.sigmoid(c.detach())))
                block.append(slot)
                slots.append(slot)
            blocks.append(block)

    def chain(block, key):
        return list(itertools.accumulate((s[key] for s in block), lambda a, b: a * b))

    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    m = {
        "accept_len": mean([1 + sum(chain(b, "acceptance")) for b in blocks]),
        "greedy_accept_len": mean([1 + sum(chain(b, "greedy")) for b in blocks]),
        "restricted_accept_len": mean([1 + sum(chain(b, "restricted")) for b in blocks]),
        "confidence_target_accept_len": mean([1 + sum(chain(b, "target")) for b in blocks]),
        "confidence_cumprod_bias": sum(sum(a - b for a, b in zip(chain(x, "pred"), chain(x, "target")))
                                       for x in blocks) / len(blocks),
        "accept_rate": mean([s["acceptance"] for s in slots]),
        "greedy_accept_rate": mean([s["greedy"] for s in slots]),
        "restricted_accept_rate": mean([s["restricted"] for s in slots]),
        "draft_vocab_coverage": mean([s["coverage"] for s in slots]),
        "ce": mean([s["ce"] for s in slots]), "tv": mean([s["tv"] for s in slots]),
        "kl": mean([s["kl"] for s in slots]), "confidence_bce": mean([s["bce"] for s in slots]),
        "confidence_abs_error": mean([abs(s["pred"] - s["target"]) for s in slots]),
        "confidence_pred_mean": mean([s["pred"] for s in slots]),
        "confidence_target_mean": mean([s["target"] for s in slots]),
    }
    for k in range(B):
        at_k = [s for s in slots if s["k"] == k]
        reach = [b for b in blocks if len(b) > k]
        m[f"pos_{k}"] = sum(chain(b, "acceptance")[k] for b in reach) / len(blocks)
        m[f"accept_rate_{k}"] = mean([s["acceptance"] for s in at_k])
        m[f"greedy_accept_rate_{k}"] = mean([s["greedy"] for s in at_k])
        m[f"confidence_pred_mean_{k}"] = mean([s["pred"] for s in at_k])
        m[f"confidence_target_mean_{k}"] = mean([s["target"] for s in at_k])
        m[f"confidence_cumprod_bias_{k}"] = mean([chain(b, "pred")[k] - chain(b, "target")[k] for b in reach])
    return total / len(slots), m, len(slots)


def agreeing_drafter(verifier, ids, last, anchors):
    """A float64 drafter whose draft vocabulary holds the verifier's argmax at about half of the supervised
    positions, and whose logits (keyed by the previous token) are pushed toward that argmax at some positions
    and toward the argmax *within the draft vocabulary* at others, so greedy agreement, disagreement, and
    agreement with a restricted argmax that is not the verifier's all occur."""
    drafter = tiny_drafter(verifier).double()
    teacher = teacher_of(verifier)
    normed = teacher.normed(last)
    full_argmax = teacher.head_logits(normed, full_head(verifier)).argmax(-1)  # [R, T] verifier ids
    sup = reference_supervision(MASK, DOCS, anchors, drafter.block_size)
    r, j, k = sup.nonzero(as_tuple=True)
    pos = anchors[r, j] + k
    wanted = sorted(set(full_argmax[r, pos].tolist()))[::2]
    rest = [i for i in torch.randperm(VOCAB, generator=torch.Generator().manual_seed(3)).tolist() if i not in wanted]
    drafter.set_draft_vocab(sorted(wanted + rest[: 100 - len(wanted)]))
    restricted_argmax = teacher.head_logits(normed, drafter.lm_head.weight).argmax(-1)  # [R, T] draft ids
    full_in_draft = drafter.verifier_to_draft_ids(full_argmax)
    first = {}
    for rr, pp in zip(r.tolist(), pos.tolist()):
        first.setdefault(int(ids[rr, pp]), (int(full_in_draft[rr, pp]), int(restricted_argmax[rr, pp])))
    boost = {}
    for i, (prev, (full_d, restricted_d)) in enumerate(sorted(first.items())):
        if i % 3 == 0 and full_d >= 0:
            boost[prev] = full_d  # agrees with the verifier's argmax
        elif i % 3 == 1 and full_d < 0:
            boost[prev] = restricted_d  # agrees only with the argmax over the draft vocabulary
    # The boost is one more linear logit term: one-hot(previous token) @ bonus^T, bonus[d, prev] = 40.
    bonus = torch.zeros(drafter.lm_head.weight.shape[0], VOCAB, dtype=torch.float64)
    for prev, d in boost.items():
        bonus[d, prev] = 40.0
    plain = drafter.logit_terms

    def logit_terms(hidden, previous, previous_features=None):
        return [*plain(hidden, previous, previous_features), (F.one_hot(previous, VOCAB).to(bonus.dtype), bonus)]

    drafter.logit_terms = logit_terms
    return drafter


FULL_VOCABULARY_METRICS = {"accept_len", "greedy_accept_len", "accept_rate", "greedy_accept_rate",
                           "draft_vocab_coverage"}


@pytest.mark.parametrize("teacher_vocab, confidence_target, chunk_elements, full_vocab_metrics", [
    ("draft", "greedy", 1 << 26, True), ("draft", "greedy_t0", 150, True), ("draft", "sampled", 1 << 26, True),
    ("full", "greedy", 150, True), ("full", "greedy_t0", 1 << 26, True), ("full", "sampled", 333, True),
    ("draft", "sampled_restricted", 150, True), ("draft", "sampled_restricted", 1 << 26, False),
    ("draft", "greedy", 333, False),  # the confidence target reads p_full: the full pass runs anyway
])  # one chunk, and ~1 slot per chunk (with several vocabulary chunks in the full-vocabulary pass)
def test_loss_gradient_and_metrics_equal_a_full_vocabulary_reference(gemma4_verifier, teacher_vocab,
                                                                     confidence_target, chunk_elements,
                                                                     full_vocab_metrics):
    verifier = gemma4_verifier.double()
    try:
        drafter0 = tiny_drafter(gemma4_verifier)
        ids, positions, aux, last, anchors = batch(verifier, drafter0)
        aux, last = aux.double(), last.double()
        drafter = agreeing_drafter(verifier, ids, last, anchors).train()
        cfg = ObjectiveConfig(block_size=drafter.block_size, chunk_elements=chunk_elements,
                              loss_weights={"ce": 0.1, "tv": 0.6, "kl": 0.3}, teacher_vocab=teacher_vocab,
                              confidence_target=confidence_target, full_vocab_metrics=full_vocab_metrics)
        out = drafter(ids, aux, anchors, document_ids=DOCS, position_ids=positions, return_logits=False)
        loss, stats = dspark_loss(drafter, out, ids, MASK, DOCS, anchors, last, teacher_of(verifier), cfg)
        loss.backward()
        grads = {n: p.grad.clone() for n, p in drafter.named_parameters() if p.requires_grad}
        drafter.zero_grad()
        ref_loss, ref, S = reference_loss(drafter, verifier, ids, positions, aux, last, anchors, cfg)
        ref_loss.backward()
    finally:
        gemma4_verifier.float()
    metrics = reduce_stats(stats, cfg.block_size)
    assert metrics["supervised_slots"] == S > 10
    r, j, k = block_supervision(MASK, DOCS, anchors, cfg.block_size).nonzero(as_tuple=True)
    assert (r * MASK.shape[1] + anchors[r, j] + k).unique().numel() < S  # overlapping blocks share teacher positions
    assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-9)
    skipped = not needs_full_vocabulary(cfg)
    for name, value in ref.items():
        if skipped and (name in FULL_VOCABULARY_METRICS or name.startswith(("pos_", "accept_rate_", "greedy_"))):
            assert math.isnan(metrics[name]), name  # not computed: NaN, never a number that looks measured
        else:
            assert metrics[name] == pytest.approx(value, rel=1e-9, abs=1e-12), name
    for name, param in drafter.named_parameters():
        if param.requires_grad:
            assert torch.allclose(grads[name], param.grad, rtol=1e-7, atol=1e-12), name
    if skipped:
        return
    # every case the greedy metrics distinguish occurs: agreement, disagreement, argmax outside the vocabulary
    assert 0 < metrics["greedy_accept_rate"] < 1 and metrics["draft_vocab_coverage"] < 0.9
    assert metrics["accept_len"] <= metrics["restricted_accept_len"]
    assert greedy_agreement_with_restricted_argmax(drafter, teacher_of(verifier), out, last, anchors) > \
        metrics["greedy_accept_rate"] * S  # some drafts match the draft-vocabulary argmax but not the verifier's


@torch.no_grad()
def greedy_agreement_with_restricted_argmax(drafter, teacher, out, last, anchors) -> int:
    sup = block_supervision(MASK, DOCS, anchors, drafter.block_size)
    r, j, k = sup.nonzero(as_tuple=True)
    logits = drafter.compute_logits(out.last_hidden_state[r, j, k], out.previous_token_ids[r, j, k])
    restricted = teacher.head_logits(teacher.normed(last[r, anchors[r, j] + k]), drafter.lm_head.weight)
    return int((logits.argmax(-1) == restricted.argmax(-1)).sum())


def test_chunked_gradients_equal_unchunked(gemma4_verifier):
    drafter = tiny_drafter(gemma4_verifier).train()
    ids, positions, aux, last, anchors = batch(gemma4_verifier, drafter, seed=1)
    teacher = teacher_of(gemma4_verifier)
    grads = []
    for chunk in (1 << 26, 333):
        drafter.zero_grad()
        cfg = ObjectiveConfig(block_size=drafter.block_size, chunk_elements=chunk)
        out = drafter(ids, aux, anchors, document_ids=DOCS, position_ids=positions, return_logits=False)
        loss, _ = dspark_loss(drafter, out, ids, MASK, DOCS, anchors, last, teacher, cfg)
        loss.backward()
        grads.append({n: p.grad.clone() for n, p in drafter.named_parameters() if p.requires_grad})
    for name in grads[0]:
        assert torch.allclose(grads[0][name], grads[1][name], atol=1e-6, rtol=1e-4), name


def test_a_known_full_vocabulary_pass_is_read_and_the_computed_one_written_back(gemma4_verifier):
    """`FullVocabulary` (what a row cache knows of the V x H pass): the loss computes only the positions it does
    not know, writes them back, and gives the same loss, statistics and gradients as without it (float64: the
    batches of positions differ, so in fp32 the normalisers would differ by summation order)."""

    try:
        verifier = gemma4_verifier.double()
        drafter = tiny_drafter(gemma4_verifier).double().train()
        ids, positions, aux, last, anchors = batch(verifier, drafter, seed=3)
        aux, last = aux.double(), last.double()
        _check_known_full_vocabulary(drafter, teacher_of(verifier), ids, positions, aux, last, anchors)
    finally:
        gemma4_verifier.float()


def _check_known_full_vocabulary(drafter, teacher, ids, positions, aux, last, anchors):
    from trainer.verifier.teacher import FullVocabulary

    computed = []
    real = teacher.full_vocabulary

    def counting(normed, chunk_elements):
        computed.append(normed.shape[0])
        return real(normed, chunk_elements)

    teacher.full_vocabulary = counting
    cfg = ObjectiveConfig(block_size=drafter.block_size, chunk_elements=333)
    known = FullVocabulary.unknown(*ids.shape, last.dtype)
    other = sample_anchors(MASK, DOCS, 3, generator=torch.Generator().manual_seed(11))

    def step(anchors, full_vocabulary):
        drafter.zero_grad()
        out = drafter(ids, aux, anchors, document_ids=DOCS, position_ids=positions, return_logits=False)
        kwargs = {"full_vocabulary": full_vocabulary} if full_vocabulary is not None else {}
        loss, stats = dspark_loss(drafter, out, ids, MASK, DOCS, anchors, last, teacher, cfg, **kwargs)
        loss.backward()
        return loss.detach(), stats, {n: p.grad.clone() for n, p in drafter.named_parameters() if p.grad is not None}

    def distinct(anchors) -> set:
        r, j, k = block_supervision(MASK, DOCS, anchors, drafter.block_size).nonzero(as_tuple=True)
        return set(zip(r.tolist(), (anchors[r, j] + k).tolist()))

    for a in (anchors, other, anchors):  # new positions, some new ones, none new
        before = set(zip(*(known.argmax >= 0).nonzero(as_tuple=True)))
        before = {(int(r), int(p)) for r, p in before}
        computed.clear()
        with_known = step(a, known)
        assert sum(computed) == len(distinct(a) - before)  # only what was not known yet
        assert {(int(r), int(p)) for r, p in zip(*(known.argmax >= 0).nonzero(as_tuple=True))} == before | distinct(a)
        fresh = step(a, None)
        assert torch.allclose(with_known[0], fresh[0], rtol=1e-12)
        assert torch.allclose(with_known[1], fresh[1], rtol=1e-12, atol=1e-14, equal_nan=True)
        for name, grad in fresh[2].items():
            assert torch.allclose(with_known[2][name], grad, rtol=1e-10, atol=1e-14), name
    # what is written is the teacher's own pass at those positions
    r, p = (known.argmax >= 0).nonzero(as_tuple=True)
    log_z, argmax = real(teacher.normed(last[r, p]), 1 << 20)
    assert torch.allclose(known.log_z[r, p], log_z, rtol=1e-12) and torch.equal(known.argmax[r, p], argmax)
    # and what is known is what is used: a wrong "known" normaliser changes the full-vocabulary metrics
    known.log_z[r, p] += 1.0
    assert not torch.equal(step(anchors, known)[1], step(anchors, None)[1])


def test_a_full_vocabulary_drafter_needs_no_second_head(gemma4_verifier):
    """Without a reduced draft vocabulary the draft rows are the whole head: coverage is 1 and the full and
    restricted metrics coincide; the teacher's own head is then optional."""
    drafter = tiny_drafter(gemma4_verifier, draft_vocab_size=None)
    ids, positions, aux, last, anchors = batch(gemma4_verifier, drafter, seed=4)
    out = drafter(ids, aux, anchors, document_ids=DOCS, position_ids=positions, return_logits=False)
    cfg = ObjectiveConfig(block_size=drafter.block_size)
    with torch.no_grad():
        _, stats = dspark_loss(drafter, out, ids, MASK, DOCS, anchors, last,
                               Teacher(verifier_decoder(gemma4_verifier).norm, 30.0), cfg)
        _, with_head = dspark_loss(drafter, out, ids, MASK, DOCS, anchors, last, teacher_of(gemma4_verifier), cfg)
    metrics = reduce_stats(stats, cfg.block_size)
    assert metrics["draft_vocab_coverage"] == pytest.approx(1.0)
    assert metrics["accept_len"] == pytest.approx(metrics["restricted_accept_len"], rel=1e-6)
    assert torch.allclose(stats, with_head)
    reduced = tiny_drafter(gemma4_verifier)
    out = reduced(ids, aux, anchors, document_ids=DOCS, position_ids=positions, return_logits=False)
    with pytest.raises(ValueError, match="the teacher has no full-vocabulary output head"):
        dspark_loss(reduced, out, ids, MASK, DOCS, anchors, last, Teacher(verifier_decoder(gemma4_verifier).norm,
                                                                          30.0), cfg)


def test_the_in_process_teacher_shares_the_verifiers_full_head(gemma4_verifier):
    from trainer.states.in_process import InProcessVerifier

    teacher = InProcessVerifier(gemma4_verifier, [2, 3]).teacher()
    head = gemma4_verifier.get_output_embeddings().weight
    assert teacher.output_weight.data_ptr() == head.data_ptr() and teacher.output_weight.shape == head.shape


def test_ce_target_data_uses_the_next_token_when_in_the_draft_vocabulary(gemma4_verifier):
    drafter = tiny_drafter(gemma4_verifier)
    ids, positions, aux, last, anchors = batch(gemma4_verifier, drafter, seed=2)
    draft_ids = drafter.draft_vocab_ids
    ids = draft_ids[ids % draft_ids.numel()]  # every token is in the draft vocabulary
    aux, last = verifier_hidden_states(gemma4_verifier, drafter.config.aux_hidden_state_layer_ids, ids)
    teacher = teacher_of(gemma4_verifier)
    out = drafter(ids, aux, anchors, document_ids=DOCS, position_ids=positions)
    cfg = ObjectiveConfig(block_size=drafter.block_size, ce_target="data", loss_weights={"ce": 1.0},
                          confidence_weight=0.0)
    loss, stats = dspark_loss(drafter, out, ids, MASK, DOCS, anchors, last, teacher, cfg)
    sup = block_supervision(MASK, DOCS, anchors, drafter.block_size)
    r, j, k = sup.nonzero(as_tuple=True)
    nxt = drafter.verifier_to_draft_ids(ids[r, anchors[r, j] + k + 1])
    logq = torch.log_softmax(out.logits[r, j, k], -1)
    w = torch.exp(-k.float() / 4.0)
    expected = -(w * logq.gather(-1, nxt[:, None]).squeeze(-1)).sum() / r.numel()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)


def test_bad_loss_configuration():
    with pytest.raises(ValueError, match="unknown loss terms"):
        ObjectiveConfig(loss_weights={"mse": 1.0})
    with pytest.raises(ValueError, match="ce_target must be"):
        ObjectiveConfig(ce_target="gold")
    with pytest.raises(ValueError, match=r"teacher_vocab must be one of \['draft', 'full'\]"):
        ObjectiveConfig(teacher_vocab="verifier")
    with pytest.raises(ValueError, match=r"confidence_target must be one of \['greedy', 'greedy_t0', 'sampled', 'sampled_restricted'\]"):
        ObjectiveConfig(confidence_target="tv")


PEAK_SCRIPT = r"""
import resource, sys, torch
sys.path[:0] = [sys.argv[1], sys.argv[1] + "/tests"]
from tiny import tiny_drafter
from transformers import Qwen3Config, Qwen3ForCausalLM
from trainer.train.loss import ObjectiveConfig, Teacher, dspark_loss
from modeling_dspark import verifier_decoder
torch.manual_seed(0)
V = 262144
verifier = Qwen3ForCausalLM(Qwen3Config(vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=3,
    num_attention_heads=2, num_key_value_heads=1, head_dim=8)).eval().requires_grad_(False)
drafter = tiny_drafter(verifier, draft_vocab_size=None if sys.argv[2] == "full" else 32000, num_hidden_layers=1,
                       head_dim=8, num_attention_heads=2, num_key_value_heads=1, intermediate_size=32,
                       markov_rank=4, block_size=8, mask_token_id=0).train()
T, N = 200, 128
ids = torch.randint(0, V, (1, T)); docs = torch.zeros(1, T, dtype=torch.long); mask = torch.ones(1, T, dtype=torch.long)
aux = torch.randn(1, T, drafter.fc.in_features); last = torch.randn(1, T, 16)
anchors = torch.arange(N).unsqueeze(0)
out = drafter(ids, aux, anchors, document_ids=docs, return_logits=False)
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
loss, stats = dspark_loss(drafter, out, ids, mask, docs, anchors, last,
                          Teacher(verifier_decoder(verifier).norm, None, verifier.get_output_embeddings().weight),
                          ObjectiveConfig(block_size=8, chunk_elements=1 << 24))
loss.backward()
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(int(stats[0]), (peak - base) / 1024)
"""


@pytest.mark.slow
@pytest.mark.parametrize("vocab", ["full", "32000"])
def test_loss_memory_is_bounded_at_gemma_vocabulary(vocab):
    """1024 supervised slots: one fp32 [slots, 262144] tensor alone is 1 GiB and an unchunked loss needs several;
    the chunked loss and its backward must stay far below that."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    proc = subprocess.run([sys.executable, "-c", PEAK_SCRIPT, root, vocab], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    slots, peak_mib = proc.stdout.split()
    assert int(slots) == 1024
    assert float(peak_mib) < 1200, f"loss peak {peak_mib} MiB"


def test_a_batch_without_supervised_slots_gives_a_zero_loss_with_gradients(gemma4_verifier):
    drafter = tiny_drafter(gemma4_verifier).train()
    ids, positions, aux, last, _ = batch(gemma4_verifier, drafter)
    anchors = torch.full((2, 1), -1)
    out = drafter(ids, aux, anchors, document_ids=DOCS, position_ids=positions, return_logits=False)
    loss, stats = dspark_loss(drafter, out, ids, MASK, DOCS, anchors, last,
                              teacher_of(gemma4_verifier), ObjectiveConfig(block_size=4))
    loss.backward()
    assert loss.item() == 0.0 and reduce_stats(stats, 4)["supervised_slots"] == 0
    assert all(p.grad is not None and not p.grad.any() for p in drafter.parameters() if p.requires_grad)


def test_the_loss_backward_runs_once_and_scales_with_the_incoming_gradient(gemma4_verifier):
    """The closed-form gradients are computed in the forward and scaled by the incoming gradient (gradient
    accumulation and loss scaling multiply the loss); a second backward through the same graph is refused."""
    drafter = tiny_drafter(gemma4_verifier).train()
    ids, positions, aux, last, anchors = batch(gemma4_verifier, drafter, seed=5)
    cfg = ObjectiveConfig(block_size=drafter.block_size, confidence_weight=0.0)
    grads = []
    for scale in (1.0, 0.25):
        drafter.zero_grad()
        out = drafter(ids, aux, anchors, document_ids=DOCS, position_ids=positions, return_logits=False)
        loss, _ = dspark_loss(drafter, out, ids, MASK, DOCS, anchors, last, teacher_of(gemma4_verifier), cfg)
        (loss * scale).backward(retain_graph=True)
        grads.append(drafter.markov_head.markov_w2.weight.grad.clone())
        with pytest.raises(RuntimeError, match="backpropagated twice"):
            loss.backward()
    assert grads[0].abs().max() > 0 and torch.allclose(grads[1], 0.25 * grads[0], rtol=1e-6, atol=1e-12)


def test_one_markov_lookup_feeds_the_logits_and_the_confidence_head(gemma4_verifier):
    """The training forward looks `markov_w1` up once; the loss's logits and the confidence head both read that
    tensor, so the backward builds one dense [V, r] gradient, not two (256 MiB each at Gemma's vocabulary)."""
    drafter = tiny_drafter(gemma4_verifier).train()
    ids, positions, aux, last, anchors = batch(gemma4_verifier, drafter, seed=6)
    lookups = []
    handle = drafter.markov_head.markov_w1.register_forward_hook(lambda *a: lookups.append(1))
    try:
        out = drafter(ids, aux, anchors, document_ids=DOCS, position_ids=positions, return_logits=False)
        loss, _ = dspark_loss(drafter, out, ids, MASK, DOCS, anchors, last, teacher_of(gemma4_verifier),
                              ObjectiveConfig(block_size=drafter.block_size))
    finally:
        handle.remove()
    assert len(lookups) == 1 and out.previous_features.shape == (*out.previous_token_ids.shape, 16)
    loss.backward()
    assert drafter.markov_head.markov_w1.weight.grad.abs().sum() > 0


def test_bf16_drafter_weights_train_with_fp32_gradient_accumulation(gemma4_verifier):
    """A bf16 drafter (bf16 weights, as `--bf16-weights` GPU runs use) goes through the closed-form loss: its
    `markov_w2` gradient is accumulated in fp32 and lands in the parameter's dtype, close to the fp32 drafter's."""
    drafter = tiny_drafter(gemma4_verifier).train()
    ids, positions, aux, last, anchors = batch(gemma4_verifier, drafter, seed=7)
    cfg = ObjectiveConfig(block_size=drafter.block_size)
    grads = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = tiny_drafter(gemma4_verifier).train().to(dtype)
        out = model(ids, aux.to(dtype), anchors, document_ids=DOCS, position_ids=positions, return_logits=False)
        loss, _ = dspark_loss(model, out, ids, MASK, DOCS, anchors, last, teacher_of(gemma4_verifier), cfg)
        loss.backward()
        grad = model.markov_head.markov_w2.weight.grad
        assert grad.dtype == dtype and torch.isfinite(loss)
        grads[dtype] = grad.float()
    reference = grads[torch.float32]
    assert ((grads[torch.bfloat16] - reference).norm() / reference.norm()) < 0.1
