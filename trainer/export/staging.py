"""Staging: the folder an export uploads, written from one checkpoint and validated before anything leaves.

`stage` writes exactly the serving contract (`trainer/contract.py`): bf16 `model.safetensors` with only the
contract's tensors (its safetensors metadata records the source checkpoint's weights sha256, so results measured on
the staged folder pair with the checkpoint: `record_source_weights`), `config.json` naming the verifier by Hub id
(vLLM refuses local paths there), the two remote-code files, the decoding loop as `custom_generate/generate.py` (a copy of `generation_dspark.py`), the model card `README.md` (`trainer/export/card.py`), with results the per-position
acceptance plot and, when the checkpoint records a confidence calibration, its reliability plot
(`trainer/export/plots.py`). It then proves the folder serves: vLLM's structural config checks, the
exact tensor set with its dtypes, finite weights equal to the checkpoint's (bf16-rounded), and a load through
`AutoModel.from_pretrained(..., trust_remote_code=True)` and transformers' `custom_generate` loader in a fresh process
with an empty module cache. The
commit message and description are built here too, from the same data.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.metadata
import json
import logging
import os
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path

import yaml

from trainer.config import RUN_CONFIG_FILE
from trainer.contract import (
    CUSTOM_GENERATE_FILE,
    CUSTOM_GENERATE_SOURCE,
    EXPORT_CODE_FILES,
    WEIGHTS_INDEX_FILE,
    check_remote_code_load,
    check_serving_config,
    check_weights,
    read_json,
    resolve_verifier_id,
    weight_files,
)
from trainer.errors import DSparkError
from trainer.evaluation.results import (
    SOURCE_WEIGHTS_KEY,
    AcceptanceResults,
    read_results,
    source_weights_sha256,
    weights_sha256,
)
from trainer.export.card import render_card
from trainer.export.card_sections import CardInputs, read_calibration
from trainer.export.plots import CALIBRATION_PLOT_FILE, PLOT_FILE, plot_acceptance, plot_reliability
from trainer.train.checkpoints import TRAINER_STATE_FILE, Checkpoint, CheckpointError, read_summary

CARD_FILE = "README.md"
# Remote files a new export replaces in the same commit: stale shards or an old plot would otherwise linger.
DELETE_PATTERNS = ["*.safetensors", "*.safetensors.index.json", f"{Path(PLOT_FILE).stem}*.png",
                   f"{Path(CALIBRATION_PLOT_FILE).stem}*.png"]


class StagingError(DSparkError):
    """Staging failed although its inputs were fine (disk, an unexpected file); one sentence with cause and fix."""


@dataclass
class Staged:
    folder: Path
    checkpoint: Checkpoint
    verifier_id: str
    files: dict[str, int]  # path inside the folder (POSIX) -> bytes
    commit_message: str
    commit_description: str
    remote_report: dict | None = None


def is_export_file(name: str) -> bool:
    """A file an export writes, by its POSIX path inside the folder (so a folder holding only such files may be
    replaced by a new export)."""
    return name in {"config.json", CARD_FILE, PLOT_FILE, CALIBRATION_PLOT_FILE, WEIGHTS_INDEX_FILE,
                    *EXPORT_CODE_FILES} or \
        ("/" not in name and name.endswith(".safetensors"))


def folder_files(folder: Path) -> set[str]:
    """Every file of a folder as its POSIX path inside it (`custom_generate/generate.py`, ...)."""
    return {p.relative_to(folder).as_posix() for p in Path(folder).rglob("*") if not p.is_dir()}


def expected_files(folder: Path, with_plot: bool, with_calibration_plot: bool = False) -> set[str]:
    names = {"config.json", CARD_FILE, *EXPORT_CODE_FILES, *weight_files(folder)}
    if (folder / WEIGHTS_INDEX_FILE).exists():
        names.add(WEIGHTS_INDEX_FILE)
    return names | ({PLOT_FILE} if with_plot else set()) | ({CALIBRATION_PLOT_FILE} if with_calibration_plot else set())


def write_custom_generate(folder: Path) -> Path:
    """Copy the package's decoding loop (`generation_dspark.py`) to `custom_generate/generate.py` in `folder`."""
    source = Path(importlib.import_module(CUSTOM_GENERATE_SOURCE).__file__)
    target = Path(folder) / CUSTOM_GENERATE_FILE
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(source, target)
    return target


