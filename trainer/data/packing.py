"""Tokenised conversations -> packed training rows: best-fit bin packing of whole conversations into rows of
`total_seq_length` tokens (`pack_conversations`), the dataset of those rows with per-document position ids
(`PackedDataset`), the collator that pads them and announces each batch to the hidden-state source
(`DSparkCollator`), and the supervised-token counts the draft vocabulary is built from.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import datasets
import numpy as np
import pyarrow.compute as pc
import torch
from tqdm.auto import tqdm

from modeling_dspark import positions_from_document_ids


def pack_conversations(lengths: Sequence[int], total_seq_length: int, seed: int) -> list[list[int]]:
    """Bin-pack conversation indices into rows of at most `total_seq_length` tokens (best-fit decreasing).

    Longest conversations are placed first, each into the open row with the least room that still fits it,
    which wastes little padding; equal lengths are ordered by a `seed`-ed shuffle, so the result is a
    deterministic function of (lengths, total_seq_length, seed). Rows list indices longest first.
    """
    lengths = [int(n) for n in lengths]
    for i, n in enumerate(lengths):
        if not 1 <= n <= total_seq_length:
            raise ValueError(
                f"conversation {i} has {n} tokens, which does not fit a packed row of total_seq_length="
                f"{total_seq_length}; prepare the data with max_seq_length <= total_seq_length."
            )
    order = list(range(len(lengths)))
    random.Random(seed).shuffle(order)
    order.sort(key=lambda i: -lengths[i])  # stable: ties keep the seeded order

    # Open rows are bucketed by their remaining room; a segment tree over room sizes 0..total_seq_length
    # finds the smallest room >= n in O(log T), so packing millions of conversations stays fast.
    size = 1 << total_seq_length.bit_length()
    tree = [0] * (2 * size)
    buckets: dict[int, list[int]] = {}

    def add(room: int, delta: int) -> None:
        node = room + size
        while node:
            tree[node] += delta
            node >>= 1

    def smallest_room_at_least(n: int) -> int:
        node = n + size
        if tree[node]:
            return n
        while node > 1:
            if not node & 1 and tree[node + 1]:
                node += 1
                while node < size:
                    node = 2 * node if tree[2 * node] else 2 * node + 1
                return node - size
            node >>= 1
        return -1

    rows: list[list[int]] = []
    for i in order:
        n = lengths[i]
        room = smallest_room_at_least(n)
        if room < 0:
            row, room = len(rows), total_seq_length
            rows.append([])
        else:
            row = buckets[room].pop()
            add(room, -1)
        rows[row].append(i)
        room -= n
        if room > 0:
            buckets.setdefault(room, []).append(row)
            add(room, 1)
    return rows


class PackedDataset(torch.utils.data.Dataset):
    """Packed training rows over a tokenised dataset; item i concatenates the conversations of `rows[i]`.

    Items are unpadded 1-D LongTensors: `input_ids`, `loss_mask`, `document_ids` (0, 1, ... per conversation
    in the row), `position_ids` (restarting at 0 per conversation), and `row_index`. Each access reads only
    its conversations from the memory-mapped arrow table, so the dataset is never materialised in Python.
    """

    def __init__(self, dataset: datasets.Dataset, rows: Sequence[Sequence[int]]):
        missing = {"input_ids", "loss_mask"} - set(dataset.column_names)
        if missing:
            raise ValueError(f"the dataset lacks columns {sorted(missing)}; pass the output of prepare_conversations.")
        self.rows = [[int(i) for i in row] for row in rows]
        n = len(dataset)
        for r, row in enumerate(self.rows):
            if not row or min(row) < 0 or max(row) >= n:
                raise ValueError(
                    f"packed row {r} = {row} is empty or indexes outside the dataset's {n} rows; repack it."
                )
        self._table = dataset.select_columns(["input_ids", "loss_mask"]).with_format("arrow")
        if "length" in dataset.column_names:
            lengths = dataset.select_columns(["length"]).with_format("numpy")[:]["length"]
        else:
            lengths = pc.list_value_length(self._table[:].column("input_ids")).to_numpy()
        lengths = np.asarray(lengths, dtype=np.int64)
        self.row_lengths = [int(lengths[row].sum()) for row in self.rows]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        row = self.rows[index]
        table = self._table[row]
        input_ids = table.column("input_ids")
        doc_lengths = pc.list_value_length(input_ids).to_numpy().astype(np.int64)
        ids = pc.list_flatten(input_ids).to_numpy().astype(np.int64)
        mask = pc.list_flatten(table.column("loss_mask")).to_numpy().astype(np.int64)
        documents = torch.from_numpy(np.repeat(np.arange(len(row), dtype=np.int64), doc_lengths))
        return {
            "input_ids": torch.from_numpy(ids),
            "loss_mask": torch.from_numpy(mask),
            "document_ids": documents,
            "position_ids": positions_from_document_ids(documents.unsqueeze(0))[0],
            "row_index": torch.tensor(index, dtype=torch.long),
        }


class DSparkCollator:
    """Right-pads packed rows into a batch of [R, T] LongTensors (T = longest row rounded up to a multiple).

    Padding is inert by construction: loss_mask 0 (never supervised), document_ids -1 (belongs to no
    document, so no attention to or from it), position_ids 0, input_ids `pad_token_id`.
    """

    PAD_VALUES = {"loss_mask": 0, "document_ids": -1, "position_ids": 0}

    def __init__(self, pad_token_id: int, pad_to_multiple_of: int | None = 8, on_batch=None):
        if pad_token_id is None:
            raise ValueError("pad_token_id is None; pass tokenizer.pad_token_id (or the eos id if it has no pad).")
        if pad_to_multiple_of is not None and pad_to_multiple_of < 1:
            raise ValueError(f"pad_to_multiple_of={pad_to_multiple_of} must be >= 1 (or None for no rounding).")
        self.pad_token_id = int(pad_token_id)
        self.pad_to_multiple_of = pad_to_multiple_of
        # Called with every collated batch: a hidden-state source with latency starts fetching it here, one batch
        # before the trainer asks (the data loader collates the next batch while the current one trains).
        self.on_batch = on_batch

    def __call__(self, features: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        if not features:
            raise ValueError("the collator got an empty list of rows; use a batch size >= 1.")
        longest = max(int(f["input_ids"].numel()) for f in features)
        multiple = self.pad_to_multiple_of or 1
        width = -(-longest // multiple) * multiple
        batch = {}
        for key, pad in {"input_ids": self.pad_token_id, **self.PAD_VALUES}.items():
            out = torch.full((len(features), width), pad, dtype=torch.long)
            for r, f in enumerate(features):
                values = torch.as_tensor(f[key], dtype=torch.long)
                out[r, : values.numel()] = values
            batch[key] = out
        batch["row_index"] = torch.tensor([int(f["row_index"]) for f in features], dtype=torch.long)
        if self.on_batch is not None:
            self.on_batch(batch)
        return batch


def supervised_token_counts(dataset: datasets.Dataset, vocab_size: int, batch_size: int = 1024) -> torch.Tensor:
    """Count each token id over the supervised (loss_mask == 1) positions: the draft vocabulary's input.

    Streams the arrow table in batches, so memory stays O(vocab_size) for any dataset size.
    """
    table = dataset.select_columns(["input_ids", "loss_mask"]).with_format("arrow")
    counts = np.zeros(vocab_size, dtype=np.int64)
    with tqdm(total=len(dataset), desc="counting supervised tokens", unit="conv") as progress:
        for batch in table.iter(batch_size=batch_size):
            ids = pc.list_flatten(batch.column("input_ids")).to_numpy().astype(np.int64)
            mask = pc.list_flatten(batch.column("loss_mask")).to_numpy().astype(bool)
            ids = ids[mask]
            if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
                bad = int(ids.max() if ids.max() >= vocab_size else ids.min())
                raise ValueError(
                    f"token id {bad} is outside the vocabulary of size {vocab_size}; tokenise with the verifier's "
                    "tokenizer and pass its vocab_size."
                )
            counts += np.bincount(ids, minlength=vocab_size)
            progress.update(batch.num_rows)
    return torch.from_numpy(counts)
