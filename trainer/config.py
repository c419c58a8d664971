"""The run configuration: one typed object (three dataclass sections) read from YAML, overridden from the
command line, validated up front, and saved into every checkpoint (`RUN_CONFIG_FILE`) so a run can
be reproduced and described in a model card.

    model:   the verifier and the drafter's architecture
    data:    chat data, sequence lengths, split
    train:   objective, optimizer, schedule, checkpoints

Command-line overrides win over the YAML: `--key value` or `--key=value`, where `key` is a field name
(`--learning_rate 1e-4`) or `section.field` (`--train.max_steps 20`); values are parsed as YAML
(`--loss_weights '{"ce": 1.0}'`, `--layer_types '[sliding_attention, full_attention]'`).
"""

import dataclasses
import difflib
import os
import types
import typing
from dataclasses import dataclass, field

import yaml

from configuration_dspark import ARCHITECTURE_KEYS
from trainer.errors import UsageError
from trainer.files import write_text_atomic

# The objective's choices and defaults: TrainArgs validates against them and the loss reads them.
LOSS_NAMES = ("ce", "tv", "kl")


# What the loss compares the draft with: "draft" = the verifier's distribution renormalised over the draft
# vocabulary; "full" = the verifier's full-vocabulary probabilities of the draft tokens (not renormalised).
TEACHER_VOCABS = ("draft", "full")


DEFAULT_TEACHER_VOCAB = "draft"  # the one place the default lives (TrainArgs and ObjectiveConfig read it)


# The acceptance probability the confidence head predicts, by how the server drafts (vLLM drafts greedily by
# default, also when the verifier samples): "greedy" = p_full(argmax q) (verifier sampling), "greedy_t0" =
# 1[argmax q == argmax p_full] (verifier greedy), "sampled" = sum_{Vd} min(p_full, q) (probabilistic drafting).
# "sampled_restricted" = sum_{Vd} min(p_draft, q), the overlap with the teacher renormalised over the draft
# vocabulary: speculators 0.9.0's target, and the only one that needs no pass over the verifier's full head.
CONFIDENCE_TARGETS = ("greedy", "greedy_t0", "sampled", "sampled_restricted")


DEFAULT_CONFIDENCE_TARGET = "greedy"


# Logits elements per loss chunk (16 MiB in fp32): ~1/10 of a naive loss's memory at 4,096 slots and Vd = 32,000.
DEFAULT_CHUNK_ELEMENTS = 1 << 22




RUN_CONFIG_FILE = "dspark_run_config.yaml"  # this config as saved into every checkpoint and the output_dir
SECTIONS = ("model", "data", "train")


# The loss terms' weights when a run names none. 0.5 KL + 0.5 TV measured above the seed recipe's 0.1 CE + 0.9 TV
# in held-out acceptance of the SmolLM2 demo drafter (block 4) on two seeds (benchmarks/RESULTS.md, 2026-12-04: +0.010 and +0.013 at T = 0, the seeds
# 0.002 apart); configs/gemma-4-E4B-it.yaml keeps the published seed recipe's weights explicitly.
DEFAULT_LOSS_WEIGHTS = {"kl": 0.5, "tv": 0.5}


@dataclass
class ModelArgs:
    """The verifier, and the drafter's architecture: one field per `configuration_dspark.ARCHITECTURE_KEYS`
    entry (checked at import), where None means "derive it from the verifier"."""

    verifier: str = ""  # local directory or Hub id; registered small models resolve to their PyPI packages
    verifier_id: str | None = None  # Hub id written for serving (default: `verifier` when it is a Hub id)
    verifier_dtype: str = "auto"  # auto = bfloat16 on GPU, float32 on CPU
    init_from: str | None = None  # continue training / adapt an existing drafter (its architecture is adopted)
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
    compile_layers: bool | None = None  # torch.compile each draft decoder layer; None (auto) = on a GPU only
    lora_rank: int = 0  # > 0: train LoRA adapters on the draft layers (merged into every saved checkpoint)
    lora_alpha: float = 16.0
    lora_dropout: float = 0.0
    lora_target_modules: list[str] = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])


    def architecture_overrides(self) -> dict:
        """The architecture choices passed to `DSparkConfig.from_verifier` (unset ones are derived there)."""
        overrides = {k: getattr(self, k) for k in ARCHITECTURE_KEYS if getattr(self, k) is not None}
        if self.markov_rank == 0:
            overrides["confidence_head_with_markov"] = False
        return overrides

    def adopt_architecture(self, architecture: dict) -> dict:
        """Take an existing drafter's architecture (`init_from`); returns `{key: (ours, theirs)}` that changed."""
        changed = {k: (getattr(self, k), v) for k, v in architecture.items() if getattr(self, k) != v}
        for key, value in architecture.items():
            setattr(self, key, value)
        return changed


