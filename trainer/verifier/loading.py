"""The frozen verifier outside the drafter: loading it for training, evaluation and regeneration, and turning
sampling settings into `generate()` arguments.

Sampling settings themselves (what the verifier's `generation_config` implies when the user gives nothing)
come from `generation_dspark.sampling_defaults`, which speculative generation uses too, so a baseline
`generate()`, a regeneration run and a speculative run all sample the same way.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import AutoModelForCausalLM

from generation_dspark import sampling_defaults


def torch_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """`auto` is bf16 on GPU and fp32 on CPU (CPU bf16 matmuls are emulated and very slow on AVX2 machines)."""
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, dtype)


def load_verifier(name_or_path: str, dtype: str = "auto", device: str | torch.device | None = None) -> nn.Module:
    """A frozen (eval, no grad) causal LM with sdpa attention (works for every verifier family, including
    Gemma 4's 512-wide heads), on `device` (default: the GPU when there is one)."""
    device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    model = AutoModelForCausalLM.from_pretrained(name_or_path, dtype=torch_dtype(dtype, device),
                                                 attn_implementation="sdpa")
    return model.to(device).eval().requires_grad_(False)


def resolve_sampling(verifier: nn.Module, temperature: float | None = None, top_k: int | None = None,
                     top_p: float | None = None) -> dict:
    """The sampling settings a run reports: `{"temperature": T}` when greedy, plus `top_k`/`top_p` when sampling,
    each defaulting to the verifier's `generation_config`."""
    settings = sampling_defaults(getattr(verifier, "generation_config", None), temperature, top_k, top_p)
    out = {"temperature": float(settings["temperature"] or 0.0)}
    if out["temperature"] > 0:
        out.update(top_p=settings["top_p"], top_k=settings["top_k"])
    return out


def generation_kwargs(sampling: dict, max_new_tokens: int, pad_token_id: int | None) -> dict:
    """`generate()` arguments for `resolve_sampling` settings; greedy clears the config's sampling fields so
    transformers does not warn about (or apply) them."""
    kwargs = dict(max_new_tokens=max_new_tokens, do_sample=sampling["temperature"] > 0, pad_token_id=pad_token_id)
    if kwargs["do_sample"]:
        kwargs.update(temperature=sampling["temperature"], top_k=sampling.get("top_k"), top_p=sampling.get("top_p"))
    else:
        kwargs.update(temperature=None, top_k=None, top_p=None)
    return kwargs


def resolve_pretrained(name: str, what: str = "verifier"):
    """`(path, config)` for a model given as a local directory, a registered small model or a Hub id, reading
    only its config (nothing heavy, and never the repo's own code), or one sentence saying why it cannot be
    loaded and what to pass instead. Drafters go through `resolve_drafter`."""
    from transformers import AutoConfig

    return _read_config(name, what, AutoConfig.from_pretrained)


def resolve_drafter(name: str, what: str = "drafter"):
    """`(path, DSparkConfig)` for a drafter saved by this package or by speculators (whose config.json has no
    `model_type` and an `auto_map` to speculators' own `config.py`, which `AutoConfig` cannot read without running
    it). The config is read with this package's `DSparkConfig` directly, so no code from the drafter's folder
    runs; a checkpoint that is not a servable DSpark drafter (another speculators algorithm, a gated or rnn Markov
    head) is refused in one sentence."""
    import json

    from configuration_dspark import DSparkConfig
    from trainer.errors import UsageError

    def read(path: str) -> DSparkConfig:
        raw, _ = DSparkConfig.get_config_dict(path)
        if "speculators_model_type" not in raw:  # a verifier's folder, say: read as DSpark, it fails far later
            kind = f"describes a {raw['model_type']!r} model" if raw.get("model_type") else "has no speculators_model_type"
            raise UsageError(f"{what} {name} is not a drafter (its config.json {kind}); pass a folder saved by this "
                             f"package or by speculators.")
        try:
            return DSparkConfig.from_pretrained(path)
        except ValueError as e:
            if isinstance(e, json.JSONDecodeError):
                raise
            # DSparkConfig's own checks: one sentence with the fix already
            raise UsageError(f"{what} {name} cannot be used: {e}") from e

    return _read_config(name, what, read)


def _read_config(name: str, what: str, read):
    """The one place a model name becomes `(path, config)`: a missing directory, a file, a folder without
    config.json, an unreadable config, an offline Hub and a Hub failure each get their own sentence. `read`'s
    OSError or ValueError means the file could not be read."""
    import os

    import huggingface_hub

    from configuration_dspark import is_hub_id
    from trainer.errors import UsageError
    from trainer.verifier.small_models import resolve_model

    if not name:
        raise UsageError(f"no {what} was given; pass a local directory or a Hub id.")
    try:
        path = resolve_model(name)
    except RuntimeError as e:
        raise UsageError(str(e)) from e
    if os.path.exists(path):
        if not os.path.isdir(path):
            raise UsageError(f"{what} {name} is a file, not a model directory; pass the directory holding its "
                             f"config.json (or a Hub id).")
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise UsageError(f"{what} directory {name} has no config.json; pass a directory saved with "
                             f"save_pretrained (or a Hub id).")
    elif not is_hub_id(path):
        raise UsageError(f"{what} directory {name} does not exist (and it is not a Hub id); check the path.")
    try:
        config = read(path)
    except UsageError:
        raise
    except (OSError, ValueError) as e:
        if os.path.isdir(path):
            raise UsageError(f"{what} directory {name} holds no readable config.json "
                             f"({' '.join(str(e).split())[:160]}); pass a directory saved with save_pretrained.") from e
        if huggingface_hub.constants.HF_HUB_OFFLINE:
            raise UsageError(f"{what} {name} is neither a local directory nor in the local Hugging Face cache, and "
                             f"the Hub is offline (HF_HUB_OFFLINE=1); download it first, pass a local directory, or "
                             f"unset HF_HUB_OFFLINE.") from e
        raise UsageError(f"cannot read the config of {what} {name} from the Hub ({' '.join(str(e).split())[:160]}); "
                         f"check the id and your access (`hf auth login`), or pass a local directory.") from e
    return path, config


def load_verifier_shell(name_or_path: str, dtype: str = "auto", device: str | torch.device | None = None) -> nn.Module:
    """The verifier with only the weights the trainer needs when its hidden states come from elsewhere (a vLLM
    server, an offline cache): the input embedding and output head (which the drafter shares) and the final
    norm (the teacher's). Everything else, the decoder layers included, stays on the meta device, so each rank
    holds a few hundred MB instead of the whole verifier, and a forward through it fails instead of computing
    garbage. The tensors are read from the checkpoint's safetensors files by name (the model's own parameter
    names, or the one checkpoint key ending with the same suffix)."""
    import json
    import os

    from safetensors import safe_open
    from transformers import AutoConfig
    from transformers.utils import cached_file

    from modeling_dspark import verifier_decoder

    device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    target_dtype = torch_dtype(dtype, device)
    config = AutoConfig.from_pretrained(name_or_path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=target_dtype, attn_implementation="sdpa")
    model.eval().requires_grad_(False)

    index = cached_file(name_or_path, "model.safetensors.index.json", _raise_exceptions_for_missing_entries=False)
    if index:
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        folder = os.path.dirname(index)
    else:
        single = cached_file(name_or_path, "model.safetensors", _raise_exceptions_for_missing_entries=False)
        if not single:
            raise FileNotFoundError(f"verifier {name_or_path} has no model.safetensors(.index.json); save it with "
                                    f"save_pretrained (safetensors) to train from served or cached hidden states.")
        folder = os.path.dirname(single)
        with safe_open(single, "pt") as f:
            weight_map = {k: "model.safetensors" for k in f.keys()}

    def read(name: str) -> torch.Tensor:
        key = name if name in weight_map else None
        if key is None:  # checkpoints written by another class nest the same module under another prefix
            tail = name.split(".", 1)[-1] if name.startswith("model.") else name
            matches = [k for k in weight_map if k.endswith("." + tail) or k == tail]
            if len(matches) != 1:
                raise KeyError(f"verifier {name_or_path}: cannot find the tensor {name} in its safetensors files "
                               f"({len(matches)} candidates); pass a checkpoint saved by transformers' save_pretrained.")
            key = matches[0]
        with safe_open(os.path.join(folder, weight_map[key]), "pt", device="cpu") as f:
            return f.get_tensor(key).to(device=device, dtype=target_dtype)

    names: dict[int, str] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), n)  # a tied tensor under its first (checkpoint) name
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    tied = head is not None and (head.weight is embedding.weight or bool(getattr(
        config.get_text_config(), "tie_word_embeddings", getattr(config, "tie_word_embeddings", False))))
    norm = verifier_decoder(model).norm
    loaded: dict[int, nn.Parameter] = {}
    for module in (embedding, norm, None if tied else head):
        if module is None:
            continue
        for attr, param in list(module._parameters.items()):
            if param is None:
                continue
            if id(param) not in loaded:
                loaded[id(param)] = nn.Parameter(read(names[id(param)]), requires_grad=False)
            module._parameters[attr] = loaded[id(param)]
    if tied:
        head.weight = embedding.weight
    stray = [n for n, b in norm.named_buffers() if b.is_meta]
    if stray:
        raise RuntimeError(f"the final norm of verifier {name_or_path} has buffers {stray} that are not in its "
                           f"checkpoint; train with the in-process source (train.hidden_states: in_process).")
    return model


def local_folder(name: str, what: str):
    """A local transformers folder for `name` (a directory, a registered small model, or a Hub id in the cache):
    the converter reads files, not Hub ids."""
    import os
    from pathlib import Path

    import huggingface_hub

    from trainer.errors import UsageError

    path, _ = resolve_pretrained(name, what)
    if os.path.isdir(path):
        return Path(path).resolve()

    try:
        return Path(huggingface_hub.snapshot_download(path))
    except Exception as e:  # noqa: BLE001 - any Hub failure is the same fix
        raise UsageError(f"{what} {name} is not a local folder and could not be fetched ({type(e).__name__}); pass "
                         f"the folder it was saved to.") from e
