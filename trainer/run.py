"""Train a DSpark drafter.

    accelerate launch trainer/run.py --config configs/gemma-4-E4B-it.yaml [--key value ...]
    python -m trainer train --config configs/smollm2-135m.yaml --max_steps 50   # one process

Steps: resolve the verifier and its tokenizer; render, tokenise (cached), split and pack the chat data;
choose the draft vocabulary from the training split; load the frozen verifier in-process; build (or
`init_from`) the drafter; train with `DSparkTrainer` (Muon + AdamW, cosine schedule, periodic evaluation
of the teacher-forced acceptance, best checkpoint by `eval_accept_len`); save the final drafter into
`output_dir`; calibrate the confidence head on the validation split and fold the calibration into the final
drafter and the best checkpoint (trainer/train/calibration.py). The last log line reports the validation
`accept_len`.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import logging
import os
import signal
import sys
import time

if __package__ in (None, ""):  # run as a script: put the repo root (not trainer/) on the path
    _root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]
    sys.path.insert(0, _root)

import torch
import transformers
from transformers import AutoTokenizer, TrainingArguments

from configuration_dspark import DSparkConfig, check_aux_layer_ids, check_draft_vocab_size
from modeling_dspark import DSparkDraftModel
from trainer.config import RunConfig
from trainer.data.packing import DSparkCollator, PackedDataset, pack_conversations
from trainer.data.prepare import check_enough_supervision, len_vocab, prepare_data
from trainer.data.vocab import build_draft_vocab
from trainer.errors import DSparkError, Parser, UsageError, is_disk_full, run_cli
from trainer.files import is_local
from trainer.states.build import build_source, close_source, source_report
from trainer.states.source import HiddenStateSource
from trainer.train.calibration import (
    HEAD_BIAS,
    HEAD_WEIGHT,
    MIN_SLOPE,
    calibration_record,
    fit_logistic,
    fold_head,
    write_folded_head,
    write_record,
)
from trainer.train.checkpoints import (
    RunLock,
    check_output_dir,
    check_resume_compatible,
    clear_run,
    latest_checkpoint,
    latest_usable_checkpoint,
    quarantine_incomplete,
    write_summary,
)
from trainer.train.compilation import compile_decoder_layers, compile_layers_enabled
from trainer.train.optim import MuonAdamWFactory
from trainer.train.trainer import (
    DSparkTrainer,
    args_barrier,
)
from trainer.verifier.loading import load_verifier, load_verifier_shell, resolve_drafter, resolve_pretrained
from trainer.verifier.small_models import resolve_model

logger = logging.getLogger("dspark")


def parse_args(argv: list[str]) -> RunConfig:
    """`--config FILE`, then any run-config key as `--key value` (either spelling); the command line wins."""
    parser = Parser(prog="accelerate launch trainer/run.py", description=__doc__,
                    formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=None, help="the run config (YAML), e.g. configs/smollm2-135m.yaml")
    args, overrides = parser.parse_known_args(argv)
    return RunConfig.load(args.config, overrides)


class Terminated(DSparkError):
    """SIGTERM: under `accelerate launch` the launcher sends it to every rank when another rank of the run died."""

    exit_code = 128 + signal.SIGTERM


def _on_sigterm(signum, frame):
    raise Terminated("this process was stopped by SIGTERM (under accelerate launch: another rank of this run died, "
                     "its log above says why); completed checkpoints are kept, so fix that cause and rerun with "
                     "--resume_from_checkpoint latest.")


def _peer_lost(error: RuntimeError) -> bool:
    """A collective failed because another rank died: NCCL raises DistBackendError, gloo a RuntimeError from its
    TCP transport when the peer's connection closes."""
    text = str(error)
    return isinstance(error, torch.distributed.DistBackendError) or (
        "gloo" in text and ("Connection reset by peer" in text or "Connection closed by peer" in text))


def main(argv: list[str] | None = None) -> dict:
    config = parse_args(sys.argv[1:] if argv is None else argv)
    signal.signal(signal.SIGTERM, _on_sigterm)  # the command only: a library caller keeps its own handler
    try:
        return train(config)
    except RuntimeError as e:
        if not _peer_lost(e):
            raise
        raise DSparkError(f"another rank of this run stopped in the middle of a collective operation ("
                          f"{' '.join(str(e).split())[:200]}); completed checkpoints are kept, so fix the cause "
                          f"in that rank's log and rerun with --resume_from_checkpoint latest.") from e


