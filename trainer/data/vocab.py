"""The draft vocabulary (docs/algorithm.md): the `Vd` most frequent supervised tokens of the
training split, sorted ascending, cached beside the tokenised data and stored in the drafter (`d2t`/`t2d`,
set by `DSparkDraftModel.set_draft_vocab`, the one place where the id mapping is built)."""

import hashlib
import os

import torch

from configuration_dspark import check_draft_vocab_size
from trainer.errors import UsageError
from trainer.files import atomic_path


def draft_vocab_from_counts(counts: torch.Tensor, draft_vocab_size: int) -> torch.Tensor:
    """Top `draft_vocab_size` ids by count (ties: lower id first), filled with the lowest unused ids when the
    data has fewer distinct tokens, returned sorted ascending."""
    vocab_size = counts.numel()
    try:
        check_draft_vocab_size(draft_vocab_size, vocab_size)
    except ValueError as e:
        raise UsageError(str(e)) from e
    counts = counts.to(torch.long).cpu()
    # stable sort on -count keeps ascending ids among equal counts
    order = torch.sort(-counts, stable=True).indices
    seen = order[counts[order] > 0][:draft_vocab_size]
    if seen.numel() < draft_vocab_size:
        unused = torch.ones(vocab_size, dtype=torch.bool)
        unused[seen] = False
        seen = torch.cat([seen, unused.nonzero().flatten()[: draft_vocab_size - seen.numel()]])
    return seen.sort().values


def build_draft_vocab(train_dataset, vocab_size: int, draft_vocab_size: int, cache_dir: str | None = None) -> torch.Tensor:
    """Count supervised tokens over `train_dataset` (tokenised conversations) and select the draft vocabulary.

    The result is cached next to the dataset's arrow cache files (or in `cache_dir`), keyed by the dataset
    fingerprint, so restarts and other ranks reuse it.
    """
    from trainer.data.packing import supervised_token_counts

    path = None
    fingerprint = getattr(train_dataset, "_fingerprint", None)
    files = getattr(train_dataset, "cache_files", None) or []
    directory = cache_dir or (os.path.dirname(files[0]["filename"]) if files else None)
    if directory and fingerprint:
        key = hashlib.sha1(f"{fingerprint}-{vocab_size}".encode()).hexdigest()[:16]
        path = os.path.join(directory, f"dspark-token-counts-{key}.pt")
    if path and os.path.exists(path):
        counts = torch.load(path, weights_only=True)
    else:
        counts = supervised_token_counts(train_dataset, vocab_size)
        if path:
            with atomic_path(path, unique=True) as tmp:  # every rank may count and write it at once
                torch.save(counts, tmp)
    if int((counts > 0).sum()) == 0:
        raise UsageError("the training split has no supervised tokens; check that the data has assistant turns.")
    return draft_vocab_from_counts(counts, draft_vocab_size)
