"""The recipe benchmark, speculators 0.9.0's side (runs in `.venv-speculators`); see `benchmarks/recipe.py`.

    .venv-speculators/bin/python -m benchmarks.speculators_recipe --work DIR --verifier DIR --steps N --seed S --out DIR

Trains speculators' own DSpark drafter with speculators' own defaults for everything the recipe benchmark leaves
to each package, on the rows and verifier states that `benchmarks.recipe` prepared for both sides:

* the configuration is resolved by speculators' own `TrainConfig.resolve` from the command line a user would
  type (`speculators train --speculator-type dspark ...`), with only the shared settings given: the verifier, the
  drafter's shape (layers, aux layers, block size, Markov rank), the draft vocabulary (`--d2t-path/--t2d-path`,
  the one `benchmarks.recipe` chose from the training split), the row length, the step count and the seed;
* the model is built by speculators' `build_draft_model` (its initialisation, mask token, `sample_from_anchor`),
  the loss terms by `get_trainer_kwargs` (its default `kl_div`, fixed-exp-decay gamma 4, confidence weight 1,
  512 anchors per row), the optimizers by `speculators.train.optimizers.build_optimizers` (Muon for hidden
  matrices, AdamW for the rest, lr 1e-3, its weight decays) and the schedule as its Trainer builds it (linear,
  1% warm-up, over `--max-steps`);
* each step is its Trainer's step: forward with the train kwargs, zero_grad, backward, gradient norm clipped to
  1.0, every optimizer, every scheduler.

What differs from `speculators train`, because it cannot run on this CPU or would change what is compared (each
listed in benchmarks/RESULTS.md): rows and states come from `rows.safetensors` and the shared offline cache instead
of its data loader (the same packed rows our run trains on, in an order shuffled per epoch with `--seed`); fp32
throughout instead of bf16 autocast; sdpa attention instead of flex (`--draft-attn-impl sdpa`, which speculators
offers); the eager loss instead of its fused Triton one (`--loss-implementation eager`, offered too); Muon's
Newton-Schulz in float32 instead of bf16 (`benchmarks.speculators_step.build_optimizers` does the same); no
per-epoch validation (its default keeps the last checkpoint, not the best, so validation changes nothing saved).
The drafter is saved with speculators' own `save_pretrained` into `OUT/drafter`, and `OUT/result.json` records
the losses, the step times and the resolved configuration.
"""

import argparse
import json
import sys
import time
from pathlib import Path

# This package's root (for `trainer.states.offline_cache`), which is not installed in .venv-speculators.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import BenchmarkError, fail, machine, write_json  # noqa: E402
from benchmarks.speculators_step import float32_newton_schulz  # noqa: E402
from trainer.errors import Parser, run_cli  # noqa: E402


def speculators_argv(work: Path, verifier: str, shape: dict, steps: int, seed: int, out: Path) -> list[str]:
    """The `speculators train` command line of this run: the shared settings only, the rest its defaults."""
    return ["--speculator-type", "dspark", "--verifier-name-or-path", verifier,
            "--num-layers", str(shape["num_hidden_layers"]),
            "--target-layer-ids", *[str(i) for i in shape["aux_hidden_state_layer_ids"]],
            "--block-size", str(shape["block_size"]), "--markov-rank", str(shape["markov_rank"]),
            "--draft-vocab-size", str(shape["draft_vocab_size"]),
            "--d2t-path", str(work / "data" / "d2t.npy"), "--t2d-path", str(work / "data" / "t2d.npy"),
            "--total-seq-len", str(shape["total_seq_length"]), "--max-steps", str(steps), "--seed", str(seed),
            "--draft-attn-impl", "sdpa", "--loss-implementation", "eager",
            "--data-path", str(work / "data"), "--save-path", str(out / "save")]


def build_from_argv(argv: list[str]):
    """What `speculators train argv` builds before its Trainer: the resolved arguments, the DSpark draft model (fp32,
    in training mode, seeded by its `--seed`) and the keyword arguments its Trainer calls the model with."""
    from speculators.model import SpeculatorModel
    from speculators.train.cli import build_draft_model, parse_vocab_mappings, set_seed
    from speculators.train.config.schema import TrainConfig

    args = argparse.Namespace(**TrainConfig.resolve(argv).flatten())
    set_seed(args.seed)
    d2t, t2d, draft_vocab_size = parse_vocab_mappings(args)
    model_class = SpeculatorModel.registry["dspark"]
    model = build_draft_model(args, model_class, t2d, d2t, draft_vocab_size).float()
    model.train()
    train_kwargs, _ = model_class.get_trainer_kwargs(**vars(args))
    return args, model, train_kwargs


def speculators_trainer_config(args: argparse.Namespace, train_kwargs: dict):
    """speculators' `TrainerConfig` from its resolved command line, as its `train` entry point builds it (the
    optimizer and scheduler settings are what this and `benchmarks.speculators_gpu_step` read from it)."""
    from speculators.train.trainer import TrainerConfig

    return TrainerConfig(
        num_epochs=args.epochs, save_path=args.save_path, lr=args.lr, optimizer=args.optimizer,
        weight_decay=args.weight_decay, muon_lr=args.muon_lr, muon_momentum=args.muon_momentum,
        muon_weight_decay=args.muon_weight_decay, muon_ns_steps=args.muon_ns_steps,
        muon_adjust_lr_fn=args.muon_adjust_lr_fn, scheduler_type=args.scheduler_type,
        scheduler_warmup_steps=args.scheduler_warmup_steps, scheduler_warmup_ratio=args.scheduler_warmup_ratio,
        scheduler_total_steps=args.scheduler_total_steps, max_steps=args.max_steps,
        train_call_kwargs=train_kwargs, val_call_kwargs=train_kwargs)


