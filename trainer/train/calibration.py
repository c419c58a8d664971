"""Confidence calibration after training (docs/algorithm.md, "Confidence calibration").

vLLM's adaptive verification ranks draft slots by `cumprod(sigmoid(confidence))`, so a confidence head that is
systematically over- or under-confident costs throughput even when its ranking is right. After training, a
two-parameter logistic map `sigmoid(a*z + c)` of the head's logits z is fitted to the confidence targets on the
validation split (soft-target BCE, Newton in float64) and folded into the head's last linear layer,
`proj.weight' = a*proj.weight`, `proj.bias' = a*proj.bias + c`: the served tensors themselves are calibrated, so
vLLM needs no new config key. What was fitted and how well (`CALIBRATION_FILE`, schema `CALIBRATION_SCHEMA`)
is written next to the folded weights, which is what the model card reports. The fold itself, `(a, c)`, also
travels inside the weights file's metadata (`FOLD_METADATA_KEY`), written by the same atomic rename as the folded
tensors: that is what lets a resumed run undo the fold (`unfold_head`) and continue from exactly the trained
weights, and a kill between the weights and the record can never leave folded weights that look unfolded.
"""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path

import torch

from trainer.contract import WEIGHTS_FILE, WEIGHTS_INDEX_FILE, read_json
from trainer.errors import DSparkError, is_disk_full
from trainer.files import atomic_path, write_json_atomic
from trainer.train.checkpoints import CALIBRATION_FILE

logger = logging.getLogger("dspark")

CALIBRATION_SCHEMA = "dspark-calibration/1"
HEAD_WEIGHT, HEAD_BIAS = "confidence_head.proj.weight", "confidence_head.proj.bias"
BINS = 10
MIN_SLOPE = 1e-3  # below this the fit says the logits carry no signal; folding would erase the head
FOLD_METADATA_KEY = "dspark_confidence_fold"  # '{"a": .., "c": ..}' in the safetensors header of folded weights


# ------------------------------------------------------------------------------------------------ the fit
def fit_logistic(z: torch.Tensor, target: torch.Tensor, iterations: int = 50) -> tuple[float, float]:
    """(a, c) minimising the mean soft-target BCE of `sigmoid(a*z + c)` against `target` (both 1-D).

    Newton's method in float64 from the identity (a, c) = (1, 0), with a backtracking line search so every
    step lowers the loss (the objective is convex in (a, c), the Hessian is `sum w [z 1]^T [z 1]`)."""
    z, t = z.double().flatten(), target.double().flatten()
    if z.numel() == 0:
        return 1.0, 0.0
    theta = torch.tensor([1.0, 0.0], dtype=torch.float64)
    features = torch.stack([z, torch.ones_like(z)], dim=-1)  # [n, 2]

    def loss(th: torch.Tensor) -> torch.Tensor:
        x = features @ th
        return (torch.nn.functional.softplus(x) - t * x).mean()

    current = loss(theta)
    for _ in range(iterations):
        s = torch.sigmoid(features @ theta)
        grad = features.T @ (s - t) / z.numel()
        w = s * (1 - s)
        hessian = (features * w.unsqueeze(-1)).T @ features / z.numel() + 1e-12 * torch.eye(2, dtype=torch.float64)
        step = torch.linalg.solve(hessian, grad)
        slope = float(grad @ step)
        if not math.isfinite(slope) or slope <= 1e-18:
            break
        lr = 1.0
        while lr > 1e-8:
            candidate = theta - lr * step
            value = loss(candidate)
            if value <= current - 1e-4 * lr * slope:
                break
            lr *= 0.5
        else:
            break
        theta, current = candidate, value
    return float(theta[0]), float(theta[1])


# ------------------------------------------------------------------------------------------------ quality
def reliability(pred: torch.Tensor, target: torch.Tensor, bins: int = BINS) -> list[dict]:
    """Equal-width bins of the predicted probability: count, mean predicted and mean observed (None if empty)."""
    pred, target = pred.double().flatten(), target.double().flatten()
    index = (pred * bins).floor().clamp(0, bins - 1).long()
    out = []
    for b in range(bins):
        sel = index == b
        n = int(sel.sum())
        out.append({"lo": b / bins, "hi": (b + 1) / bins, "count": n,
                    "mean_predicted": float(pred[sel].mean()) if n else None,
                    "mean_observed": float(target[sel].mean()) if n else None})
    return out


def expected_calibration_error(pred: torch.Tensor, target: torch.Tensor, bins: int = BINS) -> float:
    """`sum_b (n_b / n) |mean predicted_b - mean observed_b|` over equal-width bins (soft targets allowed)."""
    n = pred.numel()
    if n == 0:
        return float("nan")
    return sum(b["count"] / n * abs(b["mean_predicted"] - b["mean_observed"])
               for b in reliability(pred, target, bins) if b["count"])


def cumprod_bias(pred: torch.Tensor, target: torch.Tensor, supervised: torch.Tensor) -> list[float | None]:
    """Per position k, the mean over blocks that reach slot k of `prod_{j<=k} pred_j - prod_{j<=k} target_j`:
    how far the survival vLLM ranks slots by is from the realised one (`[M, B]` inputs; None where no block
    reaches k)."""
    gap = pred.double().cumprod(-1) - target.double().cumprod(-1)
    out = []
    for k in range(supervised.shape[-1]):
        sel = supervised[:, k].bool()
        out.append(float(gap[sel, k].mean()) if bool(sel.any()) else None)
    return out


