"""Anchors, block supervision, teacher, loss and metrics against brute-force reference formulas."""

import math
import os
import subprocess
import sys

import pytest
import torch

from modeling_dspark import positions_from_document_ids, verifier_decoder, verifier_hidden_states
from tiny import VOCAB, tiny_drafter
from trainer.objective import (
    ObjectiveConfig,
    Teacher,
    anchor_candidates,
    block_supervision,
    dspark_loss,
    reduce_stats,
    sample_anchors,
)

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


def reference_loss(drafter, verifier, ids, positions, aux, last, anchors, cfg):
    """Straight formulas over full (unchunked) logits."""
    out = drafter(ids, aux, anchors, document_ids=DOCS, position_ids=positions)
    norm = verifier_decoder(verifier).norm
    W = drafter.lm_head.weight
    cap = verifier.config.get_text_config().final_logit_softcapping
    sup = reference_supervision(MASK, DOCS, anchors, cfg.block_size)
    total, S, rows = 0.0, 0, []
    for r in range(2):
        for j in range(anchors.shape[1]):
            chain, chain_greedy, block = 1.0, 1.0, []
            for k in range(cfg.block_size):
                if not sup[r, j, k]:
                    chain = 0.0
                    chain_greedy = 0.0
                    block.append((k, None))
                    continue
                p_pos = int(anchors[r, j]) + k
                t_logits = norm(last[r, p_pos]) @ W.T
                if cap:
                    t_logits = torch.tanh(t_logits / cap) * cap
                p = torch.softmax(t_logits.double(), -1)
                q = torch.softmax(out.logits[r, j, k].double(), -1)
                tv = 0.5 * (p - q).abs().sum()
                ce = -torch.log(q[p.argmax()])
                a = 1 - tv
                c = out.confidence_logits[r, j, k].double()
                bce = -(a * torch.log(torch.sigmoid(c)) + (1 - a) * torch.log(1 - torch.sigmoid(c)))
                w = math.exp(-k / cfg.decay_gamma)
                total = total + w * (0.1 * ce + 0.9 * tv) + 1.0 * w * bce
                S += 1
                chain *= float(a.detach())
                chain_greedy *= float(q.argmax() == p.argmax())
                block.append((k, chain, chain_greedy, float(a.detach())))
            if sup[r, j, 0]:
                rows.append(block)
    accept_len = sum(1 + sum(e[1] for e in b if e[1] is not None) for b in rows) / len(rows)
    greedy_len = sum(1 + sum(e[2] for e in b if e[1] is not None) for b in rows) / len(rows)
    pos = [sum(e[1] for b in rows for e in b if e[0] == k and e[1] is not None) / len(rows)
           for k in range(cfg.block_size)]
    return total / S, accept_len, greedy_len, pos, S


@pytest.mark.parametrize("chunk_elements", [1 << 26, 150])  # one chunk, and ~1 slot per chunk
def test_loss_and_metrics_equal_reference_formulas(gemma4_verifier, chunk_elements):
    drafter = tiny_drafter(gemma4_verifier).double()
    cfg = ObjectiveConfig(block_size=drafter.block_size, chunk_elements=chunk_elements)
    ids, positions, aux, last, anchors = batch(gemma4_verifier, drafter)
    aux, last = aux.double(), last.double()
    verifier = gemma4_verifier.double()
    try:
        teacher = Teacher(verifier_decoder(verifier).norm, 30.0)
        out = drafter(ids, aux, anchors, document_ids=DOCS, position_ids=positions, return_logits=False)
        loss, stats = dspark_loss(drafter, out, ids, MASK, DOCS, anchors, last, teacher, cfg)
        ref_loss, ref_len, ref_greedy, ref_pos, S = reference_loss(drafter, verifier, ids, positions, aux, last,
                                                                     anchors, cfg)
    finally:
        gemma4_verifier.float()
    metrics = reduce_stats(stats, cfg.block_size)
    assert metrics["supervised_slots"] == S > 10
    assert loss.item() == pytest.approx(float(ref_loss.detach()), rel=1e-6)
    assert metrics["accept_len"] == pytest.approx(ref_len, rel=1e-6)
    assert metrics["greedy_accept_len"] == pytest.approx(ref_greedy, rel=1e-6)
    for k in range(cfg.block_size):
        assert metrics[f"pos_{k}"] == pytest.approx(ref_pos[k], rel=1e-6, abs=1e-9)
    assert 1.0 <= metrics["accept_len"] <= 1 + cfg.block_size


def test_chunked_gradients_equal_unchunked(gemma4_verifier):
    drafter = tiny_drafter(gemma4_verifier).train()
    ids, positions, aux, last, anchors = batch(gemma4_verifier, drafter, seed=1)
    teacher = Teacher(verifier_decoder(gemma4_verifier).norm, 30.0)
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


def test_ce_target_data_uses_the_next_token_when_in_the_draft_vocabulary(gemma4_verifier):
    drafter = tiny_drafter(gemma4_verifier)
    ids, positions, aux, last, anchors = batch(gemma4_verifier, drafter, seed=2)
    draft_ids = drafter.draft_vocab_ids
    ids = draft_ids[ids % draft_ids.numel()]  # every token is in the draft vocabulary
    aux, last = verifier_hidden_states(gemma4_verifier, drafter.config.aux_hidden_state_layer_ids, ids)
    teacher = Teacher(verifier_decoder(gemma4_verifier).norm, 30.0)
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


PEAK_SCRIPT = r"""
import resource, sys, torch
sys.path[:0] = [sys.argv[1], sys.argv[1] + "/tests"]
from tiny import tiny_drafter
from transformers import Qwen3Config, Qwen3ForCausalLM
from trainer.objective import ObjectiveConfig, Teacher, dspark_loss
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
loss, stats = dspark_loss(drafter, out, ids, mask, docs, anchors, last, Teacher(verifier_decoder(verifier).norm, None),
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
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
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
                              Teacher(verifier_decoder(gemma4_verifier).norm, 30.0), ObjectiveConfig(block_size=4))
    loss.backward()
    assert loss.item() == 0.0 and reduce_stats(stats, 4)["supervised_slots"] == 0
    assert all(p.grad is not None and not p.grad.any() for p in drafter.parameters() if p.requires_grad)
