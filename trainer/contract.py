"""The checkpoint contract: what a servable DSpark folder holds, derived from its `config.json` alone, and the
checks that prove a folder serves.

A servable folder (every trainer checkpoint, the run's final model, an exported Hub repo) holds
`config.json` (the speculators format vLLM reads, plus `auto_map` for transformers' remote code), the two
remote-code files (`REMOTE_CODE_FILES`), and `model.safetensors` with exactly these tensors:

    fc.weight [H, k*H], hidden_norm.weight [H], norm.weight [H]
    layers.i.{input_layernorm, post_attention_layernorm}.weight [H]
    layers.i.self_attn.{q,k,v,o}_proj.weight (+ biases with attention_bias), q_norm / k_norm [head_dim]
    layers.i.mlp.{gate,up,down}_proj.weight
    lm_head.weight [Vd, H], d2t [Vd] int64, t2d [V] bool      only with a reduced draft vocabulary (Vd < V)
    markov_head.markov_w1.weight [V, r], markov_w2.weight [Vd, r]   only with markov_rank r > 0
    confidence_head.proj.weight [1, H(+r)], .bias [1]          only with the confidence head

Nothing else: vLLM's loader rejects unknown names, and the verifier's embeddings (and a full-vocabulary
head) are shared at load time, never stored. Exported repos are bfloat16 (`d2t`/`t2d` keep their integer
and bool dtypes); training checkpoints may be float32, so `check_folder` compares names and shapes only
unless asked for the dtype too.

An exported repo also carries the speculative decoding loop as `custom_generate/generate.py` (a copy of this
package's `generation_dspark.py`), transformers' convention for a decoding loop shipped with a model repo:
`verifier.generate(ids, custom_generate=<repo>, trust_remote_code=True, drafter=drafter)` runs it in-process with
no package installed. `EXPORT_CODE_FILES` is the code an export ships.

The serving checks restate what vLLM 0.33 checks (or silently gets wrong) when it reads a speculators
config, so a folder that would not serve is refused before it is pushed; vLLM itself is not imported.
`check_remote_code_load` loads a folder the way a user of the pushed repo does, in a fresh process: the drafter
through `AutoModel`, and the decoding loop through transformers' `custom_generate` loader.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from configuration_dspark import check_aux_layer_ids, is_hub_id
from trainer.errors import DSparkError, UsageError

REMOTE_CODE_FILES = ("configuration_dspark.py", "modeling_dspark.py")  # auto_map's code: in every checkpoint
CUSTOM_GENERATE_FILE = "custom_generate/generate.py"  # the decoding loop, where transformers looks for it
CUSTOM_GENERATE_SOURCE = "generation_dspark"  # the package's module that an export copies there
EXPORT_CODE_FILES = (*REMOTE_CODE_FILES, CUSTOM_GENERATE_FILE)
WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX_FILE = "model.safetensors.index.json"


class ServingError(DSparkError):
    """A folder that breaks the checkpoint contract or would not serve; one sentence with cause and fix."""


def read_json(path: Path) -> dict:
    """A JSON object from a checkpoint file, or a one-sentence error naming the file."""
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ServingError(f"cannot read {path} ({e}); pass a checkpoint whose files are intact.") from e
    return data if isinstance(data, dict) else {}


# ================================================================================================
# The verifier's Hub id
# ================================================================================================
def resolve_verifier_id(checkpoint_config: dict, verifier_id: str | None) -> str:
    """The verifier's Hub id for the pushed config: `--verifier-id`, else the one the checkpoint names."""
    if verifier_id is not None:
        if not is_hub_id(verifier_id):
            raise UsageError(f"--verifier-id {verifier_id!r} is not a Hub id (a local path or an invalid repo id); "
                            f"pass the verifier's id on the Hub, e.g. google/gemma-4-E4B-it.")
        return verifier_id
    found = ((checkpoint_config.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path")
    if not is_hub_id(found):
        raise UsageError(f"the checkpoint names no Hub id for its verifier (found {found!r}); pass --verifier-id "
                        f"org/name.")
    return found


# ================================================================================================
# Weights: files, contract, comparison
# ================================================================================================
def weight_files(folder: Path) -> list[str]:
    """The safetensors files of a folder (one file, or the shards its index lists)."""
    folder = Path(folder)
    index = folder / WEIGHTS_INDEX_FILE
    if index.exists():
        return sorted(set(read_json(index).get("weight_map", {}).values()))
    return [WEIGHTS_FILE] if (folder / WEIGHTS_FILE).exists() else []


def load_tensors(folder: Path) -> dict:
    """Every tensor of a folder's safetensors files; a truncated or corrupt file is one sentence."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    tensors = {}
    for name in weight_files(folder):
        try:
            tensors.update(load_file(Path(folder) / name))
        except (SafetensorError, OSError) as e:
            raise ServingError(f"{Path(folder) / name} is not a readable safetensors file ({e}); it is truncated or "
                               f"corrupt, so pass another checkpoint (an earlier checkpoint-N of the run).") from e
    return tensors


def tensor_headers(folder: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """Name -> (shape, dtype) of every stored tensor, read from the safetensors headers without loading data."""
    from safetensors import SafetensorError, safe_open

    out = {}
    for name in weight_files(folder):
        try:
            with safe_open(Path(folder) / name, framework="pt") as f:
                for key in f.keys():
                    part = f.get_slice(key)
                    out[key] = (tuple(part.get_shape()), _DTYPES.get(part.get_dtype(), part.get_dtype()))
        except (SafetensorError, OSError) as e:
            raise ServingError(f"{Path(folder) / name} is not a readable safetensors file ({e}); it is truncated or "
                               f"corrupt, so pass another checkpoint (an earlier checkpoint-N of the run).") from e
    return out


_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float64", "I64": "int64", "BOOL": "bool"}


def check_folder(folder: Path, check_dtype: bool = False) -> dict:
    """Refuse a folder whose stored tensors are not exactly the contract's for its own `config.json` (names and
    shapes; dtypes too with `check_dtype`, as an export must be bf16). Returns the parsed config."""
    folder = Path(folder)
    if not (folder / "config.json").exists():
        raise ServingError(f"{folder} is not a drafter (no config.json); pass a checkpoint written by trainer/run.py.")
    config = read_json(folder / "config.json")
    if config.get("speculators_model_type") != "dspark":
        raise ServingError(f"{folder} is not a DSpark drafter (config.json has speculators_model_type "
                           f"{config.get('speculators_model_type')!r}, not 'dspark'); pass a checkpoint written by "
                           f"trainer/run.py.")
    if not weight_files(folder):
        raise ServingError(f"{folder} has a drafter config but no {WEIGHTS_FILE}; pass a complete checkpoint.")
    try:
        expected = contract_tensors(config)
    except (KeyError, TypeError) as e:
        raise ServingError(f"{folder}/config.json lacks the drafter field {e}; pass a checkpoint written by "
                           f"trainer/run.py.") from e
    stored = tensor_headers(folder)
    missing, extra = sorted(set(expected) - set(stored)), sorted(set(stored) - set(expected))
    if missing or extra:
        raise ServingError(f"{folder} breaks the checkpoint contract (missing {missing}, unexpected {extra}); re-save "
                           f"it with this package's DSparkDraftModel.save_pretrained.")
    for name, (shape, dtype) in stored.items():
        want_shape, want_dtype = expected[name]
        floating = want_dtype == "bfloat16"
        if shape != want_shape or (check_dtype or not floating) and dtype != want_dtype:
            raise ServingError(f"tensor {name} in {folder} is {dtype} {list(shape)}, but config.json implies "
                               f"{want_dtype} {list(want_shape)}; pass a checkpoint whose config.json matches its "
                               f"weights.")
    return config


def contract_tensors(config: dict) -> dict[str, tuple[tuple[int, ...], str]]:
    """Every tensor a DSpark repo must hold, with its shape and dtype, derived from `config.json` alone
    (see the module docstring): nothing more (vLLM's loader rejects unknown names), nothing less."""
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

    config = read_json(staged / "config.json")
    expected = contract_tensors(config)
    tensors = load_tensors(staged)
    source = load_tensors(checkpoint)
    missing, extra = sorted(set(expected) - set(tensors)), sorted(set(tensors) - set(expected))
    if missing or extra:
        raise ServingError(f"the staged weights break the checkpoint contract (missing {missing}, unexpected {extra}); "
                        f"re-save the checkpoint with this package's DSparkDraftModel.save_pretrained.")
    if set(source) != set(tensors):
        raise ServingError(f"the checkpoint's saved tensors {sorted(set(source) ^ set(tensors))} differ from the staged "
                        f"ones; re-save the checkpoint with this package's DSparkDraftModel.save_pretrained.")
    for name, tensor in tensors.items():
        shape, dtype = expected[name]
        if tuple(tensor.shape) != shape or str(tensor.dtype).removeprefix("torch.") != dtype:
            raise ServingError(f"staged tensor {name} is {str(tensor.dtype).removeprefix('torch.')} {list(tensor.shape)}, "
                            f"but config.json implies {dtype} {list(shape)}; re-export from a checkpoint whose "
                            f"config.json matches its weights.")
        if tensor.is_floating_point():
            bad = int((~torch.isfinite(tensor)).sum())
            if bad:
                raise ServingError(f"weight {name} has {bad} non-finite values (NaN/inf) in {checkpoint} after bf16 "
                                f"conversion; push an earlier checkpoint (--checkpoint OUTPUT_DIR:<step>) instead.")
            reference = source[name].to(torch.bfloat16)
        else:
            reference = source[name]
        if reference.dtype != tensor.dtype or not torch.equal(reference, tensor):
            raise ServingError(f"staged tensor {name} differs from the checkpoint's (bf16-rounded) value; re-run the "
                            f"export, and report it if it persists.")
    return tensors


# ================================================================================================
# The structural checks vLLM applies to a speculators config (restated, vLLM is not imported)
# ================================================================================================
def check_serving_config(config: dict, tensors: dict | None = None) -> None:
    """Refuse a config that `vllm serve <repo>` would reject or, worse, serve wrongly."""
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
    if config.get("sliding_window_non_causal"):
        problems.append("sliding_window_non_causal is true, but vLLM ignores it and serves the sliding layers causal "
                        "inside the block, not as this drafter was trained (retrain it with "
                        "sliding_window_non_causal: false)")
    try:
        v_layers = (config.get("verifier_text_config") or {}).get("num_hidden_layers")
        check_aux_layer_ids(config.get("aux_hidden_state_layer_ids"), v_layers if isinstance(v_layers, int) else None)
    except ValueError as e:
        problems.append(str(e).rstrip("."))
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
        raise ServingError(f"the staged config.json would not serve with vLLM: {'; '.join(problems)}; re-export from a "
                        f"checkpoint written by this package's trainer.")


# ================================================================================================
# Remote code in a fresh module cache
# ================================================================================================
_REMOTE_LOAD = r"""
import json, sys
for name in ("configuration_dspark", "modeling_dspark", "generation_dspark", "trainer"):
    sys.modules[name] = None  # this package, should it be installed here: only the folder's own code may load
import torch
from safetensors.torch import load_file
from transformers import AutoModel, GenerationMixin

folder, files = sys.argv[1], sys.argv[2:]
model, info = AutoModel.from_pretrained(folder, trust_remote_code=True, output_loading_info=True)
state = model.state_dict()
saved = {}
for name in files:
    saved.update(load_file(f"{folder}/{name}"))
mismatched = [k for k, v in saved.items() if k not in state or not torch.equal(state[k], v.to(state[k].dtype))]
# what verifier.generate(..., custom_generate=folder, trust_remote_code=True) loads (it does not use the model)
generate = GenerationMixin.load_custom_generate(None, folder, trust_remote_code=True)
print("RESULT " + json.dumps({"module": type(model).__module__, "class": type(model).__name__,
                              "missing": sorted(info["missing_keys"]), "unexpected": sorted(info["unexpected_keys"]),
                              "mismatched": mismatched, "compared": len(saved),
                              "generate_module": generate.__module__, "generate": generate.__name__}))
"""


def check_remote_code_load(folder: Path, timeout: float = 600) -> dict:
    """Load the staged folder the way a user of the pushed repo does, in a separate Python process with an
    empty `HF_MODULES_CACHE`, offline, and this package's modules blocked: only the folder's own `.py` files can
    define the classes and the `custom_generate` loop, so a missing or broken remote-code file fails here rather
    than on the user's machine. Returns the report."""
    folder = Path(folder).resolve()
    with tempfile.TemporaryDirectory(prefix="dspark-modules-") as modules:
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        env |= {"HF_MODULES_CACHE": modules, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                "HF_HUB_DISABLE_TELEMETRY": "1"}
        try:
            proc = subprocess.run([sys.executable, "-c", _REMOTE_LOAD, str(folder), *weight_files(folder)], env=env,
                                  cwd=modules, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired as e:
            raise ServingError(f"loading the staged folder with AutoModel took over {timeout:.0f} s; check the machine's "
                            f"load and re-run the export.") from e
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        reason = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise ServingError(f"the staged folder does not load with AutoModel.from_pretrained(..., trust_remote_code=True) "
                        f"in a fresh module cache, or its {CUSTOM_GENERATE_FILE} does not ({reason}); fix "
                        f"{', '.join(REMOTE_CODE_FILES)} or {CUSTOM_GENERATE_SOURCE}.py and re-export.")
    report = json.loads(lines[-1][len("RESULT "):])
    report["modules_cache"] = modules
    config = read_json(folder / "config.json")
    full_vocab = (config.get("draft_vocab_size") or 0) >= config["transformer_layer_config"]["vocab_size"]
    allowed_missing = {"lm_head.weight"} if full_vocab else set()
    problems = []
    if not report["module"].startswith("transformers_modules"):
        problems.append(f"the class came from {report['module']}, not from the repo's remote code")
    if set(report["missing"]) - allowed_missing or report["unexpected"]:
        problems.append(f"missing {report['missing']}, unexpected {report['unexpected']}")
    if report["mismatched"]:
        problems.append(f"loaded tensors {report['mismatched']} differ from the files")
    if not report["generate_module"].startswith("transformers_modules") or report["generate"] != "generate":
        problems.append(f"custom_generate loaded {report['generate_module']}.{report['generate']}, not the repo's "
                        f"{CUSTOM_GENERATE_FILE}")
    if problems:
        raise ServingError(f"the staged folder loads wrongly through remote code ({'; '.join(problems)}); fix "
                        f"{', '.join(REMOTE_CODE_FILES)} or {CUSTOM_GENERATE_SOURCE}.py and re-export.")
    return report