def train(config: RunConfig) -> dict:
    """Train under the output_dir's run lock (held by the global main process; `RANK` is set by accelerate's
    launcher), so a second run into the same directory is refused before it loads anything."""
    started = time.time()
    main_process = os.environ.get("RANK", "0") == "0"
    verifier_path = preflight(config, main_process)
    lock = RunLock(config.train.output_dir).acquire() if main_process else None
    try:
        return _train(config, verifier_path, started)
    finally:
        if lock is not None:
            lock.release()


def _train(config: RunConfig, verifier_path: str, started: float) -> dict:
    """Build everything, then run: each step below is one function of this module, in this order."""
    transformers.set_seed(config.train.seed)
    args = build_training_arguments(config, has_validation=config.data.validation_ratio > 0)
    if not args.should_log:
        logger.setLevel(logging.WARNING)
    clear_previous_run(config, args)
    tokenizer = AutoTokenizer.from_pretrained(verifier_path)
    data = build_data(config, tokenizer, verifier_path, args)
    if data.eval_rows is None and config.data.validation_ratio > 0:  # the validation split came out empty
        args = build_training_arguments(config, has_validation=False)
    verifier = build_verifier(config, verifier_path, args.device)
    drafter, model = build_models(config, verifier, tokenizer, data.vocab_ids, args.device)
    source = build_source(config, verifier, drafter.config.aux_hidden_state_layer_ids, args.process_index,
                          args.world_size)
    resume = resume_checkpoint(config, args, drafter.config)
    trainer = build_trainer(config, args, model, drafter, tokenizer, source, data)
    return run(config, trainer, drafter, source, data, resume, started)


@dataclasses.dataclass
class TrainingData:
    """The prepared splits, packed into rows, and what the run records about them."""

    train_set: object
    validation_set: object
    train_rows: PackedDataset
    eval_rows: PackedDataset | None
    vocab_ids: object
    stats: dict


def clear_previous_run(config: RunConfig, args: TrainingArguments) -> None:
    """`overwrite_output_dir` (without a resume): the previous run's files go before anything is written."""
    t = config.train
    if t.overwrite_output_dir and not t.resume_from_checkpoint:
        if args.should_save:
            removed = clear_run(t.output_dir)
            if removed:
                logger.warning("overwrite_output_dir: removed the previous run's %s from %s", ", ".join(removed),
                               t.output_dir)
        args_barrier(args)


def build_data(config: RunConfig, tokenizer, verifier_path: str, args: TrainingArguments) -> TrainingData:
    """Render, tokenise (cached, the main process first), split, choose the draft vocabulary and pack."""
    m, d = config.model, config.data
    with args.main_process_first(desc="preparing the chat data"):
        train_set, validation_set, stats = prepare_data(config, tokenizer)
        vocab_ids = None
        if not m.init_from and m.draft_vocab_size is not None:
            vocab_ids = build_draft_vocab(train_set, len_vocab(verifier_path), m.draft_vocab_size)
    check_enough_supervision(train_set, m.block_size)
    has_validation = d.validation_ratio > 0
    if has_validation and len(validation_set) == 0:
        logger.warning("the validation split is empty (too few conversations); training without evaluation")
        has_validation = False
    train_rows = PackedDataset(train_set, pack_conversations(list(train_set["length"]), d.total_seq_length,
                                                             seed=d.split_seed))
    eval_rows = None
    if has_validation:
        eval_rows = PackedDataset(validation_set, pack_conversations(list(validation_set["length"]),
                                                                     d.total_seq_length, seed=d.split_seed))
    logger.info("packed %d training conversations into %d rows of <= %d tokens (%d validation rows)",
                len(train_set), len(train_rows), d.total_seq_length, len(eval_rows) if eval_rows else 0)
    data_stats = {**dataclasses.asdict(stats), "train_conversations": len(train_set),
                  "validation_conversations": len(validation_set), "train_rows": len(train_rows),
                  "validation_rows": len(eval_rows) if eval_rows else 0,
                  "train_supervised_tokens": int(sum(train_set["num_supervised"]))}
    return TrainingData(train_set, validation_set, train_rows, eval_rows, vocab_ids, data_stats)


