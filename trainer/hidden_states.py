"""Where the verifier's hidden states come from during training.

A *hidden-state source* turns a packed batch into `VerifierStates` (the aux states the drafter reads and
the pre-norm last-layer states the teacher reads) and provides the teacher (the verifier's final norm,
softcap and full output head, which the full-vocabulary metrics need). The trainer only talks to this
interface, so other sources (a vLLM server, an offline cache) plug in by implementing `states()` and
`teacher()`.

The default, `InProcessVerifier`, runs a frozen Hugging Face verifier inside the training process: one
no-grad decoder forward per batch, documents run separately (so a packed row never leaks context across
documents, whatever attention the verifier uses), with the full-vocabulary output head skipped.

Because documents run separately, a document's states depend on its token ids alone. The sources that do
not run the verifier here are therefore per-document (`DocumentStateSource`): they fetch or read each
document's states by `document_key` (a hash of its ids) and `DocumentStateSource.states` packs them into the
batch, one implementation for all of them:

    source                      where the states come from                      module
    InProcessVerifier           the verifier in this process                    here
    VLLMStateSource             vLLM servers (extract_hidden_states), online    trainer/vllm_states.py
    StatesCache                 safetensors shards written before training      trainer/states_cache.py
    HybridSource                the cache, else an online source                trainer/states_cache.py
"""

import hashlib
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


def verifier_teacher(verifier: nn.Module) -> Teacher:
    """The teacher of a verifier (a full model or `trainer.verifier.load_verifier_shell`'s): its final norm,
    softcap and output head, the verifier's own tensors (detach shares them, no copy)."""
    text = verifier.config.get_text_config()
    head = verifier.get_output_embeddings()
    return Teacher(verifier_decoder(verifier).norm, getattr(text, "final_logit_softcapping", None),
                   head.weight.detach() if head is not None else None)


def aux_layer_ids_for_config(config, verifier_config) -> list[int]:
    """The aux ids a run extracts: `model.aux_hidden_state_layer_ids`, or the drafter's default for this verifier
    (configuration_dspark), checked against its layer count. Shared by training, the cache writer and the
    extraction server's command, so all three ask for the same layers."""
    from configuration_dspark import check_aux_layer_ids, default_aux_layer_ids
    from trainer.errors import UsageError

    layers = verifier_config.get_text_config().num_hidden_layers
    try:
        ids = config.model.aux_hidden_state_layer_ids or default_aux_layer_ids(layers)
        check_aux_layer_ids(list(ids), layers)
    except ValueError as e:
        raise UsageError(f"model.aux_hidden_state_layer_ids: {e}") from e
    return list(ids)


def document_key(input_ids: torch.Tensor) -> str:
    """The key of one document's verifier states: a hash of its token ids (the states depend on nothing else,
    since every source runs each document on its own). Shared by the online source, the cache and its writer."""
    return hashlib.blake2b(input_ids.detach().to("cpu", torch.int64).numpy().tobytes(), digest_size=16).hexdigest()


class DocumentStateSource(HiddenStateSource):
    """A source that produces states one document at a time (`document_states`); `states` packs them into the
    batch's rows (padding stays zero). `prefetch` lets the collator announce a batch before the trainer asks
    for it, so a source with latency (a server) can fetch it during the previous step."""

    hidden_size: int
    dtype: torch.dtype

    @abstractmethod
    def document_states(self, documents: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """`(aux [n, k*H], last [n, H])` for each document's token ids `[n]`, in order."""

    def prefetch(self, batch: dict[str, torch.Tensor]) -> None:
        """Start fetching a batch that `states` will be asked for soon (no-op unless the source has latency)."""

    @staticmethod
    def documents(batch: dict[str, torch.Tensor]) -> tuple[list[tuple[int, int, int]], list[torch.Tensor]]:
        """The `(row, start, end)` segments of a batch and each one's token ids (on the CPU)."""
        segments = document_segments(batch["document_ids"].cpu())
        input_ids = batch["input_ids"].cpu()
        return segments, [input_ids[r, s:e] for r, s, e in segments]

    @torch.no_grad()
    def states(self, batch: dict[str, torch.Tensor]) -> VerifierStates:
        rows, length = batch["input_ids"].shape
        segments, documents = self.documents(batch)
        width = self.hidden_size * len(self.aux_layer_ids)
        aux_out = torch.zeros(rows, length, width, dtype=self.dtype)
        last_out = torch.zeros(rows, length, self.hidden_size, dtype=self.dtype)
        for (r, s, e), (aux, last) in zip(segments, self.document_states(documents)):
            aux_out[r, s:e] = aux
            last_out[r, s:e] = last
        return VerifierStates(aux_out, last_out)


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
