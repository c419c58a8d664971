"""The teacher: the verifier's own next-token distribution at the drafted positions, from its pre-norm last-layer
states through its final norm, output head and softcap. Every hidden-state source provides one, and the loss
reads it; it lives with the verifier, not with the loss, so the states layer does not depend on the loss.
"""

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from modeling_dspark import CompiledOrEager, verifier_decoder


def upcast(x: torch.Tensor) -> torch.Tensor:
    """At least fp32 (bf16 logits are upcast; a float64 run, as the reference tests use, stays float64)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


# Vocabulary rows per full-vocabulary chunk are rounded down to a multiple of this (see `Teacher.full_vocabulary`).
VOCAB_ALIGNMENT = 128


def softcapped(logits: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """The verifier's final-logit softcap, `tanh(logits / softcap) * softcap` (Gemma), or the logits unchanged."""
    return torch.tanh(logits / softcap) * softcap if softcap else logits


def softcapped_max_logsumexp(raw: torch.Tensor, softcap: float | None):
    """`(max, argmax, logsumexp)` over the last dimension of the softcapped logits `raw` (the head's dtype), at
    least in fp32: one vocabulary chunk of `Teacher.full_vocabulary`. The first id wins a tie."""
    logits = softcapped(upcast(raw), softcap)
    value, index = logits.max(dim=-1)
    log_z = logits.sub_(value.unsqueeze(-1)).exp_().sum(dim=-1).log_().add_(value)
    return value, index, log_z


# On a GPU the reduction above runs compiled: eagerly it is about ten full passes over each [positions, chunk]
# fp32 tensor (upcast, softcap, max, subtract, exp, sum); compiled, the chunk's logits are read by a fused kernel
# or two.
_FUSED_MAX_LOGSUMEXP = CompiledOrEager(softcapped_max_logsumexp, "the full-vocabulary reduction")


# ------------------------------------------------------------------------------------------------ teacher
@dataclass
class FullVocabulary:
    """The verifier's full-vocabulary log-normaliser and argmax (verifier id) per position of a batch, `[R, T]`
    each, NaN and -1 where not known yet.

    They depend on the position's verifier state alone, so a source that keeps a row's states across epochs
    (`MemoryRowCache`) keeps these too: the loss reads the known ones and writes the ones it computes into these
    tensors in place, and the V x H pass then runs once per position of the data rather than once per distinct
    position of every step."""

    log_z: torch.Tensor  # [R, T], the states' dtype (at least fp32)
    argmax: torch.Tensor  # [R, T] long

    @classmethod
    def unknown(cls, rows: int, length: int, dtype: torch.dtype) -> "FullVocabulary":
        return cls(torch.full((rows, length), math.nan, dtype=torch.promote_types(dtype, torch.float32)),
                   torch.full((rows, length), -1, dtype=torch.long))

    def lookup(self, teacher: "Teacher", normed: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor,
               chunk_elements: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`(log_z, argmax)` at the given positions (`normed`: their normalised states): read where known,
        computed by `teacher.full_vocabulary` and written back where not."""
        device = normed.device
        rows, positions = rows.to(self.log_z.device), positions.to(self.log_z.device)
        log_z, argmax = self.log_z[rows, positions], self.argmax[rows, positions]
        missing = (argmax < 0).nonzero().squeeze(-1)
        if missing.numel():
            z, a = teacher.full_vocabulary(normed[missing.to(device)], chunk_elements)
            log_z[missing], argmax[missing] = z.to(log_z), a.to(argmax.device)
            self.log_z[rows[missing], positions[missing]] = log_z[missing]
            self.argmax[rows[missing], positions[missing]] = argmax[missing]
        return log_z.to(device), argmax.to(device)


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
        return softcapped(upcast(F.linear(normed.to(head_weight.dtype), head_weight)), self.softcap)

    @torch.no_grad()
    def logits(self, last_hidden: torch.Tensor, head_weight: torch.Tensor) -> torch.Tensor:
        return self.head_logits(self.normed(last_hidden), head_weight)

    @torch.no_grad()
    def full_vocabulary(self, normed: torch.Tensor, chunk_elements: int):
        """Log-normaliser and argmax (verifier id) of the verifier's distribution over its whole vocabulary, each
        `[n]`, from the full output head in vocabulary chunks of `chunk_elements // n` rows, so no `[n, V]` tensor
        exists. One pass per chunk: the running max gives both the argmax and the logsumexp's shift (the lowest id
        wins a tie, as argmax over the whole vocabulary does). Contiguous row slices are views of the shared head,
        never copies. On a GPU each chunk's reduction runs compiled (`_FUSED_MAX_LOGSUMEXP`)."""
        weight = self.output_weight
        vocab, n = weight.shape[0], normed.shape[0]
        device = normed.device
        h = normed.to(weight.dtype)
        dtype = torch.promote_types(weight.dtype, torch.float32)
        log_z = torch.full((n,), -math.inf, device=device, dtype=dtype)
        best = torch.full((n,), -math.inf, device=device, dtype=dtype)
        best_id = torch.full((n,), vocab, dtype=torch.long, device=device)
        step = max(1, chunk_elements // max(n, 1))
        if step >= VOCAB_ALIGNMENT:
            # Each chunk's logits are [n, step]: a row length that is not a multiple of 8 bf16 values sends cuBLAS
            # to a slow fallback GEMM (3.6 ms a chunk on an H200 at the seed shapes; aligned, the default
            # objective's loss went from 58 to 30 ms there, benchmarks/RESULTS.md).
            step -= step % VOCAB_ALIGNMENT
        reduce = _FUSED_MAX_LOGSUMEXP if device.type == "cuda" else softcapped_max_logsumexp
        for start in range(0, vocab, step):
            value, index, chunk_log_z = reduce(F.linear(h, weight[start : start + step]), self.softcap)
            log_z = torch.logaddexp(log_z, chunk_log_z)
            better = value > best  # strict: an earlier chunk's (lower) id keeps a tie
            best = torch.where(better, value, best)
            best_id = torch.where(better, index + start, best_id)
        return log_z, best_id


def verifier_teacher(verifier: nn.Module) -> Teacher:
    """The teacher of a verifier (a full model or `trainer.verifier.loading.load_verifier_shell`'s): its final norm,
    softcap and output head, the verifier's own tensors (detach shares them, no copy)."""
    text = verifier.config.get_text_config()
    head = verifier.get_output_embeddings()
    return Teacher(verifier_decoder(verifier).norm, getattr(text, "final_logit_softcapping", None),
                   head.weight.detach() if head is not None else None)