def build_verifier(config: RunConfig, verifier_path: str, device):
    """The whole frozen verifier for in-process states; for states from servers or a cache, only the embedding,
    final norm and head the drafter and the teacher need."""
    m, t = config.model, config.train
    if t.hidden_states == "in_process":
        logger.info("loading the verifier %s (%s)", m.verifier, verifier_path)
        return load_verifier(verifier_path, dtype=m.verifier_dtype, device=device)
    logger.info("loading the embedding, final norm and head of the verifier %s (%s); hidden states from %s",
                m.verifier, verifier_path, t.hidden_states)
    return load_verifier_shell(verifier_path, dtype=m.verifier_dtype, device=device)


def build_models(config: RunConfig, verifier, tokenizer, vocab_ids, device) -> tuple[DSparkDraftModel, object]:
    """The drafter, and the model the Trainer optimises: the drafter itself, or its LoRA wrapper."""
    m = config.model
    drafter = build_drafter(config, verifier, tokenizer, vocab_ids)
    attn = m.attn_implementation
    if attn == "auto":
        attn = "flex_attention" if device.type == "cuda" else "sdpa"
    drafter.config._attn_implementation = attn
    if compile_layers_enabled(m.compile_layers, device):
        compile_decoder_layers(drafter)
    model = drafter
    if m.lora_rank:
        from trainer.train.adapters import add_lora

        model = add_lora(drafter, m.lora_rank, m.lora_alpha, m.lora_dropout, m.lora_target_modules)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    logger.info("drafter: %d layers, block %d, draft vocab %d, aux layers %s, %.1fM trainable parameters",
                drafter.config.num_hidden_layers, drafter.config.block_size, drafter.config.draft_vocab_size,
                drafter.config.aux_hidden_state_layer_ids, trainable / 1e6)
    return drafter, model


def resume_checkpoint(config: RunConfig, args: TrainingArguments, drafter_config) -> str | None:
    """The checkpoint `resume_from_checkpoint` names (`latest`: the newest complete one), after interrupted and
    damaged checkpoints are set aside by the main process; None starts from scratch."""
    t = config.train
    if not t.resume_from_checkpoint:
        return None
    if args.should_save:
        for moved in quarantine_incomplete(t.output_dir):
            logger.warning("checkpoint %s was interrupted while saving; moved aside", moved)
    args_barrier(args)
    if t.resume_from_checkpoint == "latest":
        if args.should_save:
            latest_usable_checkpoint(t.output_dir)  # sets damaged checkpoints aside, once, before any rank looks
        args_barrier(args)
        resume = latest_checkpoint(t.output_dir)
    else:
        resume = t.resume_from_checkpoint
    if resume is None:
        logger.info("no complete checkpoint in %s yet; starting from scratch", t.output_dir)
    else:
        check_resume_compatible(resume, drafter_config)
        logger.info("resuming from %s", resume)
    return resume


def build_trainer(config: RunConfig, args: TrainingArguments, model, drafter: DSparkDraftModel, tokenizer,
                  source: HiddenStateSource, data: TrainingData) -> DSparkTrainer:
    t = config.train
    optimizer = None
    if t.optimizer == "muon":
        optimizer = (MuonAdamWFactory, dict(lr=t.learning_rate, muon_lr=t.muon_learning_rate,
                                            weight_decay=t.weight_decay, muon_weight_decay=t.muon_weight_decay))
    return DSparkTrainer(
        model=model,
        args=args,
        train_dataset=data.train_rows,
        eval_dataset=data.eval_rows,
        # A source with latency fetches each batch while the previous one trains (not under the in-memory row
        # cache, which would fetch rows it already holds).
        data_collator=DSparkCollator(pad_token_id=tokenizer.pad_token_id or 0, on_batch=None if
                                     t.cache_verifier_states_gb else getattr(source, "prefetch", None)),
        optimizer_cls_and_kwargs=optimizer,
        source=source,
        objective=build_objective(config, drafter.config.block_size),
        run_config=config,
        data_stats=data.stats,
        save_total_limit=t.save_total_limit,
    )


