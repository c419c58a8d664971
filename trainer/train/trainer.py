"""`DSparkTrainer`: a `transformers.Trainer` whose step is the DSpark objective.

One training step (`compute_loss`):

    states  = source.states(batch)                       trainer/states/source.py  (frozen verifier, no grad)
    anchors = sample_anchors(loss_mask, document_ids)    trainer/train/anchors.py  (fresh every step; the replies'
                                                                                  tokens, or every token)
    out     = model(input_ids, states.aux, anchors, ...) modeling_dspark.py        (drafter forward)
    loss    = dspark_loss(drafter, out, ..., teacher)    trainer/train/loss.py      (chunked CE/TV + confidence)

Evaluation returns the teacher-forced acceptance metrics against the verifier's full vocabulary
(`eval_accept_len`, `eval_accept_rate`, `eval_pos_k`, `eval_draft_vocab_coverage`, the confidence head's
calibration), reduced as sums across batches and processes; the best checkpoint is the one with the highest
`eval_accept_len`. `confidence_samples` collects the confidence logits and targets of the validation split for
the post-training calibration (trainer/train/calibration.py); a checkpoint whose head carries a folded calibration
is unfolded when the Trainer loads it (resume, best model at the end), so training always continues from the
trained weights. Every checkpoint directory is a servable drafter (trainer/contract.py) plus the Trainer's
state, the run config and the data statistics; a completion marker, written last, says it is complete (the
layout and its file names: trainer/train/checkpoints.py). The verifier is never saved.
"""

import dataclasses
import json
import math
import os
import shutil

import torch
from torch.utils.data import DataLoader, Subset
from transformers import Trainer, TrainingArguments  # noqa: E402
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from modeling_dspark import DSparkDraftModel
from trainer.config import ObjectiveConfig
from trainer.errors import (
    DSparkError,
    UsageError,
    is_disk_full,  # noqa: E402
)
from trainer.states.memory import MemoryRowCache
from trainer.states.source import HiddenStateSource
from trainer.train.anchors import sample_anchors, training_loss_mask
from trainer.train.calibration import unfold_head
from trainer.train.checkpoints import (
    ADAPTER_DIR,
    CALIBRATION_FILE,
    CHECKPOINT_PREFIX,
    TRAINING_ARGS_FILE,
    batch_log_file,
    latest_checkpoint,
    mark_complete,
    rotate_checkpoints,
    update_best_link,
    write_data_stats,
)
from trainer.train.loss import dspark_loss
from trainer.train.stats import reduce_stats, stat_names

assert CHECKPOINT_PREFIX == PREFIX_CHECKPOINT_DIR, "the Trainer's checkpoint prefix changed; update trainer/train/checkpoints.py"


class NonFiniteLossError(DSparkError, FloatingPointError):
    """The loss diverged; training stopped before the update (a runtime failure: exit status 1)."""


