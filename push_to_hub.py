"""Export a DSpark checkpoint as a servable Hugging Face Hub repo with a model card, then upload it.

    python push_to_hub.py --checkpoint out/checkpoint-best --repo-id me/gemma-4-E4B-it-dspark
    python push_to_hub.py --checkpoint out/run:latest --repo-id me/x --eval-results t1.json greedy.json
    python push_to_hub.py --checkpoint out/run --repo-id me/x --dry-run exported/       # no network at all

The export runs in three steps, and any failure stops it before anything reaches the Hub:

1. **Stage** a folder that is exactly the serving contract (`checkpoint-format.md`): bf16
   `model.safetensors` with only the contract's tensors, `config.json` naming the verifier by Hub id (vLLM
   0.33 refuses local paths there), the two remote-code files, `README.md` (the model card, rendered from
   the checkpoint's config, its saved run configuration and the given evaluation results, never from typed
   numbers) and, with results, the per-position acceptance plot.
2. **Validate** the staged folder: the structural checks vLLM applies to a speculators config, the exact
   tensor set with its dtypes, finite weights equal to the checkpoint's (bf16-rounded), and a load through
   `AutoModel.from_pretrained(..., trust_remote_code=True)` in a fresh process with an empty module cache,
   which is what a user of the pushed repo runs.
3. **Upload** the folder in one commit with `huggingface_hub` (`create_repo(exist_ok=True)`, optional
   branch, one `upload_folder`), after refusing to overwrite a repo that holds a drafter for a different
   verifier unless `--force`. The staged folder lives in the system temp directory and is always removed,
   so a failed upload leaves nothing behind locally; the Hub commit itself is atomic.

`--checkpoint` accepts a `checkpoint-N` directory (it must carry the trainer's `dspark_checkpoint.json`
completion marker), the run's final model, or a training output_dir, which means its `checkpoint-best`
when present, else its own final model, else its latest complete checkpoint. `OUTPUT_DIR:best`,
`OUTPUT_DIR:latest`, `OUTPUT_DIR:final` and `OUTPUT_DIR:<step>` select explicitly. Symlinks are resolved.

The token comes from the usual Hugging Face sources (`HF_TOKEN`, or the login saved by `hf auth login`) and
is never printed. Errors are one sentence naming the cause and the fix; the exit status is 1.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import math
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import huggingface_hub
import yaml
from huggingface_hub import EvalResult, ModelCard, ModelCardData, get_token
from huggingface_hub.errors import EntryNotFoundError, HFValidationError, RepositoryNotFoundError, RevisionNotFoundError
from huggingface_hub.utils import validate_repo_id

from configuration_dspark import is_hub_id as config_is_hub_id
from trainer.acceptance import SCHEMA as RESULTS_SCHEMA
from trainer.acceptance import SUBSETS as SUBSET_ORDER
from trainer.acceptance import weights_sha256
from trainer.config import CONFIG_FILE as RUN_CONFIG_FILE
from trainer.dspark_trainer import COMPLETE_MARKER, DATA_STATS_FILE, checkpoints, latest_checkpoint

SUMMARY_FILE = "dspark_train_summary.json"  # written by trainer/run.py into the output_dir
REMOTE_CODE_FILES = ("configuration_dspark.py", "modeling_dspark.py")
PLOT_FILE = "acceptance_per_position.png"
# Remote files a new export replaces in the same commit: stale shards or an old plot would otherwise linger.
DELETE_PATTERNS = ["*.safetensors", "*.safetensors.index.json", "acceptance_per_position*.png"]
_CHECKPOINT_DIR = re.compile(r"^checkpoint-(\d+)$")
_SELECTOR = re.compile(r"^(best|latest|final|\d+)$")


class PushError(Exception):
    """A refusal or failure reported to the user as one sentence (cause and fix); nothing was uploaded."""


# ================================================================================================
# 1. Which checkpoint
# ================================================================================================
@dataclass
class Checkpoint:
    """A resolved drafter directory. `kind` is "checkpoint" (a `checkpoint-N` dir) or "final" (the model the
    run saved into its output_dir); `step` is the optimizer step its weights come from, when recorded."""

    path: Path
    kind: str
    step: int | None
    run_dir: Path | None  # the training output_dir, for the run summary


def resolve_checkpoint(spec: str | os.PathLike) -> Checkpoint:
    """Turn `--checkpoint` into one complete drafter directory (see the module docstring for the rules)."""
    spec = os.fspath(spec)
    selector = None
    head, sep, tail = spec.rpartition(":")
    if sep and head and _SELECTOR.match(tail) and not os.path.exists(spec):
        spec, selector = head, tail
    path = Path(spec)
    if not path.exists():
        raise PushError(f"checkpoint path {spec} does not exist; pass a checkpoint-N directory or a training "
                        f"output_dir (optionally OUTPUT_DIR:best|latest|final|<step>).")
    if not path.is_dir():
        raise PushError(f"checkpoint path {spec} is not a directory; pass a checkpoint-N directory or a training "
                        f"output_dir.")
    path = path.resolve()
    if selector is not None:
        return _select(path, selector)
    if _CHECKPOINT_DIR.match(path.name) or (path / COMPLETE_MARKER).exists():
        return _as_checkpoint(path)
    if (path / "checkpoint-best").is_dir():
        return _as_checkpoint((path / "checkpoint-best").resolve())
    if (path / "config.json").exists():
        return _as_final(path)
    latest = _latest_complete(path)
    if latest is None:
        raise PushError(f"{spec} holds no drafter (no config.json, no checkpoint-best and no complete checkpoint-N); "
                        f"pass the output_dir of a run that saved a checkpoint, or a checkpoint directory.")
    return _as_checkpoint(latest)


def _select(run_dir: Path, selector: str) -> Checkpoint:
    """The explicit `OUTPUT_DIR:best|latest|final|<step>` choice; each miss names what is there instead."""
    if selector == "best":
        if not (run_dir / "checkpoint-best").is_dir():
            raise PushError(f"{run_dir} has no checkpoint-best (the run had no validation split or has not "
                            f"evaluated yet); use {run_dir}:latest or {run_dir}:final.")
        return _as_checkpoint((run_dir / "checkpoint-best").resolve())
    if selector == "latest":
        latest = _latest_complete(run_dir)
        if latest is None:
            raise PushError(f"{run_dir} has no complete checkpoint-N directory; use {run_dir}:final or pass "
                            f"the run's output_dir once it has saved a checkpoint.")
        return _as_checkpoint(latest)
    if selector == "final":
        if not (run_dir / "config.json").exists():
            raise PushError(f"{run_dir} has no final model (no config.json; the run has not finished); use "
                            f"{run_dir}:latest.")
        return _as_final(run_dir)
    target = run_dir / f"checkpoint-{selector}"
    if not target.is_dir():
        steps = [p.name.split("-")[1] for p in _checkpoint_dirs(run_dir)]
        raise PushError(f"{run_dir} has no checkpoint-{selector}; pick one of the available steps "
                        f"{steps or 'none'}.")
    return _as_checkpoint(target.resolve())


def _checkpoint_dirs(run_dir: Path) -> list[Path]:
    return [Path(p) for p in checkpoints(str(run_dir))]


def _latest_complete(run_dir: Path) -> Path | None:
    latest = latest_checkpoint(str(run_dir))
    return Path(latest) if latest else None


def _as_checkpoint(path: Path) -> Checkpoint:
    marker = path / COMPLETE_MARKER
    if not marker.exists():
        raise PushError(f"{path} is an incomplete checkpoint (no {COMPLETE_MARKER}: its save was interrupted); pass "
                        f"an earlier complete checkpoint or the run's output_dir.")
    _check_is_drafter(path)
    step = _read_json(marker).get("step")
    match = _CHECKPOINT_DIR.match(path.name)
    if step is None and match:
        step = int(match.group(1))
    return Checkpoint(path=path, kind="checkpoint", step=step, run_dir=path.parent)


def _as_final(path: Path) -> Checkpoint:
    _check_is_drafter(path)
    summary = _read_json(path / SUMMARY_FILE) if (path / SUMMARY_FILE).exists() else {}
    step = summary.get("global_step")
    best = summary.get("best_checkpoint")
    if best and _CHECKPOINT_DIR.match(Path(best).name):  # load_best_model_at_end: the final weights are the best's
        step = int(Path(best).name.split("-")[1])
    return Checkpoint(path=path, kind="final", step=step, run_dir=path)


def _check_is_drafter(path: Path) -> None:
    config_file = path / "config.json"
    if not config_file.exists():
        raise PushError(f"{path} is not a drafter (no config.json); pass a checkpoint written by trainer/run.py.")
    config = _read_json(config_file)
    if config.get("speculators_model_type") != "dspark":
        raise PushError(f"{path} is not a DSpark drafter (config.json has speculators_model_type "
                        f"{config.get('speculators_model_type')!r}, not 'dspark'); pass a checkpoint written by "
                        f"trainer/run.py.")
    if not weight_files(path):
        raise PushError(f"{path} has a drafter config but no model.safetensors; pass a complete checkpoint.")


def _read_json(path: Path) -> dict:
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise PushError(f"cannot read {path} ({e}); pass a checkpoint whose files are intact.") from e
    return data if isinstance(data, dict) else {}


# ================================================================================================
# 2. Verifier Hub id
# ================================================================================================
def is_hub_id(name: str | None) -> bool:
    """What vLLM 0.33 accepts as `speculators_config.verifier.name_or_path`: a valid repo id that is not also
    an existing local path (vLLM would load the local directory, which users of the pushed repo don't have)."""
    if not isinstance(name, str) or not config_is_hub_id(name):
        return False
    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return not os.path.lexists(name)


def resolve_verifier_id(checkpoint_config: dict, verifier_id: str | None) -> str:
    """The verifier's Hub id for the pushed config: `--verifier-id`, else the one the checkpoint names."""
    if verifier_id is not None:
        if not is_hub_id(verifier_id):
            raise PushError(f"--verifier-id {verifier_id!r} is not a Hub id (a local path or an invalid repo id); "
                            f"pass the verifier's id on the Hub, e.g. google/gemma-4-E4B-it.")
        return verifier_id
    found = ((checkpoint_config.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path")
    if not is_hub_id(found):
        raise PushError(f"the checkpoint names no Hub id for its verifier (found {found!r}); pass --verifier-id "
                        f"org/name.")
    return found


# ================================================================================================
# 3. Weights: files, contract, comparison
# ================================================================================================
def weight_files(folder: Path) -> list[str]:
    """The safetensors files of a folder (one file, or the shards its index lists)."""
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.exists():
        return sorted(set(_read_json(index).get("weight_map", {}).values()))
    return ["model.safetensors"] if (folder / "model.safetensors").exists() else []


def load_tensors(folder: Path) -> dict:
    from safetensors.torch import load_file

    tensors = {}
    for name in weight_files(folder):
        tensors.update(load_file(Path(folder) / name))
    return tensors


def contract_tensors(config: dict) -> dict[str, tuple[tuple[int, ...], str]]:
    """Every tensor a DSpark repo must hold, with its shape and dtype, derived from `config.json` alone
    (checkpoint-format.md): nothing more (vLLM's loader rejects unknown names), nothing less."""
    layer = config["transformer_layer_config"]
    hidden, vocab = layer["hidden_size"], layer["vocab_size"]
    draft_vocab = config.get("draft_vocab_size") or vocab
    heads, kv_heads = layer["num_attention_heads"], layer["num_key_value_heads"]
    head_dim = layer.get("head_dim") or hidden // heads
    inter = layer["intermediate_size"]
    aux_width = (config.get("target_hidden_size") or hidden) * len(config.get("aux_hidden_state_layer_ids") or [])
    rank = config.get("markov_rank") or 0
    bf16 = "bfloat16"
    out = {"fc.weight": ((hidden, aux_width), bf16), "hidden_norm.weight": ((hidden,), bf16),
           "norm.weight": ((hidden,), bf16)}
    for i in range(layer["num_hidden_layers"]):
        p = f"layers.{i}."
        out |= {p + "input_layernorm.weight": ((hidden,), bf16),
                p + "post_attention_layernorm.weight": ((hidden,), bf16),
                p + "self_attn.q_proj.weight": ((heads * head_dim, hidden), bf16),
                p + "self_attn.k_proj.weight": ((kv_heads * head_dim, hidden), bf16),
                p + "self_attn.v_proj.weight": ((kv_heads * head_dim, hidden), bf16),
                p + "self_attn.o_proj.weight": ((hidden, heads * head_dim), bf16),
                p + "self_attn.q_norm.weight": ((head_dim,), bf16), p + "self_attn.k_norm.weight": ((head_dim,), bf16),
                p + "mlp.gate_proj.weight": ((inter, hidden), bf16), p + "mlp.up_proj.weight": ((inter, hidden), bf16),
                p + "mlp.down_proj.weight": ((hidden, inter), bf16)}
        if layer.get("attention_bias"):
            out |= {p + "self_attn.q_proj.bias": ((heads * head_dim,), bf16),
                    p + "self_attn.k_proj.bias": ((kv_heads * head_dim,), bf16),
                    p + "self_attn.v_proj.bias": ((kv_heads * head_dim,), bf16),
                    p + "self_attn.o_proj.bias": ((hidden,), bf16)}
    if draft_vocab < vocab:
        out |= {"lm_head.weight": ((draft_vocab, hidden), bf16), "d2t": ((draft_vocab,), "int64"),
                "t2d": ((vocab,), "bool")}
    if rank > 0:
        out |= {"markov_head.markov_w1.weight": ((vocab, rank), bf16),
                "markov_head.markov_w2.weight": ((draft_vocab, rank), bf16)}
    if config.get("enable_confidence_head", True):
        width = hidden + (rank if config.get("confidence_head_with_markov", True) and rank > 0 else 0)
        out |= {"confidence_head.proj.weight": ((1, width), bf16), "confidence_head.proj.bias": ((1,), bf16)}
    return out


def check_weights(staged: Path, checkpoint: Path) -> dict:
    """The staged tensors are exactly the contract's (names, shapes, dtypes), finite, and equal to the
    checkpoint's bf16-rounded values; returns the staged tensors."""
    import torch

    config = _read_json(staged / "config.json")
    expected = contract_tensors(config)
    tensors = load_tensors(staged)
    source = load_tensors(checkpoint)
    missing, extra = sorted(set(expected) - set(tensors)), sorted(set(tensors) - set(expected))
    if missing or extra:
        raise PushError(f"the staged weights break the checkpoint contract (missing {missing}, unexpected {extra}); "
                        f"re-save the checkpoint with this package's DSparkDraftModel.save_pretrained.")
    if set(source) != set(tensors):
        raise PushError(f"the checkpoint's saved tensors {sorted(set(source) ^ set(tensors))} differ from the staged "
                        f"ones; re-save the checkpoint with this package's DSparkDraftModel.save_pretrained.")
    for name, tensor in tensors.items():
        shape, dtype = expected[name]
        if tuple(tensor.shape) != shape or str(tensor.dtype).removeprefix("torch.") != dtype:
            raise PushError(f"staged tensor {name} is {str(tensor.dtype).removeprefix('torch.')} {list(tensor.shape)}, "
                            f"but config.json implies {dtype} {list(shape)}; re-export from a checkpoint whose "
                            f"config.json matches its weights.")
        if tensor.is_floating_point():
            bad = int((~torch.isfinite(tensor)).sum())
            if bad:
                raise PushError(f"weight {name} has {bad} non-finite values (NaN/inf) in {checkpoint} after bf16 "
                                f"conversion; push an earlier checkpoint (--checkpoint OUTPUT_DIR:<step>) instead.")
            reference = source[name].to(torch.bfloat16)
        else:
            reference = source[name]
        if reference.dtype != tensor.dtype or not torch.equal(reference, tensor):
            raise PushError(f"staged tensor {name} differs from the checkpoint's (bf16-rounded) value; re-run the "
                            f"export, and report it if it persists.")
    return tensors


# ================================================================================================
# 4. The structural checks vLLM applies to a speculators config (reimplemented, vLLM is not imported)
# ================================================================================================
def check_serving_config(config: dict, tensors: dict | None = None) -> None:
    """Refuse a config that `vllm serve <repo>` would reject or, worse, serve wrongly (vllm-reference.md §1)."""
    problems = []
    sc = config.get("speculators_config")
    sc = sc if isinstance(sc, dict) else {}
    methods = sc.get("proposal_methods")
    tokens = methods[0].get("speculative_tokens") if isinstance(methods, list) and methods and \
        isinstance(methods[0], dict) else None
    if tokens is None:
        problems.append("speculators_config.proposal_methods[0].speculative_tokens is missing")
    verifier = (sc.get("verifier") or {}).get("name_or_path") if isinstance(sc.get("verifier"), dict) else None
    if not verifier:
        problems.append("speculators_config.verifier.name_or_path is missing")
    elif not is_hub_id(verifier):
        problems.append(f"speculators_config.verifier.name_or_path {verifier!r} is not a Hub id")
    if config.get("speculators_model_type") != "dspark":
        problems.append(f"speculators_model_type is {config.get('speculators_model_type')!r}, not 'dspark'")
    layer = config.get("transformer_layer_config")
    if not isinstance(layer, dict):
        problems.append("transformer_layer_config is not a mapping")
        layer = {}
    if "model_type" in config and config["model_type"] != "speculators":
        problems.append(f"top-level model_type {config['model_type']!r} is set (vLLM then ignores the speculators "
                        f"keys; it must be absent or 'speculators')")
    block = config.get("block_size")
    if tokens is not None and tokens != block:
        problems.append(f"speculative_tokens {tokens} differs from block_size {block} (anchor-first layout)")
    if "sample_from_anchor" not in config:
        problems.append("sample_from_anchor is missing (vLLM defaults it to false, collapsing acceptance to ~1)")
    elif config["sample_from_anchor"] is not True:
        problems.append(f"sample_from_anchor is {config['sample_from_anchor']!r}, not true")
    aux = config.get("aux_hidden_state_layer_ids")
    if not isinstance(aux, list) or not aux or any(not isinstance(i, int) or i < 1 for i in aux) or \
            any(b <= a for a, b in zip(aux, aux[1:])):
        problems.append(f"aux_hidden_state_layer_ids {aux} must be a non-empty ascending list of unique ids >= 1")
    elif isinstance(v_layers := (config.get("verifier_text_config") or {}).get("num_hidden_layers"), int) and \
            aux[-1] > v_layers - 1:
        problems.append(f"aux layer id {aux[-1]} is out of range for the {v_layers}-layer verifier (valid: "
                        f"1..{v_layers - 1}; vLLM appends the last layer itself)")
    if layer:
        if layer.get("hidden_act") != "silu":
            problems.append(f"transformer_layer_config.hidden_act is {layer.get('hidden_act')!r}, not 'silu'")
        if "rope_theta" not in (layer.get("rope_parameters") or {}):
            problems.append("transformer_layer_config.rope_parameters has no rope_theta (vLLM would default it)")
        for key in ("vocab_size", "num_hidden_layers"):
            if not isinstance(layer.get(key), int):
                problems.append(f"transformer_layer_config.{key} is missing")
    vocab, draft_vocab = layer.get("vocab_size"), config.get("draft_vocab_size")
    if tensors is not None and isinstance(vocab, int) and isinstance(draft_vocab, int) and draft_vocab < vocab:
        hidden = layer.get("hidden_size")
        head, d2t = tensors.get("lm_head.weight"), tensors.get("d2t")
        if head is None or tuple(head.shape) != (draft_vocab, hidden):
            problems.append(f"lm_head.weight must be [{draft_vocab}, {hidden}] for a reduced draft vocabulary")
        if d2t is None or tuple(d2t.shape) != (draft_vocab,):
            problems.append(f"d2t must be [{draft_vocab}] for a reduced draft vocabulary")
    if problems:
        raise PushError(f"the staged config.json would not serve with vLLM: {'; '.join(problems)}; re-export from a "
                        f"checkpoint written by this package's trainer.")


# ================================================================================================
# 5. Remote code in a fresh module cache
# ================================================================================================
_REMOTE_LOAD = r"""
import json, sys
import torch
from safetensors.torch import load_file
from transformers import AutoModel

folder, files = sys.argv[1], sys.argv[2:]
model, info = AutoModel.from_pretrained(folder, trust_remote_code=True, output_loading_info=True)
state = model.state_dict()
saved = {}
for name in files:
    saved.update(load_file(f"{folder}/{name}"))
mismatched = [k for k, v in saved.items() if k not in state or not torch.equal(state[k], v.to(state[k].dtype))]
print("RESULT " + json.dumps({"module": type(model).__module__, "class": type(model).__name__,
                              "missing": sorted(info["missing_keys"]), "unexpected": sorted(info["unexpected_keys"]),
                              "mismatched": mismatched, "compared": len(saved)}))
"""


def check_remote_code_load(folder: Path, timeout: float = 600) -> dict:
    """Load the staged folder the way a user of the pushed repo does, in a separate Python process with an
    empty `HF_MODULES_CACHE` and offline mode: only the folder's own `.py` files can define the classes, so a
    missing or broken remote-code file fails here rather than on the user's machine. Returns the report."""
    folder = Path(folder).resolve()
    with tempfile.TemporaryDirectory(prefix="dspark-modules-") as modules:
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        env |= {"HF_MODULES_CACHE": modules, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                "HF_HUB_DISABLE_TELEMETRY": "1"}
        try:
            proc = subprocess.run([sys.executable, "-c", _REMOTE_LOAD, str(folder), *weight_files(folder)], env=env,
                                  cwd=modules, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired as e:
            raise PushError(f"loading the staged folder with AutoModel took over {timeout:.0f} s; check the machine's "
                            f"load and re-run the export.") from e
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        reason = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise PushError(f"the staged folder does not load with AutoModel.from_pretrained(..., trust_remote_code=True) "
                        f"in a fresh module cache ({reason}); fix configuration_dspark.py/modeling_dspark.py and "
                        f"re-export.")
    report = json.loads(lines[-1][len("RESULT "):])
    report["modules_cache"] = modules
    config = _read_json(folder / "config.json")
    full_vocab = (config.get("draft_vocab_size") or 0) >= config["transformer_layer_config"]["vocab_size"]
    allowed_missing = {"lm_head.weight"} if full_vocab else set()
    problems = []
    if not report["module"].startswith("transformers_modules"):
        problems.append(f"the class came from {report['module']}, not from the repo's remote code")
    if set(report["missing"]) - allowed_missing or report["unexpected"]:
        problems.append(f"missing {report['missing']}, unexpected {report['unexpected']}")
    if report["mismatched"]:
        problems.append(f"loaded tensors {report['mismatched']} differ from the files")
    if problems:
        raise PushError(f"the staged folder loads wrongly through AutoModel remote code ({'; '.join(problems)}); fix "
                        f"configuration_dspark.py/modeling_dspark.py and re-export.")
    return report


# ================================================================================================
# 6. Evaluation results (trainer/acceptance.py, schema dspark-acceptance/1)
# ================================================================================================
@dataclass
class SubsetResult:
    name: str
    acceptance_length: float
    pos: list[float]
    steps: int | None = None
    prompts: int | None = None
    generated_tokens: int | None = None
    tokens_per_s: float | None = None
    baseline_tokens_per_s: float | None = None
    speedup: float | None = None


@dataclass
class AcceptanceResults:
    path: Path
    block_size: int
    subsets: list[SubsetResult]
    sampling: dict = field(default_factory=dict)
    backend: str | None = None
    verifier: str | None = None
    dataset: str | None = None
    max_new_tokens: int | None = None
    date: str | None = None
    machine: str | None = None
    versions: dict = field(default_factory=dict)
    weighted: float | None = None
    unweighted: float | None = None
    total_steps: int | None = None
    other_drafters: dict = field(default_factory=dict)
    concurrency: int | None = None
    unmeasured: list[str] = field(default_factory=list)

    @property
    def dataset_label(self) -> str:
        """The Hub dataset id, or the last component of a local prompt directory (no machine paths in cards)."""
        if not self.dataset:
            return "unrecorded prompts"
        return self.dataset if _is_hub_dataset(self.dataset) else Path(self.dataset).name

    @property
    def greedy(self) -> bool:
        return not self.sampling.get("temperature")

    @property
    def title(self) -> str:
        """The sampling settings, which titles this file's section (greedy and T=1 results read differently)."""
        if not self.sampling:
            return "Sampling settings not recorded"
        if self.greedy:
            return "Greedy decoding (temperature 0)"
        parts = [f"temperature {self.sampling['temperature']}"]
        parts += [f"{k} {self.sampling[k]}" for k in ("top_p", "top_k", "min_p") if self.sampling.get(k) is not None]
        return "Sampling: " + ", ".join(parts)

    @property
    def short(self) -> str:
        if self.greedy:
            return "greedy" if self.sampling else "sampling not recorded"
        keys = (("temperature", "T"), ("top_p", "top_p"), ("top_k", "top_k"))
        return ", ".join(f"{label}={self.sampling[k]}" for k, label in keys if self.sampling.get(k) is not None)

    def best(self) -> SubsetResult:
        return max(self.subsets, key=lambda s: s.acceptance_length)


def _number(value, where: str, path: Path, integer: bool = False, required: bool = False):
    if value is None and not required:
        return None
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or (integer and float(value) != int(value)):
        kind = "integer" if integer else "number"
        raise PushError(f"eval results {path}: {where} is {value!r}, not a finite {kind}; regenerate the file with "
                        f"trainer/acceptance.py.")
    return int(value) if integer else float(value)


def load_eval_results(path: str | os.PathLike, block_size: int, verifier_id: str | None = None,
                      weights_sha256: str | None = None) -> AcceptanceResults:
    """Read one results JSON defensively: every required field is checked, optional ones may be absent."""
    path = Path(path)
    if not path.is_file():
        raise PushError(f"eval results file {path} does not exist; pass the JSON written by trainer/acceptance.py.")
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise PushError(f"eval results {path} is not valid JSON ({e}); pass the file written by "
                        f"trainer/acceptance.py.") from e
    if not isinstance(data, dict) or data.get("schema") != RESULTS_SCHEMA:
        schema = data.get("schema") if isinstance(data, dict) else None
        raise PushError(f"eval results {path} has schema {schema!r}, not {RESULTS_SCHEMA!r}; pass a file written by "
                        f"trainer/acceptance.py.")
    measured = _number(data.get("block_size"), "block_size", path, integer=True, required=True)
    if measured != block_size:
        raise PushError(f"eval results {path} were measured with block size {measured} but this drafter has block size "
                        f"{block_size}; pass results measured for this drafter.")
    verifier = data.get("verifier")
    if verifier_id and is_hub_id(verifier) and verifier != verifier_id:
        raise PushError(f"eval results {path} were measured with verifier {verifier} but this drafter's verifier is "
                        f"{verifier_id}; pass results measured for this drafter.")
    measured_weights = data.get("drafter_weights_sha256")
    if weights_sha256 and measured_weights and measured_weights != weights_sha256:
        raise PushError(f"eval results {path} were measured on different drafter weights than this checkpoint's "
                        f"(sha256 {measured_weights[:12]} vs {weights_sha256[:12]}); evaluate this checkpoint with "
                        f"trainer/acceptance.py and pass that file.")
    raw = data.get("subsets")
    if not isinstance(raw, dict) or not raw:
        raise PushError(f"eval results {path} has no subsets; regenerate the file with trainer/acceptance.py.")
    ordered = [s for s in SUBSET_ORDER if s in raw] + sorted(s for s in raw if s not in SUBSET_ORDER)
    subsets, unmeasured = [], []
    for name in ordered:
        entry = raw[name] if isinstance(raw[name], dict) else {}
        if entry.get("acceptance_length") is None and not entry.get("steps"):
            unmeasured.append(name)  # trainer/acceptance.py writes nulls for a subset without verification steps
            continue
        pos = entry.get("pos")
        if not isinstance(pos, list) or len(pos) != block_size:
            raise PushError(f"eval results {path}: subsets.{name}.pos has "
                            f"{len(pos) if isinstance(pos, list) else 'no'} values, expected {block_size} (one per "
                            f"draft position); regenerate the file with trainer/acceptance.py.")
        w = f"subsets.{name}."
        subsets.append(SubsetResult(
            name=name,
            acceptance_length=_number(entry.get("acceptance_length"), w + "acceptance_length", path, required=True),
            pos=[_number(p, f"{w}pos[{k}]", path, required=True) for k, p in enumerate(pos)],
            steps=_number(entry.get("steps"), w + "steps", path, integer=True),
            prompts=_number(entry.get("prompts"), w + "prompts", path, integer=True),
            generated_tokens=_number(entry.get("generated_tokens"), w + "generated_tokens", path, integer=True),
            tokens_per_s=_number(entry.get("tokens_per_s"), w + "tokens_per_s", path),
            baseline_tokens_per_s=_number(entry.get("baseline_tokens_per_s"), w + "baseline_tokens_per_s", path),
            speedup=_number(entry.get("speedup"), w + "speedup", path),
        ))
    if not subsets:
        raise PushError(f"eval results {path} has no measured subset (no verification steps in {unmeasured}); rerun "
                        f"trainer/acceptance.py with prompts that generate tokens.")
    total = _number(data.get("total_steps"), "total_steps", path, integer=True) or None
    weighted = _number(data.get("weighted_acceptance_length"), "weighted_acceptance_length", path)
    if all(s.steps for s in subsets):
        total = total if total is not None else sum(s.steps for s in subsets)
        if weighted is None:
            weighted = sum(s.acceptance_length * s.steps for s in subsets) / sum(s.steps for s in subsets)
    unweighted = _number(data.get("unweighted_acceptance_length"), "unweighted_acceptance_length", path)
    if unweighted is None:
        unweighted = sum(s.acceptance_length for s in subsets) / len(subsets)
    others = data.get("other_drafters") if isinstance(data.get("other_drafters"), dict) else {}
    sampling = data.get("sampling") if isinstance(data.get("sampling"), dict) else {}
    return AcceptanceResults(
        path=path, block_size=block_size, subsets=subsets, sampling=sampling, backend=data.get("backend"),
        verifier=verifier, dataset=data.get("dataset"), max_new_tokens=data.get("max_new_tokens"),
        date=data.get("date"), machine=data.get("machine"),
        versions=data.get("versions") if isinstance(data.get("versions"), dict) else {},
        weighted=weighted, unweighted=unweighted, total_steps=total,
        other_drafters={k: v for k, v in others.items() if isinstance(v, dict)},
        concurrency=_number(data.get("concurrency"), "concurrency", path, integer=True), unmeasured=unmeasured,
    )


# ================================================================================================
# 7. The model card
# ================================================================================================
CARD_TEMPLATE = """---
{{ card_data }}
---

# {{ title }}

{{ summary }}

## Usage

{{ usage }}

## Architecture

{{ architecture }}

## Training

{{ training }}

## Evaluation

{{ evaluation }}

## Limitations

{{ limitations }}

## Provenance

{{ provenance }}
"""


@dataclass
class CardInputs:
    """Everything the card is generated from; no number in the card comes from anywhere else."""

    repo_id: str
    verifier_id: str
    config: dict  # the staged config.json
    tensors: dict  # the staged tensors
    checkpoint: Checkpoint
    run_config: dict | None
    trainer_state: dict | None
    summary: dict | None
    results: list[AcceptanceResults]
    license: str
    revision: str | None


def _fmt_count(n: int) -> str:
    for scale, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "k")):
        if n >= scale:
            return f"{n / scale:.3g}{suffix}"
    return str(n)


def _hub_link(repo: str, kind: str = "") -> str:
    return f"[{repo}](https://huggingface.co/{kind}{repo})"


def _is_hub_dataset(name) -> bool:
    """Training data names a Hub dataset (metadata-worthy) rather than a local file or directory. Runs are
    usually launched from the package root, so a relative path is also looked up there, not only in the cwd."""
    return isinstance(name, str) and "/" in name and not name.startswith((".", "/", "~")) and \
        not name.endswith((".json", ".jsonl", ".parquet", ".csv", ".arrow")) and is_hub_id(name) and \
        not (Path(__file__).resolve().parent / name).exists()


def _train_datasets(run_config: dict | None) -> list[str]:
    data = (run_config or {}).get("data") or {}
    names = data.get("train_data")
    names = names if isinstance(names, list) else [names]
    return [n for n in names if _is_hub_dataset(n)]


def _describe_data(names) -> str:
    names = names if isinstance(names, list) else [names]
    shown = [_hub_link(n, "datasets/") if _is_hub_dataset(n) else f"a local dataset (`{Path(str(n)).name}`)"
             for n in names if n]
    return ", ".join(shown) or "not recorded"


def _layer_summary(types: list[str], window, non_causal: bool) -> str:
    """Runs of equal layer types, e.g. "layers 0–2: sliding-window attention (window 2048) ...; layer 3: full"."""
    runs, start = [], 0
    for i in range(1, len(types) + 1):
        if i == len(types) or types[i] != types[start]:
            runs.append((start, i - 1, types[start]))
            start = i
    parts = []
    for a, b, kind in runs:
        where = f"Layer {a}" if a == b else f"Layers {a}–{b}"
        if kind == "sliding_attention":
            inside = "bidirectional" if non_causal else "causal"
            parts.append(f"{where}: sliding-window attention (window {window}, {inside} inside the block)")
        else:
            parts.append(f"{where}: full attention (bidirectional inside the block)")
    return "; ".join(parts)


def architecture_section(inputs: CardInputs) -> str:
    c = inputs.config
    layer = c["transformer_layer_config"]
    snap = c.get("verifier_text_config") or {}
    params = sum(t.numel() for t in inputs.tensors.values() if t.is_floating_point())
    heads, kv = layer["num_attention_heads"], layer["num_key_value_heads"]
    n_layers = layer["num_hidden_layers"]
    attention = "GQA" if kv < heads else "MHA"
    vocab, draft_vocab = layer["vocab_size"], c.get("draft_vocab_size") or layer["vocab_size"]
    non_causal = bool(c.get("sliding_window_non_causal"))
    rows = [
        f"- Qwen3-style decoder with {n_layers} draft layer{'s' if n_layers != 1 else ''}; {params:,} saved "
        f"parameters (~{_fmt_count(params)}), {c.get('dtype', 'bfloat16')}",
        f"- Hidden size {layer['hidden_size']} (the verifier's), MLP size {layer['intermediate_size']} (SwiGLU)",
        f"- {heads} query heads over {kv} KV heads ({attention}, head dim {layer.get('head_dim')}), RoPE theta "
        f"{(layer.get('rope_parameters') or {}).get('rope_theta')}",
        f"- {_layer_summary(layer.get('layer_types') or [], layer.get('sliding_window'), non_causal)}",
        f"- Block size {c['block_size']}: {c['block_size']} draft tokens per verification step (anchor-first "
        f"layout), so acceptance length ranges from 1.0 to {c['block_size'] + 1}.0",
    ]
    if draft_vocab < vocab:
        how = " (the most frequent supervised tokens of the training data)" if inputs.run_config else ""
        rows.append(f"- Draft vocabulary of {draft_vocab:,} tokens, reduced from the verifier's {vocab:,}{how}; "
                    f"`d2t` maps draft ids to verifier ids")
    else:
        rows.append(f"- Full verifier vocabulary ({vocab:,} tokens): the output head is the verifier's own, shared at "
                    f"load time and not stored here")
    aux = c.get("aux_hidden_state_layer_ids") or []
    of = f" of its {snap['num_hidden_layers']}" if snap.get("num_hidden_layers") else ""
    rows.append(f"- Aux hidden states from verifier layers {'/'.join(map(str, aux))}{of}, fused by `fc` into the "
                f"context every draft layer attends to")
    rank = c.get("markov_rank") or 0
    rows.append(f"- Rank-{rank} vanilla Markov logit bias over the previous token" if rank else "- No Markov head")
    if c.get("enable_confidence_head", True):
        extra = " (reads the Markov features)" if c.get("confidence_head_with_markov") and rank else ""
        rows.append(f"- Confidence head{extra}: predicts per position whether the verifier will accept the draft")
    rows.append(f"- Input embeddings are the verifier's (shared, not stored); mask token id {c.get('mask_token_id')}")
    return "\n".join(rows)


def _get(d: dict | None, *keys, default=None):
    for key in keys:
        if not isinstance(d, dict) or key not in d:
            return default
        d = d[key]
    return d


def _teacher_forced(inputs: CardInputs) -> float | None:
    """The trainer's validation accept_len for exactly these weights (training-time estimate)."""
    if inputs.checkpoint.kind == "checkpoint" and inputs.trainer_state:
        for entry in inputs.trainer_state.get("log_history", []):
            if entry.get("step") == inputs.checkpoint.step and "eval_accept_len" in entry:
                return float(entry["eval_accept_len"])
        return None
    value = _get(inputs.summary, "eval_accept_len")
    return float(value) if isinstance(value, (int, float)) else None


def training_section(inputs: CardInputs) -> str:
    rc = inputs.run_config
    if not rc:
        return (f"No run configuration (`{RUN_CONFIG_FILE}`) was found in the checkpoint, so the training setup is "
                f"not recorded here.")
    m, d, t = rc.get("model") or {}, rc.get("data") or {}, rc.get("train") or {}
    rows = []
    step = inputs.checkpoint.step
    where = "the run's final model" if inputs.checkpoint.kind == "final" else inputs.checkpoint.path.name
    length = f"{t.get('max_steps')} steps" if (t.get("max_steps") or -1) > 0 else f"{t.get('num_train_epochs')} epochs"
    rows.append(f"- Weights from {where}" + (f" (optimizer step {step:,})" if step is not None else "") +
                f" of a run planned for {length}")
    if t.get("optimizer") == "muon":
        muon_lr = t.get("muon_learning_rate") or t.get("learning_rate")
        rows.append(f"- Optimizer: Muon for `fc` and the draft layers' projection matrices (lr {muon_lr}, weight "
                    f"decay {t.get('muon_weight_decay')}), AdamW for norms and the Markov and confidence heads (lr "
                    f"{t.get('learning_rate')}, weight decay {t.get('weight_decay')})")
    else:
        rows.append(f"- Optimizer: {t.get('optimizer')} (lr {t.get('learning_rate')}, weight decay "
                    f"{t.get('weight_decay')})")
    warmup = t.get("warmup_ratio")
    rows.append(f"- Schedule: {t.get('lr_scheduler_type')}" +
                (f" with {warmup:.0%} warmup" if isinstance(warmup, (int, float)) else "") +
                f", gradient clipping {t.get('max_grad_norm')}")
    rows_per_step = t.get("per_device_train_batch_size")
    rows.append(f"- Batch: {rows_per_step} packed row{'' if rows_per_step == 1 else 's'} per device and step, "
                f"gradient accumulation {t.get('gradient_accumulation_steps')} (device count not recorded)")
    rows.append(f"- Loss: {json.dumps(t.get('loss_weights'))} (CE target: {t.get('ce_target')}), confidence BCE weight "
                f"{t.get('confidence_weight')}, position decay exp(−k/γ) with γ = {t.get('decay_gamma')}")
    rows.append(f"- Anchors: up to {t.get('max_anchors')} per document, sampled fresh each step on supervised "
                f"positions")
    samples = f", up to {d['max_samples']:,} samples" if d.get("max_samples") else ""
    rows.append(f"- Data: {_describe_data(d.get('train_data'))} (split `{d.get('train_split')}`{samples}), "
                f"assistant tokens supervised; {1 - (d.get('validation_ratio') or 0):.0%}/"
                f"{(d.get('validation_ratio') or 0):.0%} train/validation split")
    stats = _data_stats(inputs)
    if stats:
        rows.append(f"- Trained on {stats['train_conversations']:,} conversations "
                    f"({stats['train_supervised_tokens']:,} supervised tokens in {stats['train_rows']:,} packed rows); "
                    f"{stats['validation_conversations']:,} held out for validation; data preparation kept "
                    f"{stats['kept']:,} of {stats['total']:,} rows")
    else:
        rows.append(f"- Data statistics: not recorded (`{DATA_STATS_FILE}` missing from the checkpoint)")
    rows.append(f"- Sequence lengths: conversations capped at {d.get('max_seq_length')} tokens, packed into training "
                f"rows of {d.get('total_seq_length')} tokens")
    if m.get("init_from"):
        lora = f", adapted with LoRA rank {m.get('lora_rank')} (merged)" if m.get("lora_rank") else ""
        rows.append(f"- Initialised from an existing drafter (`{Path(str(m['init_from'])).name}`){lora}")
    rows.append(f"- Seed {t.get('seed')}")
    estimate = _teacher_forced(inputs)
    if estimate is not None:
        rows.append(f"- Validation acceptance length for these weights, teacher-forced during training: {estimate:.3f} "
                    f"(a training-time estimate, not a serving measurement)")
    return "\n".join(rows)


def _data_stats(inputs: CardInputs) -> dict | None:
    """`dspark_data_stats.json` written by the trainer into every checkpoint (None for older checkpoints)."""
    path = inputs.checkpoint.path / DATA_STATS_FILE
    if not path.exists():
        return None
    stats = _read_json(path)
    keys = ("train_conversations", "train_supervised_tokens", "train_rows", "validation_conversations", "kept", "total")
    return stats if all(isinstance(stats.get(k), int) for k in keys) else None


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def _speedup(s: SubsetResult) -> float | None:
    if s.speedup is not None:
        return s.speedup
    if s.tokens_per_s and s.baseline_tokens_per_s:
        return s.tokens_per_s / s.baseline_tokens_per_s
    return None


def _results_section(r: AcceptanceResults, block: int) -> str:
    out = []
    dataset = _hub_link(r.dataset, "datasets/") if _is_hub_dataset(r.dataset) else \
        f"local prompt set `{r.dataset_label}`" if r.dataset else "not recorded"
    prompts = sum(s.prompts for s in r.subsets if s.prompts)
    setup = [f"- Dataset: {dataset} ({len(r.subsets)} subsets" + (f", {prompts:,} prompts)" if prompts else ")")]
    if r.unmeasured:
        setup.append(f"- Not measured (no verification steps): {', '.join(r.unmeasured)}")
    if r.max_new_tokens:
        setup.append(f"- Up to {r.max_new_tokens} new tokens per prompt")
    if r.backend:
        setup.append(f"- Backend: {r.backend}")
    if r.machine:
        setup.append(f"- Hardware: {r.machine}")
    if r.versions:
        setup.append("- Versions: " + ", ".join(f"{k} {v}" for k, v in r.versions.items()))
    if r.date:
        setup.append(f"- Date: {r.date}")
    out.append("\n".join(setup))
    out.append(f"`acceptance_length` is the mean number of tokens committed per verification step, bonus token "
               f"included: its floor is 1.0 and its ceiling is {block + 1}.0 at block size {block}. `pos_k` is the "
               f"share of steps that accepted at least k+1 drafts.")
    header = ["subset", "acceptance_length", *[f"pos_{k}" for k in range(block)]]
    out.append(_table(header, [[s.name, f"{s.acceptance_length:.3f}", *map(_pct, s.pos)] for s in r.subsets]))
    if r.weighted is not None and r.total_steps:
        out.append(f"Weighted across all subsets: {r.weighted:.3f} over {r.total_steps:,} verification steps "
                   f"(unweighted mean of the subsets: {r.unweighted:.3f}).")
    else:
        out.append(f"Unweighted mean across subsets: {r.unweighted:.3f} (step counts were not recorded, so no weighted "
                   f"mean).")
    best, worst = r.best(), min(r.subsets, key=lambda s: s.acceptance_length)
    if len(r.subsets) > 1:
        out.append(f"Highest on {best.name} ({best.acceptance_length:.2f}, pos_{block - 1} {_pct(best.pos[-1])}), "
                   f"lowest on {worst.name} ({worst.acceptance_length:.2f}).")
    out.append(_throughput(r))
    comparison = _comparison(r)
    if comparison:
        out.append(comparison)
    return "\n\n".join(out)


def _throughput(r: AcceptanceResults) -> str:
    measured = [s for s in r.subsets if s.tokens_per_s is not None]
    if not measured:
        return "Throughput was not measured in these results."
    others = list(r.other_drafters)
    header = ["subset", "baseline (no drafter)", *others, "DSpark (this model)", "DSpark speedup"]
    rows, ratios = [], {name: [] for name in ["baseline", *others, "this"]}
    for s in measured:
        base = s.baseline_tokens_per_s
        row = [s.name, f"{base:.1f}" if base else "–"]
        for name in others:
            tps = _get(r.other_drafters, name, s.name, "tokens_per_s")
            row.append(f"{tps:.1f}" if isinstance(tps, (int, float)) else "–")
            if isinstance(tps, (int, float)) and base:
                ratios[name].append(tps / base)
        speed = _speedup(s)
        row += [f"{s.tokens_per_s:.1f}", f"{speed:.2f}×" if speed is not None else "–"]
        if speed is not None:
            ratios["this"].append(speed)
        rows.append(row)
    mean = lambda xs: f"{sum(xs) / len(xs):.2f}×" if xs else "–"  # noqa: E731
    if ratios["this"]:
        rows.append(["average speedup", "1.00×", *[mean(ratios[n]) for n in others], mean(ratios["this"]),
                     mean(ratios["this"])])
    at = f" at concurrency {r.concurrency}" if r.concurrency else ""
    text = (f"#### Throughput (tokens/s)\n\nMean output throughput{at} with the setup above; the last column is "
            f"this drafter's speedup over the verifier alone"
            + (", and the last row each method's mean per-subset speedup." if ratios["this"] else "."))
    return text + "\n\n" + _table(header, rows)


def _comparison(r: AcceptanceResults) -> str | None:
    def measured(name: str, subset: str):
        value = _get(r.other_drafters, name, subset, "acceptance_length")
        return value if isinstance(value, (int, float)) else None

    others = [n for n in r.other_drafters if any(measured(n, s.name) is not None for s in r.subsets)]
    if not others:
        return None
    header = ["subset", *others, "DSpark (this model)", "best"]
    rows, sums = [], {n: [] for n in [*others, "this"]}
    for s in r.subsets:
        values = {n: measured(n, s.name) for n in others if measured(n, s.name) is not None}
        if not values:
            continue
        candidates = {**values, "DSpark": s.acceptance_length}
        rows.append([s.name, *[f"{values[n]:.3f}" if n in values else "–" for n in others],
                     f"{s.acceptance_length:.3f}", max(candidates, key=candidates.get)])
        if len(values) == len(others):
            for n in others:
                sums[n].append(values[n])
            sums["this"].append(s.acceptance_length)
    if sums["this"]:
        means = {n: sum(v) / len(v) for n, v in sums.items()}
        best = max(means, key=means.get)
        rows.append(["mean (unweighted)", *[f"{means[n]:.3f}" for n in others], f"{means['this']:.3f}",
                     "DSpark" if best == "this" else best])
    return ("#### Comparison with other drafters (acceptance length)\n\nSame prompts and sampling settings. Per-step "
            "draft cost differs between drafters, so acceptance length alone does not determine speed.\n\n"
            + _table(header, rows))


def evaluation_section(inputs: CardInputs) -> str:
    if not inputs.results:
        return ("No evaluation results were given to this export (`push_to_hub.py --eval-results`), so this card "
                "reports no measured acceptance length or throughput.")
    block = inputs.config["block_size"]
    titles = [r.title for r in inputs.results]
    parts = []
    for r in inputs.results:
        title = r.title if titles.count(r.title) == 1 else f"{r.title} ({r.path.name})"
        parts.append(f"### {title}\n\n{_results_section(r, block)}")
    parts.append(f"### Per-position acceptance\n\n![Per-position acceptance by subset]({PLOT_FILE})\n\n"
                 f"Share of verification steps that accepted at least k+1 drafts, per subset"
                 + (" (one panel per sampling setting)." if len(inputs.results) > 1 else "."))
    return "\n\n".join(parts)


def summary_section(inputs: CardInputs) -> str:
    c, v = inputs.config, inputs.verifier_id
    block = c["block_size"]
    trained = " trained with the dspark-hf package (a `transformers.Trainer`)" if inputs.run_config else ""
    text = (f"A DSpark draft model for speculative decoding with {_hub_link(v)} as the verifier,{trained}. "
            f"The drafter proposes {block} tokens at a time from the "
            f"verifier's hidden states and the verifier checks them in one forward pass, so the output is identical to "
            f"running the verifier alone: any speedup is lossless.")
    if not inputs.results:
        return text + " No acceptance was measured for this export (see Evaluation)."
    r = inputs.results[0]
    top = sorted(r.subsets, key=lambda s: -s.acceptance_length)[:2]
    mean = (f"Mean acceptance length is {r.weighted:.2f} tokens committed per verification step over "
            f"{r.total_steps:,} steps" if r.weighted is not None and r.total_steps else
            f"Mean acceptance length (unweighted over subsets) is {r.unweighted:.2f} tokens per verification step")
    text += f" {mean} ({r.short})"
    if len(r.subsets) > 1:
        text += ", up to " + " and ".join(f"{s.acceptance_length:.2f} on {s.name}" for s in top)
    text += "."
    speeds = sorted(((s, _speedup(s)) for s in r.subsets if _speedup(s) is not None), key=lambda x: -x[1])[:2]
    if speeds:
        where = f" on {r.machine}" if r.machine else ""
        at = f" at concurrency {r.concurrency}" if r.concurrency else ""
        if speeds[0][1] >= 1.0:
            text += (f" Measured{where}{at}, that gives a throughput speedup over the verifier alone of "
                     + " and ".join(f"{x:.2f}× on {s.name}" for s, x in speeds if x >= 1.0) + ".")
        else:  # say it plainly: a measured slowdown is not a speedup
            s, x = speeds[0]
            text += (f" Measured{where}{at}, generation with the drafter was slower than the verifier alone on every "
                     f"subset (at best {x:.2f}× on {s.name}).")
    return text


def usage_section(inputs: CardInputs) -> str:
    repo, v, block = inputs.repo_id, inputs.verifier_id, inputs.config["block_size"]
    revision = inputs.revision or "main"
    return f"""### vLLM

vLLM (0.31 or newer) reads the verifier (`{v}`) and the number of speculative tokens ({block}) from `config.json`, so
neither is passed separately:

```bash
vllm serve {repo} --port 8000
```

Then query the OpenAI-compatible endpoint at `http://localhost:8000/v1`; the model id is the drafter repo as typed:

```python
from openai import OpenAI

client = OpenAI(base_url="http://localhost:8000/v1", api_key="EMPTY")
reply = client.chat.completions.create(model="{repo}", messages=[{{"role": "user", "content": "Hello!"}}],
                                       max_tokens=256)
print(reply.choices[0].message.content)
```

### transformers

`trust_remote_code=True` runs this repo's `configuration_dspark.py` and `modeling_dspark.py`, so pin the commit you
reviewed (its hash from the "Files and versions" tab) rather than a moving branch:

```python
import torch
from transformers import AutoModel, AutoTokenizer

REVISION = "{revision}"  # replace with the reviewed commit hash
device = "cuda" if torch.cuda.is_available() else "cpu"
drafter = AutoModel.from_pretrained("{repo}", trust_remote_code=True, revision=REVISION,
                                    dtype=torch.bfloat16).to(device)
verifier = drafter.load_verifier(dtype=torch.bfloat16, device_map=device)  # {v}; shares its embeddings
tokenizer = AutoTokenizer.from_pretrained("{v}")
```

The drafter alone is not a language model: using it before `load_verifier()` / `attach_verifier(model)` raises.

### In-process speculative generation

```python
messages = [{{"role": "user", "content": "Explain speculative decoding in one paragraph."}}]
input_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                          return_dict=True)["input_ids"].to(device)
out = drafter.speculative_generate(verifier, input_ids, max_new_tokens=256)  # the verifier's sampling defaults
print(tokenizer.decode(out.sequences[0, input_ids.shape[1]:], skip_special_tokens=True))
print("acceptance length", sum(out.committed_per_step) / len(out.committed_per_step))
```

`speculative_generate` returns exactly the verifier's output (token-identical to greedy `generate` at temperature 0,
identically distributed when sampling) and the tokens committed per verification step."""


def limitations_section(inputs: CardInputs) -> str:
    v = inputs.verifier_id
    rows = [f"- Works only with {_hub_link(v)}: it reads that model's hidden states and shares its embeddings, and is "
            f"not usable as a standalone model or with another verifier."]
    if inputs.results:
        r = inputs.results[0]
        best, worst = r.best(), min(r.subsets, key=lambda s: s.acceptance_length)
        rows.append(f"- Acceptance depends on the traffic: in the measurements above ({r.short}) it ranges from "
                    f"{worst.acceptance_length:.2f} on {worst.name} to {best.acceptance_length:.2f} on {best.name}, so "
                    f"real-world speedup depends on your mix of requests.")
        if not any(x.greedy for x in inputs.results):
            rows.append("- All results were measured with sampling; greedy decoding typically accepts more, so they "
                        "are closer to the conservative case.")
    else:
        rows.append("- Acceptance depends on the traffic, and it was not measured for this export: measure it on your "
                    "own requests before relying on a speedup.")
    rows.append("- Verification is lossless, so the verifier's own behaviour and biases carry through unchanged.")
    return "\n".join(rows)


def provenance_section(inputs: CardInputs, run_config_sha: str | None) -> str:
    ckpt = inputs.checkpoint
    source = ckpt.path.name if ckpt.kind == "checkpoint" else "the run's final model"
    step = f" (step {ckpt.step:,})" if ckpt.step is not None else ""
    rows = [f"- Exported by `push_to_hub.py` from {source}{step}; weights converted to bfloat16 and checked against "
            f"the checkpoint"]
    if run_config_sha:
        rows.append(f"- Run configuration sha256 {run_config_sha[:16]}")
    rows.append(f"- Results files: {', '.join(f'`{r.path.name}`' for r in inputs.results)}" if inputs.results else
                "- Results files: none")
    rows.append("- Every number in this card was read from the checkpoint's `config.json` and weights, its saved run "
                "configuration and trainer state, and the results files listed here; none was typed by hand.")
    return "\n".join(rows)


def card_metadata(inputs: CardInputs) -> ModelCardData:
    tags = ["speculative-decoding", "dspark", "speculators", "draft-model"]
    family = (inputs.config.get("verifier_text_config") or {}).get("model_type")
    if isinstance(family, str) and family and family not in tags:
        tags.append(family.removesuffix("_text"))
    evals = []
    for r in inputs.results:
        hub = _is_hub_dataset(r.dataset)
        common = dict(task_type="text-generation", task_name="Speculative decoding",
                      dataset_type=r.dataset if hub else "custom", dataset_name=r.dataset_label,
                      metric_type="acceptance_length", metric_args=dict(r.sampling) or None)
        for s in r.subsets:
            evals.append(EvalResult(**common, dataset_config=s.name, metric_value=round(s.acceptance_length, 4),
                                    metric_name=f"acceptance length ({r.short})"))
        if r.weighted is not None:
            evals.append(EvalResult(**common, metric_value=round(r.weighted, 4),
                                    metric_name=f"weighted mean acceptance length ({r.short})"))
    return ModelCardData(
        base_model=inputs.verifier_id, library_name="transformers", pipeline_tag="text-generation",
        license=inputs.license, tags=tags, datasets=_train_datasets(inputs.run_config) or None,
        model_name=inputs.repo_id.split("/")[-1] if evals else None, eval_results=evals or None,
    )


def render_card(inputs: CardInputs, run_config_sha: str | None = None) -> ModelCard:
    """The model card, rendered from data by `huggingface_hub`'s `ModelCard.from_template`."""
    return ModelCard.from_template(
        card_metadata(inputs), template_str=CARD_TEMPLATE, title=inputs.repo_id.split("/")[-1],
        summary=summary_section(inputs), usage=usage_section(inputs), architecture=architecture_section(inputs),
        training=training_section(inputs), evaluation=evaluation_section(inputs),
        limitations=limitations_section(inputs), provenance=provenance_section(inputs, run_config_sha),
    )


def plot_acceptance(results: list[AcceptanceResults], path: Path) -> None:
    """pos_k against k, one line per subset, one panel per results file. Uses matplotlib's object API (no
    pyplot), so no GUI backend or global state is involved; the canvas is Agg."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.4 * len(results), 4.2), dpi=110)
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(results), squeeze=False)[0]
    for ax, r in zip(axes, results):
        xs = list(range(r.block_size))
        for s in r.subsets:
            ax.plot(xs, [100 * p for p in s.pos], marker="o", linewidth=1.5,
                    label=f"{s.name} ({s.acceptance_length:.2f})")
        ax.set_xticks(xs, [f"pos_{k}" for k in xs])
        ax.set_ylim(0, 100)
        ax.set_ylabel("steps accepting ≥ k+1 drafts (%)")
        ax.set_title(r.title, fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, title="subset (acceptance length)", title_fontsize=8)
    fig.tight_layout()
    fig.savefig(path, format="png", metadata={"Software": None})


# ================================================================================================
# 8. Staging
# ================================================================================================
@dataclass
class Staged:
    folder: Path
    checkpoint: Checkpoint
    verifier_id: str
    files: dict[str, int]  # name -> bytes
    commit_message: str
    commit_description: str
    remote_report: dict | None = None


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


def expected_files(folder: Path, with_plot: bool) -> set[str]:
    names = {"config.json", "README.md", *REMOTE_CODE_FILES, *weight_files(folder)}
    if (folder / "model.safetensors.index.json").exists():
        names.add("model.safetensors.index.json")
    return names | ({PLOT_FILE} if with_plot else set())


def stage(checkpoint: Checkpoint, folder: Path, *, repo_id: str, verifier_id: str | None = None,
          eval_results: list[str | os.PathLike] = (), license: str = "apache-2.0", revision: str | None = None,
          remote_code_check: bool = True) -> Staged:
    """Write the repo folder for `checkpoint` into the empty directory `folder`, then validate it.

    The weights go through `DSparkDraftModel` (fp32 load, floats to bf16, `save_pretrained`) rather than a
    file copy, so the staged config is regenerated by the current `DSparkConfig` and the remote-code files
    are the current ones; `check_weights` then proves nothing but the dtype changed."""
    import torch

    from modeling_dspark import DSparkDraftModel

    folder = Path(folder)
    source_config = _read_json(checkpoint.path / "config.json")
    verifier = resolve_verifier_id(source_config, verifier_id)
    block = source_config.get("block_size")
    weights_sha = weights_sha256(checkpoint.path)
    results = [load_eval_results(p, block, verifier, weights_sha) for p in eval_results]

    model, info = DSparkDraftModel.from_pretrained(checkpoint.path, dtype=torch.float32, output_loading_info=True)
    allowed_missing = set() if model.config.uses_draft_vocab else {"lm_head.weight"}
    if set(info["missing_keys"]) - allowed_missing or info["unexpected_keys"]:
        raise PushError(f"{checkpoint.path} does not match this package's DSparkDraftModel (missing "
                        f"{sorted(info['missing_keys'])}, unexpected {sorted(info['unexpected_keys'])}); export it "
                        f"with the package version that trained it.")
    model = model.to(torch.bfloat16)
    model.config.speculators_config["verifier"]["name_or_path"] = verifier
    model.config.verifier_local_path = None  # machine-specific; vLLM reads the Hub id above
    model.save_pretrained(folder)
    config = _read_json(folder / "config.json")

    check_serving_config(config)
    tensors = check_weights(folder, checkpoint.path)
    check_serving_config(config, tensors)

    run_config_file = checkpoint.path / RUN_CONFIG_FILE
    run_config, run_config_sha = None, None
    if run_config_file.exists():
        raw = run_config_file.read_bytes()
        run_config_sha = hashlib.sha256(raw).hexdigest()
        try:
            run_config = yaml.safe_load(raw) or None
        except yaml.YAMLError as e:
            raise PushError(f"{run_config_file} is not valid YAML ({e}); restore it from the run, or delete it to "
                            f"export without a training section.") from e
    state_file = checkpoint.path / "trainer_state.json"
    summary_file = (checkpoint.run_dir or checkpoint.path) / SUMMARY_FILE
    inputs = CardInputs(
        repo_id=repo_id, verifier_id=verifier, config=config, tensors=tensors, checkpoint=checkpoint,
        run_config=run_config if isinstance(run_config, dict) else None,
        trainer_state=_read_json(state_file) if state_file.exists() else None,
        summary=_read_json(summary_file) if summary_file.exists() and checkpoint.kind == "final" else None,
        results=results, license=license, revision=revision,
    )
    if results:
        plot_acceptance(results, folder / PLOT_FILE)
    render_card(inputs, run_config_sha).save(folder / "README.md")

    present = {p.name for p in folder.iterdir()}
    wanted = expected_files(folder, bool(results))
    if present != wanted:
        raise PushError(f"the staged folder holds {sorted(present ^ wanted)} beyond or short of the contract's files; "
                        f"re-run the export, and report it if it persists.")
    report = check_remote_code_load(folder) if remote_code_check else None
    message, description = commit_texts(verifier, checkpoint, results, run_config_sha)
    files = {name: (folder / name).stat().st_size for name in sorted(present)}
    return Staged(folder=folder, checkpoint=checkpoint, verifier_id=verifier, files=files, commit_message=message,
                  commit_description=description, remote_report=report)


# ================================================================================================
# 9. Upload
# ================================================================================================
def _remote_verifier(api, repo_id: str, revision: str | None) -> str | None:
    """The verifier named by the repo's current config.json, or None for a new/empty repo or branch."""
    for rev in dict.fromkeys([revision, None]):
        try:
            path = api.hf_hub_download(repo_id=repo_id, filename="config.json", revision=rev, repo_type="model")
        except RevisionNotFoundError:
            continue  # a new branch: compare with the default branch instead
        except (RepositoryNotFoundError, EntryNotFoundError):
            return None
        config = _read_json(Path(path))
        return ((config.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path") or "(none)"
    return None


def upload(api, repo_id: str, staged: Staged, *, private: bool = False, revision: str | None = None,
           create_pr: bool = False, commit_message: str | None = None, force: bool = False) -> str:
    """Push the staged folder as exactly one commit and return its URL (the PR URL with `create_pr`).

    `api` is an `HfApi` (or anything with the same methods: tests inject a fake). The calls, in order:
    `hf_hub_download(config.json)` to refuse a repo that serves another verifier, `create_repo(exist_ok=True)`,
    `create_branch(exist_ok=True)` for a `revision` other than main, then one `upload_folder`."""
    existing = _remote_verifier(api, repo_id, revision)
    if existing is not None and existing != staged.verifier_id and not force:
        raise PushError(f"{repo_id} already holds a drafter for verifier {existing}, not {staged.verifier_id}; push to "
                        f"another repo, or pass --force to replace it.")
    api.create_repo(repo_id=repo_id, private=private, exist_ok=True, repo_type="model")
    if revision and revision != "main":
        api.create_branch(repo_id=repo_id, branch=revision, exist_ok=True, repo_type="model")
    info = api.upload_folder(
        repo_id=repo_id, folder_path=str(staged.folder), repo_type="model", revision=revision, create_pr=create_pr,
        commit_message=commit_message or staged.commit_message, commit_description=staged.commit_description,
        delete_patterns=DELETE_PATTERNS,
    )
    url = getattr(info, "pr_url", None) if create_pr else None
    return url or getattr(info, "commit_url", None) or str(info)


# ================================================================================================
# 10. Command line
# ================================================================================================
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="push_to_hub.py", description="Export a DSpark checkpoint as a servable Hub repo with a model card.",
        epilog="--checkpoint: a checkpoint-N dir, the run's output_dir (checkpoint-best, else its final model, else "
               "the latest complete checkpoint) or OUTPUT_DIR:best|latest|final|<step>.")
    p.add_argument("--checkpoint", required=True, help="checkpoint directory or training output_dir[:selector]")
    p.add_argument("--repo-id", required=True, help="target Hub repo, ORG/NAME")
    p.add_argument("--verifier-id", help="the verifier's Hub id for config.json (default: the checkpoint's)")
    p.add_argument("--eval-results", nargs="+", action="extend", default=[], metavar="FILE",
                   help="dspark-acceptance/1 JSON files from trainer/acceptance.py (one card section each)")
    p.add_argument("--license", default="apache-2.0", help="license metadata for the card (default: apache-2.0)")
    p.add_argument("--private", action="store_true", help="create the repo as private (when it does not exist)")
    p.add_argument("--revision", help="branch to commit to (created when missing; default: main)")
    p.add_argument("--create-pr", action="store_true", help="open a pull request instead of committing directly")
    p.add_argument("--commit-message", help="override the data-derived commit message")
    p.add_argument("--force", action="store_true", help="replace a repo that holds a drafter for another verifier")
    p.add_argument("--dry-run", metavar="OUT_DIR", help="stage and validate into OUT_DIR only; no network at all")
    return p


def _check_repo_id(repo_id: str) -> None:
    try:
        validate_repo_id(repo_id)
    except HFValidationError as e:
        raise PushError(f"--repo-id {repo_id!r} is not a valid Hub repo id ({e}); use ORG/NAME.") from e
    if "/" not in repo_id:
        raise PushError(f"--repo-id {repo_id!r} has no namespace; use ORG/NAME (your user name or an organization).")


def _staged_export(path: Path) -> bool:
    """A directory holding only files an export writes (safe to replace on a repeated --dry-run)."""
    allowed = {"config.json", "README.md", PLOT_FILE, "model.safetensors.index.json", *REMOTE_CODE_FILES}
    return all(p.is_file() and (p.name in allowed or p.name.endswith(".safetensors")) for p in path.iterdir())


def _print_plan(staged: Staged, args, out=None) -> None:
    out = out or sys.stdout  # looked up per call, so redirected output (tests, wrappers) is honoured
    width = max(map(len, staged.files))
    print(f"staged {len(staged.files)} files from {staged.checkpoint.path}:", file=out)
    for name, size in staged.files.items():
        print(f"  {name:<{width}}  {size:>12,} bytes", file=out)
    where = f"revision {args.revision or 'main'}" + (", as a pull request" if args.create_pr else "")
    print(f"commit to {args.repo_id} ({where}):", file=out)
    print(f"  message: {args.commit_message or staged.commit_message}", file=out)
    for line in staged.commit_description.splitlines():
        print(f"  | {line}", file=out)


def _dry_run(checkpoint: Checkpoint, args) -> Staged:
    out = Path(args.dry_run).resolve()
    if out.exists() and not (out.is_dir() and _staged_export(out)):
        raise PushError(f"--dry-run directory {out} exists and holds other files; pass a new directory or remove it.")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f"{out.name}.tmp-", dir=out.parent))
    try:
        try:
            staged = stage(checkpoint, tmp, repo_id=args.repo_id, verifier_id=args.verifier_id,
                           eval_results=args.eval_results, license=args.license, revision=args.revision)
        except OSError as e:
            raise PushError(f"staging into {tmp} failed ({e}); free disk space there or choose another --dry-run "
                            f"directory, then rerun.") from e
        old = None
        if out.exists():
            old = Path(tempfile.mkdtemp(prefix=f"{out.name}.old-", dir=out.parent))
            os.replace(out, old / "x")
        os.replace(tmp, out)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    staged.folder = out
    return staged


def main(argv: list[str] | None = None, api=None) -> int:
    """CLI entry. `api` injects an `HfApi`-like object (tests); by default a real `HfApi` is built after the
    offline and token checks, and never in --dry-run."""
    args = build_parser().parse_args(argv)
    token = None
    try:
        _check_repo_id(args.repo_id)
        if not args.dry_run:
            if huggingface_hub.constants.HF_HUB_OFFLINE:
                raise PushError("Hugging Face Hub offline mode is on (HF_HUB_OFFLINE=1); unset it to upload or use "
                                "--dry-run OUT_DIR.")
            token = get_token()
            if not token:
                raise PushError("no Hugging Face token found; run `hf auth login` or set HF_TOKEN.")
        checkpoint = resolve_checkpoint(args.checkpoint)
        print(f"exporting {checkpoint.path}" + (f" (step {checkpoint.step})" if checkpoint.step is not None else ""))
        if args.dry_run:
            staged = _dry_run(checkpoint, args)
            _print_plan(staged, args)
            print(f"dry run: validated {staged.folder}; nothing was uploaded.")
            return 0
        with tempfile.TemporaryDirectory(prefix="dspark-push-") as tmp:
            try:
                staged = stage(checkpoint, Path(tmp) / "repo", repo_id=args.repo_id, verifier_id=args.verifier_id,
                               eval_results=args.eval_results, license=args.license, revision=args.revision)
            except OSError as e:
                raise PushError(f"staging into {tmp} failed ({e}); free disk space there (or point TMPDIR at a "
                                f"larger disk) and rerun.") from e
            _print_plan(staged, args)
            if api is None:
                from huggingface_hub import HfApi

                api = HfApi(token=token)
            try:
                url = upload(api, args.repo_id, staged, private=args.private, revision=args.revision,
                             create_pr=args.create_pr, commit_message=args.commit_message, force=args.force)
            except PushError:
                raise
            except Exception as e:  # network, auth, permissions: the Hub commit is atomic, so nothing half-pushed
                rerun = shlex.join(["python", "push_to_hub.py", *(sys.argv[1:] if argv is None else argv)])
                reason = " ".join(str(e).split())  # Hub errors span lines (server message, request id)
                raise PushError(f"upload to {args.repo_id} failed ({type(e).__name__}: {reason}); nothing was "
                                f"committed and the staged folder was removed, so fix the cause and rerun: "
                                f"{rerun}") from e
        print(f"uploaded {len(staged.files)} files to {args.repo_id} in one commit: {url}")
        return 0
    except PushError as e:
        message = str(e)
        if token:
            message = message.replace(token, "***")
        print(f"error: {message}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