def run(config: RunConfig, trainer: DSparkTrainer, drafter: DSparkDraftModel, source: HiddenStateSource,
        data: TrainingData, resume: str | None, started: float) -> dict:
    """Train, save the final drafter, evaluate it, calibrate its confidence head and write the run summary."""
    t = config.train
    has_validation = data.eval_rows is not None
    # The initial evaluation runs inside train() (eval_on_start): calling trainer.evaluate() before train()
    # registers the unwrapped model with accelerate, and training then silently runs without DDP.
    trainer.args.eval_on_start = has_validation and t.eval_at_start and resume is None
    try:
        result = trainer.train(resume_from_checkpoint=resume)
    except BaseException:
        # The run stops here: drop the requests queued for later batches, so the exit waits only for those in
        # flight (each deletes its file) and sends a server nothing more.
        close_source(source)
        raise
    initial = next((h for h in trainer.state.log_history if h.get("step") == 0 and "eval_accept_len" in h), None)
    try:
        trainer.save_model(t.output_dir)
    except (OSError, RuntimeError) as e:
        if not is_disk_full(e):
            raise
        raise DSparkError(f"the disk of {t.output_dir} filled up while writing the final drafter (the newest "
                          f"complete checkpoint, {latest_checkpoint(t.output_dir)}, is kept); free some space and "
                          f"rerun the same command with --resume_from_checkpoint latest.") from e
    trainer.update_best_link()
    final = trainer.evaluate() if has_validation else {}
    calibration = calibrate_confidence(trainer, drafter, config, has_validation)
    states_report = source_report(source)
    close_source(source)
    summary = {
        "train_loss": result.training_loss,
        "global_step": trainer.state.global_step,
        "eval_accept_len": final.get("eval_accept_len"),
        "initial_eval_accept_len": initial["eval_accept_len"] if initial else None,
        "best_checkpoint": trainer.state.best_model_checkpoint,
        "calibration": calibration,
        "hidden_states": states_report,
        "train_steps_per_second": result.metrics.get("train_steps_per_second"),
        "wall_time_s": time.time() - started,
    }
    if trainer.args.should_save:
        write_summary(t.output_dir, {**summary, "final_metrics": final, "data": data.stats})
    if has_validation:
        logger.warning(
            "done: validation accept_len %.4f (initial %s) after %d steps in %.0f s; best checkpoint %s",
            summary["eval_accept_len"], f"{summary['initial_eval_accept_len']:.4f}" if initial else "n/a",
            summary["global_step"], summary["wall_time_s"], summary["best_checkpoint"])
    else:
        logger.warning("done: %d steps in %.0f s (no validation split)", summary["global_step"], summary["wall_time_s"])
    return summary


def validation_metrics(config: RunConfig, drafter: str) -> dict:
    """The teacher-forced validation metrics (`eval_accept_len`, `eval_pos_k`, the confidence head's calibration,
    ...) of an existing drafter, saved by this package or by speculators, on `config`'s validation split: the same
    data path, hidden-state source and evaluation step a training run of `config` uses, with no training. This is
    how drafters trained elsewhere are put on equal terms with ours (benchmarks/recipe.py). The drafter's
    architecture is adopted as `init_from` adopts it; `train.output_dir` is only the Trainer's scratch directory."""
    config.model.init_from = drafter
    config.model.lora_rank = 0
    verifier_path = preflight(config)
    transformers.set_seed(config.train.seed)
    args = build_training_arguments(config, has_validation=True)
    tokenizer = AutoTokenizer.from_pretrained(verifier_path)
    data = build_data(config, tokenizer, verifier_path, args)
    if data.eval_rows is None:
        raise UsageError(f"the run config's validation split is empty, so drafter {drafter} cannot be evaluated on "
                         f"it; set data.validation_ratio above 0 (e.g. 0.1).")
    verifier = build_verifier(config, verifier_path, args.device)
    model_drafter, model = build_models(config, verifier, tokenizer, None, args.device)
    source = build_source(config, verifier, model_drafter.config.aux_hidden_state_layer_ids)
    try:
        trainer = build_trainer(config, args, model, model_drafter, tokenizer, source, data)
        return trainer.evaluate()
    finally:
        close_source(source)


def build_objective(config: RunConfig, block_size: int | None = None):
    """The loss settings, with the teacher and confidence-target choices of the train section."""
    try:
        return config.objective(block_size=block_size)
    except ValueError as e:  # ObjectiveConfig's checks are one sentence naming the valid values
        raise UsageError(f"train: {e}") from e


