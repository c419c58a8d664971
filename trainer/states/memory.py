"""`MemoryRowCache`: an in-memory cache of each packed row's states in front of another source, for multi-epoch
runs on small data (not to be confused with the offline cache on disk, trainer/states/offline_cache.py).
"""

import torch

from trainer.states.source import HiddenStateSource, VerifierStates
from trainer.verifier.teacher import FullVocabulary, Teacher


class MemoryRowCache(HiddenStateSource):
    """Keeps the verifier states of each packed row after computing them once, for multi-epoch runs on small
    data where the frozen verifier's forward dominates the step (the CPU demo). Rows are keyed by
    `row_index`, so use one instance per dataset; caching stops at `max_bytes` (later rows are recomputed).

    A cached row also keeps what the loss learns of the verifier's full-vocabulary pass at its positions
    (`FullVocabulary`): every batch hands out fresh `[R, T]` tensors holding what is known, and each cached row
    keeps a view of its row of them, so the positions the loss computes during the step stay known for the
    next epoch, whose anchors land on other positions (the pass then runs about once per position of the data)."""

    def __init__(self, source: HiddenStateSource, max_bytes: int):
        self.source = source
        self.aux_layer_ids = source.aux_layer_ids
        self.max_bytes = max_bytes
        self.bytes = 0
        self._rows: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._full: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # row -> views of (log_z, argmax)

    def teacher(self) -> Teacher:
        return self.source.teacher()

    def states(self, batch: dict[str, torch.Tensor]) -> VerifierStates:
        rows = batch["row_index"].tolist()
        length = batch["input_ids"].shape[1]
        if all(r in self._rows for r in rows):
            aux = [self._rows[r][0] for r in rows]
            last = [self._rows[r][1] for r in rows]
            pad = lambda t: torch.nn.functional.pad(t, (0, 0, 0, length - t.shape[0]))  # noqa: E731
            states = VerifierStates(torch.stack([pad(a) for a in aux]), torch.stack([pad(x) for x in last]))
        else:
            states = self.source.states(batch)
            for i, r in enumerate(rows):
                n = int((batch["document_ids"][i] >= 0).sum())
                # the states, and the full-vocabulary log-normaliser and argmax of each position (12 bytes)
                size = (states.aux_hidden_states[i, :n].numel() + states.last_hidden_state[i, :n].numel()) * \
                    states.aux_hidden_states.element_size() + 12 * n
                if r not in self._rows and self.bytes + size <= self.max_bytes:
                    self._rows[r] = (states.aux_hidden_states[i, :n].clone(), states.last_hidden_state[i, :n].clone())
                    self.bytes += size
        states.full_vocabulary = self._full_vocabulary(rows, length, states.last_hidden_state.dtype,
                                                       states.full_vocabulary)
        return states

    def _full_vocabulary(self, rows: list[int], length: int, dtype: torch.dtype,
                         known: FullVocabulary | None = None) -> FullVocabulary:
        """The batch's `FullVocabulary`: what the inner source knows (`known`, e.g. the offline cache's stored
        pass) or else nothing, with what is known of each cached row copied in where that is unknown, then that
        row's views moved to this batch's tensors (which the loss fills in)."""
        full = known if known is not None else FullVocabulary.unknown(len(rows), length, dtype)
        for i, r in enumerate(rows):
            if r not in self._rows:
                continue
            n = self._rows[r][1].shape[0]
            if r in self._full:
                log_z, argmax = self._full[r]
                fill = (full.argmax[i, :n] < 0) & (argmax >= 0)
                full.log_z[i, :n][fill], full.argmax[i, :n][fill] = log_z[fill], argmax[fill]
            self._full[r] = (full.log_z[i, :n], full.argmax[i, :n])
        return full
