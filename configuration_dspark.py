"""Configuration of a DSpark draft model (remote code: imports only torch, transformers and the stdlib).

One `config.json` serves three readers:

* vLLM and the `speculators` library read the *speculators format*: no top-level `model_type`,
  `speculators_model_type: "dspark"`, a `speculators_config` naming the verifier by Hub id, and a
  complete Qwen3 `transformer_layer_config` for the draft decoder layers.
* transformers reads the same file through `auto_map` (`AutoConfig`/`AutoModel` with
  `trust_remote_code=True`), which is why `auto_map` is always written.
* This package additionally keeps a small snapshot of the verifier's text config
  (`verifier_text_config`) and an optional local verifier path (`verifier_local_path`), so that a
  drafter attached to the wrong verifier fails at load time instead of silently drafting garbage.
  vLLM and speculators ignore both keys.

`DSparkConfig.from_verifier(...)` derives everything the verifier determines (hidden size, vocabulary,
RoPE, default aux layers, mask token) and validates the rest; every check raises a one-sentence
`ValueError` that names the cause and the fix.
"""

import copy
import os
import re
from typing import Any

from transformers import AutoConfig, PreTrainedConfig

SPECULATORS_VERSION = "0.9.0"
SLIDING, FULL = "sliding_attention", "full_attention"
AUTO_MAP = {
    "AutoConfig": "configuration_dspark.DSparkConfig",
    "AutoModel": "modeling_dspark.DSparkDraftModel",
}

# The draft decoder layers of the seed recipe (gemma-4-E4B-it drafter). `from_verifier` replaces the
# fields the verifier determines; the rest are the defaults of a bare `DSparkConfig()`.
DEFAULT_LAYER_CONFIG: dict[str, Any] = {
    "model_type": "qwen3",
    "hidden_act": "silu",
    "hidden_size": 2560,
    "intermediate_size": 8192,
    "num_hidden_layers": 4,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "layer_types": [SLIDING, SLIDING, SLIDING, FULL],
    "sliding_window": 2048,
    "use_sliding_window": True,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
    "attention_bias": False,
    "attention_dropout": 0.0,
    "initializer_range": 0.02,
    "tie_word_embeddings": False,
    "vocab_size": 262144,
}
# Keys that may be passed flat to `DSparkConfig(...)`/`from_verifier(...)` and belong to the layers.
LAYER_KEYS = frozenset(DEFAULT_LAYER_CONFIG) - {"model_type", "tie_word_embeddings", "use_sliding_window"}

# The drafter's architecture, declared once: every choice a recipe may make about the drafter's shape and
# behaviour (flat names; the layer fields live in `transformer_layer_config`). `from_verifier(**overrides)`
# takes them, the trainer's run config (`trainer/config.py`, section `model`) has one field per key and
# passes exactly these on, and `DSparkConfig.architecture()` reads them back (for `init_from`).
ARCHITECTURE_KEYS = (
    "num_hidden_layers", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
    "layer_types", "sliding_window", "block_size", "aux_hidden_state_layer_ids", "draft_vocab_size",
    "mask_token_id", "markov_rank", "enable_confidence_head", "confidence_head_with_markov",
    "sliding_window_non_causal",
)
# `config.json` keys (dotted for nested ones) that describe where and with what a drafter was saved, not the
# drafter itself: two configs that differ only here are the same drafter (resuming compares everything else).
RUNTIME_ONLY_KEYS = frozenset({
    "transformers_version", "dtype", "use_cache", "verifier_local_path", "architectures", "auto_map", "speculators_version",
    "speculators_config.verifier.name_or_path", "speculators_config.verifier.architectures",
})

# Generic PreTrainedConfig keys that mean nothing for a drafter and are not part of the contract.
_NOISE_KEYS = (
    "model_type", "output_hidden_states", "return_dict", "chunk_size_feed_forward", "is_encoder_decoder",
    "id2label", "label2id", "problem_type", "output_attentions", "_name_or_path",
)
_HUB_ID = re.compile(r"^(\b[\w\-.]+\b/)?\b[\w\-.]+\b$")


