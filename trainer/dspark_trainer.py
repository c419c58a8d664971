"""`DSparkTrainer`: a `transformers.Trainer` whose step is the DSpark objective.

One training step (`compute_loss`):

    states  = source.states(batch)                       trainer/hidden_states.py  (frozen verifier, no grad)
    anchors = sample_anchors(loss_mask, document_ids)    trainer/objective.py      (fresh every step)
    out     = model(input_ids, states.aux, anchors, ...) modeling_dspark.py        (drafter forward)
    loss    = dspark_loss(drafter, out, ..., teacher)    trainer/objective.py      (chunked CE/TV + confidence)

Evaluation returns the teacher-forced acceptance metrics (`eval_accept_len`, `eval_accept_rate`,
`eval_pos_k`, calibration), reduced as sums across batches and processes; the best checkpoint is the one
with the highest `eval_accept_len`. Every checkpoint directory is a servable drafter (config.json,
model.safetensors, the remote-code files) plus the Trainer's state, `dspark_run_config.yaml` and
`dspark_data_stats.json`; a
`dspark_checkpoint.json` marker, written last, says it is complete. The verifier is never saved.
"""

import json
import os
import shutil
import time

import torch
from transformers import Trainer
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from modeling_dspark import DSparkDraftModel
from trainer.hidden_states import CachedStates, HiddenStateSource
from trainer.objective import ObjectiveConfig, dspark_loss, reduce_stats, sample_anchors, stat_names

COMPLETE_MARKER = "dspark_checkpoint.json"
DATA_STATS_FILE = "dspark_data_stats.json"  # what the training data held (for reproducibility and the model card)
ADAPTER_DIR = "adapter"
SHAPE_KEYS = ("block_size", "draft_vocab_size", "aux_hidden_state_layer_ids", "markov_rank",
              "enable_confidence_head", "confidence_head_with_markov", "mask_token_id")
LAYER_SHAPE_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                    "num_key_value_heads", "head_dim", "vocab_size", "layer_types", "sliding_window")


