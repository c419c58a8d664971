"""`HybridSource`: documents the offline cache holds are read from it, the rest come from an online source (vLLM),
so a partly written cache still serves a run.
"""

from __future__ import annotations

import torch

from trainer.errors import DSparkError, UsageError
from trainer.states.offline_cache import OfflineCache
from trainer.states.source import DocumentStateSource, document_key
from trainer.verifier.teacher import Teacher


class HybridSource(DocumentStateSource):
    """Cached documents from the cache, the others from `fallback` (an online source), in one fallback call per
    batch; states come out in the cache's dtype. Counts what each side served (`served`, `share()`, `report()`)."""

    def __init__(self, cache: OfflineCache, fallback: DocumentStateSource, fallback_name: str | None = None):
        if list(fallback.aux_layer_ids) != cache.aux_layer_ids or fallback.hidden_size != cache.hidden_size:
            raise UsageError(f"the cache {cache.cache_dir} holds aux layers {cache.aux_layer_ids} of hidden size "
                             f"{cache.hidden_size}, but the fallback serves {list(fallback.aux_layer_ids)} of "
                             f"{fallback.hidden_size}; rebuild the cache or configure both for the same layers.")
        self.cache = cache
        self.fallback = fallback
        names = {"VLLMStateSource": "vllm", "InProcessVerifier": "the in-process verifier"}
        known = [names[c.__name__] for c in type(fallback).__mro__ if c.__name__ in names]
        self.fallback_name = fallback_name or (known[0] if known else type(fallback).__name__)
        self.aux_layer_ids = cache.aux_layer_ids
        self.hidden_size = cache.hidden_size
        self.dtype = cache.dtype
        self.served = {"cache": {"documents": 0, "tokens": 0}, "fallback": {"documents": 0, "tokens": 0}}

    def teacher(self) -> Teacher:
        return self.fallback.teacher()

    def prefetch(self, batch: dict[str, torch.Tensor]) -> None:
        """Announce to the fallback only the documents the cache lacks, as a sub-batch of one document per row
        (`input_ids`, `document_ids`, `position_ids`), so it never fetches (or holds) a cached document."""
        missing = [d for d in self.documents(batch)[1] if not self.cache.contains(document_key(d))]
        if not missing:
            return
        length = max(int(d.numel()) for d in missing)
        sub = {"input_ids": torch.zeros(len(missing), length, dtype=torch.long),
               "document_ids": torch.full((len(missing), length), -1, dtype=torch.long),
               "position_ids": torch.zeros(len(missing), length, dtype=torch.long)}
        for i, d in enumerate(missing):
            n = int(d.numel())
            sub["input_ids"][i, :n] = d
            sub["document_ids"][i, :n] = 0
            sub["position_ids"][i, :n] = torch.arange(n)
        self.fallback.prefetch(sub)

    def document_states(self, documents: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        cached = [self.cache.contains(document_key(d)) for d in documents]
        hits = iter(self.cache.document_states([d for d, c in zip(documents, cached) if c]))
        missing = [d for d, c in zip(documents, cached) if not c]
        answered = self.fallback.document_states(missing) if missing else []
        if len(answered) != len(missing):
            raise DSparkError(f"the fallback ({self.fallback_name}) returned {len(answered)} results for "
                              f"{len(missing)} documents; fix the source to answer every document.")
        misses = iter(answered)
        out = []
        for d, c in zip(documents, cached):
            aux, last = next(hits) if c else next(misses)
            side = self.served["cache" if c else "fallback"]
            side["documents"] += 1
            side["tokens"] += int(d.numel())
            out.append((aux.to(self.dtype), last.to(self.dtype)))
        return out

    def document_full_vocabulary(self, documents: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor] | None] | None:
        """The cache's stored full-vocabulary pass for the documents it holds (the loss computes the others')."""
        if not self.cache.full_vocabulary:
            return None
        cached = [d for d in documents if self.cache.contains(document_key(d))]
        hits = iter(self.cache.document_full_vocabulary(cached) if cached else [])
        return [next(hits) if self.cache.contains(document_key(d)) else None for d in documents]

    def share(self) -> float:
        """The share of served tokens that came from the cache (0.0 before anything was served)."""
        total = self.served["cache"]["tokens"] + self.served["fallback"]["tokens"]
        return self.served["cache"]["tokens"] / total if total else 0.0

    def report(self) -> str:
        c, f = self.served["cache"], self.served["fallback"]
        if not c["documents"] + f["documents"]:
            return "hidden states: nothing served yet"
        share = self.share()
        return (f"hidden states: {100 * share:.1f}% of tokens ({c['documents']} of {c['documents'] + f['documents']} "
                f"documents) from the cache, {100 * (1 - share):.1f}% from {self.fallback_name}")