_missing = set(ARCHITECTURE_KEYS) - {f.name for f in dataclasses.fields(ModelArgs)}
if _missing:
    raise ImportError(f"ModelArgs lacks the architecture keys {sorted(_missing)} that configuration_dspark.py "
                      f"declares; add a field for each.")


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
    max_bad_line_ratio: float = 0.01  # unreadable lines in local JSON(L) files: skip up to this share, else refuse


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
    # true: training blocks anchor on every token of a conversation (prompts, system and tool turns too), each
    # toward the verifier's distribution there; validation stays on the replies. Pays off on small data sets
    # (the SmolLM2 demo: benchmarks/RESULTS.md); with it, raise max_anchors so the replies keep their share.
    train_on_prompts: bool = False
    loss_weights: dict = field(default_factory=lambda: dict(DEFAULT_LOSS_WEIGHTS))
    confidence_weight: float = 1.0
    decay_gamma: float = 4.0
    ce_target: str = "teacher"
    loss_chunk_elements: int = DEFAULT_CHUNK_ELEMENTS  # logits elements per chunk of the loss (its memory budget)
    # What CE/TV/KL compare the draft with: draft = the verifier's distribution renormalised over the draft
    # vocabulary; full = its full-vocabulary probabilities of the draft tokens (the mass outside stays lost).
    teacher_vocab: str = DEFAULT_TEACHER_VOCAB
    # The acceptance the confidence head predicts: greedy = p(argmax q) (vLLM's default greedy drafts, verifier
    # sampling), greedy_t0 = 1[argmax q == argmax p] (greedy verifier), sampled = 1 - TV (probabilistic drafting).
    confidence_target: str = DEFAULT_CONFIDENCE_TARGET
    # false: skip the full-vocabulary metrics on training batches when the loss does not need them (teacher_vocab
    # draft + confidence_target sampled_restricted), a pass over the verifier's whole head per slot; evaluation
    # always computes them.
    full_vocab_metrics: bool = True
    calibrate_confidence: bool = True  # after training, fit sigmoid(a*z + c) on validation and fold it into the head
    calibration_max_slots: int = 200_000  # validation slots the calibration collects at most (whole blocks)
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
    overwrite_output_dir: bool = False  # replace a previous run in output_dir (otherwise a fresh run refuses it)
    dataloader_num_workers: int = 0
    use_cpu: bool = False
    verifier_max_tokens_per_forward: int = 16384
    cache_verifier_states_gb: float = 0.0  # > 0: keep each row's verifier states in memory across epochs (small runs)
    record_batches: bool = False  # write the rows each rank trains on to <output_dir>/batches-rank<r>.jsonl
    # Where the verifier's hidden states come from (trainer/states/source.py): in_process (the verifier in every
    # training process), vllm (servers started as `python -m trainer vllm-server` prints, read online and deleted),
    # cache (shards written by `python -m trainer states-cache`), hybrid (the cache, else the servers).
    hidden_states: str = "in_process"
    vllm_urls: list[str] = field(default_factory=list)  # e.g. [http://10.0.0.5:8000]; spread over, or one per rank
    vllm_states_dir: str | None = None  # the servers' shared_storage_path, as the trainer's machine sees it
    vllm_url_per_rank: bool = False  # true: consecutive ranks share one URL (one server per node, in node order)
    vllm_concurrency: int = 8  # requests in flight per training process
    vllm_timeout: float = 300.0  # seconds per request (HTTP answer + the file's lock)
    vllm_retries: int = 3  # further attempts per document (on another URL when there is one), with backoff
    vllm_max_failures: int = 8  # consecutive failed requests that stop the run
    states_cache_dir: str | None = None  # for cache / hybrid


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
                raise UsageError(f"config section '{f.name}' must be a mapping, got {type(given).__name__}.")
            known = {x.name for x in dataclasses.fields(f.default_factory())}
            unknown = sorted(set(given) - known)
            if unknown:
                raise UsageError(f"unknown key {f.name}.{unknown[0]} in the config; {_suggest(unknown[0], known, f.name)}")
            section = f.default_factory()
            hints = {x.name: x.type for x in dataclasses.fields(section)}
            for key, value in given.items():
                setattr(section, key, _coerce(value, hints[key], f"{f.name}.{key}"))
            sections[f.name] = section
        if data:
            name = sorted(data, key=str)[0]
            close = difflib.get_close_matches(str(name), SECTIONS, n=1)
            hint = f"did you mean '{close[0]}'?" if close else "the sections are model, data and train."
            raise UsageError(f"unknown config section '{name}'; {hint}")
        return cls(**sections)

    @classmethod
    def load(cls, path: str | None = None, overrides: list[str] | None = None) -> "RunConfig":
        data = {}
        if path:
            if not os.path.exists(path):
                raise UsageError(f"config file {path} does not exist; pass --config configs/<recipe>.yaml.")
            if os.path.isdir(path):
                raise UsageError(f"config file {path} is a directory; pass a YAML file such as "
                                 f"configs/smollm2-135m.yaml.")
            try:
                with open(path, encoding="utf-8") as f:
                    data = yaml.safe_load(f) or {}
            except UnicodeDecodeError as e:
                raise UsageError(f"config file {path} is not UTF-8 text ({e.reason} at byte {e.start}); save it as "
                                 f"UTF-8 YAML.") from e
            except yaml.YAMLError as e:
                mark = getattr(e, "problem_mark", None)
                where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
                problem = getattr(e, "problem", None) or str(e).splitlines()[0]
                raise UsageError(f"config file {path} is not valid YAML ({problem}{where}); fix the YAML there.") from e
            if not isinstance(data, dict):
                raise UsageError(f"config file {path} holds a YAML {type(data).__name__}, not a mapping; write "
                                 f"sections 'model:', 'data:' and 'train:' at the top level.")
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
                raise UsageError(f"unexpected argument {token!r}; overrides look like --key value.")
            if "=" in token:
                key, raw = token[2:].split("=", 1)
                i += 1
            else:
                if i + 1 >= len(argv):
                    raise UsageError(f"override {token} has no value; write {token} <value>.")
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
            if section not in SECTIONS:
                close = difflib.get_close_matches(section, SECTIONS, n=1)
                hint = f"did you mean --{close[0]}.{name}?" if close else "the sections are model, data and train."
                raise UsageError(f"unknown option --{key}; {hint}")
            known = {f.name for f in dataclasses.fields(getattr(self, section))}
            if name in known:
                return section, name
            raise UsageError(f"unknown option --{key}; {_suggest(name, known, section, flag=True)}")
        owners = [s for s in ("model", "data", "train") if name_in(getattr(self, s), key)]
        if not owners:
            names = [f.name for s in SECTIONS for f in dataclasses.fields(getattr(self, s))]
            close = difflib.get_close_matches(key, names, n=1)
            hint = f"did you mean --{close[0]}?" if close else "see trainer/config.py for the valid keys."
            raise UsageError(f"unknown option --{key}; {hint}")
        return owners[0], key

    # -------------------------------------------------------------------------------- validation
    def validate(self) -> None:
        """Everything that can be checked without touching the disk or loading a model: presence, types (at
        parse time), ranges and combinations. `trainer/run.py` checks paths and the verifier's config next."""
        m, d, t = self.model, self.data, self.train
        for where, value, low, high, inclusive in numeric_ranges(self):
            if value is None:
                continue
            below = value < low if inclusive[0] else value <= low
            above = high is not None and (value > high if inclusive[1] else value >= high)
            if below or above:
                lo, hi = ("[" if inclusive[0] else "("), ("]" if inclusive[1] else ")")
                span = f"in {lo}{low}, {high}{hi}" if high is not None else f"{'>=' if inclusive[0] else '>'} {low}"
                raise UsageError(f"{where} is {value}, but it must be {span}; set it within that range.")
        if not m.verifier:
            raise UsageError("model.verifier is not set; pass the verifier's Hub id or local directory (--verifier).")
        if not d.train_data:
            raise UsageError("data.train_data is not set; pass a chat dataset (Hub id, JSONL or Parquet) via --train_data.")
        if d.max_seq_length > d.total_seq_length:
            raise UsageError(f"data.max_seq_length {d.max_seq_length} exceeds the packing window data.total_seq_length "
                             f"{d.total_seq_length}; a conversation must fit in one row.")
        if d.max_seq_length < 2 * m.block_size:
            raise UsageError(f"data.max_seq_length {d.max_seq_length} is too short for blocks of {m.block_size}.")
        if t.optimizer not in ("muon", "adamw"):
            raise UsageError(f"train.optimizer must be 'muon' or 'adamw' (got {t.optimizer!r}).")
        if t.save_steps is not None and t.save_steps % t.eval_steps and d.validation_ratio > 0:
            raise UsageError(f"train.save_steps {t.save_steps} must be a multiple of train.eval_steps {t.eval_steps} "
                             f"so the best checkpoint is chosen by validation accept_len.")
        if t.max_steps <= 0 and t.num_train_epochs <= 0:
            raise UsageError("set train.num_train_epochs > 0 or train.max_steps > 0.")
        if m.lora_rank and not m.init_from:
            raise UsageError("LoRA adapts an existing drafter; set model.init_from to it (or lora_rank: 0).")
        if m.sliding_window_non_causal:
            raise UsageError("model.sliding_window_non_causal is true, but vLLM ignores it and serves the sliding "
                             "layers causal inside the block, so the drafter would not serve as trained; set it "
                             "to false.")
        sources = ("in_process", "vllm", "cache", "hybrid")
        if t.hidden_states not in sources:
            raise UsageError(f"train.hidden_states must be one of {', '.join(sources)} (got {t.hidden_states!r}).")
        if t.hidden_states in ("vllm", "hybrid") and not (t.vllm_urls and t.vllm_states_dir):
            raise UsageError(f"train.hidden_states is {t.hidden_states}, which needs train.vllm_urls and "
                             f"train.vllm_states_dir; start a server with `python -m trainer vllm-server --config ...` "
                             f"and pass its URL and hidden-states directory.")
        if t.hidden_states in ("cache", "hybrid") and not t.states_cache_dir:
            raise UsageError(f"train.hidden_states is {t.hidden_states}, which needs train.states_cache_dir; build one "
                             f"with `python -m trainer states-cache --config ... --cache_dir DIR` and pass DIR.")
        if m.attn_implementation not in ("auto", "sdpa", "eager", "flex_attention"):
            raise UsageError(f"model.attn_implementation must be auto, sdpa, eager or flex_attention "
                             f"(got {m.attn_implementation!r}).")
        if not t.full_vocab_metrics and (t.teacher_vocab != "draft" or t.confidence_target != "sampled_restricted"):
            raise UsageError(f"train.full_vocab_metrics is false, but teacher_vocab {t.teacher_vocab!r} with "
                             f"confidence_target {t.confidence_target!r} needs the full-vocabulary pass anyway; set "
                             f"full_vocab_metrics to true, or teacher_vocab to draft and confidence_target to "
                             f"sampled_restricted.")
        try:
            self.objective()  # validates the loss settings
        except ValueError as e:
            raise UsageError(f"train: {e}") from e

    def objective(self, block_size: int | None = None):
        """The loss settings; `block_size` is the trained drafter's (the run config's before it exists)."""
        t = self.train
        return ObjectiveConfig(block_size=block_size or self.model.block_size, max_anchors=t.max_anchors,
                               train_on_prompts=t.train_on_prompts, loss_weights=dict(t.loss_weights),
                               confidence_weight=t.confidence_weight, decay_gamma=t.decay_gamma,
                               ce_target=t.ce_target, chunk_elements=t.loss_chunk_elements,
                               teacher_vocab=t.teacher_vocab, confidence_target=t.confidence_target,
                               full_vocab_metrics=t.full_vocab_metrics)

    # -------------------------------------------------------------------------------- saving
    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def save(self, directory: str) -> str:
        path = os.path.join(directory, RUN_CONFIG_FILE)
        write_text_atomic(path, yaml.safe_dump(self.to_dict(), sort_keys=False))
        return path


