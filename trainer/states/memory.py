"""`MemoryRowCache`: an in-memory cache of each packed row's states in front of another source, for multi-epoch
runs on small data (not to be confused with the offline cache on disk, trainer/states/offline_cache.py).
"""

import torch

from trainer.states.source import HiddenStateSource, VerifierStates
from trainer.verifier.teacher import Teacher


class MemoryRowCache(HiddenStateSource):
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
