"""Training-step benchmark, speculators 0.9.0's side (runs in `.venv-speculators`); see `benchmarks/train_step.py`.

    .venv-speculators/bin/python -m benchmarks.speculators_step --config small|large --inputs DIR --json OUT

Same inputs and weights as `benchmarks.train_step run`: the drafter folder is loaded with
`SpeculatorModel.from_pretrained` (fp32; its frozen embedding, output head and verifier norm come from the saved
verifier folder), run with sdpa attention and dense masks (speculators' default flex path compiles, and needs a
GPU for backward), eager losses from `DSparkDraftModel.get_trainer_kwargs(loss_fn='{"ce": 0.1, "tv": 0.9}',
loss_implementation="eager", max_anchors=N)`, and the same explicit anchors (`select_anchors` is replaced for the
run). The optimizers are routed as speculators' own trainer routes them (`speculators.train.optimizers`:
`split_named_params_for_muon`, then `torch.optim.Muon` and a one-group AdamW), except that torch's Muon runs
its Newton-Schulz in float32 instead of bf16 (catastrophically slow on a CPU without bf16 matmuls): the same
fp32 treatment our CPU runs get, without this package's stacking and Gram-matrix form; the same learning rate,
momentum and weight decays as our run; the gradient norm is clipped to 1.0 as speculators' trainer does. Same timing split and JSON fields.
"""

import argparse
import json
import sys
import time
from pathlib import Path

# This package's root (for `benchmarks.common` and `trainer.train.optim`), which is not installed in .venv-speculators.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import LOSS_WEIGHTS, BenchmarkError, fail, machine, train_steps, write_json  # noqa: E402
from benchmarks.train_step import (  # noqa: E402
    LEARNING_RATE,
    MAX_GRAD_NORM,
    MUON_MOMENTUM,
    MUON_WEIGHT_DECAY,
    WEIGHT_DECAY,
    load_inputs,
    read_meta,
)
from trainer.errors import Parser, run_cli  # noqa: E402


def float32_newton_schulz() -> None:
    """torch's Muon runs its Newton-Schulz in bf16, catastrophically slow on a CPU without bf16 matmuls: the same
    iteration in float32 (torch's per-matrix iteration line for line, `trainer.train.optim.zeropower_via_newton_schulz`),
    for this process only (a fresh one per run). Used by this benchmark and by `benchmarks.speculators_recipe`."""
    import torch
    import torch.optim._muon as torch_muon

    from trainer.train.optim import zeropower_via_newton_schulz

    def newton_schulz_fp32(grad, ns_coefficients, ns_steps, eps):
        return zeropower_via_newton_schulz(grad, ns_coefficients, ns_steps, eps, torch.float32)

    torch_muon._zeropower_via_newtonschulz = newton_schulz_fp32


def build_optimizers(model):
    """speculators' routing (`build_optimizers(model, config)` with `optimizer="muon"`): torch's own `Muon`, with
    its Newton-Schulz run in float32 instead of bf16 (the fp32 treatment our CPU runs get, and nothing more: one
    matrix at a time, torch's iteration line for line, `trainer.train.optim.zeropower_via_newton_schulz`), and torch's
    default AdamW."""
    import torch
    from speculators.train.optimizers import split_named_params_for_muon

    float32_newton_schulz()
    muon_params, adamw_params = split_named_params_for_muon(model)
    optimizers = []
    if muon_params:
        optimizers.append(torch.optim.Muon(muon_params, lr=LEARNING_RATE, momentum=MUON_MOMENTUM,
                                           weight_decay=MUON_WEIGHT_DECAY, ns_steps=5, adjust_lr_fn="match_rms_adamw"))
    if adamw_params:
        optimizers.append(torch.optim.AdamW(adamw_params, lr=LEARNING_RATE, weight_decay=WEIGHT_DECAY))
    return optimizers, [n for n, _ in muon_params]