def numeric_ranges(c: "RunConfig"):
    """(name, value, low, high, (low inclusive, high inclusive)) for every bounded numeric setting."""
    m, d, t = c.model, c.data, c.train
    closed, positive, unit = (True, True), (False, True), (True, False)
    return [
        ("model.num_hidden_layers", m.num_hidden_layers, 1, None, closed),
        ("model.intermediate_size", m.intermediate_size, 1, None, closed),
        ("model.num_attention_heads", m.num_attention_heads, 1, None, closed),
        ("model.num_key_value_heads", m.num_key_value_heads, 1, None, closed),
        ("model.head_dim", m.head_dim, 1, None, closed),
        ("model.sliding_window", m.sliding_window, 1, None, closed),
        ("model.block_size", m.block_size, 1, None, closed),
        ("model.draft_vocab_size", m.draft_vocab_size, 1, None, closed),
        ("model.mask_token_id", m.mask_token_id, 0, None, closed),
        ("model.markov_rank", m.markov_rank, 0, None, closed),
        ("model.lora_rank", m.lora_rank, 0, None, closed),
        ("model.lora_alpha", m.lora_alpha, 0, None, positive),
        ("model.lora_dropout", m.lora_dropout, 0, 1, unit),
        ("data.max_samples", d.max_samples, 1, None, closed),
        ("data.max_seq_length", d.max_seq_length, 1, None, closed),
        ("data.total_seq_length", d.total_seq_length, 1, None, closed),
        ("data.validation_ratio", d.validation_ratio, 0, 1, unit),
        ("data.num_proc", d.num_proc, 1, None, closed),
        ("data.max_bad_line_ratio", d.max_bad_line_ratio, 0, 1, closed),
        ("train.per_device_train_batch_size", t.per_device_train_batch_size, 1, None, closed),
        ("train.gradient_accumulation_steps", t.gradient_accumulation_steps, 1, None, closed),
        ("train.learning_rate", t.learning_rate, 0, None, positive),
        ("train.muon_learning_rate", t.muon_learning_rate, 0, None, positive),
        ("train.weight_decay", t.weight_decay, 0, None, closed),
        ("train.muon_weight_decay", t.muon_weight_decay, 0, None, closed),
        ("train.warmup_ratio", t.warmup_ratio, 0, 1, unit),
        ("train.max_grad_norm", t.max_grad_norm, 0, None, positive),
        ("train.max_anchors", t.max_anchors, 1, None, closed),
        ("train.confidence_weight", t.confidence_weight, 0, None, closed),
        ("train.decay_gamma", t.decay_gamma, 0, None, positive),
        ("train.loss_chunk_elements", t.loss_chunk_elements, 1, None, closed),
        ("train.calibration_max_slots", t.calibration_max_slots, 1, None, closed),
        ("train.eval_steps", t.eval_steps, 1, None, closed),
        ("train.save_steps", t.save_steps, 1, None, closed),
        ("train.logging_steps", t.logging_steps, 1, None, closed),
        ("train.save_total_limit", t.save_total_limit, 1, None, closed),
        ("train.dataloader_num_workers", t.dataloader_num_workers, 0, None, closed),
        ("train.verifier_max_tokens_per_forward", t.verifier_max_tokens_per_forward, 1, None, closed),
        ("train.cache_verifier_states_gb", t.cache_verifier_states_gb, 0, None, closed),
        ("train.vllm_concurrency", t.vllm_concurrency, 1, None, closed),
        ("train.vllm_timeout", t.vllm_timeout, 0, None, positive),
        ("train.vllm_retries", t.vllm_retries, 0, None, closed),
        ("train.vllm_max_failures", t.vllm_max_failures, 1, None, closed),
    ]