def record_source_weights(folder: Path, sha256: str) -> None:
    """Record the source checkpoint's weights sha256 in the safetensors metadata of the staged weights.

    Results measured on the staged folder (evaluated before the push, the documented serving workflow) record the
    folder's own sha256, of bf16 bytes, which never equals the checkpoint's; with this record they also carry the
    checkpoint's (`with_provenance`), so the push can pair them with the checkpoint. Metadata, because a tensor or a
    config key that the contract does not list would be refused by vLLM and speculators, which ignore metadata
    (transformers needs only its `format` entry, kept). `save_pretrained` writes fixed metadata, so each file is
    written again with the tensors unchanged (`check_weights` compares them with the checkpoint afterwards)."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    for name in weight_files(folder):
        path = Path(folder) / name
        with safe_open(path, framework="pt") as f:
            metadata = dict(f.metadata() or {})
        tensors = load_file(path)
        partial = path.with_name(path.name + ".partial")
        save_file(tensors, partial, metadata={**metadata, SOURCE_WEIGHTS_KEY: sha256})
        _sort_metadata(partial)
        os.replace(partial, path)


def _sort_metadata(path: Path) -> None:
    """Put a safetensors file's metadata keys in sorted order, in place.

    safetensors writes its metadata map in a random order, so with two keys the same checkpoint would stage
    different bytes (a different sha256 for the same weights, a new upload of an unchanged file). The header is
    rewritten with the keys sorted: the same bytes in another order, so its length and the tensor data are untouched.
    Only done when re-serializing the parsed header reproduces it exactly; otherwise the file is left as written
    (valid, only its key order unfixed)."""
    with open(path, "r+b") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        raw = f.read(length)
        text = raw.rstrip(b" ")  # the header is padded with spaces to an 8-byte boundary
        header = json.loads(text)

        def dump(h: dict) -> bytes:
            return json.dumps(h, separators=(",", ":"), ensure_ascii=False).encode()

        if dump(header) != text or not isinstance(header.get("__metadata__"), dict):
            return
        header["__metadata__"] = dict(sorted(header["__metadata__"].items()))
        f.seek(8)
        f.write(dump(header))


def _versions() -> dict[str, str]:
    out = {}
    for dist in ("dspark-hf", "transformers", "torch", "huggingface_hub", "safetensors"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            pass
    return out


def commit_texts(verifier_id: str, checkpoint: Checkpoint, results: list[AcceptanceResults],
                 run_config_sha: str | None) -> tuple[str, str]:
    """Default commit message and description, built from the data only (parts without data are left out)."""
    parts = []
    if checkpoint.step is not None:
        parts.append(f"step {checkpoint.step}")
    if results:
        r = results[0]
        value = r.weighted if r.weighted is not None else r.unweighted
        parts.append(f"acceptance length {value:.2f}" + (f" on {r.dataset_label}" if r.dataset else ""))
    message = f"Upload DSpark drafter for {verifier_id}" + (f" ({', '.join(parts)})" if parts else "")
    lines = [f"Checkpoint: {checkpoint.path.name if checkpoint.kind == 'checkpoint' else 'final model'}"
             + (f" (step {checkpoint.step})" if checkpoint.step is not None else "")]
    if run_config_sha:
        lines.append(f"Run config sha256: {run_config_sha}")
    for r in results:
        mean = f"weighted acceptance length {r.weighted:.3f} over {r.total_steps} steps" if r.weighted is not None \
            and r.total_steps else f"unweighted acceptance length {r.unweighted:.3f}"
        lines.append(f"Eval ({r.short}, {r.dataset_label}): {mean}; {r.path.name}")
    lines.append("Exported with " + ", ".join(f"{k} {v}" for k, v in _versions().items()))
    return message, "\n".join(lines)


def _run_config(checkpoint: Checkpoint) -> tuple[dict | None, str | None]:
    """The checkpoint's saved run configuration and the sha256 of its bytes (both None when it has none)."""
    path = checkpoint.path / RUN_CONFIG_FILE
    if not path.exists():
        return None, None
    raw = path.read_bytes()
    try:
        run_config = yaml.safe_load(raw) or None
    except yaml.YAMLError as e:
        raise CheckpointError(f"{path} is not valid YAML ({e}); restore it from the run, or delete it to export "
                              f"without a training section.") from e
    return run_config if isinstance(run_config, dict) else None, hashlib.sha256(raw).hexdigest()


