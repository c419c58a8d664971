"""`InProcessVerifier`, the default hidden-state source: a frozen Hugging Face verifier inside the training
process, one no-grad decoder forward per group of documents (each document on its own, so a packed row never
leaks context across documents), with the full-vocabulary output head skipped; and `verifier_hidden_states`, one
such decoder forward over a batch of ids (the evaluator's fidelity check, tests, benchmarks).
"""

from collections.abc import Sequence

import torch
from torch import nn

from modeling_dspark import VerifierStateCapture, verifier_decoder
from trainer.states.source import DocumentStateSource, VerifierStates, document_segments
from trainer.verifier.teacher import Teacher, verifier_teacher


@torch.no_grad()
def verifier_hidden_states(
    verifier: nn.Module, aux_layer_ids: Sequence[int], input_ids: torch.Tensor, **forward_kwargs
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the verifier's decoder once (no output head) and return `(aux_hidden_states, last_hidden_state)`."""
    with VerifierStateCapture(verifier, aux_layer_ids) as capture:
        verifier_decoder(verifier)(input_ids=input_ids, use_cache=False, **forward_kwargs)
    return capture.aux_hidden_states, capture.last_hidden_state


class InProcessVerifier(DocumentStateSource):
    """A frozen HF causal LM in the training process (replicated per rank under DDP). `states` runs a batch's
    documents grouped by length (its own packing); `document_states` serves the per-document callers (the
    cache writer, equivalence checks)."""

    def __init__(self, verifier: nn.Module, aux_layer_ids: list[int], max_tokens_per_forward: int = 16384):
        self.verifier = verifier
        self.aux_layer_ids = list(aux_layer_ids)
        self.max_tokens_per_forward = max_tokens_per_forward
        text = verifier.config.get_text_config()
        self._teacher = verifier_teacher(verifier)
        VerifierStateCapture(verifier, self.aux_layer_ids)  # validates the layer ids against this verifier
        self.hidden_size = text.hidden_size
        self.dtype = next(verifier.parameters()).dtype

    def document_states(self, documents: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        if not documents:
            return []
        length = max(int(d.numel()) for d in documents)
        batch = {"input_ids": torch.zeros(len(documents), length, dtype=torch.long),
                 "document_ids": torch.full((len(documents), length), -1, dtype=torch.long)}
        for i, d in enumerate(documents):
            batch["input_ids"][i, : d.numel()] = d
            batch["document_ids"][i, : d.numel()] = 0
        states = self.states(batch)
        return [(states.aux_hidden_states[i, : d.numel()].cpu(), states.last_hidden_state[i, : d.numel()].cpu())
                for i, d in enumerate(documents)]

    @property
    def device(self) -> torch.device:
        return next(self.verifier.parameters()).device

    def teacher(self) -> Teacher:
        return self._teacher

    @torch.no_grad()
    def states(self, batch: dict[str, torch.Tensor]) -> VerifierStates:
        input_ids, documents = batch["input_ids"], batch["document_ids"]
        rows, length = input_ids.shape
        segments = document_segments(documents)  # (row, start, end) of every document
        device = self.device
        aux_out = last_out = None
        segments.sort(key=lambda s: s[2] - s[1], reverse=True)
        i = 0
        while i < len(segments):
            longest = segments[i][2] - segments[i][1]
            take = max(1, self.max_tokens_per_forward // max(longest, 1))
            group = segments[i : i + take]
            i += take
            ids = torch.zeros(len(group), longest, dtype=torch.long)
            mask = torch.zeros(len(group), longest, dtype=torch.long)
            for g, (r, s, e) in enumerate(group):
                ids[g, : e - s] = input_ids[r, s:e]
                mask[g, : e - s] = 1
            with VerifierStateCapture(self.verifier, self.aux_layer_ids) as capture:
                verifier_decoder(self.verifier)(
                    input_ids=ids.to(device), attention_mask=mask.to(device), use_cache=False
                )
            aux, last = capture.aux_hidden_states, capture.last_hidden_state
            if aux_out is None:
                aux_out = aux.new_zeros(rows, length, aux.shape[-1])
                last_out = last.new_zeros(rows, length, last.shape[-1])
            for g, (r, s, e) in enumerate(group):
                aux_out[r, s:e] = aux[g, : e - s]
                last_out[r, s:e] = last[g, : e - s]
        if aux_out is None:  # a batch of padding only
            text = self.verifier.config.get_text_config()
            aux_out = torch.zeros(rows, length, text.hidden_size * len(self.aux_layer_ids), device=device)
            last_out = torch.zeros(rows, length, text.hidden_size, device=device)
        return VerifierStates(aux_out, last_out)