def read_rows(path: Path) -> list[dict]:
    """The packed training rows `benchmarks.recipe` wrote: flat tensors cut at `offsets`."""
    from safetensors.torch import load_file

    flat = load_file(str(path))
    offsets = flat.pop("offsets").tolist()
    return [{k: v[a:b][None] for k, v in flat.items()} for a, b in zip(offsets[:-1], offsets[1:])]


def train(work: Path, verifier: str, steps: int, seed: int, out: Path) -> dict:
    process_started = time.perf_counter()
    import speculators
    import torch
    from speculators.train.optimizers import build_optimizers
    from speculators.train.trainer import _resolve_scheduler_steps
    from transformers import get_linear_schedule_with_warmup

    from trainer.states.offline_cache import OfflineCache

    shape = json.loads((work / "data" / "shape.json").read_text())
    argv = speculators_argv(work, verifier, shape, steps, seed, out)
    args, model, train_kwargs = build_from_argv(argv)
    if args.scheduler_type != "linear":
        raise BenchmarkError(f"speculators' default scheduler is now {args.scheduler_type!r}, which this runner does "
                             f"not build; update benchmarks/speculators_recipe.py.")
    trainer_config = speculators_trainer_config(args, train_kwargs)
    float32_newton_schulz()
    optimizers = build_optimizers(model, trainer_config)
    rows = read_rows(work / "data" / "rows.safetensors")
    warmup, total = _resolve_scheduler_steps(trainer_config, len(rows))
    schedulers = [get_linear_schedule_with_warmup(o, num_warmup_steps=warmup, num_training_steps=total)
                  for o in optimizers]
    cache = OfflineCache(str(work / "cache"), aux_layer_ids=list(shape["aux_hidden_state_layer_ids"]))

    order = torch.Generator().manual_seed(seed)
    losses, step_s = [], []
    started = time.perf_counter()
    queue: list[int] = []
    for step in range(steps):
        if not queue:  # a new epoch: every row once, shuffled
            queue = torch.randperm(len(rows), generator=order).tolist()
        row = rows[queue.pop(0)]
        t0 = time.perf_counter()
        states = cache.states(row)
        batch = {"hidden_states": states.aux_hidden_states, "input_ids": row["input_ids"],
                 "loss_mask": row["loss_mask"], "verifier_last_hidden_states": states.last_hidden_state,
                 "document_ids": row["document_ids"], "position_ids": row["position_ids"]}
        _, loss, _ = model(**batch, **train_kwargs)
        for opt in optimizers:
            opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        for opt in optimizers:
            opt.step()
        for scheduler in schedulers:
            scheduler.step()
        losses.append(float(loss.detach()))
        step_s.append(time.perf_counter() - t0)
        if not torch.isfinite(loss.detach()):
            raise BenchmarkError(f"speculators' loss is {losses[-1]} at step {step + 1}; the run diverged.")
        if (step + 1) % 10 == 0 or step + 1 == steps:
            print(f"step {step + 1}/{steps}: loss {losses[-1]:.4f}, {step_s[-1]:.2f} s/step", flush=True)
    train_s = time.perf_counter() - started
    model.save_pretrained(str(out / "drafter"))
    result = {"impl": "speculators", "speculators_version": getattr(speculators, "__version__", None),
              "argv": ["speculators", "train", *argv], "steps": steps, "seed": seed, "rows": len(rows),
              "loss_first": losses[0], "loss_last": losses[-1], "losses": losses, "train_s": train_s,
              "step_s_median": sorted(step_s)[len(step_s) // 2], "warmup_steps": warmup, "total_steps": total,
              "resolved": {k: getattr(args, k) for k in (
                  "loss_fn", "max_anchors", "dflash_decay_gamma", "per_position_loss_weight", "confidence_head_alpha",
                  "lr", "muon_lr", "weight_decay", "muon_weight_decay", "muon_momentum", "optimizer",
                  "scheduler_type", "mask_token_id", "hidden_states_dtype", "sliding_window")},
              "sample_from_anchor": bool(model.config.sample_from_anchor), "machine": machine(),
              "process_s": time.perf_counter() - process_started}
    write_json(out / "result.json", result)
    print(f"speculators: {steps} steps in {train_s:.1f} s, loss {losses[0]:.4f} -> {losses[-1]:.4f}", flush=True)
    return result


def main(argv=None) -> None:
    parser = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, required=True, help="the recipe benchmark's work directory")
    parser.add_argument("--verifier", required=True, help="the verifier's local folder")
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    try:
        if args.steps < 1:
            raise BenchmarkError("--steps must be at least 1.")
        for need in ("data/shape.json", "data/rows.safetensors", "data/d2t.npy", "cache"):
            if not (args.work / need).exists():
                raise BenchmarkError(f"{args.work / need} is missing; run `python -m benchmarks.recipe` (it prepares "
                                     f"the rows, the vocabulary and the cache first).")
        try:
            import speculators  # noqa: F401
        except ImportError:
            raise BenchmarkError("speculators is not installed in this Python; run this script with "
                                 ".venv-speculators/bin/python (create it with `make speculators-env`).") from None
        train(args.work, args.verifier, args.steps, args.seed, args.out)
    except BenchmarkError as e:
        fail(str(e))


if __name__ == "__main__":
    sys.exit(run_cli(main))