# report_to integrations whose package is not named like the integration: (the modules transformers imports for
# it, any one of which will do; what pip installs). The others import and install under their own name.
REPORTER_PACKAGES = {
    "tensorboard": (("tensorboard", "tensorboardX"), "tensorboard"),
    "azure_ml": (("azureml",), "azureml-core"),
    "flyte": (("flytekit",), "flytekit"),
}


def check_report_to(report_to: str | None) -> None:
    """`train.report_to` names an integration transformers knows whose package imports here. Checked before
    anything is read or written: otherwise a missing package surfaces only once the verifier and the data are
    loaded, as a transformers error in the middle of setting up the Trainer."""
    import importlib.util

    from transformers.integrations.integration_utils import INTEGRATION_TO_CALLBACK

    if report_to in (None, "", "none", "all"):  # all: whichever integrations are installed
        return
    if report_to not in INTEGRATION_TO_CALLBACK:
        close = difflib.get_close_matches(report_to, list(INTEGRATION_TO_CALLBACK), n=1)
        hint = f"did you mean {close[0]}? " if close else ""
        raise UsageError(f"train.report_to {report_to!r} is not a reporting integration; {hint}use none, all or one "
                         f"of {', '.join(sorted(INTEGRATION_TO_CALLBACK))}.")
    modules, package = REPORTER_PACKAGES.get(report_to, ((report_to,), report_to))
    if all(importlib.util.find_spec(m) is None for m in modules):
        extra = ' (or pip install -e ".[gpu]", which includes it)' if report_to == "tensorboard" else ""
        raise UsageError(f"train.report_to is {report_to}, but the {package} package is not installed here; install "
                         f"it with pip install {package}{extra}, or pass --report_to none.")


def build_training_arguments(config: RunConfig, has_validation: bool) -> TrainingArguments:
    t = config.train
    check_report_to(t.report_to)
    use_cpu = t.use_cpu or not torch.cuda.is_available()
    bf16 = (not use_cpu and torch.cuda.is_bf16_supported()) if t.bf16 == "auto" else str(t.bf16).lower() == "true"
    return TrainingArguments(
        output_dir=t.output_dir,
        num_train_epochs=t.num_train_epochs,
        max_steps=t.max_steps,
        per_device_train_batch_size=t.per_device_train_batch_size,
        per_device_eval_batch_size=1,  # one packed row per eval step: the stats vector is per sample
        gradient_accumulation_steps=t.gradient_accumulation_steps,
        learning_rate=t.learning_rate,
        weight_decay=t.weight_decay,
        lr_scheduler_type=t.lr_scheduler_type,
        warmup_steps=t.warmup_ratio,  # a float below 1 is a ratio of the total steps
        max_grad_norm=t.max_grad_norm,
        logging_steps=t.logging_steps,
        logging_first_step=True,
        eval_strategy="steps" if has_validation else "no",
        eval_steps=t.eval_steps if has_validation else None,
        save_strategy="steps",
        save_steps=t.save_steps or t.eval_steps,
        save_total_limit=None,  # DSparkTrainer rotates, after the new checkpoint is complete
        load_best_model_at_end=has_validation,
        metric_for_best_model="accept_len" if has_validation else None,
        greater_is_better=True,
        remove_unused_columns=False,
        label_names=[],
        report_to=[] if t.report_to in ("none", "", None) else [t.report_to],
        seed=t.seed,
        data_seed=t.seed,
        bf16=bf16,
        use_cpu=use_cpu,
        dataloader_num_workers=t.dataloader_num_workers,
        ddp_find_unused_parameters=False,
        gradient_checkpointing=t.gradient_checkpointing,
        gradient_checkpointing_kwargs={"use_reentrant": False} if t.gradient_checkpointing else None,
    )


def check_sharding() -> None:
    """accelerate (1.15) turns `accelerate launch --use_fsdp` into FSDP only for accelerator process groups: on a
    machine without one it quietly falls back to data parallelism over gloo, so every process would hold a full
    replica, the very memory the user asked FSDP to save. Refuse that up front instead."""
    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() != "true":
        return
    if torch.accelerator.is_available():
        return
    raise UsageError("accelerate launch --use_fsdp shards a run only across GPUs (accelerate runs FSDP on accelerator "
                     "process groups alone), and this machine has none, so each process would train a full replica; "
                     "launch with --multi_gpu for data-parallel processes on CPU, or run on GPUs.")