def _suggest(name: str, known, section: str, flag: bool = False) -> str:
    """"did you mean ...?" for a mistyped key, else where the valid keys are documented."""
    close = difflib.get_close_matches(name, sorted(known), n=1)
    if close:
        return f"did you mean --{section}.{close[0]}?" if flag else f"did you mean '{close[0]}'?"
    return f"the keys of section {section} are documented in trainer/config.py."


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
        raise UsageError(f"{where}: cannot use {value!r}; expected {hint}.")
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise UsageError(f"{where}: expected true or false, got {value!r}.")
    if hint in (int, float):
        if isinstance(value, str):  # YAML 1.1 reads "3e-3" (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise UsageError(f"{where}: expected a number, got {value!r}.")
        if hint is int and float(value) != int(value):
            raise UsageError(f"{where}: expected an integer, got {value!r}.")
        return hint(value)
    if hint is str:
        if isinstance(value, (dict, list)):
            raise UsageError(f"{where}: expected a string, got {value!r}.")
        return str(value)
    if origin is list or hint is list:
        if not isinstance(value, list):
            raise UsageError(f"{where}: expected a list, got {value!r}.")
        inner = args[0] if args else None
        return [_coerce(v, inner, where) if inner else v for v in value]
    if origin is dict or hint is dict:
        if not isinstance(value, dict):
            raise UsageError(f"{where}: expected a mapping, got {value!r}.")
        return value
    return value



