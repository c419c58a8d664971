"""One training step of the seed recipe's drafter on a GPU: step time, tokens/s, peak CUDA memory and MFU.

    python -m benchmarks.gpu_step --json OUT [--steps 5] [--warmup 3] [--bf16-weights] [--attn flex_attention]
    python -m benchmarks.gpu_step --cpu-smoke [--json OUT]        # tiny fp32/sdpa shapes on the CPU
    python -m benchmarks.run --only gpu_step [--quick]             # --quick: 2 steps on a GPU, else the CPU smoke
    python -m benchmarks.gpu_step --json OUT --set confidence_target sampled_restricted --set full_vocab_metrics false
    python -m benchmarks.gpu_step --json OUT --profile --set compile_layers false   # + torch.profiler's table; eager layers

The drafter is configs/gemma-4-E4B-it.yaml's (read through `trainer.config.RunConfig`: hidden 2560, 4 Qwen3-style
layers (3 sliding with window 2048 + 1 full), V = 262,144, Vd = 32,000, block 8, Markov rank 256, confidence head,
aux layers [2, 10, 20, 30, 40]) for google/gemma-4-E4B-it's text config (scripts/seed_checkpoint.py; no
download), with random weights. The verifier is synthetic: its tied embedding/output head `[V, H]` in bf16 (what
`attach_verifier` shares; Gemma 4 ties them), its final norm and softcap 30; no verifier forward runs, its states
are random bf16 tensors, so the step is the drafter's alone: `sample_anchors` (512 anchors), the drafter's
`forward`, `dspark_loss` with the recipe's objective (`RunConfig.objective()`), backward, gradient clipping
(max_grad_norm) and our `MuonWithAdamW` (Muon with bf16 Newton-Schulz on CUDA, AdamW for the rest).

One packed row of T = 4096 tokens, one document whose first 512 tokens are the prompt (unsupervised).

Precision: by default fp32 master weights under `torch.autocast("cuda", bfloat16)`, which is what the HF Trainer
does with `bf16=True` (the recipe's `bf16: auto` on a GPU); `--bf16-weights` casts the drafter itself to bf16
instead (weights, gradients and optimizer state in bf16). Attention: flex attention (the trainer's GPU default).

FLOPs: `torch.utils.flop_counter.FlopCounterMode` over one extra step, optimizer included (matmuls and attention
only; elementwise work is not counted). Attention is counted dense (every query against every key, as the
counter's flex and sdpa formulas do); the mask-aware figure scales the attention FLOPs by the share of
(query, key) pairs the DSpark mask keeps. MFU = FLOPs per step / step time / the chip's dense bf16 peak from its data
sheet (`SPEC_PEAK`, by device name; none on the CPU smoke or an unknown chip).

Each region of the step (anchors, forward, loss, backward, clipping, optimizer) is timed twice, host seconds to issue
it and, on CUDA, device seconds between events around it (`regions` in the JSON): device time above host time means
the host ran ahead (kernels bound the region); the two about equal means the GPU kept pace with the host (launches or
a synchronisation bound it). The trainer's compilation applies as in training (`trainer/train/compilation.py`:
decoder layers compiled on a GPU unless `--set compile_layers false`; masks and the full-vocabulary reduction compiled
where they are built). `--profile` profiles one more step: torch.profiler's top-ops table, and one table per region
(`profile_regions`) of the operations that started in it, by the device time of what they launched, so a region's
time can be read down to its operations.

Without CUDA it is unavailable (one sentence; `benchmarks.run` skips it), unless `--cpu-smoke`, which runs the same code path on tiny
shapes in fp32 with sdpa (flex attention's CPU backward is not supported) to check everything but the device.
"""

from __future__ import annotations

import contextlib
import math
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

from benchmarks import common  # noqa: E402
from trainer.errors import UsageError  # noqa: E402
from trainer.train.compilation import compile_decoder_layers, compile_layers_enabled  # noqa: E402

NAME = "gpu_step"
REGION_LABEL = "dspark-region:"  # torch.profiler ranges around the step's regions
# benchmarks.run --quick: 1 warm-up and 2 timed steps on a GPU; on a machine without one, the CPU smoke
QUICK_ARGS = ["--quick"] if torch.cuda.is_available() else ["--quick", "--cpu-smoke"]
RECIPE = os.path.join(ROOT, "configs", "gemma-4-E4B-it.yaml")
# Dense bf16 tensor-core peaks from the vendors' data sheets (FLOP/s), matched against the device name in order.
SPEC_PEAK = [("H200", 989.4e12), ("H100 PCIe", 756.0e12), ("H100", 989.4e12), ("A100", 312.0e12),
             ("L40S", 362.1e12)]