class DSparkTrainer(Trainer):
    def __init__(self, *args, source: HiddenStateSource, objective: ObjectiveConfig, run_config=None,
                 data_stats: dict | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.source = source
        cache_bytes = int((run_config.train.cache_verifier_states_gb if run_config else 0) * 2**30)
        self.train_source = CachedStates(source, cache_bytes) if cache_bytes else source
        self.eval_source = CachedStates(source, cache_bytes) if cache_bytes else source
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
        states = (self.train_source if model.training else self.eval_source).states(inputs)
        device = inputs["input_ids"].device
        anchors = sample_anchors(inputs["loss_mask"], inputs["document_ids"], self.objective.max_anchors,
                                 generator=None if model.training else self._eval_generator)
        outputs = model(
            input_ids=inputs["input_ids"],
            aux_hidden_states=states.aux_hidden_states.to(device),
            anchor_positions=anchors,
            document_ids=inputs["document_ids"],
            position_ids=inputs["position_ids"],
            return_logits=False,
        )
        loss, stats = dspark_loss(
            self.drafter(model), outputs, inputs["input_ids"], inputs["loss_mask"], inputs["document_ids"], anchors,
            states.last_hidden_state.to(device), self.source.teacher(), self.objective,
        )
        if model.training:
            self._check_finite(loss, inputs)
            self._train_stats = stats if self._train_stats is None else self._train_stats + stats
            self._record_batch(inputs)
        return (loss, stats) if return_outputs else loss

    def _check_finite(self, loss: torch.Tensor, inputs) -> None:
        if torch.isfinite(loss).item():
            return
        last = latest_checkpoint(self.args.output_dir)
        raise FloatingPointError(
            f"non-finite loss ({loss.item()}) at step {self.state.global_step + 1} on packed rows "
            f"{inputs['row_index'].tolist()}; training stopped before the update, so the last good checkpoint "
            f"({last or 'none saved yet'}) is intact: lower the learning rate or inspect those rows, then resume."
        )

    def _record_batch(self, inputs) -> None:
        if not (self.run_config and self.run_config.train.record_batches):
            return
        if self._batch_log is None:
            os.makedirs(self.args.output_dir, exist_ok=True)
            path = os.path.join(self.args.output_dir, f"batches-rank{self.args.process_index}.jsonl")
            self._batch_log = open(path, "a")
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
            logs.update({k: round(metrics[k], 4) for k in ("accept_len", "accept_rate", "greedy_accept_len")})
            self._train_stats = None
        super().log(logs, start_time)

    # ------------------------------------------------------------------------------------------ checkpoints
    def _save(self, output_dir: str | None = None, state_dict=None) -> None:
        """Write a servable drafter: LoRA adapters merged, never the verifier, plus the run config."""
        output_dir = output_dir or self.args.output_dir
        os.makedirs(output_dir, exist_ok=True)
        model = self.accelerator.unwrap_model(self.model)
        if hasattr(model, "get_base_model"):  # PEFT: save merged weights to serve, the adapter to resume
            from trainer.adapters import merged_state_dict

            model.save_pretrained(os.path.join(output_dir, ADAPTER_DIR))
            state_dict = merged_state_dict(model)
            model = model.get_base_model()
        if state_dict is not None:
            state_dict = {k: v for k, v in state_dict.items() if not k.startswith("verifier")}
        model.save_pretrained(output_dir, state_dict=state_dict)
        if self.run_config is not None:
            self.run_config.save(output_dir)
        if self.data_stats is not None:
            with open(os.path.join(output_dir, DATA_STATS_FILE), "w") as f:
                json.dump(self.data_stats, f, indent=2)
        torch.save(self.args, os.path.join(output_dir, "training_args.bin"))

    def _save_checkpoint(self, model, trial) -> None:
        super()._save_checkpoint(model, trial)
        if not self.args.should_save:
            return
        directory = os.path.join(self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        mark_complete(directory, self.state.global_step)
        self.update_best_link()

    def update_best_link(self) -> None:
        """`<output_dir>/checkpoint-best` points at the checkpoint with the highest validation accept_len."""
        best = self.state.best_model_checkpoint
        if not (self.args.should_save and best and os.path.isdir(best)):
            return
        link = os.path.join(self.args.output_dir, "checkpoint-best")
        tmp = f"{link}.tmp"
        if os.path.lexists(tmp):
            os.remove(tmp)
        os.symlink(os.path.basename(os.path.normpath(best)), tmp)
        os.replace(tmp, link)

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        model = model if model is not None else self.model
        unwrapped = self.accelerator.unwrap_model(model)
        if hasattr(unwrapped, "get_base_model"):
            adapter = os.path.join(resume_from_checkpoint, ADAPTER_DIR)
            if not os.path.isdir(adapter):
                raise ValueError(f"{resume_from_checkpoint} has no LoRA adapter to resume from; resume a LoRA run "
                                 f"from one of its own checkpoints.")
            unwrapped.load_adapter(adapter, adapter_name="default", is_trainable=True)
            return
        super()._load_from_checkpoint(resume_from_checkpoint, model)


# ------------------------------------------------------------------------------------------ checkpoint helpers
def mark_complete(directory: str, step: int) -> None:
    """Write the completion marker last and atomically: a checkpoint without it was interrupted mid-save."""
    path = os.path.join(directory, COMPLETE_MARKER)
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump({"step": step, "complete": True, "time": time.time()}, f)
    os.replace(tmp, path)


def is_complete(directory: str) -> bool:
    return os.path.isfile(os.path.join(directory, COMPLETE_MARKER))


def checkpoints(output_dir: str) -> list[str]:
    """`checkpoint-N` directories in step order."""
    if not os.path.isdir(output_dir):
        return []
    found = []
    for name in os.listdir(output_dir):
        path = os.path.join(output_dir, name)
        if name.startswith(f"{PREFIX_CHECKPOINT_DIR}-") and name.split("-")[-1].isdigit() and os.path.isdir(path) \
                and not os.path.islink(path):
            found.append(path)
    return sorted(found, key=lambda p: int(p.rsplit("-", 1)[-1]))


def latest_checkpoint(output_dir: str) -> str | None:
    """The newest *complete* checkpoint; interrupted saves are moved aside (renamed `incomplete-checkpoint-N`)
    so neither resuming nor the Trainer's rotation picks them up."""
    latest = None
    for path in checkpoints(output_dir):
        if is_complete(path):
            latest = path
    return latest


def quarantine_incomplete(output_dir: str) -> list[str]:
    moved = []
    for path in checkpoints(output_dir):
        if not is_complete(path):
            target = os.path.join(output_dir, "incomplete-" + os.path.basename(path))
            shutil.rmtree(target, ignore_errors=True)
            os.replace(path, target)
            moved.append(target)
    return moved


def check_resume_compatible(checkpoint: str, config) -> None:
    """Refuse to resume into a drafter whose shape differs from the checkpoint's, naming the fields."""
    with open(os.path.join(checkpoint, "config.json")) as f:
        saved = json.load(f)
    current = config.to_dict()
    diffs = [f"{k}: {saved.get(k)} -> {current.get(k)}" for k in SHAPE_KEYS if saved.get(k) != current.get(k)]
    s_layer, c_layer = saved.get("transformer_layer_config", {}), current["transformer_layer_config"]
    diffs += [f"{k}: {s_layer.get(k)} -> {c_layer.get(k)}" for k in LAYER_SHAPE_KEYS if s_layer.get(k) != c_layer.get(k)]
    if diffs:
        raise ValueError(
            f"cannot resume from {checkpoint}: the model shape changed ({'; '.join(diffs)}); resume with the "
            f"checkpoint's model settings or start a new output_dir."
        )
