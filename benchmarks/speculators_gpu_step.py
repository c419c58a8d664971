"""speculators 0.9.0's training step at the seed recipe's shapes, as it ships on a GPU: `make gpu-check`'s part 4.

    python -m benchmarks.speculators_gpu_step --json OUT [--steps 5] [--warmup 3]    # a Python where speculators imports
    python -m benchmarks.speculators_gpu_step --cpu-smoke --json OUT                 # tiny shapes, CPU, fp32

Runs in a Python where `import speculators` works: `.venv-speculators` here, or the GPU machine's own Python with
the wheels `make gpu-wheels` downloads installed beside it (that machine has no network).

What it builds, through speculators' own command-line path (`TrainConfig.resolve`, `parse_vocab_mappings`,
`build_draft_model`, `get_trainer_kwargs`, `build_optimizers`), from files this script writes first:

* a verifier folder: google/gemma-4-E4B-it's config (`scripts/seed_checkpoint.gemma4_e4b_config`, the same one
  `benchmarks.gpu_step` builds our drafter for) and a `model.safetensors` holding only what speculators reads from
  a verifier (its embedding, tied to the output head as Gemma 4's is, and the final norm), random, bf16;
* `--draft-config`: our `DSparkConfig.from_verifier` for configs/gemma-4-E4B-it.yaml (4 Qwen3-style layers, 3
  sliding with window 2048 + 1 full, 32 heads of 128 over 8 KV heads, MLP 8192), so both packages train the
  same decoder; speculators' own derivation from the verifier would pick Gemma's 8 heads of 256;
* d2t / t2d for a random 32,000-token draft vocabulary (the same ids `benchmarks.gpu_step` draws).

The command line is the seed recipe's (block 8, Markov rank 256, aux layers 2/10/20/30/40, 512 anchors, loss
0.1 CE + 0.9 TV) with everything else speculators' default: flex attention (`simple_flex_attention`) and its fused
Triton loss on a GPU, its Muon (torch's, bf16 Newton-Schulz) + AdamW. The step is its Trainer's: the batch under
`torch.autocast(cuda, bfloat16)` with fp32 master weights, zero_grad, backward, clip to 1.0, every optimizer's
step. One packed row of T = 4096 tokens, one document whose first 512 tokens are unsupervised, random bf16 states
(as `benchmarks.gpu_step`; speculators draws its own 512 anchors with `select_anchors`).

The CPU smoke (`--cpu-smoke`) runs the same path at `benchmarks.gpu_step.SMOKE`'s shapes in fp32 with sdpa and the
eager loss (flex attention's backward and Triton need a GPU), Newton-Schulz in float32, to check the script.
Writes one JSON: step times (median), each step's regions (its model call, which returns the loss; backward;
clipping; optimizer) in host and, on CUDA, device time, as `benchmarks.gpu_step` times ours, tokens/s, peak CUDA
memory, FLOPs of one extra step (FlopCounterMode; its failure under the compiled path is recorded, not fatal) and the
losses.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # this package is not installed beside speculators
    sys.path.insert(0, str(ROOT))

from benchmarks.common import (  # noqa: E402
    LOSS_WEIGHTS,
    BenchmarkError,
    fail,
    write_json,
    write_speculators_vocab_mapping,
)
from trainer.errors import Parser, run_cli  # noqa: E402

RECIPE = ROOT / "configs" / "gemma-4-E4B-it.yaml"


def write_inputs(directory: Path, smoke: bool) -> dict:
    """The verifier folder, the draft decoder's config and the vocabulary mappings speculators' CLI reads."""
    import torch
    from safetensors.torch import save_file

    from benchmarks.gpu_step import CONTEXT_TOKENS, PROMPT_TOKENS, SMOKE, verifier_config
    from configuration_dspark import DSparkConfig
    from trainer.config import RunConfig

    run = RunConfig.load(str(RECIPE))
    vcfg = verifier_config(smoke)
    text = vcfg.get_text_config()
    verifier = directory / "verifier"
    verifier.mkdir(parents=True, exist_ok=True)
    vcfg.save_pretrained(str(verifier))
    dtype = torch.float32 if smoke else torch.bfloat16
    g = torch.Generator().manual_seed(0)
    embedding = (torch.randn(text.vocab_size, text.hidden_size, generator=g) * (2.0 / math.sqrt(text.hidden_size)))
    # Gemma 4's own key names, so speculators finds them as it would in the real checkpoint.
    save_file({"model.language_model.embed_tokens.weight": embedding.to(dtype),
               "model.language_model.norm.weight": torch.ones(text.hidden_size, dtype=dtype)},
              str(verifier / "model.safetensors"))
    del embedding

    overrides = dict(SMOKE["drafter"]) if smoke else run.model.architecture_overrides()
    ours = DSparkConfig.from_verifier(vcfg, verifier_name_or_path=str(verifier), **overrides)
    draft_config = directory / "draft_config.json"
    layer = ours.transformer_layer_config
    draft_config.write_text(json.dumps(layer if isinstance(layer, dict) else layer.to_dict(), indent=1))

    draft_vocab = ours.draft_vocab_size
    ids = torch.randperm(text.vocab_size, generator=torch.Generator().manual_seed(0))[:draft_vocab].sort().values
    write_speculators_vocab_mapping(directory, ids, text.vocab_size)
    return {"verifier": str(verifier), "draft_config": str(draft_config), "draft_vocab_size": draft_vocab,
            "block_size": ours.block_size, "markov_rank": ours.markov_rank, "mask_token_id": ours.mask_token_id,
            "aux_hidden_state_layer_ids": list(ours.aux_hidden_state_layer_ids),
            "max_anchors": SMOKE["max_anchors"] if smoke else run.train.max_anchors,
            "tokens": SMOKE["tokens"] if smoke else CONTEXT_TOKENS,
            "prompt": SMOKE["prompt"] if smoke else PROMPT_TOKENS,
            "vocab": text.vocab_size, "hidden": text.hidden_size}


def speculators_argv(directory: Path, shape: dict, smoke: bool, loss_implementation: str | None = None) -> list[str]:
    """The `speculators train` command line: the seed recipe's shape, speculators' defaults for the rest (on the
    CPU smoke: sdpa and the eager loss, which run without a GPU); `loss_implementation` overrides its loss."""
    argv = ["--speculator-type", "dspark", "--verifier-name-or-path", shape["verifier"],
            "--draft-config", shape["draft_config"],
            "--target-layer-ids", *[str(i) for i in shape["aux_hidden_state_layer_ids"]],
            "--block-size", str(shape["block_size"]), "--markov-rank", str(shape["markov_rank"]),
            "--draft-vocab-size", str(shape["draft_vocab_size"]), "--max-anchors", str(shape["max_anchors"]),
            "--d2t-path", str(directory / "d2t.npy"), "--t2d-path", str(directory / "t2d.npy"),
            "--loss-fn", json.dumps(LOSS_WEIGHTS), "--total-seq-len", str(shape["tokens"]),
            "--data-path", str(directory), "--save-path", str(directory / "save")]
    if shape["mask_token_id"] is not None:  # the folder holds no tokenizer to resolve it from, as ours resolves it
        argv += ["--mask-token-id", str(shape["mask_token_id"])]
    if smoke:
        argv += ["--draft-attn-impl", "sdpa"]
    if smoke or loss_implementation:
        argv += ["--loss-implementation", loss_implementation or "eager"]
    return argv


def synthetic_batch(shape: dict, aux_size: int, device, dtype) -> dict:
    """One packed row of `tokens`, one document, its first `prompt` tokens unsupervised; random ids and states."""
    import torch

    g = torch.Generator().manual_seed(0)
    tokens, hidden = shape["tokens"], shape["hidden"]
    loss_mask = torch.ones(1, tokens, dtype=torch.long)
    loss_mask[:, :shape["prompt"]] = 0
    batch = {"input_ids": torch.randint(0, shape["vocab"], (1, tokens), generator=g), "loss_mask": loss_mask,
             "document_ids": torch.zeros(1, tokens, dtype=torch.long),
             "position_ids": torch.arange(tokens)[None],
             "hidden_states": torch.randn(1, tokens, aux_size, generator=g).to(dtype),
             "verifier_last_hidden_states": (torch.randn(1, tokens, hidden, generator=g) * 3.0).to(dtype)}
    return {k: v.to(device) for k, v in batch.items()}


def run(smoke: bool, steps: int, warmup: int, flops: bool, loss_implementation: str | None = None) -> dict:
    import contextlib

    import speculators
    import torch
    from speculators.train.optimizers import build_optimizers

    from benchmarks.gpu_step import RegionClock, region_medians
    from benchmarks.speculators_recipe import build_from_argv, speculators_trainer_config

    if not smoke and not torch.cuda.is_available():
        raise BenchmarkError("no CUDA device: this measures speculators' GPU step; pass --cpu-smoke to check the "
                             "script on tiny CPU shapes.")
    device = torch.device("cpu" if smoke else "cuda")
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="speculators-gpu-step-") as tmp:
        directory = Path(tmp)
        print("writing the verifier folder, draft config and vocabulary mappings ...", flush=True)
        shape = write_inputs(directory, smoke)
        argv = speculators_argv(directory, shape, smoke, loss_implementation)
        print("building speculators' DSparkDraftModel ...", flush=True)
        args, model, train_kwargs = build_from_argv(argv)
        model.to(device)
        trainer_config = speculators_trainer_config(args, train_kwargs)
        if smoke:  # bf16 Newton-Schulz is emulated, and catastrophically slow, on CPUs without bf16 matmuls
            from benchmarks.speculators_step import float32_newton_schulz

            float32_newton_schulz()
        optimizers = build_optimizers(model, trainer_config)
    # the aux states' width is what speculators' input projection takes (aux layers x verifier hidden)
    batch = synthetic_batch(shape, model.fc.in_features, device, torch.float32 if smoke else torch.bfloat16)
    autocast = contextlib.nullcontext if smoke else (lambda: torch.autocast("cuda", dtype=torch.bfloat16))
    params = list(model.parameters())
    losses: list[float] = []
    region_s: list[dict[str, float]] = []
    region_gpu_s: list[dict[str, float]] = []
    # Our step's regions where speculators has them: its forward returns the loss (anchors, forward and loss are
    # one call), so that is one region here.
    names = ("forward and loss", "backward", "clip", "optimizer")

    def step() -> None:
        clock = RegionClock(names, device.type == "cuda")
        mark = clock.mark

        mark()
        with autocast():
            _, loss, _metrics = model(**batch, **train_kwargs)
        for opt in optimizers:
            opt.zero_grad()
        mark()
        loss.backward()
        mark()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        mark()
        for opt in optimizers:
            opt.step()
        mark()
        losses.append(float(loss.detach()))  # synchronises: every event above has completed
        host, gpu = clock.seconds()
        region_s.append(host)
        if gpu is not None:
            region_gpu_s.append(gpu)

    def timed(n: int) -> list[float]:
        """Seconds of each of `n` steps, the device synchronised around each."""
        seconds = []
        for _ in range(n):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            step()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            seconds.append(time.perf_counter() - t0)
        return seconds

    print(f"warm-up: {warmup} steps (flex attention and torch.compile build here) ...", flush=True)
    warm = timed(warmup)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    print(f"timing: {steps} steps ...", flush=True)
    times = timed(steps)
    regions = {"host_s": region_medians(region_s[-steps:]), "gpu_s": region_medians(region_gpu_s[-steps:])}
    memory = {}
    if device.type == "cuda":
        memory = {"peak_allocated_bytes": torch.cuda.max_memory_allocated(device),
                  "peak_reserved_bytes": torch.cuda.max_memory_reserved(device)}
    counted = None
    if flops:
        from torch.utils.flop_counter import FlopCounterMode

        try:
            with FlopCounterMode(display=False) as counter:
                step()
            counted = {"total": int(counter.get_total_flops())}
        except Exception as e:  # noqa: BLE001 - recorded: the compiled flex path may not be countable
            counted = {"failed": f"{type(e).__name__}: {str(e)[:200]}"}
    median = statistics.median(times)
    finite = all(math.isfinite(v) for v in losses)
    result = {
        "impl": "speculators", "smoke": smoke, "speculators_version": getattr(speculators, "__version__", None),
        "torch": torch.__version__, "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "argv": ["speculators", "train", *[a if not a.startswith(tmp) else "<tmp>" + a[len(tmp):] for a in argv]],
        "shape": {k: v for k, v in shape.items() if k not in ("verifier", "draft_config")},
        "attention": model.config.transformer_layer_config._attn_implementation,
        "loss_implementation": args.loss_implementation,
        "precision": "fp32 (CPU smoke)" if smoke else "fp32 master weights + torch.autocast(cuda, bfloat16)",
        "optimizers": [type(o).__name__ for o in optimizers],
        "warmup_s": warm, "step_s": times, "step_median_s": median, "context_tokens_per_s": shape["tokens"] / median,
        "regions": regions,
        "memory": memory, "flops": counted, "losses": losses, "losses_finite": finite,
        "seconds": time.time() - started,
    }
    if not finite:
        result["failed"] = "speculators' step produced a non-finite loss"
    return result


def main(argv=None) -> None:
    parser = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny fp32/sdpa/eager shapes on the CPU")
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=5, help="timed steps (median reported)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (compilation happens here)")
    parser.add_argument("--no-flops", action="store_true", help="skip the FLOP count of one extra step")
    parser.add_argument("--loss-implementation", choices=["fused", "eager"], default=None,
                        help="speculators' loss (default: as it ships, fused Triton on a GPU; eager on the CPU smoke)")
    args = parser.parse_args(argv)
    try:
        if args.warmup < 0 or args.steps < 1:
            raise BenchmarkError(f"--steps {args.steps} / --warmup {args.warmup} is out of range; pass --steps >= 1 "
                                 f"and --warmup >= 0.")
        try:
            import speculators  # noqa: F401
        except ImportError as e:
            raise BenchmarkError(f"speculators does not import in this Python ({e}); run this with "
                                 f".venv-speculators/bin/python, or install `make gpu-wheels`' wheels first on a "
                                 f"machine without network.") from None
        result = run(args.cpu_smoke, args.steps, args.warmup, not args.no_flops, args.loss_implementation)
        write_json(args.json, result)
        print(f"speculators step: median {result['step_median_s']:.4g} s, losses finite: {result['losses_finite']}",
              flush=True)
        if "failed" in result:
            raise BenchmarkError(result["failed"])
    except BenchmarkError as e:
        fail(str(e))


if __name__ == "__main__":
    sys.exit(run_cli(main))