def spec_peak(device_name: str) -> float | None:
    """The dense bf16 peak of the named chip, None when it is not in `SPEC_PEAK`."""
    for name, peak in SPEC_PEAK:
        if name in device_name:
            return peak
    return None
CONTEXT_TOKENS = 4096
PROMPT_TOKENS = 512
SMOKE = dict(tokens=128, prompt=16, max_anchors=16, vocab=1024, draft_vocab=256, hidden=64, layers=6,
             drafter=dict(num_hidden_layers=4, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                          head_dim=16, layer_types=["sliding_attention"] * 3 + ["full_attention"], sliding_window=24,
                          block_size=8, aux_hidden_state_layer_ids=[1, 2, 3, 4, 5], draft_vocab_size=256,
                          markov_rank=16, enable_confidence_head=True, confidence_head_with_markov=True))


# ------------------------------------------------------------------------------------------------ helpers
# ------------------------------------------------------------------------------------------------ models
def verifier_config(smoke: bool):
    """google/gemma-4-E4B-it's text stack as a config (scripts/seed_checkpoint.py), or a tiny Gemma 4 one."""
    if not smoke:
        scripts = os.path.join(ROOT, "scripts")
        if scripts not in sys.path:
            sys.path.insert(0, scripts)
        from seed_checkpoint import gemma4_e4b_config

        return gemma4_e4b_config()
    from transformers import Gemma4Config, Gemma4TextConfig

    layers = SMOKE["layers"]
    text = Gemma4TextConfig(
        vocab_size=SMOKE["vocab"], hidden_size=SMOKE["hidden"], intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, global_head_dim=16,
        vocab_size_per_layer_input=SMOKE["vocab"], hidden_size_per_layer_input=16, num_kv_shared_layers=2,
        sliding_window=16, layer_types=["sliding_attention", "sliding_attention", "full_attention"] * (layers // 3),
        final_logit_softcapping=30.0, max_position_embeddings=1024, pad_token_id=0, eos_token_id=1, bos_token_id=2)
    return Gemma4Config(text_config=text, vision_config=None, audio_config=None, tie_word_embeddings=True)


class SyntheticVerifier:
    """What a drafter and the loss read from the verifier, with random weights: the config, a decoder with
    `.layers` (placeholders, never run) and the final `.norm`, and the tied input/output embedding."""

    def __init__(self, config, device, dtype):
        import torch
        from torch import nn

        text = config.get_text_config()
        self.config = config
        self.embedding = nn.Embedding(text.vocab_size, text.hidden_size, device=device, dtype=dtype)
        with torch.no_grad():
            self.embedding.weight.normal_(0.0, 2.0 / math.sqrt(text.hidden_size))
        self.embedding.requires_grad_(False)
        self.decoder = nn.Module()
        self.decoder.layers = nn.ModuleList(nn.Identity() for _ in range(text.num_hidden_layers))
        self.decoder.norm = nn.RMSNorm(text.hidden_size, eps=getattr(text, "rms_norm_eps", 1e-6), device=device,
                                       dtype=dtype)
        self.decoder.requires_grad_(False)

    def get_decoder(self):
        return self.decoder

    def get_input_embeddings(self):
        return self.embedding

    def get_output_embeddings(self):
        return self.embedding  # tied, as Gemma 4's


def build(smoke: bool, device, bf16_weights: bool, attn: str, overrides_argv: list[str]):
    import torch

    from configuration_dspark import DSparkConfig
    from modeling_dspark import DSparkDraftModel
    from trainer.config import RunConfig
    from trainer.train.optim import MuonAdamWFactory
    from trainer.verifier.teacher import Teacher

    run = RunConfig.load(RECIPE, overrides_argv)
    vcfg = verifier_config(smoke)
    overrides = dict(SMOKE["drafter"]) if smoke else run.model.architecture_overrides()
    config = DSparkConfig.from_verifier(vcfg, verifier_name_or_path=run.model.verifier_id or run.model.verifier,
                                        **overrides)
    verifier_dtype = torch.float32 if smoke else torch.bfloat16  # the trainer loads the verifier in bf16 on a GPU
    verifier = SyntheticVerifier(vcfg, device, verifier_dtype)
    torch.manual_seed(0)
    with torch.device(device):
        drafter = DSparkDraftModel(config)
    if config.uses_draft_vocab:
        g = torch.Generator().manual_seed(0)
        drafter.set_draft_vocab(torch.randperm(config.vocab_size, generator=g)[: config.draft_vocab_size].sort().values)
    drafter.attach_verifier(verifier)
    if bf16_weights:
        drafter.to(torch.bfloat16)
    drafter.config._attn_implementation = attn
    drafter.train()
    text = vcfg.get_text_config()
    teacher = Teacher(verifier.decoder.norm, getattr(text, "final_logit_softcapping", None), verifier.embedding.weight)
    t = run.train
    optimizer = MuonAdamWFactory()(drafter, lr=t.learning_rate, muon_lr=t.muon_learning_rate,
                                   weight_decay=t.weight_decay, muon_weight_decay=t.muon_weight_decay)
    objective = run.objective(block_size=config.block_size)
    if smoke:
        objective.max_anchors = SMOKE["max_anchors"]
    return drafter, verifier, teacher, optimizer, objective, run


def synthetic_batch(drafter, verifier, device, smoke: bool, seed: int = 0):
    """One packed row: a single document of T tokens whose first `prompt` tokens are unsupervised, random
    token ids and random bf16 (fp32 in the smoke) verifier states."""
    import torch

    from modeling_dspark import positions_from_document_ids

    tokens = SMOKE["tokens"] if smoke else CONTEXT_TOKENS
    prompt = SMOKE["prompt"] if smoke else PROMPT_TOKENS
    cfg = drafter.config
    g = torch.Generator().manual_seed(seed)
    dtype = verifier.embedding.weight.dtype
    input_ids = torch.randint(0, cfg.vocab_size, (1, tokens), generator=g)
    loss_mask = torch.ones_like(input_ids)
    loss_mask[:, :prompt] = 0
    document_ids = torch.zeros_like(input_ids)
    hidden = cfg.target_hidden_size or cfg.hidden_size
    aux = torch.randn(1, tokens, cfg.aux_input_size, generator=g).to(dtype)
    last = (torch.randn(1, tokens, hidden, generator=g) * 3.0).to(dtype)
    batch = dict(input_ids=input_ids, loss_mask=loss_mask, document_ids=document_ids,
                 position_ids=positions_from_document_ids(document_ids), aux_hidden_states=aux,
                 last_hidden_state=last)
    return {k: v.to(device) for k, v in batch.items()}


# ------------------------------------------------------------------------------------------------ the step
class Step:
    """The trainer's step on one packed row: anchors, forward + loss (under autocast unless bf16 weights),
    backward, clipping, optimizer step, zero_grad.

    Each region's time is recorded per step in `region_s` (host seconds to issue it) and, on CUDA, `region_gpu_s`
    (device seconds between CUDA events around it): device time above host time means the host ran ahead and kernels
    bound the region; the two about equal means launches or a synchronisation did, which compiling or larger loss
    chunks address."""

    REGIONS = ("anchors", "forward", "loss", "backward", "clip", "optimizer")

    def __init__(self, drafter, teacher, optimizer, objective, batch, device, autocast: bool, max_grad_norm: float):
        import torch

        self.drafter, self.teacher, self.optimizer, self.objective = drafter, teacher, optimizer, objective
        self.batch, self.device, self.max_grad_norm = batch, device, max_grad_norm
        self.autocast = (lambda: torch.autocast(device.type, dtype=torch.bfloat16)) if autocast else \
            contextlib.nullcontext
        self.generator = torch.Generator().manual_seed(1)
        self.slots: list[int] = []
        self.losses: list[float] = []
        self.region_s: list[dict[str, float]] = []
        self.region_gpu_s: list[dict[str, float]] = []

    def __call__(self):
        import torch

        from trainer.train.anchors import block_supervision, sample_anchors
        from trainer.train.loss import dspark_loss

        b = self.batch
        clock = RegionClock(self.REGIONS, self.device.type == "cuda")
        mark = clock.mark

        mark()
        anchors = sample_anchors(b["loss_mask"], b["document_ids"], self.objective.max_anchors, generator=self.generator)
        mark()
        with self.autocast():
            out = self.drafter(input_ids=b["input_ids"], aux_hidden_states=b["aux_hidden_states"],
                               anchor_positions=anchors, document_ids=b["document_ids"],
                               position_ids=b["position_ids"], return_logits=False)
            mark()
            loss, _ = dspark_loss(self.drafter, out, b["input_ids"], b["loss_mask"], b["document_ids"], anchors,
                                  b["last_hidden_state"], self.teacher, self.objective)
        mark()
        loss.backward()
        mark()
        if self.max_grad_norm:
            torch.nn.utils.clip_grad_norm_([p for p in self.drafter.parameters() if p.requires_grad],
                                           self.max_grad_norm)
        mark()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        mark()
        self.losses.append(float(loss.detach()))  # synchronises: every event above has completed
        host, gpu = clock.seconds()
        self.region_s.append(host)
        if gpu is not None:
            self.region_gpu_s.append(gpu)
        self.slots.append(int(block_supervision(b["loss_mask"], b["document_ids"], anchors,
                                                self.objective.block_size).sum()))
        return anchors


class RegionClock:
    """Times the consecutive regions of one step: `mark()` at the start of the first region and after each one.
    Records host seconds between marks and, on CUDA, device seconds between events recorded at them; each region is
    also a labelled torch.profiler range (`REGION_LABEL` + name), which `profile_step` splits its table by (a no-op
    unless profiling). One clock per step, for our step and speculators' alike."""

    def __init__(self, names: tuple[str, ...], cuda: bool):
        self.names, self.cuda = names, cuda
        self.marks: list[tuple[float, object]] = []
        self.range = None

    def mark(self) -> None:
        event = None
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
        self.marks.append((time.perf_counter(), event))
        if self.range is not None:
            self.range.__exit__(None, None, None)
            self.range = None
        if len(self.marks) <= len(self.names):
            self.range = torch.profiler.record_function(REGION_LABEL + self.names[len(self.marks) - 1])
            self.range.__enter__()

    def seconds(self) -> tuple[dict[str, float], dict[str, float] | None]:
        """Host seconds per region, and device seconds on CUDA (else None); call after a synchronisation."""
        m = self.marks
        host = {name: m[i + 1][0] - m[i][0] for i, name in enumerate(self.names)}
        gpu = ({name: m[i][1].elapsed_time(m[i + 1][1]) / 1e3 for i, name in enumerate(self.names)}
               if self.cuda else None)
        return host, gpu


def region_medians(per_step: list[dict[str, float]]) -> dict[str, float] | None:
    """Per-region median over the timed steps (None when nothing was recorded)."""
    if not per_step:
        return None
    return {name: statistics.median(step[name] for step in per_step) for name in per_step[0]}


def profile_step(step: Step, device, rows: int = 30, region_rows: int = 12) -> tuple[str, dict[str, str]]:
    """torch.profiler's table of one more step, ops sorted by their own device time (host time on the CPU), and one
    table per region of the step: the top-level operations that started inside the region (on any thread, so the
    autograd engine's backward ops count in `backward`), by the device time of everything they launched (on the
    CPU, their host time)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        step()
        sync(device)
    sort = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=sort, row_limit=rows, max_name_column_width=60)
    return table, region_tables(prof.events(), cuda, region_rows)


def region_tables(events, cuda: bool, rows: int) -> dict[str, str]:
    """Per region (`REGION_LABEL` ranges), the operations that started inside it and have no parent operation:
    name, calls, milliseconds (device time of all they launched on CUDA, host time on the CPU)."""
    spans = {e.name[len(REGION_LABEL):]: (e.time_range.start, e.time_range.end)
             for e in events if e.name.startswith(REGION_LABEL)}
    totals: dict[str, dict[str, list]] = {name: {} for name in spans}  # name -> [calls, ms, nested]

    def add(ops: dict, key: str, event, nested: bool = False) -> None:
        entry = ops.setdefault(key, [0, 0.0, nested])
        entry[0] += 1
        entry[1] += (event.device_time_total if cuda else event.cpu_time_total) / 1e3

    for e in events:
        if e.cpu_parent is not None and not e.cpu_parent.name.startswith(REGION_LABEL):
            continue  # counted in its parent's total
        if e.name.startswith(REGION_LABEL) or e.device_type != torch.autograd.DeviceType.CPU:
            continue
        for name, (start, end) in spans.items():
            if start <= e.time_range.start < end:
                add(totals[name], e.name, e)
                # a Python-level operation (the loss's autograd Function, an optimizer step, a compiled region) is
                # opened one level too, its children rows prefixed with its name (they are inside its total)
                if not e.name.startswith(("aten::", "autograd::")):
                    for child in e.cpu_children:
                        add(totals[name], f"{e.name} > {child.name}", child, nested=True)
                break
    tables = {}
    for name, ops in totals.items():
        ranked = sorted(ops.items(), key=lambda item: -item[1][1])
        top = [v for v in ops.values() if not v[2]]
        lines = [f"{'operation':<90} {'calls':>6} {'ms':>9}"]
        lines += [f"{op[:90]:<90} {calls:>6} {ms:>9.3f}" for op, (calls, ms, _) in ranked[:rows]]
        lines.append(f"{'all, ' + str(len(top)) + ' kinds of operation':<90} {sum(v[0] for v in top):>6} "
                     f"{sum(v[1] for v in top):>9.3f}")
        tables[name] = "\n".join(lines)
    return tables


def sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def mask_density(drafter, anchors, batch) -> dict:
    """Share of the (query, key) pairs the DSpark mask keeps, per layer type (dense evaluation of the mask)."""
    import torch

    from configuration_dspark import SLIDING
    from modeling_dspark import build_attention_mask, dspark_mask_mod

    cfg = drafter.config
    documents = batch["document_ids"]
    valid = anchors >= 0
    p = anchors.clamp(min=0)
    anchor_documents = documents.gather(1, p).masked_fill(~valid, -1)
    q_len = anchors.shape[1] * cfg.block_size
    kv_len = documents.shape[1] + q_len
    out = {}
    for kind in sorted({layer.layer_type for layer in drafter.layers}):
        window = cfg.transformer_layer_config["sliding_window"] if kind == SLIDING else None
        causal = kind == SLIDING and not cfg.sliding_window_non_causal
        mod = dspark_mask_mod(documents, p.masked_fill(~valid, 0), anchor_documents, cfg.block_size, window, causal)
        dense = build_attention_mask(mod, anchors.shape[0], q_len, kv_len, anchors.device, "sdpa", torch.float32)
        out[kind] = float(dense.float().mean())
    counts = {kind: sum(layer.layer_type == kind for layer in drafter.layers) for kind in out}
    out["mean"] = sum(out[k] * counts[k] for k in counts) / max(sum(counts.values()), 1)
    return out


def count_step_flops(step: Step, attn: str) -> dict:
    """FLOPs of one step (optimizer included) under FlopCounterMode. Flex attention is counted as sdpa (the same
    dense formula): under torch 2.11 on an H200 the flex operator raised under the counter's mode, and the
    process's next flex compile then failed (Dynamo traced into flex's dense fallback), so it is not attempted."""
    from torch.utils.flop_counter import FlopCounterMode

    counted = "sdpa" if attn == "flex_attention" else attn
    previous = step.drafter.config._attn_implementation
    step.drafter.config._attn_implementation = counted
    try:
        with FlopCounterMode(display=False) as counter:
            step()
    finally:
        step.drafter.config._attn_implementation = previous
    total = int(counter.get_total_flops())
    attention = sum(v for op, v in counter.get_flop_counts().get("Global", {}).items() if "attention" in str(op))
    note = f"counted with {counted}" + (" (flex attention is not countable under FlopCounterMode)"
                                        if counted != attn else "")
    if attention == 0:  # sdpa's math path (CPU, or a mask no fused kernel takes): attention is in the matmuls
        note += "; attention ran as plain matmuls, so it is not separated (mask-aware figure unavailable)"
    return dict(total=total, attention=attention or None, non_attention=total - attention, note=note)


# ------------------------------------------------------------------------------------------------ main
def add_arguments(parser) -> None:
    """`--quick` (the protocol's) here means fewer steps: 1 warm-up, 2 timed."""
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny fp32/sdpa shapes on the CPU (checks the script)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps (median reported)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (flex attention compiles here)")
    parser.add_argument("--bf16-weights", action="store_true",
                        help="cast the drafter to bf16 instead of fp32 weights under bf16 autocast")
    parser.add_argument("--attn", default=None, choices=["flex_attention", "sdpa", "eager"],
                        help="attention backend (default: flex_attention on the GPU, sdpa in the CPU smoke)")
    parser.add_argument("--no-flops", action="store_true", help="skip the FLOP count (one extra step)")
    parser.add_argument("--profile", action="store_true",
                        help="profile one more step with torch.profiler and keep its top-ops table in the JSON, with one "
                             "table per region of the step (`profile_regions`)")
    parser.add_argument("--set", nargs=2, action="append", default=[], metavar=("KEY", "VALUE"),
                        help="override a recipe key, as trainer/run.py does (e.g. --set confidence_target "
                             "sampled_restricted --set full_vocab_metrics false)")


def unavailable(args) -> str | None:
    if not args.cpu_smoke and not torch.cuda.is_available():
        return ("no CUDA device: benchmarks.gpu_step measures a bf16 GPU training step; run it on a GPU machine, or "
                "pass --cpu-smoke to check the script on tiny CPU shapes")
    return None


def run(args) -> dict:
    smoke = args.cpu_smoke
    if args.quick:
        args.steps, args.warmup = min(args.steps, 2), min(args.warmup, 1)
    if args.steps < 1 or args.warmup < 0:
        raise UsageError(f"--steps {args.steps} / --warmup {args.warmup} is out of range; pass --steps >= 1 and "
                         f"--warmup >= 0.")
    device = torch.device("cpu" if smoke else "cuda")
    peak = None if smoke else spec_peak(torch.cuda.get_device_name(device))
    attn = args.attn or ("sdpa" if smoke else "flex_attention")
    autocast = not smoke and not args.bf16_weights
    precision = ("bf16 weights, gradients and optimizer state" if args.bf16_weights
                 else "fp32 (CPU smoke)" if smoke else "fp32 master weights + torch.autocast(cuda, bfloat16)")
    started = time.time()
    print(f"building the drafter ({'tiny smoke shape' if smoke else 'configs/gemma-4-E4B-it.yaml'}) on {device} ...",
          flush=True)
    overrides = [item for key, value in args.set for item in (f"--{key}", value)]
    drafter, verifier, teacher, optimizer, objective, run = build(smoke, device, args.bf16_weights, attn, overrides)
    batch = synthetic_batch(drafter, verifier, device, smoke)
    compiled = compile_layers_enabled(run.model.compile_layers, device)
    if compiled:
        compile_decoder_layers(drafter)
    step = Step(drafter, teacher, optimizer, objective, batch, device, autocast, run.train.max_grad_norm)
    params = sum(p.numel() for p in drafter.parameters())
    trainable = sum(p.numel() for p in drafter.parameters() if p.requires_grad)

    print(f"warm-up: {args.warmup} steps ...", flush=True)
    warm = []
    for _ in range(args.warmup):
        sync(device)
        start = time.perf_counter()
        step()
        sync(device)
        warm.append(time.perf_counter() - start)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        base_allocated = torch.cuda.memory_allocated(device)
    print(f"timing: {args.steps} steps ...", flush=True)
    times = []
    anchors = None
    for _ in range(args.steps):
        sync(device)
        start = time.perf_counter()
        anchors = step()
        sync(device)
        times.append(time.perf_counter() - start)
    memory = {}
    if device.type == "cuda":
        memory = dict(peak_allocated_bytes=torch.cuda.max_memory_allocated(device),
                      peak_reserved_bytes=torch.cuda.max_memory_reserved(device),
                      allocated_before_steps_bytes=base_allocated)
    median = statistics.median(times)
    slots = statistics.mean(step.slots[-args.steps:])
    regions = dict(host_s=region_medians(step.region_s[-args.steps:]),
                   gpu_s=region_medians(step.region_gpu_s[-args.steps:]))
    tokens = batch["input_ids"].numel()
    density = mask_density(drafter, anchors, batch)
    flops = None
    if not args.no_flops:
        print("counting FLOPs of one more step ...", flush=True)
        flops = count_step_flops(step, attn)
        flops["mask_aware"] = (flops["non_attention"] + flops["attention"] * density["mean"]
                               if flops["attention"] else None)
        flops["mfu"] = flops["total"] / median / peak if peak else None
        flops["mfu_mask_aware"] = flops["mask_aware"] / median / peak if flops["mask_aware"] and peak else None
    profile = profile_regions = None
    if args.profile:
        print("profiling one more step ...", flush=True)
        profile, profile_regions = profile_step(step, device)
        print(profile, flush=True)
        for name, table in profile_regions.items():
            print(f"region {name}:\n{table}", flush=True)
    finite = all(math.isfinite(v) for v in step.losses)
    cfg = drafter.config
    out = dict(
        benchmark="gpu_step", smoke=smoke, recipe_overrides=overrides, device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        torch=torch.__version__, precision=precision, attention=attn, compile_layers=compiled,
        shape=dict(hidden=cfg.hidden_size, layers=cfg.num_hidden_layers,
                   layer_types=cfg.transformer_layer_config["layer_types"], vocab=cfg.vocab_size,
                   draft_vocab=cfg.draft_vocab_size, block=cfg.block_size, markov_rank=cfg.markov_rank,
                   confidence_head=cfg.enable_confidence_head, aux_ids=list(cfg.aux_hidden_state_layer_ids),
                   context_tokens=tokens, max_anchors=objective.max_anchors, anchors=int((anchors >= 0).sum()),
                   parameters=params, trainable_parameters=trainable),
        objective={k: getattr(objective, k) for k in ("loss_weights", "teacher_vocab", "confidence_target",
                                                      "chunk_elements", "max_anchors")
                   } | ({"full_vocab_metrics": objective.full_vocab_metrics}
                        if hasattr(objective, "full_vocab_metrics") else {}),
        optimizer=type(optimizer).__name__, warmup_s=warm, step_s=times, step_median_s=median,
        context_tokens_per_s=tokens / median, supervised_slots=slots, supervised_slots_per_s=slots / median,
        memory=memory, flops=flops, mask_density=density, peak_flops=peak, regions=regions, profile=profile,
        profile_regions=profile_regions,
        losses=step.losses,
        losses_finite=finite, seconds=time.time() - started,
    )
    gib = 2**30
    tag = "smoke " if smoke else ""
    rows = [
        [f"{tag}step time", median, "s", f"median of {args.steps} after {args.warmup} warm-up; {precision}; {attn}"
         + ("; decoder layers compiled" if compiled else "")],
        [f"{tag}context tokens/s", tokens / median, "tokens/s", f"T = {tokens}, 1 packed row"],
        [f"{tag}supervised slots/s", slots / median, "slots/s", f"{slots:.0f} slots ({out['shape']['anchors']} anchors "
                                                                f"x block {cfg.block_size})"],
    ]
    if memory:
        rows += [[f"{tag}peak CUDA memory allocated", memory["peak_allocated_bytes"] / gib, "GiB",
                  f"{memory['allocated_before_steps_bytes'] / gib:.2f} GiB before the steps (weights, optimizer "
                  f"state, inputs, verifier head)"],
                 [f"{tag}peak CUDA memory reserved", memory["peak_reserved_bytes"] / gib, "GiB", ""]]
    if flops:
        rows += [[f"{tag}FLOPs per step", flops["total"] / 1e12, "TFLOP",
                  f"FlopCounterMode, optimizer included, dense attention "
                  f"{(flops['attention'] or 0) / 1e12:.3g} TFLOP; {flops['note']}"],
                 [f"{tag}MFU", flops["mfu"], "share", f"vs {peak / 1e12:.0f} TFLOP/s bf16 dense peak" if peak
                  else "no spec peak for this device (the CPU smoke has none)"],
                 [f"{tag}MFU (mask-aware attention)", flops["mfu_mask_aware"], "share",
                  f"attention FLOPs x mask density {density['mean']:.3f}"]]
    for name in Step.REGIONS:
        gpu = regions["gpu_s"][name] if regions["gpu_s"] else None
        rows.append([f"{tag}region {name}", regions["host_s"][name], "s",
                     "host seconds to issue (median)" + (f"; {gpu:.4g} s on the device" if gpu is not None else "")])
    rows.append([f"{tag}losses finite", finite, "", f"first {step.losses[0]:.4f}, last {step.losses[-1]:.4f}"])
    out["table"] = rows
    if not finite:
        out["failed"] = "a training step produced a non-finite loss"
    return out


if __name__ == "__main__":
    common.main(sys.modules[__name__])