class DSparkTrainer(Trainer):
    def __init__(self, *args, source: HiddenStateSource, objective: ObjectiveConfig, run_config=None,
                 data_stats: dict | None = None, save_total_limit: int | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        # The Trainer's own rotation runs before our completion marker exists and counts the checkpoint-best
        # link as a checkpoint, so it is disabled (TrainingArguments.save_total_limit=None) and done here.
        if self.args.save_total_limit:
            raise ValueError("pass save_total_limit to DSparkTrainer, not to TrainingArguments (the Trainer's "
                             "rotation would delete checkpoints before the new one is complete).")
        self.save_total_limit = save_total_limit
        self.source = source
        cache_bytes = int((run_config.train.cache_verifier_states_gb if run_config else 0) * 2**30)
        self.train_source = MemoryRowCache(source, cache_bytes) if cache_bytes else source
        self.eval_source = MemoryRowCache(source, cache_bytes) if cache_bytes else source
        self.objective = objective
        self.run_config = run_config
        self.data_stats = data_stats
        # The loss is a per-batch mean over supervised slots; let the Trainer average over accumulation steps.
        self.model_accepts_loss_kwargs = False
        self._train_stats: torch.Tensor | None = None
        self._eval_generator: torch.Generator | None = None
        self._batch_log = None
        self.compute_metrics = self.compute_acceptance_metrics

    # ------------------------------------------------------------------------------------------ the step
    def drafter(self, model=None) -> DSparkDraftModel:
        """The bare drafter behind DDP/PEFT wrappers (its heads recompute logits chunk by chunk)."""
        model = self.accelerator.unwrap_model(model if model is not None else self.model)
        return model.get_base_model() if hasattr(model, "get_base_model") else model

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss, stats = self._loss(model, inputs)
        if model.training:
            self._check_finite(loss, inputs)
            self._train_stats = stats if self._train_stats is None else self._train_stats + stats
            self._record_batch(inputs)
        return (loss, stats) if return_outputs else loss

    def _loss(self, model, inputs, return_blocks: bool = False):
        states = (self.train_source if model.training else self.eval_source).states(inputs)
        device = inputs["input_ids"].device
        # Training may also supervise the prompts; evaluation measures the replies, what a served drafter proposes.
        loss_mask = training_loss_mask(inputs["loss_mask"], inputs["document_ids"],
                                       model.training and self.objective.train_on_prompts)
        anchors = sample_anchors(loss_mask, inputs["document_ids"], self.objective.max_anchors,
                                 generator=None if model.training else self._eval_generator)
        outputs = model(
            input_ids=inputs["input_ids"],
            aux_hidden_states=states.aux_hidden_states.to(device),
            anchor_positions=anchors,
            document_ids=inputs["document_ids"],
            position_ids=inputs["position_ids"],
            return_logits=False,
        )
        # Evaluation always reports the full-vocabulary metrics (the best checkpoint is chosen on them).
        objective = self.objective if model.training else dataclasses.replace(self.objective, full_vocab_metrics=True)
        return dspark_loss(
            self.drafter(model), outputs, inputs["input_ids"], loss_mask, inputs["document_ids"], anchors,
            states.last_hidden_state.to(device), self.source.teacher(), objective,
            **({"return_blocks": True} if return_blocks else {}),  # the plain call stays the plain signature
            **({"full_vocabulary": states.full_vocabulary} if states.full_vocabulary is not None else {}),
        )

    def _check_finite(self, loss: torch.Tensor, inputs) -> None:
        if torch.isfinite(loss).item():
            return
        last = latest_checkpoint(self.args.output_dir)
        raise NonFiniteLossError(
            f"non-finite loss ({loss.item()}) at step {self.state.global_step + 1} on packed rows "
            f"{inputs['row_index'].tolist()}; training stopped before the update, so the last good checkpoint "
            f"({last or 'none saved yet'}) is intact: lower the learning rate or inspect those rows, then resume."
        )

    def _record_batch(self, inputs) -> None:
        if not (self.run_config and self.run_config.train.record_batches):
            return
        if self._batch_log is None:
            os.makedirs(self.args.output_dir, exist_ok=True)
            self._batch_log = open(batch_log_file(self.args.output_dir, self.args.process_index), "a")
        # The parameter checksum shows replicas stay in sync under DDP (same weights before every step).
        checksum = sum(float(p.detach().double().sum()) for p in self.model.parameters() if p.requires_grad)
        row = {"step": self.state.global_step, "rank": self.args.process_index,
               "rows": inputs["row_index"].tolist(), "param_checksum": checksum}
        self._batch_log.write(json.dumps(row) + "\n")
        self._batch_log.flush()

    # ------------------------------------------------------------------------------------------ evaluation
    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad():
            loss, stats = self.compute_loss(model, inputs, return_outputs=True)
        stats = stats.unsqueeze(0)
        return loss.detach(), stats, torch.zeros_like(stats[:, :1])  # labels: the Trainer needs some to call metrics

    def evaluate(self, *args, **kwargs):
        # Fixed anchors per evaluation, so accept_len compares checkpoints, not anchor draws.
        self._eval_generator = torch.Generator().manual_seed(self.args.seed)
        try:
            return super().evaluate(*args, **kwargs)
        finally:
            self._eval_generator = None

    def compute_acceptance_metrics(self, prediction) -> dict[str, float]:
        stats = torch.as_tensor(prediction.predictions).reshape(-1, len(stat_names(self.objective.block_size)))
        metrics = reduce_stats(stats.sum(0), self.objective.block_size)
        metrics.pop("loss", None)  # the Trainer reports eval_loss itself
        return metrics

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if "loss" in logs and not any(k.startswith("eval_") for k in logs) and self._train_stats is not None:
            stats = self.accelerator.reduce(self._train_stats.to(self.args.device), reduction="sum")
            metrics = reduce_stats(stats, self.objective.block_size)
            # The full-vocabulary ones are NaN when train.full_vocab_metrics skipped them: not logged then.
            logs.update({k: round(metrics[k], 4) for k in ("accept_len", "accept_rate", "greedy_accept_len",
                                                           "draft_vocab_coverage", "restricted_accept_len")
                         if math.isfinite(metrics[k])})
            self._train_stats = None
        super().log(logs, start_time)

    @torch.no_grad()
    def confidence_samples(self, max_slots: int) -> dict[str, torch.Tensor]:
        """`[M, B]` confidence logits `z`, confidence targets `target` and `supervised` masks of validation blocks,
        float64 on the CPU and identical on every process, for the post-training calibration.

        Process r reads validation rows r, r + W, ... (each row exactly once: the Trainer's sharded loader repeats
        rows to even out the last batch), with evaluation's anchor seed, so on one process the fit sees exactly the
        blocks `eval_*` describe. At most `max_slots // B` blocks are kept: a uniform sample without replacement
        (the blocks with the smallest seeded random keys, merged batch by batch and then across processes), so
        memory stays bounded and the sample is the same on a rerun."""
        if self.drafter().confidence_head is None:
            raise ValueError("the drafter has no confidence head to calibrate; check drafter.confidence_head first.")
        B = self.objective.block_size
        keep = max(1, max_slots // B)
        model = self.model
        was_training = model.training
        model.eval()
        self._eval_generator = torch.Generator().manual_seed(self.args.seed)
        picker = torch.Generator().manual_seed(self.args.seed + 1 + self.args.process_index)
        held = [torch.zeros(0, dtype=torch.float64), torch.zeros(0, B, dtype=torch.float64),
                torch.zeros(0, B, dtype=torch.float64), torch.zeros(0, B, dtype=torch.float64)]
        try:
            rows = range(self.args.process_index, len(self.eval_dataset), self.args.world_size)
            loader = DataLoader(Subset(self.eval_dataset, rows), batch_size=self.args.per_device_eval_batch_size,
                                collate_fn=self.data_collator)
            for inputs in loader:
                inputs = self._prepare_inputs(inputs)
                with self.compute_loss_context_manager():
                    _, _, blocks = self._loss(model, inputs, return_blocks=True)
                valid = blocks["supervised"][..., 0]
                z = blocks["confidence"][valid].double().cpu()
                new = [torch.rand(z.shape[0], generator=picker, dtype=torch.float64), z,
                       blocks["target"][valid].double().cpu(), blocks["supervised"][valid].double().cpu()]
                held = _smallest_keys([torch.cat([a, b]) for a, b in zip(held, new)], keep)
        finally:
            self._eval_generator = None
            model.train(was_training)
        if self.args.world_size > 1:  # the same sample everywhere, so every process folds the same (a, c)
            device = self.args.device
            padded = [self.accelerator.pad_across_processes(held[0].to(device), dim=0, pad_index=2)]
            padded += [self.accelerator.pad_across_processes(x.to(device), dim=0) for x in held[1:]]
            gathered = [self.accelerator.gather(x).cpu() for x in padded]
            real = gathered[0] < 2
            held = _smallest_keys([x[real] for x in gathered], keep)
        return {"z": held[1], "target": held[2], "supervised": held[3].bool()}

    def servable_state_dict(self) -> dict[str, torch.Tensor]:
        """The drafter's tensors as its checkpoints store them (LoRA deltas merged)."""
        model = self.accelerator.unwrap_model(self.model)
        if hasattr(model, "get_base_model"):
            from trainer.train.adapters import merged_state_dict

            return merged_state_dict(model)
        return model.state_dict()

    # ------------------------------------------------------------------------------------------ checkpoints
    def _save(self, output_dir: str | None = None, state_dict=None) -> None:
        """Write a servable drafter: LoRA adapters merged, never the verifier, plus the run config."""
        output_dir = output_dir or self.args.output_dir
        os.makedirs(output_dir, exist_ok=True)
        model = self.accelerator.unwrap_model(self.model)
        if hasattr(model, "get_base_model"):  # PEFT: save merged weights to serve, the adapter to resume
            from trainer.train.adapters import merged_state_dict

            model.save_pretrained(os.path.join(output_dir, ADAPTER_DIR))
            state_dict = merged_state_dict(model)
            model = model.get_base_model()
        if state_dict is not None:
            state_dict = {k: v for k, v in state_dict.items() if not k.startswith("verifier")}
        model.save_pretrained(output_dir, state_dict=state_dict)
        # These weights are unfolded: a calibration record an earlier attempt left here no longer describes them.
        if os.path.exists(os.path.join(output_dir, CALIBRATION_FILE)):
            os.remove(os.path.join(output_dir, CALIBRATION_FILE))
        if self.run_config is not None:
            self.run_config.save(output_dir)
        if self.data_stats is not None:
            write_data_stats(output_dir, self.data_stats)
        torch.save(self.args, os.path.join(output_dir, TRAINING_ARGS_FILE))

    def _save_checkpoint(self, model, trial) -> None:
        directory = os.path.join(self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        try:
            super()._save_checkpoint(model, trial)
        except (OSError, RuntimeError) as e:
            if not is_disk_full(e):
                raise
            # The half-written checkpoint goes (it frees the space it took); the previous one is untouched, since
            # rotation only runs after a checkpoint is complete.
            if self.args.should_save:
                shutil.rmtree(directory, ignore_errors=True)
            kept = latest_checkpoint(self.args.output_dir)
            raise DSparkError(
                f"the disk of {self.args.output_dir} filled up while saving {os.path.basename(directory)}, which was "
                f"removed ({f'{os.path.basename(kept)} is the newest complete checkpoint' if kept else 'no earlier checkpoint'}"
                f"); free some space and rerun the same command with --resume_from_checkpoint latest.") from e
        if not self.args.should_save:
            return
        mark_complete(directory, self.state.global_step)
        self.update_best_link()
        rotate_checkpoints(self.args.output_dir, self.save_total_limit, self.state.best_model_checkpoint)

    def update_best_link(self) -> None:
        """`<output_dir>/checkpoint-best` points at the checkpoint with the highest validation accept_len."""
        if self.args.should_save:
            update_best_link(self.args.output_dir, self.state.best_model_checkpoint)

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        model = model if model is not None else self.model
        unwrapped = self.accelerator.unwrap_model(model)
        if hasattr(unwrapped, "get_base_model"):
            adapter = os.path.join(resume_from_checkpoint, ADAPTER_DIR)
            if not os.path.isdir(adapter):
                raise UsageError(f"{resume_from_checkpoint} has no LoRA adapter to resume from; resume a LoRA run "
                                 f"from one of its own checkpoints.")
            unwrapped.load_adapter(adapter, adapter_name="default", is_trainable=True)
            return  # the base weights, confidence head included, come from init_from and were never folded
        super()._load_from_checkpoint(resume_from_checkpoint, model)
        self._unfold_calibration(unwrapped, resume_from_checkpoint)

    def _load_best_model(self) -> None:
        super()._load_best_model()
        unwrapped = self.accelerator.unwrap_model(self.model)
        if not hasattr(unwrapped, "get_base_model"):  # PEFT: the Trainer reloads only an adapter at the top level
            self._unfold_calibration(unwrapped, self.state.best_model_checkpoint)

    @staticmethod
    def _unfold_calibration(drafter, directory: str) -> None:
        """A calibrated checkpoint holds `fold(trained head, a, c)` (trainer/train/calibration.py); training continues
        from the trained head, so a resumed run matches an uninterrupted one and calibration is refitted once."""
        head = getattr(drafter, "confidence_head", None)
        if head is not None:
            unfold_head(head.proj, directory)


def _smallest_keys(held: list[torch.Tensor], keep: int) -> list[torch.Tensor]:
    """The rows of `held[1:]` whose key (`held[0]`) is among the `keep` smallest: bottom-k sampling."""
    if held[0].numel() <= keep:
        return held
    order = held[0].argsort()[:keep]
    return [x[order] for x in held]




def args_barrier(args: TrainingArguments) -> None:
    if args.world_size > 1 and torch.distributed.is_initialized():
        torch.distributed.barrier()