def run(config: str, inputs: Path, json_out: Path, warmup: int, steps: int, flops: bool) -> dict:
    import speculators
    import torch
    from speculators import SpeculatorModel
    from speculators.models.dflash import core as dflash_core
    from torch.nn.attention.flex_attention import create_mask

    start = time.perf_counter()
    meta, t = load_inputs(inputs, config)
    c = meta["configs"][config]
    model = SpeculatorModel.from_pretrained(str(inputs / "drafter")).float()
    # dense sdpa masks, as tests/speculators_crosscheck.py runs it
    model.config.transformer_layer_config._attn_implementation = "sdpa"
    model._attn_impl, model._create_mask_fn = "sdpa", create_mask
    model.train()
    anchors = t["anchors"]
    valid = torch.ones_like(anchors, dtype=torch.bool)
    if anchors.numel() != c["anchors"]:
        raise BenchmarkError(f"{config} inputs hold {anchors.numel()} anchors, meta says {c['anchors']}.")
    dflash_core.select_anchors = lambda loss_mask, n, block: (anchors.clone(), valid.clone())
    train_kwargs, _ = type(model).get_trainer_kwargs(loss_fn=json.dumps(LOSS_WEIGHTS), loss_implementation="eager",
                                                     max_anchors=anchors.numel())
    optimizers, muon_names = build_optimizers(model)
    params = list(model.parameters())
    block = model.block_size
    supervised = int(t["loss_mask"][0, (anchors[:, None] + torch.arange(block)).flatten()].sum())
    batch = {"hidden_states": t["aux_hidden_states"], "input_ids": t["input_ids"], "loss_mask": t["loss_mask"],
             "verifier_last_hidden_states": t["last_hidden_state"], "document_ids": t["document_ids"],
             "position_ids": t["position_ids"]}
    load_s = time.perf_counter() - start

    def forward():
        _, loss, _metrics = model(**batch, **train_kwargs)
        return loss

    def backward(loss):
        loss.backward()

    def optimizer_step():
        torch.nn.utils.clip_grad_norm_(params, MAX_GRAD_NORM)
        for opt in optimizers:
            opt.step()
        for opt in optimizers:
            opt.zero_grad(set_to_none=True)

    report = train_steps(forward, backward, optimizer_step, warmup=warmup, steps=steps, flops=flops)
    result = {
        "impl": "speculators", "config": config, "quick": meta["quick"], "inputs": c, "supervised_slots": supervised,
        "objective": {"loss_fn": LOSS_WEIGHTS, "loss_implementation": "eager", "max_anchors": anchors.numel(),
                      "gamma": train_kwargs["gamma"], "confidence_head_alpha": train_kwargs["confidence_head_alpha"],
                      "attention": "sdpa (dense masks)"},
        "warnings": [], "load_s": load_s,
        "optimizer": {"muon": "torch.optim.Muon with float32 Newton-Schulz (torch's per-matrix iteration)",
                      "routing": "speculators.train.optimizers.split_named_params_for_muon",
                      "lr": LEARNING_RATE, "weight_decay": WEIGHT_DECAY, "muon_weight_decay": MUON_WEIGHT_DECAY,
                      "momentum": MUON_MOMENTUM, "max_grad_norm": MAX_GRAD_NORM, "muon_params": len(muon_names),
                      "adamw": "one group, torch defaults otherwise (betas 0.9/0.999), as speculators builds it"},
        "speculators_version": getattr(speculators, "__version__", None),
        "machine": machine(), **report,
    }
    write_json(json_out, result)
    print(f"speculators {config}: first-step loss {result['loss_first_step']:.9g}, median step "
          f"{result['total_s']['median']:.3f} s", flush=True)
    return result


def main(argv=None) -> None:
    parser = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, choices=["small", "large"])
    parser.add_argument("--inputs", type=Path, required=True)
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--no-flops", action="store_true", help="skip the FLOP count of one extra step")
    args = parser.parse_args(argv)
    try:
        if args.warmup < 1 or args.steps < 1:
            raise BenchmarkError("--warmup and --steps must be at least 1.")
        read_meta(args.inputs)  # bad input is named first, in whichever python this runs
        try:
            import speculators  # noqa: F401
        except ImportError:
            raise BenchmarkError("speculators is not installed in this Python; run this script with "
                                 ".venv-speculators/bin/python (create it with `make speculators-env`).") from None
        run(args.config, args.inputs, args.json, args.warmup, args.steps, not args.no_flops)
    except BenchmarkError as e:
        fail(str(e))


if __name__ == "__main__":
    sys.exit(run_cli(main))
