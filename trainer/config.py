"""The run configuration: one typed object (three dataclass sections) read from YAML, overridden from the
command line, validated up front, and saved into every checkpoint (`dspark_run_config.yaml`) so a run can
be reproduced and described in a model card.

    model:   the verifier and the drafter's architecture
    data:    chat data, sequence lengths, split
    train:   objective, optimizer, schedule, checkpoints

Command-line overrides win over the YAML: `--key value` or `--key=value`, where `key` is a field name
(`--learning_rate 1e-4`) or `section.field` (`--train.max_steps 20`); values are parsed as YAML
(`--loss_weights '{"ce": 1.0}'`, `--layer_types '[sliding_attention, full_attention]'`).
"""

import dataclasses
import os
import types
import typing
from dataclasses import dataclass, field

import yaml

CONFIG_FILE = "dspark_run_config.yaml"


@dataclass
class ModelArgs:
    verifier: str = ""  # local directory or Hub id; registered small models resolve to their PyPI packages
    verifier_id: str | None = None  # Hub id written for serving (default: `verifier` when it is a Hub id)
    verifier_dtype: str = "auto"  # auto = bfloat16 on GPU, float32 on CPU
    init_from: str | None = None  # continue training / adapt an existing drafter (its architecture is kept)
    num_hidden_layers: int = 4
    intermediate_size: int | None = None  # None: the verifier's value
    num_attention_heads: int | None = None
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    layer_types: list[str] | None = None  # None: sliding layers, the last one full attention
    sliding_window: int = 2048
    block_size: int = 8
    aux_hidden_state_layer_ids: list[int] | None = None  # None: [2, L//2, L-3]
    draft_vocab_size: int | None = 32000  # None: the verifier's full vocabulary
    mask_token_id: int | None = None  # None: resolved from the verifier's tokenizer
    markov_rank: int = 256
    enable_confidence_head: bool = True
    confidence_head_with_markov: bool = True
    sliding_window_non_causal: bool = False
    attn_implementation: str = "auto"  # auto = flex_attention on GPU, sdpa on CPU
    lora_rank: int = 0  # > 0: train LoRA adapters on the draft layers (merged into every saved checkpoint)
    lora_alpha: float = 16.0
    lora_dropout: float = 0.0
    lora_target_modules: list[str] = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])


@dataclass
class DataArgs:
    train_data: str | list[str] = ""  # Hub dataset id, local JSONL/Parquet file(s) or directory
    train_split: str = "train"
    max_samples: int | None = None
    max_seq_length: int = 2560  # cap per conversation (prompt + response) when preparing it
    total_seq_length: int = 4096  # packing window: several conversations per training row
    validation_ratio: float = 0.04
    split_seed: int = 42
    num_proc: int = 1


@dataclass
class TrainArgs:
    output_dir: str = "out"
    num_train_epochs: float = 3.0
    max_steps: int = -1
    per_device_train_batch_size: int = 1  # packed rows per step and device
    gradient_accumulation_steps: int = 1
    optimizer: str = "muon"  # muon (Muon for hidden matrices + AdamW) or adamw
    learning_rate: float = 5e-4
    muon_learning_rate: float | None = None  # None: learning_rate (Muon's update is RMS-matched to AdamW's)
    weight_decay: float = 0.01
    muon_weight_decay: float = 0.1
    lr_scheduler_type: str = "cosine"
    warmup_ratio: float = 0.04
    max_grad_norm: float = 1.0
    max_anchors: int = 512  # per document
    loss_weights: dict = field(default_factory=lambda: {"ce": 0.1, "tv": 0.9})
    confidence_weight: float = 1.0
    decay_gamma: float = 4.0
    ce_target: str = "teacher"
    loss_chunk_elements: int = 1 << 26
    eval_steps: int = 500
    save_steps: int | None = None  # None: eval_steps
    logging_steps: int = 10
    save_total_limit: int | None = 3
    eval_at_start: bool = True
    seed: int = 42
    bf16: str = "auto"  # auto = on when a GPU supports it
    gradient_checkpointing: bool = False
    report_to: str = "none"  # or tensorboard
    resume_from_checkpoint: str | None = None  # "latest" or a checkpoint directory
    dataloader_num_workers: int = 0
    use_cpu: bool = False
    verifier_max_tokens_per_forward: int = 16384
    cache_verifier_states_gb: float = 0.0  # > 0: keep each row's verifier states in memory across epochs (small runs)
    record_batches: bool = False  # write the rows each rank trains on to <output_dir>/batches-rank<r>.jsonl