def preflight(config: RunConfig, main_process: bool = True) -> str:
    """Check everything that needs the disk or a model's config but nothing heavy, before any data is read or
    any model is loaded: the output_dir, the verifier (its config only: layer count for the aux ids, vocabulary
    for the draft vocabulary and mask token), the `init_from` drafter, local data paths and the resume target.
    Returns the verifier's resolved path."""
    m, d, t = config.model, config.data, config.train
    build_objective(config)  # the teacher and confidence-target choices, before anything touches the disk
    check_sharding()
    check_output_dir(t.output_dir, t.resume_from_checkpoint, t.overwrite_output_dir, check_lock=main_process)
    if t.resume_from_checkpoint not in (None, "latest") and not os.path.isdir(t.resume_from_checkpoint):
        raise UsageError(f"train.resume_from_checkpoint {t.resume_from_checkpoint} is not a directory; pass "
                         f"'latest' or a checkpoint-N directory of this run.")
    for source in (d.train_data if isinstance(d.train_data, list) else [d.train_data]):
        check_local_data(source, m.verifier)
    check_report_to(t.report_to)
    if m.init_from:
        resolve_drafter(m.init_from, "init_from drafter")
        adopt_init_from(config)
    verifier_path, verifier_config = resolve_pretrained(m.verifier, "verifier")
    text = verifier_config.get_text_config()
    layers, vocab = getattr(text, "num_hidden_layers", None), getattr(text, "vocab_size", None)
    if m.aux_hidden_state_layer_ids is not None and isinstance(layers, int):
        try:
            check_aux_layer_ids(m.aux_hidden_state_layer_ids, layers)
        except ValueError as e:
            raise UsageError(f"model.aux_hidden_state_layer_ids: {e}") from e
    if isinstance(vocab, int):
        if m.draft_vocab_size is not None:
            try:
                check_draft_vocab_size(m.draft_vocab_size, vocab, "model.draft_vocab_size")
            except ValueError as e:
                raise UsageError(str(e)) from e
        if m.mask_token_id is not None and m.mask_token_id >= vocab:
            raise UsageError(f"model.mask_token_id {m.mask_token_id} is outside the verifier's vocabulary of {vocab} "
                             f"tokens; use an id in 0..{vocab - 1} or leave it unset.")
    return verifier_path


def check_local_data(source: str, verifier: str) -> None:
    """A training data path that should exist here but does not, in one sentence with the command that creates
    it. Besides a path that can only be local, this covers one shaped like a Hub id (`data/open-perfectblend-...`)
    whose first directory exists here: the recipe's own data path, which `python -m trainer regenerate` writes.
    Without this it would be sent to the Hub and fail much later (or, offline, be reported as something else)."""
    if os.path.exists(os.path.expanduser(source)):
        return
    top = source.split("/", 1)[0]
    if not (is_local(source) or (top not in ("", ".", "..") and os.path.isdir(top))):
        return  # a Hub dataset id
    out = source if source.lower().endswith((".jsonl", ".json")) else os.path.join(source, "train.jsonl")
    raise UsageError(f"data.train_data {source} does not exist; create it with `python -m trainer regenerate "
                     f"--verifier {verifier} --prompts PROMPTS --out {out}` (PROMPTS: the prompts' JSONL or Hub "
                     f"dataset, e.g. mlabonne/open-perfectblend for the seed recipe), or pass --train_data with an "
                     f"existing chat dataset.")


def adopt_init_from(config: RunConfig) -> None:
    """`init_from` continues an existing drafter, so its architecture wins over the run config's (block size
    included, so the objective trains exactly the drafter's slots); the run config is updated to match, so the
    saved run config describes the drafter that was trained."""
    m = config.model
    existing = DSparkConfig.from_pretrained(resolve_model(m.init_from))
    changed = m.adopt_architecture(existing.architecture())
    for key, (ours, theirs) in changed.items():
        logger.warning("model.%s: using the init_from drafter's %r instead of the run config's %r", key, theirs, ours)
    config.validate()