def aux_layer_ids_for_config(config, verifier_config) -> list[int]:
    """The aux ids a run extracts: `model.aux_hidden_state_layer_ids`, or the drafter's default for this verifier
    (configuration_dspark), checked against its layer count. Shared by training, the cache writer and the
    extraction server's command, so all three ask for the same layers."""
    return aux_layer_ids_for_layers(config, verifier_config.get_text_config().num_hidden_layers)


def aux_layer_ids_for_layers(config, layers: int) -> list[int]:
    """`aux_layer_ids_for_config` from the verifier's layer count alone: the extraction server's command can then
    be printed where the verifier's config cannot be read (offline, `vllm-server --verifier_layers`)."""
    from configuration_dspark import check_aux_layer_ids, default_aux_layer_ids

    try:
        ids = config.model.aux_hidden_state_layer_ids or default_aux_layer_ids(layers)
        check_aux_layer_ids(list(ids), layers)
    except ValueError as e:
        raise UsageError(f"model.aux_hidden_state_layer_ids: {e}") from e
    return list(ids)




# ------------------------------------------------------------------------------------------------ loss
@dataclass
class ObjectiveConfig:
    """Loss configuration (the package's defaults, which `TrainArgs` shares)."""

    block_size: int = 8
    max_anchors: int = 512
    # Training also supervises the prompts' tokens (trainer/train/anchors.py, training_loss_mask); evaluation never.
    train_on_prompts: bool = False
    loss_weights: dict = field(default_factory=lambda: dict(DEFAULT_LOSS_WEIGHTS))
    confidence_weight: float = 1.0
    decay_gamma: float = 4.0
    ce_target: str = "teacher"  # or "data": x_{p+k+1} when it is in the draft vocabulary
    # Logits elements per chunk of slots, the loss's memory budget (rows: `chunk_rows`).
    chunk_elements: int = DEFAULT_CHUNK_ELEMENTS
    teacher_vocab: str = DEFAULT_TEACHER_VOCAB  # what CE/TV/KL compare the draft with (TEACHER_VOCABS)
    confidence_target: str = DEFAULT_CONFIDENCE_TARGET  # what the confidence head predicts (CONFIDENCE_TARGETS)
    # The full-vocabulary metrics (accept_len, greedy, coverage) need a no-gradient pass over the verifier's
    # whole output head (V x H per slot, 8x the draft head's cost at V = 262,144, Vd = 32,000). False skips it
    # when the loss does not need it (teacher_vocab "draft" and confidence_target "sampled_restricted"); those
    # metrics are then NaN. Evaluation always computes them (DSparkTrainer).
    full_vocab_metrics: bool = True

    def __post_init__(self):
        unknown = set(self.loss_weights) - set(LOSS_NAMES)
        if unknown:
            raise ValueError(f"unknown loss terms {sorted(unknown)}; use a dict over {list(LOSS_NAMES)}, "
                             f'e.g. {{"kl": 0.5, "tv": 0.5}}.')
        if self.ce_target not in ("teacher", "data"):
            raise ValueError(f"ce_target must be 'teacher' or 'data' (got {self.ce_target!r}).")
        if self.max_anchors < 1:
            raise ValueError(f"max_anchors must be at least 1 (got {self.max_anchors}).")
        if self.teacher_vocab not in TEACHER_VOCABS:
            raise ValueError(f"teacher_vocab must be one of {list(TEACHER_VOCABS)} (got {self.teacher_vocab!r}).")
        if self.confidence_target not in CONFIDENCE_TARGETS:
            raise ValueError(f"confidence_target must be one of {list(CONFIDENCE_TARGETS)} "
                             f"(got {self.confidence_target!r}).")