def calibration_record(z: torch.Tensor, target: torch.Tensor, supervised: torch.Tensor, a: float, c: float,
                       **extra) -> dict:
    """The `CALIBRATION_FILE` content for `[M, B]` logits, targets and supervision masks and the fitted (a, c)."""
    mask = supervised.bool()
    before, after = torch.sigmoid(z.double()), torch.sigmoid(a * z.double() + c)
    t = target.double()

    def bce(p: torch.Tensor) -> float:
        p = p[mask].clamp(1e-12, 1 - 1e-12)
        return float(-(t[mask] * p.log() + (1 - t[mask]) * (1 - p).log()).mean())

    def per_position(p: torch.Tensor) -> list[list[dict]]:
        return [reliability(p[mask[:, k], k], t[mask[:, k], k]) for k in range(mask.shape[1])]

    return {
        "schema": CALIBRATION_SCHEMA,
        "a": a, "c": c,
        **extra,
        "n_slots": int(mask.sum()), "n_blocks": int(mask[:, 0].sum()) if mask.numel() else 0,
        "bins": BINS,
        "bce_before": bce(before), "bce_after": bce(after),
        "ece_before": expected_calibration_error(before[mask], t[mask]),
        "ece_after": expected_calibration_error(after[mask], t[mask]),
        "cumprod_bias_before": cumprod_bias(before, t, mask),
        "cumprod_bias_after": cumprod_bias(after, t, mask),
        "reliability_before": per_position(before),
        "reliability_after": per_position(after),
    }


# ------------------------------------------------------------------------------------------------ the fold
def fold(weight: torch.Tensor, bias: torch.Tensor, a: float, c: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`(a*weight, a*bias + c)` computed in float64 and returned in the tensors' dtypes, so the logits become
    `a*z + c`. Used for the model in memory and the files alike, so both hold the same values."""
    return (a * weight.double()).to(weight.dtype), (a * bias.double() + c).to(bias.dtype)


def unfold(weight: torch.Tensor, bias: torch.Tensor, a: float, c: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of `fold` (exact up to one rounding of the stored dtype)."""
    return (weight.double() / a).to(weight.dtype), ((bias.double() - c) / a).to(bias.dtype)


@torch.no_grad()
def fold_head(head: torch.nn.Linear, a: float, c: float) -> None:
    w, b = fold(head.weight, head.bias, a, c)
    head.weight.copy_(w)
    head.bias.copy_(b)


@torch.no_grad()
def unfold_head(head: torch.nn.Linear, directory: str | os.PathLike) -> dict | None:
    """Undo the fold recorded in `directory` (if any) on a head just loaded from it; returns the fold `{a, c}`."""
    fold_record = applied_fold(directory)
    if fold_record is None:
        return None
    w, b = unfold(head.weight, head.bias, float(fold_record["a"]), float(fold_record["c"]))
    head.weight.copy_(w)
    head.bias.copy_(b)
    return fold_record


def applied_fold(directory: str | os.PathLike) -> dict | None:
    """The `(a, c)` folded into the weights in `directory`, read from the weights file itself; checkpoints written
    before the fold was stored there fall back to their `CALIBRATION_FILE`."""
    from safetensors import safe_open

    path = _weights_file(Path(directory))
    if path.exists():
        with safe_open(str(path), framework="pt") as f:
            stored = (f.metadata() or {}).get(FOLD_METADATA_KEY)
        if stored is not None:
            return json.loads(stored)
    record = Path(directory) / CALIBRATION_FILE
    return read_json(record) if record.exists() else None


def _weights_file(directory: Path) -> Path:
    index = directory / WEIGHTS_INDEX_FILE
    if index.exists():
        return directory / read_json(index)["weight_map"][HEAD_WEIGHT]
    return directory / WEIGHTS_FILE


def write_folded_head(directory: str | os.PathLike, head: dict[str, torch.Tensor],
                      reference: dict[str, torch.Tensor], a: float, c: float) -> bool:
    """Replace the confidence-head tensors of the checkpoint in `directory` with `head` (already folded with
    `(a, c)`), but only when every other tensor of its weights file equals `reference` (the unfolded model in
    memory): the fit is valid for exactly those weights. The file, with the fold in its metadata, is rewritten
    through a temporary file and a rename, so the directory never holds half a file and its completion marker
    and trainer state stay valid. Returns whether the checkpoint was the reference model (False: left
    untouched)."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    path = _weights_file(Path(directory))
    if not path.exists():
        return False
    with safe_open(str(path), framework="pt") as f:
        metadata = f.metadata()
    tensors = load_file(str(path))
    if not set(head) <= set(tensors):
        return False
    for name, value in tensors.items():
        if name in head:
            continue
        ref = reference.get(name)
        if ref is None or ref.shape != value.shape or not torch.equal(ref.detach().to("cpu", value.dtype), value):
            return False
    for name, value in head.items():
        tensors[name] = value.detach().to("cpu", tensors[name].dtype).contiguous()
    metadata = {**(metadata or {}), FOLD_METADATA_KEY: json.dumps({"a": a, "c": c})}
    try:
        with atomic_path(path) as tmp:
            save_file(tensors, tmp, metadata=metadata)
    except (OSError, RuntimeError) as e:
        if is_disk_full(e):
            raise DSparkError(f"the disk of {directory} filled up while folding the confidence calibration into "
                              f"{path.name}, which is unchanged (not calibrated); free some space and rerun the same "
                              f"command with --resume_from_checkpoint latest.") from e
        raise
    return True


def write_record(directory: str | os.PathLike, record: dict) -> None:
    write_json_atomic(os.path.join(directory, CALIBRATION_FILE), record)