def verifier_snapshot_for(verifier: str) -> dict | None:
    """The verifier snapshot a checkpoint saved by speculators lacks (the card reads the verifier's family from
    it), from the verifier's config when it can be read here; without it the export goes on and the card leaves
    out the family-specific serving notes."""
    from configuration_dspark import verifier_snapshot
    from trainer.verifier.loading import resolve_pretrained

    try:
        _, config = resolve_pretrained(verifier, "verifier")
    except DSparkError as e:
        logging.getLogger(__name__).warning("the checkpoint has no verifier snapshot (saved by speculators) and the "
                                            "verifier's config cannot be read here (%s); the card omits the "
                                            "verifier-family notes", e)
        return None
    return verifier_snapshot(config)


def stage(checkpoint: Checkpoint, folder: Path, *, repo_id: str, verifier_id: str | None = None,
          eval_results: list[str | os.PathLike] = (), license: str = "apache-2.0", revision: str | None = None,
          remote_code_check: bool = True) -> Staged:
    """Write the repo folder for `checkpoint` into the empty directory `folder`, then validate it.

    The weights go through `DSparkDraftModel` (fp32 load, floats to bf16, `save_pretrained`) rather than a
    file copy, so the staged config is regenerated by the current `DSparkConfig` and the remote-code files
    are the current ones (the decoding loop is copied from `generation_dspark.py`); `check_weights` then proves
    nothing but the dtype changed."""
    import torch

    from modeling_dspark import DSparkDraftModel

    folder = Path(folder)
    source_config = read_json(checkpoint.path / "config.json")
    verifier = resolve_verifier_id(source_config, verifier_id)
    block = source_config.get("block_size")
    weights_sha = weights_sha256(checkpoint.path)
    results = [read_results(p, block, verifier, weights_sha) for p in eval_results]

    model, info = DSparkDraftModel.from_pretrained(checkpoint.path, dtype=torch.float32, output_loading_info=True)
    allowed_missing = set() if model.config.uses_draft_vocab else {"lm_head.weight"}
    if set(info["missing_keys"]) - allowed_missing or info["unexpected_keys"]:
        raise CheckpointError(f"{checkpoint.path} does not match this package's DSparkDraftModel (missing "
                              f"{sorted(info['missing_keys'])}, unexpected {sorted(info['unexpected_keys'])}); export "
                              f"it with the package version that trained it.")
    if not model.config.verifier_text_config:
        # the folder the drafter was trained against, when it is here, over the Hub id it will be served with
        saved = model.config.verifier_local_path or model.config.verifier_name_or_path
        model.config.verifier_text_config = verifier_snapshot_for(saved if saved and os.path.isdir(saved) else verifier)
    model = model.to(torch.bfloat16)
    model.config.speculators_config["verifier"]["name_or_path"] = verifier
    model.config.verifier_local_path = None  # machine-specific; vLLM reads the Hub id above
    model.save_pretrained(folder)
    del model
    record_source_weights(folder, weights_sha)
    if source_weights_sha256(folder) != weights_sha:
        raise StagingError(f"the staged weights in {folder} do not record the checkpoint's sha256; re-run the "
                           f"export, and report it if it persists.")
    write_custom_generate(folder)
    config = read_json(folder / "config.json")

    check_serving_config(config)
    tensors = check_weights(folder, checkpoint.path)
    check_serving_config(config, tensors)

    run_config, run_config_sha = _run_config(checkpoint)
    state_file = checkpoint.path / TRAINER_STATE_FILE
    inputs = CardInputs(
        repo_id=repo_id, verifier_id=verifier, config=config, tensors=tensors, checkpoint=checkpoint,
        run_config=run_config, trainer_state=read_json(state_file) if state_file.exists() else None,
        summary=read_summary(checkpoint.run_dir or checkpoint.path) if checkpoint.kind == "final" else None,
        results=results, license=license, revision=revision,
    )
    if results:
        plot_acceptance(results, folder / PLOT_FILE)
    calibration = read_calibration(checkpoint.path)
    if calibration is not None:
        plot_reliability(calibration, folder / CALIBRATION_PLOT_FILE)
    render_card(inputs, run_config_sha).save(folder / CARD_FILE)

    present = folder_files(folder)
    wanted = expected_files(folder, bool(results), calibration is not None)
    if present != wanted:
        raise StagingError(f"the staged folder holds {sorted(present ^ wanted)} beyond or short of the contract's "
                           f"files; re-run the export, and report it if it persists.")
    report = check_remote_code_load(folder) if remote_code_check else None
    message, description = commit_texts(verifier, checkpoint, results, run_config_sha)
    files = {name: (folder / name).stat().st_size for name in sorted(present)}
    return Staged(folder=folder, checkpoint=checkpoint, verifier_id=verifier, files=files, commit_message=message,
                  commit_description=description, remote_report=report)
