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
    InProcessVerifier           the verifier in this process                    trainer/states/in_process.py
    VLLMStateSource             vLLM servers (extract_hidden_states), online    trainer/states/vllm.py
    OfflineCache                 safetensors shards written before training      trainer/states/cache_format.py
    HybridSource                the cache, else an online source                trainer/states/hybrid.py
"""

import hashlib
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from modeling_dspark import index_within_runs
from trainer.verifier.teacher import FullVocabulary, Teacher


@dataclass
class VerifierStates:
    aux_hidden_states: torch.Tensor  # [R, T, k*H]
    last_hidden_state: torch.Tensor  # [R, T, H], before the verifier's final norm
    # what is known of the full-vocabulary pass at these positions (a source that keeps rows across epochs)
    full_vocabulary: FullVocabulary | None = None


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


def document_segments(document_ids: torch.Tensor) -> list[tuple[int, int, int]]:
    """`(row, start, end)` of every document (run of equal ids `>= 0`) of packed rows `[R, T]`, `end` exclusive.

    Row-major, left to right; padding runs (id `-1`) are skipped. Used to run each document through the
    verifier on its own, so no state leaks across the documents of a packed row.
    """
    rows, length = document_ids.shape
    if rows == 0 or length == 0:
        return []
    row, start = (index_within_runs(document_ids) == 0).nonzero(as_tuple=True)  # run starts, row-major
    same_row_next = torch.zeros_like(row, dtype=torch.bool)
    same_row_next[:-1] = row[1:] == row[:-1]
    end = torch.where(same_row_next, start.roll(-1), torch.full_like(start, length))
    keep = document_ids[row, start] >= 0
    return list(zip(row[keep].tolist(), start[keep].tolist(), end[keep].tolist()))


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

    def document_full_vocabulary(self, documents: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor] | None] | None:
        """What the source knows of the verifier's full-vocabulary pass (`log_z [n]`, `argmax [n]`) for each
        document, None for one it does not know (or None for all): the offline cache stores it."""
        return None

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
        known = self.document_full_vocabulary(documents)
        full = None
        if known is not None and any(k is not None for k in known):
            full = FullVocabulary.unknown(rows, length, self.dtype)
            for (r, s, e), pair in zip(segments, known):
                if pair is not None:
                    full.log_z[r, s:e], full.argmax[r, s:e] = pair
        return VerifierStates(aux_out, last_out, full)