@dataclass
class RunConfig:
    model: ModelArgs = field(default_factory=ModelArgs)
    data: DataArgs = field(default_factory=DataArgs)
    train: TrainArgs = field(default_factory=TrainArgs)

    # -------------------------------------------------------------------------------- loading
    @classmethod
    def from_dict(cls, data: dict) -> "RunConfig":
        data = dict(data or {})
        sections = {}
        for f in dataclasses.fields(cls):
            given = data.pop(f.name, None) or {}
            if not isinstance(given, dict):
                raise ValueError(f"config section '{f.name}' must be a mapping, got {type(given).__name__}.")
            known = {x.name for x in dataclasses.fields(f.default_factory())}
            unknown = set(given) - known
            if unknown:
                raise ValueError(f"unknown key(s) {sorted(unknown)} in section '{f.name}'; valid keys: {sorted(known)}.")
            section = f.default_factory()
            hints = {x.name: x.type for x in dataclasses.fields(section)}
            for key, value in given.items():
                setattr(section, key, _coerce(value, hints[key], f"{f.name}.{key}"))
            sections[f.name] = section
        if data:
            raise ValueError(f"unknown config section(s) {sorted(data)}; use model, data and train.")
        return cls(**sections)

    @classmethod
    def load(cls, path: str | None = None, overrides: list[str] | None = None) -> "RunConfig":
        data = {}
        if path:
            if not os.path.exists(path):
                raise FileNotFoundError(f"config file {path} does not exist; pass --config configs/<recipe>.yaml.")
            with open(path) as f:
                data = yaml.safe_load(f) or {}
        config = cls.from_dict(data)
        config.apply_overrides(overrides or [])
        config.validate()
        return config

    def apply_overrides(self, argv: list[str]) -> None:
        """Apply `--key value` / `--key=value` pairs (command line wins over the YAML file)."""
        i = 0
        while i < len(argv):
            token = argv[i]
            if not token.startswith("--"):
                raise ValueError(f"unexpected argument {token!r}; overrides look like --key value.")
            if "=" in token:
                key, raw = token[2:].split("=", 1)
                i += 1
            else:
                if i + 1 >= len(argv):
                    raise ValueError(f"override {token} has no value; write {token} <value>.")
                key, raw = token[2:], argv[i + 1]
                i += 2
            self.set(key.replace("-", "_"), raw)

    def set(self, key: str, raw) -> None:
        section, name = self._locate(key)
        target = getattr(self, section)
        hint = {f.name: f.type for f in dataclasses.fields(target)}[name]
        value = yaml.safe_load(raw) if isinstance(raw, str) else raw
        setattr(target, name, _coerce(value, hint, f"{section}.{name}"))

    def _locate(self, key: str) -> tuple[str, str]:
        if "." in key:
            section, name = key.split(".", 1)
            if section in ("model", "data", "train") and name in {f.name for f in dataclasses.fields(getattr(self, section))}:
                return section, name
            raise ValueError(f"unknown option --{key}; see trainer/config.py for the valid keys.")
        owners = [s for s in ("model", "data", "train") if name_in(getattr(self, s), key)]
        if not owners:
            import difflib

            names = [f.name for s in ("model", "data", "train") for f in dataclasses.fields(getattr(self, s))]
            close = difflib.get_close_matches(key, names, n=1)
            hint = f"did you mean --{close[0]}?" if close else "see trainer/config.py for the valid keys."
            raise ValueError(f"unknown option --{key}; {hint}")
        return owners[0], key

    # -------------------------------------------------------------------------------- validation
    def validate(self) -> None:
        m, d, t = self.model, self.data, self.train
        if not m.verifier:
            raise ValueError("model.verifier is not set; pass the verifier's Hub id or local directory (--verifier).")
        if not d.train_data:
            raise ValueError("data.train_data is not set; pass a chat dataset (Hub id, JSONL or Parquet) via --train_data.")
        if d.max_seq_length > d.total_seq_length:
            raise ValueError(f"data.max_seq_length {d.max_seq_length} exceeds the packing window data.total_seq_length "
                             f"{d.total_seq_length}; a conversation must fit in one row.")
        if d.max_seq_length < 2 * m.block_size:
            raise ValueError(f"data.max_seq_length {d.max_seq_length} is too short for blocks of {m.block_size}.")
        if not 0.0 <= d.validation_ratio < 1.0:
            raise ValueError(f"data.validation_ratio must be in [0, 1) (got {d.validation_ratio}).")
        if t.optimizer not in ("muon", "adamw"):
            raise ValueError(f"train.optimizer must be 'muon' or 'adamw' (got {t.optimizer!r}).")
        if t.save_steps is not None and t.save_steps % t.eval_steps and d.validation_ratio > 0:
            raise ValueError(f"train.save_steps {t.save_steps} must be a multiple of train.eval_steps {t.eval_steps} "
                             f"so the best checkpoint is chosen by validation accept_len.")
        if t.max_steps <= 0 and t.num_train_epochs <= 0:
            raise ValueError("set train.num_train_epochs > 0 or train.max_steps > 0.")
        if m.lora_rank and not m.init_from:
            raise ValueError("LoRA adapts an existing drafter; set model.init_from to it (or lora_rank: 0).")
        if m.attn_implementation not in ("auto", "sdpa", "eager", "flex_attention"):
            raise ValueError(f"model.attn_implementation must be auto, sdpa, eager or flex_attention "
                             f"(got {m.attn_implementation!r}).")
        self.objective()  # validates the loss settings

    def objective(self):
        from trainer.objective import ObjectiveConfig

        t = self.train
        return ObjectiveConfig(block_size=self.model.block_size, max_anchors=t.max_anchors,
                               loss_weights=dict(t.loss_weights), confidence_weight=t.confidence_weight,
                               decay_gamma=t.decay_gamma, ce_target=t.ce_target, chunk_elements=t.loss_chunk_elements)

    # -------------------------------------------------------------------------------- saving
    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def save(self, directory: str) -> str:
        path = os.path.join(directory, CONFIG_FILE)
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            yaml.safe_dump(self.to_dict(), f, sort_keys=False)
        os.replace(tmp, path)
        return path


