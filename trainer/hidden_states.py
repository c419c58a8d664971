"""Where the verifier's hidden states come from during training.

A *hidden-state source* turns a packed batch into `VerifierStates` (the aux states the drafter reads and
the pre-norm last-layer states the teacher reads) and provides the teacher (the verifier's final norm,
softcap and full output head, which the full-vocabulary metrics need). The trainer only talks to this
interface, so other sources (a vLLM server, an offline cache) plug in by implementing `states()` and
`teacher()`.

The default, `InProcessVerifier`, runs a frozen Hugging Face verifier inside the training process: one
no-grad decoder forward per batch, documents run separately (so a packed row never leaks context across
documents, whatever attention the verifier uses), with the full-vocabulary output head skipped.
"""

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
from torch import nn

from modeling_dspark import VerifierStateCapture, document_segments, verifier_decoder
from trainer.objective import Teacher


@dataclass
class VerifierStates:
    aux_hidden_states: torch.Tensor  # [R, T, k*H]
    last_hidden_state: torch.Tensor  # [R, T, H], before the verifier's final norm


class HiddenStateSource(ABC):
    """Interface between the trainer and whatever produces verifier states."""

    aux_layer_ids: list[int]

    @abstractmethod
    def states(self, batch: dict[str, torch.Tensor]) -> VerifierStates:
        """States for a collated batch (`input_ids`, `document_ids`, `position_ids`, `[R, T]`)."""

    @abstractmethod
    def teacher(self) -> Teacher:
        """The verifier's final norm, softcap and full output head (shared), applied by the loss to
        `last_hidden_state`; a source without the head supports only full-vocabulary drafters."""


class InProcessVerifier(HiddenStateSource):
    """A frozen HF causal LM in the training process (replicated per rank under DDP)."""

    def __init__(self, verifier: nn.Module, aux_layer_ids: list[int], max_tokens_per_forward: int = 16384):
        self.verifier = verifier
        self.aux_layer_ids = list(aux_layer_ids)
        self.max_tokens_per_forward = max_tokens_per_forward
        text = verifier.config.get_text_config()
        head = verifier.get_output_embeddings()  # the verifier's own tensor (detach shares it, no copy)
        self._teacher = Teacher(verifier_decoder(verifier).norm, getattr(text, "final_logit_softcapping", None),
                                head.weight.detach() if head is not None else None)
        VerifierStateCapture(verifier, self.aux_layer_ids)  # validates the layer ids against this verifier

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


class CachedStates(HiddenStateSource):
    """Keeps the verifier states of each packed row after computing them once, for multi-epoch runs on small
    data where the frozen verifier's forward dominates the step (the CPU demo). Rows are keyed by
    `row_index`, so use one instance per dataset; caching stops at `max_bytes` (later rows are recomputed)."""

    def __init__(self, source: HiddenStateSource, max_bytes: int):
        self.source = source
        self.aux_layer_ids = source.aux_layer_ids
        self.max_bytes = max_bytes
        self.bytes = 0
        self._rows: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def teacher(self) -> Teacher:
        return self.source.teacher()

    def states(self, batch: dict[str, torch.Tensor]) -> VerifierStates:
        rows = batch["row_index"].tolist()
        length = batch["input_ids"].shape[1]
        if not all(r in self._rows for r in rows):
            computed = self.source.states(batch)
            for i, r in enumerate(rows):
                n = int((batch["document_ids"][i] >= 0).sum())
                size = (computed.aux_hidden_states[i, :n].numel() + computed.last_hidden_state[i, :n].numel()) * \
                    computed.aux_hidden_states.element_size()
                if r not in self._rows and self.bytes + size <= self.max_bytes:
                    self._rows[r] = (computed.aux_hidden_states[i, :n].clone(), computed.last_hidden_state[i, :n].clone())
                    self.bytes += size
            return computed
        aux = [self._rows[r][0] for r in rows]
        last = [self._rows[r][1] for r in rows]
        pad = lambda t: torch.nn.functional.pad(t, (0, 0, 0, length - t.shape[0]))  # noqa: E731
        return VerifierStates(torch.stack([pad(a) for a in aux]), torch.stack([pad(x) for x in last]))