def is_hub_id(name: str | None) -> bool:
    """True for a valid Hub repo id (`org/name` or `name`) that is not also an existing local path.

    This is what vLLM accepts as `speculators_config.verifier.name_or_path`: a local directory there would be
    loaded instead of the Hub repo, and users of a pushed drafter don't have it. The rules are the Hub's own
    (`huggingface_hub.utils.validate_repo_id`: word characters, `-` and `.`, at most one `/`, no `--` or `..`,
    no `.git` suffix, at most 96 characters), restated here because remote code imports only the stdlib,
    torch and transformers."""
    if not isinstance(name, str) or not name or len(name) > 96 or _HUB_ID.match(name) is None:
        return False
    if "--" in name or ".." in name or name.endswith(".git"):
        return False
    return not os.path.lexists(name)


class DSparkConfig(PreTrainedConfig):
    r"""Configuration of a [`DSparkDraftModel`]: a block-parallel drafter conditioned on a frozen verifier.

    Args:
        transformer_layer_config (`dict`): a complete Qwen3 config for the draft decoder layers
            (`hidden_size` = the verifier's hidden size, `vocab_size` = the verifier's vocabulary,
            `num_hidden_layers` = draft depth, `layer_types`, `sliding_window`, `rope_parameters`, ...).
            Layer fields may also be passed flat (`hidden_size=...`) and are merged into it.
        block_size (`int`): query slots per draft block; the proposal length served by vLLM.
        aux_hidden_state_layer_ids (`list[int]`): verifier residual streams fused by `fc`; id L is the
            stream after L decoder layers (HF `output_hidden_states=True` index L), ascending, in 1..L-1.
        draft_vocab_size (`int`): output vocabulary of the drafter (defaults to the verifier's).
        mask_token_id (`int`): verifier token id placed in the non-anchor slots of a block.
        markov_rank / markov_head_type: rank of the vanilla Markov logit bias (`0` disables it).
        enable_confidence_head / confidence_head_with_markov: the per-slot acceptance predictor.
        sample_from_anchor (`bool`): anchor-first layout (slot k predicts token p+k+1). Always `True`.
        sliding_window_non_causal (`bool`): whether sliding layers attend bidirectionally inside a block. Kept
            for the speculators format, but vLLM never reads it and serves sliding layers causal, so the trainer
            and the export refuse `True`.
        speculators_config (`dict`): the speculators/vLLM section; its verifier `name_or_path` is a Hub id.
        verifier_local_path (`str`): optional local verifier directory for in-process use.
        verifier_text_config (`dict`): snapshot of the verifier (hidden size, layers, vocab, softcap).
    """

    model_type = "dspark"

    transformer_layer_config: dict | None = None
    block_size: int = 8
    aux_hidden_state_layer_ids: list[int] | None = None
    draft_vocab_size: int | None = None
    mask_token_id: int | None = None
    markov_rank: int = 256
    markov_head_type: str = "vanilla"
    enable_confidence_head: bool = True
    confidence_head_with_markov: bool = True
    sample_from_anchor: bool = True
    sliding_window_non_causal: bool = False
    target_hidden_size: int | None = None
    tie_word_embeddings: bool = False
    speculators_config: dict | None = None
    speculators_model_type: str = "dspark"
    speculators_version: str = SPECULATORS_VERSION
    verifier_local_path: str | None = None
    verifier_text_config: dict | None = None

    def __post_init__(self, **kwargs):
        # speculators saves its other algorithms (eagle3, dflash, ...) in the same format; reading one as DSpark
        # would silently drop or misplace its weights
        algorithm = (self.speculators_config or {}).get("algorithm") or "dspark"
        if self.speculators_model_type != "dspark" or algorithm != "dspark":
            found = algorithm if algorithm != "dspark" else self.speculators_model_type
            raise ValueError(
                f"this is a speculators {found!r} checkpoint, not a DSpark drafter; only DSpark drafters "
                f"(speculators_model_type 'dspark') load here, so train or pick a DSpark one."
            )
        layer = copy.deepcopy(DEFAULT_LAYER_CONFIG)
        given = self.transformer_layer_config
        if isinstance(given, PreTrainedConfig):
            given = given.to_dict()
        layer.update({k: v for k, v in (given or {}).items() if k != "transformers_version"})
        layer.update({k: kwargs.pop(k) for k in list(kwargs) if k in LAYER_KEYS})
        layer["model_type"] = "qwen3"
        layer["tie_word_embeddings"] = False
        if given is not None and "layer_types" not in given and "num_hidden_layers" in given:
            layer["layer_types"] = default_layer_types(layer["num_hidden_layers"])
        layer["use_sliding_window"] = SLIDING in (layer.get("layer_types") or [])
        self.transformer_layer_config = layer
        if self.draft_vocab_size is None:
            self.draft_vocab_size = layer["vocab_size"]
        if self.aux_hidden_state_layer_ids is not None:
            self.aux_hidden_state_layer_ids = [int(i) for i in self.aux_hidden_state_layer_ids]
        sc = copy.deepcopy(self.speculators_config) if self.speculators_config else {}
        verifier = sc.get("verifier") or {}
        self.speculators_config = {
            "algorithm": "dspark",
            "verifier": {
                "name_or_path": verifier.get("name_or_path"),
                "architectures": list(verifier.get("architectures") or []),
            },
        }
        super().__post_init__(**kwargs)
        self.validate_dspark()

    # ------------------------------------------------------------------ derived views
    @property
    def hidden_size(self) -> int:
        return self.transformer_layer_config["hidden_size"]

    @property
    def vocab_size(self) -> int:
        """The verifier's vocabulary size V (rows of the shared embedding and of `markov_w1`)."""
        return self.transformer_layer_config["vocab_size"]

    @property
    def num_hidden_layers(self) -> int:
        return self.transformer_layer_config["num_hidden_layers"]

    @property
    def initializer_range(self) -> float:
        return self.transformer_layer_config.get("initializer_range", 0.02)

    @property
    def verifier_name_or_path(self) -> str | None:
        """The verifier's Hub id as written for serving (`speculators_config.verifier.name_or_path`)."""
        return self.speculators_config["verifier"]["name_or_path"]

    @property
    def aux_input_size(self) -> int:
        """Width of the fused verifier states fed to `fc` (k aux layers x verifier hidden size)."""
        per_layer = self.target_hidden_size or self.hidden_size
        return per_layer * len(self.aux_hidden_state_layer_ids or [])

    @property
    def uses_draft_vocab(self) -> bool:
        """True when the draft vocabulary is a strict subset of the verifier's (d2t/t2d and lm_head saved)."""
        return self.draft_vocab_size < self.vocab_size

    def architecture(self) -> dict[str, Any]:
        """The `ARCHITECTURE_KEYS` values of this drafter (layer fields read from `transformer_layer_config`)."""
        layer = self.transformer_layer_config
        return {k: copy.deepcopy(layer[k] if k in LAYER_KEYS else getattr(self, k)) for k in ARCHITECTURE_KEYS}

    def layer_config(self):
        """The draft decoder layers' config as a `Qwen3Config` (what the Qwen3 building blocks read)."""
        from transformers import Qwen3Config

        cfg = Qwen3Config(**{k: v for k, v in self.transformer_layer_config.items() if k != "model_type"})
        cfg._attn_implementation = self._attn_implementation
        return cfg

    # ------------------------------------------------------------------ validation
    def validate_dspark(self) -> None:
        """Check internal consistency and, when a verifier snapshot is present, the pairing with it."""
        layer = self.transformer_layer_config
        n_layers, hidden = layer["num_hidden_layers"], layer["hidden_size"]
        vocab = layer["vocab_size"]
        if not isinstance(self.block_size, int) or self.block_size < 1:
            raise ValueError(f"block_size must be a positive integer (got {self.block_size}); the seed recipe uses 8.")
        if not self.sample_from_anchor:
            raise ValueError(
                "sample_from_anchor=False (the DFlash 1+N layout) is not supported; DSpark drafters here use the "
                "anchor-first layout, so set sample_from_anchor=True."
            )
        if n_layers < 1:
            raise ValueError(f"num_hidden_layers must be at least 1 (got {n_layers}).")
        types = layer.get("layer_types")
        if not isinstance(types, list) or len(types) != n_layers or any(t not in (SLIDING, FULL) for t in types):
            raise ValueError(
                f"layer_types {types} must list '{SLIDING}' or '{FULL}' once per draft layer ({n_layers}); "
                f"for example {default_layer_types(n_layers)}."
            )
        if SLIDING in types and not (isinstance(layer.get("sliding_window"), int) and layer["sliding_window"] > 0):
            raise ValueError(f"sliding layers need a positive sliding_window (got {layer.get('sliding_window')}).")
        if layer["num_attention_heads"] % layer["num_key_value_heads"]:
            raise ValueError(
                f"num_attention_heads ({layer['num_attention_heads']}) must be a multiple of num_key_value_heads "
                f"({layer['num_key_value_heads']})."
            )
        if layer.get("hidden_act") != "silu":
            raise ValueError(f"hidden_act must be 'silu' (got {layer.get('hidden_act')!r}); vLLM serves only SwiGLU drafts.")
        rope = layer.get("rope_parameters") or {}
        if "rope_theta" not in rope:
            raise ValueError(
                f"rope_parameters {rope} has no rope_theta; write it explicitly (vLLM defaults a missing theta to 1e6)."
            )
        check_draft_vocab_size(self.draft_vocab_size, vocab)
        if self.mask_token_id is not None and not 0 <= self.mask_token_id < vocab:
            raise ValueError(
                f"mask_token_id {self.mask_token_id} is outside the verifier vocabulary of {vocab} tokens; use an id "
                f"in 0..{vocab - 1} (the tokenizer's mask, pad or an unused token)."
            )
        if self.markov_head_type != "vanilla":
            raise ValueError(
                f"markov_head_type {self.markov_head_type!r} is not supported; use 'vanilla' (the only head vLLM serves)."
            )
        if self.markov_rank < 0:
            raise ValueError(f"markov_rank must be >= 0 (got {self.markov_rank}); 0 disables the Markov head.")
        if self.enable_confidence_head and self.confidence_head_with_markov and self.markov_rank == 0:
            raise ValueError(
                "confidence_head_with_markov=True needs a Markov head; set markov_rank > 0 or "
                "confidence_head_with_markov=False."
            )
        aux = self.aux_hidden_state_layer_ids
        snap = self.verifier_text_config or {}
        if aux is not None:
            check_aux_layer_ids(aux, snap.get("num_hidden_layers"))
        if snap:
            v_hidden = snap.get("hidden_size")
            if v_hidden is not None and (self.target_hidden_size or hidden) != v_hidden:
                raise ValueError(
                    f"draft hidden_size {hidden} differs from the verifier's hidden size {v_hidden}; DSpark drafters "
                    f"share the verifier's embeddings, so set hidden_size={v_hidden} (or leave it unset)."
                )
            if snap.get("vocab_size") is not None and snap["vocab_size"] != vocab:
                raise ValueError(
                    f"transformer_layer_config.vocab_size {vocab} differs from the verifier's vocabulary "
                    f"{snap['vocab_size']}; vocab_size must be the verifier's V."
                )

    # ------------------------------------------------------------------ serialization
    def to_dict(self) -> dict[str, Any]:
        """The speculators-format dict: no top-level `model_type`, `auto_map` always present."""
        out = super().to_dict()
        for key in _NOISE_KEYS:
            out.pop(key, None)
        out["auto_map"] = dict(AUTO_MAP)
        out["architectures"] = ["DSparkDraftModel"]
        out["speculators_config"] = {
            "algorithm": "dspark",
            "default_proposal_method": "greedy",
            "proposal_methods": [
                {
                    "accept_tolerance": 0.0,
                    "proposal_type": "greedy",
                    "speculative_tokens": self.block_size,  # anchor-first layout: B drafts per step
                    "verifier_accept_k": 1,
                }
            ],
            "verifier": copy.deepcopy(self.speculators_config["verifier"]),
        }
        out["transformer_layer_config"] = copy.deepcopy(self.transformer_layer_config)
        return out

    def to_diff_dict(self) -> dict[str, Any]:
        # Readers (vLLM in particular) need every key explicitly, so the "diff" is the whole dict.
        return self.to_dict()

    # ------------------------------------------------------------------ construction from a verifier
    @classmethod
    def from_verifier(
        cls,
        verifier,
        verifier_name_or_path: str | None = None,
        tokenizer=None,
        **overrides,
    ) -> "DSparkConfig":
        """Build a config for a drafter of `verifier`.

        Args:
            verifier: the verifier's config, model, local directory or Hub id.
            verifier_name_or_path: the Hub id written into `speculators_config` for serving. Defaults to
                `verifier` when that is a Hub id; a local directory is kept in `verifier_local_path`.
            tokenizer: the verifier's tokenizer, used to resolve `mask_token_id` when not given.
            **overrides: any `DSparkConfig` field or draft-layer field (`num_hidden_layers`,
                `block_size`, `aux_hidden_state_layer_ids`, `draft_vocab_size`, `layer_types`, ...).

        Fields the verifier determines (hidden size, vocabulary, RoPE, max positions, norm eps) are
        derived; passing a conflicting value raises.
        """
        local_path, architecture = None, None
        if isinstance(verifier, (str, os.PathLike)):
            name = os.fspath(verifier)
            if os.path.isdir(name):
                local_path = os.path.abspath(name)
            elif verifier_name_or_path is None and is_hub_id(name):
                verifier_name_or_path = name
            vcfg = AutoConfig.from_pretrained(name)
            if tokenizer is None and "mask_token_id" not in overrides and local_path is not None:
                tokenizer = _try_load_tokenizer(local_path)
        elif isinstance(verifier, PreTrainedConfig):
            vcfg = verifier
        elif hasattr(verifier, "config") and isinstance(verifier.config, PreTrainedConfig):
            vcfg = verifier.config
            architecture = type(verifier).__name__
        else:
            raise TypeError(
                f"verifier must be a config, a model, a local directory or a Hub id (got {type(verifier).__name__})."
            )
        if verifier_name_or_path is None:
            origin = getattr(vcfg, "_name_or_path", "") or ""
            if is_hub_id(origin):
                verifier_name_or_path = origin
            elif origin and os.path.isdir(origin) and local_path is None:
                local_path = os.path.abspath(origin)
        text = vcfg.get_text_config()
        v_hidden, v_layers, v_vocab = _field(text, "hidden_size"), _field(text, "num_hidden_layers"), _field(text, "vocab_size")
        n_heads = _field(text, "num_attention_heads")

        for key, derived in (("hidden_size", v_hidden), ("vocab_size", v_vocab)):
            if key in overrides and overrides[key] != derived:
                raise ValueError(
                    f"{key}={overrides[key]} conflicts with the verifier's {key} {derived}; a DSpark drafter must use "
                    f"the verifier's value, so drop the override."
                )
        layer = copy.deepcopy(DEFAULT_LAYER_CONFIG)
        layer.update(
            hidden_size=v_hidden,
            vocab_size=v_vocab,
            num_attention_heads=n_heads,
            num_key_value_heads=_field(text, "num_key_value_heads") or n_heads,
            head_dim=_field(text, "head_dim") or v_hidden // n_heads,
            intermediate_size=_dense_intermediate_size(text, v_hidden),
            max_position_embeddings=_field(text, "max_position_embeddings") or layer["max_position_embeddings"],
            rms_norm_eps=_field(text, "rms_norm_eps") or layer["rms_norm_eps"],
            rope_parameters=_draft_rope_parameters(text),
            initializer_range=_field(text, "initializer_range") or 0.02,
        )
        if "layer_types" not in overrides:
            layer["layer_types"] = default_layer_types(overrides.get("num_hidden_layers", layer["num_hidden_layers"]))
        for key in list(overrides):
            if key in LAYER_KEYS:
                layer[key] = overrides.pop(key)

        if "aux_hidden_state_layer_ids" not in overrides:
            overrides["aux_hidden_state_layer_ids"] = default_aux_layer_ids(v_layers)
        else:
            check_aux_layer_ids(list(overrides["aux_hidden_state_layer_ids"]), v_layers)
        if overrides.get("mask_token_id") is None:
            overrides["mask_token_id"] = resolve_mask_token_id(tokenizer, text, v_vocab)
        if local_path is not None and overrides.get("verifier_local_path") is None:
            overrides["verifier_local_path"] = local_path
        snapshot = verifier_snapshot(vcfg, architecture)
        return cls(
            transformer_layer_config=layer,
            speculators_config={"verifier": {"name_or_path": verifier_name_or_path,
                                             "architectures": snapshot["architectures"]}},
            verifier_text_config=snapshot,
            **overrides,
        )