def name_in(section, key: str) -> bool:
    return key in {f.name for f in dataclasses.fields(section)}


def _coerce(value, hint, where: str):
    """Coerce a YAML-parsed override to the field's annotated type, with a clear error."""
    origin = typing.get_origin(hint)
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if value is None:
        return None
    if origin in (typing.Union, types.UnionType):
        for a in args:
            try:
                return _coerce(value, a, where)
            except (TypeError, ValueError):
                continue
        raise ValueError(f"{where}: cannot use {value!r}; expected {hint}.")
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise ValueError(f"{where}: expected true or false, got {value!r}.")
    if hint in (int, float):
        if isinstance(value, str):  # YAML 1.1 reads "3e-3" (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{where}: expected a number, got {value!r}.")
        if hint is int and float(value) != int(value):
            raise ValueError(f"{where}: expected an integer, got {value!r}.")
        return hint(value)
    if hint is str:
        if isinstance(value, (dict, list)):
            raise ValueError(f"{where}: expected a string, got {value!r}.")
        return str(value)
    if origin is list or hint is list:
        if not isinstance(value, list):
            raise ValueError(f"{where}: expected a list, got {value!r}.")
        inner = args[0] if args else None
        return [_coerce(v, inner, where) if inner else v for v in value]
    if origin is dict or hint is dict:
        if not isinstance(value, dict):
            raise ValueError(f"{where}: expected a mapping, got {value!r}.")
        return value
    return value