def build_drafter(config: RunConfig, verifier, tokenizer, vocab_ids) -> DSparkDraftModel:
    m = config.model
    if m.init_from:
        drafter = DSparkDraftModel.from_pretrained(resolve_model(m.init_from), dtype=torch.float32)
        logger.info("initialised from the drafter %s (its architecture and draft vocabulary are kept)", m.init_from)
    else:
        hub_id = m.verifier_id or (m.verifier if not os.path.exists(m.verifier) else None)
        try:
            dconfig = DSparkConfig.from_verifier(verifier, verifier_name_or_path=hub_id, tokenizer=tokenizer,
                                                 **m.architecture_overrides())
        except ValueError as e:  # DSparkConfig's checks are one sentence with the fix already
            raise UsageError(f"the model section does not describe a valid drafter for this verifier: {e}") from e
        drafter = DSparkDraftModel(dconfig)
        if vocab_ids is not None:
            drafter.set_draft_vocab(vocab_ids)
    drafter.attach_verifier(verifier)
    return drafter.to(verifier.get_input_embeddings().weight.device)  # (the shell's decoder layers are on meta)


def calibrate_confidence(trainer: DSparkTrainer, drafter: DSparkDraftModel, config: RunConfig,
                         has_validation: bool) -> dict | None:
    """Fit `sigmoid(a*z + c)` to the confidence targets of the validation split and fold it into the head of the
    model in memory, the final drafter in output_dir and the best checkpoint (the one an export picks), each with
    its `CALIBRATION_FILE`; a checkpoint whose other weights differ from the model in memory is left alone (the
    fit is not for it). Runs on every process (the sample is gathered), writes on the main one. Returns the
    summary's record, or None when skipped (no validation split, no confidence head, or switched off)."""
    t, args = config.train, trainer.args
    head = drafter.confidence_head
    reason = ("train.calibrate_confidence is false" if not t.calibrate_confidence else
              "the drafter has no confidence head" if head is None else
              "there is no validation split" if not has_validation else None)
    if reason:
        logger.info("confidence calibration skipped: %s", reason)
        return None
    samples = trainer.confidence_samples(t.calibration_max_slots)
    z, target, mask = samples["z"], samples["target"], samples["supervised"]
    if not bool(mask.any()):
        logger.info("confidence calibration skipped: the validation split has no supervised slot")
        return None
    a, c = fit_logistic(z[mask], target[mask])
    if not abs(a) >= MIN_SLOPE:
        logger.warning("confidence calibration skipped: the fitted slope a=%.2g says the confidence logits carry no "
                       "signal about acceptance, so folding it would erase the head", a)
        return None
    record = calibration_record(z, target, mask, a, c, confidence_target=t.confidence_target,
                                teacher_vocab=t.teacher_vocab, split="validation", max_slots=t.calibration_max_slots)
    reference = trainer.servable_state_dict()  # before the fold: the weights the fit belongs to
    fold_head(head.proj, a, c)
    folded = {HEAD_WEIGHT: head.proj.weight, HEAD_BIAS: head.proj.bias}
    applied = []
    if args.should_save:
        for directory in dict.fromkeys(d for d in (t.output_dir, trainer.state.best_model_checkpoint) if d):
            if write_folded_head(directory, folded, reference, a, c):
                write_record(directory, record)  # after the weights: the record's presence means they are folded
                applied.append(directory)
            else:
                logger.warning("confidence calibration not applied to %s: its weights are not the model it was "
                               "fitted on", directory)
    args_barrier(args)
    fmt = lambda xs: "[" + ", ".join("n/a" if x is None else f"{x:+.3f}" for x in xs) + "]"  # noqa: E731
    logger.info("confidence calibration (%s target) on %d validation slots: sigmoid(%.4f*z %+.4f); ECE %.4f -> %.4f; "
                "cumulative-product bias per position %s -> %s; folded into %s", t.confidence_target,
                record["n_slots"], a, c, record["ece_before"], record["ece_after"],
                fmt(record["cumprod_bias_before"]), fmt(record["cumprod_bias_after"]), ", ".join(applied) or "nothing")
    keys = ("a", "c", "n_slots", "ece_before", "ece_after", "cumprod_bias_before", "cumprod_bias_after")
    return {**{k: record[k] for k in keys}, "applied_to": applied}


if __name__ == "__main__":
    sys.exit(run_cli(main))