# ---------------------------------------------------------------------- helpers (also used by the trainer)
def verifier_snapshot(vcfg: PreTrainedConfig, architecture: str | None = None) -> dict:
    """`verifier_text_config`: what a drafter must know of its verifier to check a pairing and to train and
    export without loading it (hidden size, layers, vocabulary, softcap, family). A drafter saved by
    speculators has none; `DSparkDraftModel.attach_verifier` fills it from the verifier it is attached to."""
    text = vcfg.get_text_config()
    return {
        "model_type": getattr(text, "model_type", None),
        "architectures": list(getattr(vcfg, "architectures", None) or ([architecture] if architecture else [])),
        "hidden_size": _field(text, "hidden_size"),
        "num_hidden_layers": _field(text, "num_hidden_layers"),
        "vocab_size": _field(text, "vocab_size"),
        "final_logit_softcapping": _field(text, "final_logit_softcapping"),
        "tie_word_embeddings": bool(getattr(vcfg, "tie_word_embeddings", getattr(text, "tie_word_embeddings", False))),
    }


def default_layer_types(num_layers: int) -> list[str]:
    """Seed-recipe pattern: sliding layers, with the last layer full attention (bidirectional in the block)."""
    return [SLIDING] * (num_layers - 1) + [FULL]


def default_aux_layer_ids(num_verifier_layers: int) -> list[int]:
    """speculators' default `[2, L//2, L-3]`, deduplicated, sorted and clipped to the valid range 1..L-1."""
    ids = sorted({i for i in (2, num_verifier_layers // 2, num_verifier_layers - 3) if 1 <= i < num_verifier_layers})
    if not ids:
        raise ValueError(f"a {num_verifier_layers}-layer verifier has no layer id in 1..L-1 to use as an aux state.")
    return ids


def check_draft_vocab_size(draft_vocab_size: int, vocab_size: int, name: str = "draft_vocab_size") -> None:
    """The one bound on a draft vocabulary: it selects 1..V of the V-token verifier vocabulary. `name` is the
    setting as the caller's user wrote it (a run config's `model.draft_vocab_size`)."""
    if not 1 <= draft_vocab_size <= vocab_size:
        raise ValueError(f"{name} {draft_vocab_size} does not fit the verifier vocabulary of {vocab_size} tokens; use "
                         f"a value in 1..{vocab_size}, or null/None for the verifier's full vocabulary.")


def check_aux_layer_ids(ids: list[int], num_verifier_layers: int | None = None) -> None:
    """The one check of aux layer ids: a non-empty, strictly ascending list of integer ids, each in 1..L-1 for an
    L-layer verifier when L is known (id L is the last layer, which vLLM appends itself; id 0 is the embedding)."""
    if not isinstance(ids, (list, tuple)) or not ids:
        raise ValueError(f"aux_hidden_state_layer_ids {ids!r} is empty or not a list; list at least one verifier "
                         f"layer id, e.g. [2, 10, 20].")
    if any(isinstance(i, bool) or not isinstance(i, int) for i in ids):
        raise ValueError(f"aux_hidden_state_layer_ids {list(ids)} must hold integer layer ids; write them as numbers.")
    for i in ids:
        if num_verifier_layers is not None and not 1 <= i <= num_verifier_layers - 1:
            raise ValueError(
                f"aux layer id {i} is out of range for a {num_verifier_layers}-layer verifier; "
                f"use ids in 1..{num_verifier_layers - 1}."
            )
        if i < 1:
            raise ValueError(f"aux layer id {i} is not a decoder layer (ids start at 1; 0 is the embedding output); "
                             f"use ids >= 1.")
    if any(b <= a for a, b in zip(ids, ids[1:])):
        raise ValueError(
            f"aux_hidden_state_layer_ids {list(ids)} must be strictly ascending without duplicates; "
            f"use {sorted(set(ids))}."
        )


def resolve_mask_token_id(tokenizer, text_config, vocab_size: int) -> int:
    """The verifier token placed in mask slots: the tokenizer's mask token, else the first embedding row the
    tokenizer does not use, else pad / eos / unk (any row works: it is frozen and shared with the verifier)."""
    candidates: list[int | None] = []
    if tokenizer is not None:
        candidates.append(getattr(tokenizer, "mask_token_id", None))
        if len(tokenizer) < vocab_size:
            candidates.append(len(tokenizer))
        candidates += [getattr(tokenizer, "pad_token_id", None), getattr(tokenizer, "eos_token_id", None),
                       getattr(tokenizer, "unk_token_id", None)]
    eos = _field(text_config, "eos_token_id")
    candidates += [_field(text_config, "pad_token_id"), eos[0] if isinstance(eos, list) and eos else eos]
    for c in candidates:
        if isinstance(c, int) and 0 <= c < vocab_size:
            return c
    raise ValueError(
        "cannot determine mask_token_id: the verifier has no mask, pad or eos token; pass mask_token_id=<id> "
        "or tokenizer=<verifier tokenizer>."
    )


def _field(config, name: str):
    """Read a config field, also from heterogeneous (per-layer) configs such as Gemma 4, where the global
    attribute access raises; the global value there is the sliding layers' one."""
    try:
        return getattr(config, name, None)
    except Exception:
        return config.__dict__.get(name)


def _draft_rope_parameters(text_config) -> dict:
    """The verifier's RoPE as a flat Qwen3 dict: per-layer-type dicts (Gemma) resolve to the sliding variant,
    partial rotary factors are dropped (draft layers rotate the whole head), and theta is always explicit."""
    rope = _field(text_config, "rope_parameters") or {}
    if rope and all(isinstance(v, dict) for v in rope.values()):
        rope = rope.get(SLIDING) or rope.get(FULL) or next(iter(rope.values()))
    rope = {k: v for k, v in dict(rope).items() if k not in ("partial_rotary_factor", "mrope_section", "type")}
    rope.setdefault("rope_type", "default")
    if rope["rope_type"] == "proportional":
        rope["rope_type"] = "default"
    if "rope_theta" not in rope:
        rope["rope_theta"] = float(_field(text_config, "rope_theta") or 10000.0)
    return rope


def _dense_intermediate_size(text_config, hidden: int) -> int:
    size = _field(text_config, "intermediate_size")
    if isinstance(size, (list, tuple)):
        size = size[0]
    return int(size) if size else 3 * hidden


def _try_load_tokenizer(path: str):
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path)
    except Exception:  # a verifier directory without tokenizer files is fine; the config fallbacks apply
        return None


__all__ = ["DSparkConfig"]
