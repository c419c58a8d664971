"""The DSpark loss alone (forward + backward), ours against a naive one-shot reference.

    python -m benchmarks.loss_alone --json OUT [--quick] [--repeats 3] [--vocab 32000,262144]

Shape (the seed recipe's loss at one packed row): 4,096 supervised slots (512 anchors x block 8), H = 640,
verifier vocabulary V = 262,144, draft vocabulary Vd = 32,000 and Vd = V (no reduced draft vocabulary),
Markov rank 256, confidence head on. Only the heads are exercised: the draft states `[1, 512, 8, H]` are a
leaf tensor that requires grad (what the backbone would hand the loss), the teacher is a final norm plus a
random `[V, H]` output head over random pre-norm verifier states.

Three implementations, each timed and measured in a fresh process (a hidden `--worker` mode):

* `ours`: `trainer.train.loss.dspark_loss` with `teacher_vocab="draft"`, `confidence_target="sampled_restricted"`
  and `full_vocab_metrics=False` (the training configuration this benchmark is about);
* `default`: `dspark_loss` with the package's default `ObjectiveConfig` loss fields (full-vocabulary metrics on,
  the default confidence target), same loss weights;
* `naive`: a straightforward fp32 one-shot implementation of the same loss as `ours` (full `[S, Vd]` logits,
  log_softmax, CE to the teacher argmax, TV, BCE of the confidence logits against the overlap; autograd does the
  rest).

`ours` and `naive` must give the same loss (relative difference < 1e-5) and the same gradient w.r.t. the draft
states (max abs difference reported). Time is the median of `--repeats` runs after a warm-up run (the warm-up
uses at most 64 anchors, to spare minutes at Vd = V); peak extra memory is the peak RSS increase over the
measured region (`/proc/self/clear_refs` + VmHWM - VmRSS). At Vd = V the naive reference needs several
`[4096, 262144]` fp32 tensors (4.3 GB each): its memory is estimated first from two small probe runs, and if
it does not fit in MemAvailable with 4 GB of headroom it runs at fewer slots; the full-size time and memory are
then linear extrapolations, labelled as estimates.

Run time on a 2-core CPU (one thread): about 4 minutes at Vd = 32,000; at Vd = V every implementation is ~8x
slower per slot, so the full 4,096 slots take ~15 minutes there: `--vocab 262144 --anchors 64` measures 512 slots
(~4.5 minutes) and adds full-size estimates (linear in the slots), labelled as such. On a shared machine pass
`--threads 1` (multi-threaded kernels on busy cores are many times slower).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks import common  # noqa: E402
from benchmarks.common import (  # noqa: E402
    LOSS_WEIGHTS,
    PeakRSS,
    busy_warning,
    mem_available_bytes,
    objective,
)
from trainer.errors import UsageError  # noqa: E402

NAME = "loss_alone"

FULL = dict(anchors=512, block=8, hidden=640, vocab=262144, draft_vocabs=[32000, 262144], rank=256)
QUICK = dict(anchors=16, block=8, hidden=64, vocab=4096, draft_vocabs=[512, 4096], rank=16)
HEADROOM_BYTES = 4 * 2**30
WARMUP_MAX_ANCHORS = 64


# ------------------------------------------------------------------------------------------------ helpers
# ------------------------------------------------------------------------------------------------ problem
def build_problem(shape: dict, draft_vocab: int, seed: int = 0):
    """A small real drafter (1 layer; only its heads are used), the teacher and one packed row where every slot
    of every block is supervised: anchors at 0, B, 2B, ..., so slot k of block j sits at position jB + k."""
    import torch
    from transformers import LlamaConfig

    from configuration_dspark import DSparkConfig
    from modeling_dspark import DSparkDraftModel
    from trainer.verifier.teacher import Teacher

    torch.manual_seed(seed)
    n, block, hidden, vocab, rank = shape["anchors"], shape["block"], shape["hidden"], shape["vocab"], shape["rank"]
    verifier_config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                                  num_hidden_layers=4, num_attention_heads=max(1, hidden // 64),
                                  num_key_value_heads=1, head_dim=min(64, hidden))
    config = DSparkConfig.from_verifier(
        verifier_config, num_hidden_layers=1, layer_types=["full_attention"], intermediate_size=64,
        num_attention_heads=1, num_key_value_heads=1, head_dim=32, block_size=block,
        aux_hidden_state_layer_ids=[1, 2], draft_vocab_size=draft_vocab, mask_token_id=0, markov_rank=rank,
        enable_confidence_head=True, confidence_head_with_markov=True)
    drafter = DSparkDraftModel(config)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        drafter.markov_head.markov_w1.weight.normal_(0.0, 0.3, generator=g)
        drafter.markov_head.markov_w2.weight.normal_(0.0, 0.1, generator=g)
        drafter.confidence_head.proj.weight.normal_(0.0, 0.3 / math.sqrt(hidden + rank), generator=g)
    # The verifier's output head: logits of std ~2.5, so the teacher is peaked like a trained model's.
    output_weight = torch.randn(vocab, hidden, generator=g) * (2.5 / math.sqrt(hidden))
    if config.uses_draft_vocab:
        ids = torch.randperm(vocab, generator=g)[:draft_vocab].sort().values
        drafter.set_draft_vocab(ids)
        # What attach_verifier does with a real verifier: copy its output rows of the draft vocabulary.
        drafter.lm_head.weight.data = output_weight[drafter.draft_vocab_ids].clone()
    else:
        drafter.lm_head.weight = torch.nn.Parameter(output_weight, requires_grad=False)  # shared, as attach does
    drafter.train()
    final_norm = torch.nn.RMSNorm(hidden, eps=1e-6)
    with torch.no_grad():
        final_norm.weight.uniform_(0.5, 1.5, generator=g)
    final_norm.requires_grad_(False)
    teacher = Teacher(final_norm, softcap=None, output_weight=output_weight)

    length = n * block + 1
    input_ids = torch.randint(0, vocab, (1, length), generator=g)
    anchors = (torch.arange(n) * block).unsqueeze(0)
    positions = anchors.unsqueeze(-1) + torch.arange(block)  # [1, N, B]: the teacher position of each slot
    problem = dict(
        input_ids=input_ids, loss_mask=torch.ones_like(input_ids), document_ids=torch.zeros_like(input_ids),
        anchors=anchors, previous=input_ids[0, positions.view(-1)].view(1, n, block),
        hidden=torch.randn(1, n, block, hidden, generator=g),
        teacher_hidden=torch.randn(1, length, hidden, generator=g) * 3.0,
    )
    return drafter, teacher, problem


def subset(problem: dict, n: int) -> dict:
    """The same problem restricted to its first `n` anchors (a fresh leaf for the draft states)."""
    out = dict(problem)
    out["anchors"] = problem["anchors"][:, :n]
    out["previous"] = problem["previous"][:, :n]
    out["hidden"] = problem["hidden"][:, :n]
    return out


def run_ours(drafter, teacher, problem: dict, config):
    import torch

    from modeling_dspark import DSparkDraftOutput
    from trainer.train.loss import dspark_loss

    h = problem["hidden"].detach().clone().requires_grad_(True)
    previous = problem["previous"]
    features = drafter.markov_head.previous_features(previous)  # one lookup, as the drafter's forward does
    outputs = DSparkDraftOutput(last_hidden_state=h, confidence_logits=drafter.compute_confidence(h, previous, features),
                                previous_token_ids=previous, previous_features=features,
                                anchor_mask=torch.ones_like(problem["anchors"], dtype=torch.bool))
    loss, _ = dspark_loss(drafter, outputs, problem["input_ids"], problem["loss_mask"], problem["document_ids"],
                          problem["anchors"], problem["teacher_hidden"], teacher, config)
    loss.backward()
    return loss.detach(), h.grad


def run_naive(drafter, teacher, problem: dict, config):
    """One-shot fp32 reference of `ours`' loss: everything `[S, Vd]` at once, autograd for the backward."""
    import torch
    import torch.nn.functional as F

    h = problem["hidden"].detach().clone().requires_grad_(True)
    rows, n, block, hidden = h.shape
    previous = problem["previous"].reshape(-1)
    slot = torch.arange(block).repeat(rows * n)
    positions = (problem["anchors"].unsqueeze(-1) + torch.arange(block)).reshape(-1)
    states = h.reshape(-1, hidden)
    features = drafter.markov_head.previous_features(previous)  # one lookup for both readers, as ours
    confidence = drafter.compute_confidence(states, previous, features)

    logits = drafter.compute_logits(states, previous, features)  # [S, Vd]
    log_q = torch.log_softmax(logits, dim=-1)
    q = log_q.exp()
    with torch.no_grad():
        normed = teacher.final_norm(problem["teacher_hidden"][0, positions])
        teacher_logits = normed @ drafter.lm_head.weight.T  # the verifier's rows of the draft vocabulary
        log_p = torch.log_softmax(teacher_logits, dim=-1)
        p = log_p.exp()
        target = teacher_logits.argmax(dim=-1)
    ce = -log_q.gather(1, target.unsqueeze(1)).squeeze(1)
    overlap = torch.minimum(q, p).sum(dim=-1)
    tv = 1.0 - overlap
    with torch.no_grad():
        if config.confidence_target == "sampled_restricted" or not drafter.config.uses_draft_vocab:
            conf_target = overlap.detach()
        else:
            raise ValueError(f"the naive reference has no confidence target {config.confidence_target!r}")
        conf_target = conf_target.clamp(0.0, 1.0)
    bce = F.binary_cross_entropy_with_logits(confidence, conf_target, reduction="none")
    weights = torch.exp(-slot.double() / config.decay_gamma).float()
    lw = config.loss_weights
    total = (weights * (lw.get("ce", 0.0) * ce + lw.get("tv", 0.0) * tv)).sum()
    total = total + config.confidence_weight * (weights * bce).sum()
    loss = total / states.shape[0]
    loss.backward()
    return loss.detach(), h.grad


# ------------------------------------------------------------------------------------------------ worker
def worker(spec: dict) -> None:
    """One implementation in this fresh process: warm-up, `repeats` timed runs with peak memory each, then an
    optional check run at `check_anchors` whose loss and gradient are saved for the comparison."""
    import torch

    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    drafter, teacher, problem = build_problem(spec["shape"], spec["draft_vocab"])
    impl = spec["impl"]
    config = objective("default" if impl == "default" else "matched", spec["shape"]["block"], spec["shape"]["anchors"])
    fn = run_naive if impl == "naive" else run_ours
    anchors = spec["anchors"]
    full = subset(problem, anchors)

    def once(prob):
        drafter.zero_grad(set_to_none=True)
        with PeakRSS() as mem:
            start = time.perf_counter()
            loss, grad = fn(drafter, teacher, prob, config)
            seconds = time.perf_counter() - start
        return loss, grad, seconds, mem.delta, mem.before

    result = {"impl": impl, "anchors": anchors, "slots": anchors * spec["shape"]["block"],
              "config": dataclasses.asdict(config),
              "threads": torch.get_num_threads()}
    if spec["repeats"]:
        once(subset(problem, min(anchors, WARMUP_MAX_ANCHORS)))
        times, peaks, baseline = [], [], 0
        for _ in range(spec["repeats"]):
            loss, grad, seconds, delta, before = once(full)
            times.append(seconds)
            peaks.append(delta)
            baseline = before
            if spec.get("check_anchors") != anchors:
                del grad
        result.update(times_s=times, median_s=statistics.median(times), peak_bytes=max(peaks), baseline_rss=baseline,
                      loss=float(loss))
    if spec.get("check_anchors") == anchors and spec["repeats"]:  # the last timed run is the check run
        torch.save({"loss": loss.double(), "grad": grad}, spec["check_out"])
        result["check"] = {"anchors": anchors, "seconds": seconds, "peak_bytes": delta, "loss": float(loss),
                           "baseline_rss": before}
    elif spec.get("check_anchors"):
        loss, grad, seconds, delta, before = once(subset(problem, spec["check_anchors"]))
        torch.save({"loss": loss.double(), "grad": grad}, spec["check_out"])
        result["check"] = {"anchors": spec["check_anchors"], "seconds": seconds, "peak_bytes": delta,
                           "loss": float(loss), "baseline_rss": before}
    with open(spec["out"], "w") as f:
        json.dump(result, f)


def spawn(spec: dict, tmp: str, label: str) -> dict:
    """Run one worker in a fresh interpreter and return its result dict."""
    spec = dict(spec, out=os.path.join(tmp, f"{label}.json"))
    start = time.perf_counter()
    print(f"  {label} ...", flush=True, end=" ")
    proc = subprocess.run([sys.executable, "-m", "benchmarks.loss_alone", "--worker", json.dumps(spec)],
                          cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()
        raise RuntimeError(f"worker {label} failed (exit {proc.returncode}): {tail[-1] if tail else 'no output'}")
    for line in proc.stderr.splitlines():
        if "Warning" in line:
            print(f"\n    [{label}] {line.strip()}", end="")
    print(f"{time.perf_counter() - start:.0f} s", flush=True)
    with open(spec["out"]) as f:
        return json.load(f)


# ------------------------------------------------------------------------------------------------ parent
NAIVE_TENSORS = 16  # conservative count of live [S, Vd] fp32 tensors in the naive forward + backward


def param_bytes(shape: dict, draft_vocab: int) -> int:
    """Resident bytes of the problem's weights: the output head, its draft rows, both Markov factors."""
    v, h, r = shape["vocab"], shape["hidden"], shape["rank"]
    return 4 * (v * h + (draft_vocab * h if draft_vocab < v else 0) + v * r + draft_vocab * r)


def naive_rows_plan(shape, draft_vocab, anchors, tmp, budget_bytes, threads) -> dict:
    """How many anchors the naive reference can run at within `budget_bytes` of resident memory (headroom
    already removed). A generous analytic bound decides first (`NAIVE_TENSORS` `[S, Vd]` fp32 tensors plus the
    Markov gradients); only when that is not comfortably inside the budget, two small probe runs measure the
    memory and a linear fit in the anchors picks the largest power of two that fits."""
    block = shape["block"]
    per_anchor = NAIVE_TENSORS * block * draft_vocab * 4.0
    fixed = 2.0 * 4 * (shape["vocab"] + draft_vocab) * shape["rank"]
    baseline = param_bytes(shape, draft_vocab) + 0.75 * 2**30  # + the interpreter, torch and the problem
    estimate = fixed + per_anchor * anchors
    plan = dict(method="analytic bound", per_anchor_bytes=per_anchor, fixed_bytes=fixed, baseline_rss=baseline,
                estimate_bytes=estimate, budget_bytes=budget_bytes)
    if baseline + estimate <= 0.5 * budget_bytes:
        return dict(plan, fits=True, anchors=anchors, slots=anchors * block)
    small, large = min(8, anchors), min(16, anchors)
    probes = {}
    for n in sorted({small, large}):
        probes[n] = spawn(dict(impl="naive", shape=shape, draft_vocab=draft_vocab, anchors=n, repeats=1,
                               threads=threads), tmp, f"naive-probe-vd{draft_vocab}-a{n}")
    if len(probes) == 1:
        (n, r), = probes.items()
        per_anchor, fixed = r["peak_bytes"] / n, 0.0
    else:
        per_anchor = (probes[large]["peak_bytes"] - probes[small]["peak_bytes"]) / (large - small)
        fixed = probes[small]["peak_bytes"] - per_anchor * small
    baseline = max(r["baseline_rss"] for r in probes.values())
    estimate = fixed + per_anchor * anchors
    fits = baseline + estimate <= budget_bytes
    run_at = anchors
    if not fits:
        run_at = int((budget_bytes - baseline - fixed) // max(per_anchor, 1.0))
        run_at = 2 ** int(math.log2(run_at)) if run_at >= 1 else 0  # a power of two: a clean subset
        if run_at < 1:
            raise RuntimeError(f"the naive reference does not fit even at one anchor (estimated {estimate / 2**30:.1f} "
                               f"GiB); free memory or lower the shape")
    return dict(method="two probe runs, linear fit", per_anchor_bytes=per_anchor, fixed_bytes=fixed,
                baseline_rss=baseline, estimate_bytes=estimate, budget_bytes=budget_bytes, fits=fits, anchors=run_at,
                slots=run_at * block, probe_times_s={str(n): r["median_s"] for n, r in probes.items()})


def compare(a_file: str, b_file: str) -> dict:
    import torch

    a, b = torch.load(a_file, weights_only=True), torch.load(b_file, weights_only=True)  # tensors only: no pickle
    rel = abs(float(a["loss"]) - float(b["loss"])) / max(abs(float(b["loss"])), 1e-30)
    diff = (a["grad"] - b["grad"]).abs().max().item()
    scale = b["grad"].abs().max().item()
    return dict(loss_ours=float(a["loss"]), loss_naive=float(b["loss"]), loss_rel_diff=rel, grad_max_abs_diff=diff,
                grad_max_abs=scale, grad_rel_diff=diff / max(scale, 1e-30))


def benchmark_vocab(shape, draft_vocab, anchors, repeats, tmp, budget_override, threads) -> tuple[dict, list]:
    block, full_anchors = shape["block"], shape["anchors"]
    slots, full_slots = anchors * block, full_anchors * block
    tag = "Vd=V" if draft_vocab == shape["vocab"] else f"Vd={draft_vocab}"
    print(f"{tag} ({slots} slots, H={shape['hidden']}, V={shape['vocab']}, rank {shape['rank']}):", flush=True)
    budget = budget_override if budget_override is not None else mem_available_bytes() - HEADROOM_BYTES
    plan = naive_rows_plan(shape, draft_vocab, anchors, tmp, budget, threads)
    check_anchors = plan["anchors"]
    base = dict(shape=shape, draft_vocab=draft_vocab, anchors=anchors, repeats=repeats, threads=threads)
    ours = spawn(dict(base, impl="ours", check_anchors=check_anchors,
                      check_out=os.path.join(tmp, f"ours-{draft_vocab}.pt")), tmp, f"ours-vd{draft_vocab}")
    default = spawn(dict(base, impl="default"), tmp, f"default-vd{draft_vocab}")
    naive = spawn(dict(base, impl="naive", anchors=check_anchors, check_anchors=check_anchors,
                       check_out=os.path.join(tmp, f"naive-{draft_vocab}.pt")), tmp, f"naive-vd{draft_vocab}")
    check = compare(os.path.join(tmp, f"ours-{draft_vocab}.pt"), os.path.join(tmp, f"naive-{draft_vocab}.pt"))
    check["slots"] = check_anchors * block
    check["ok"] = check["loss_rel_diff"] < 1e-5
    gib = 2**30
    if plan["fits"]:
        naive_s, naive_mem, est = naive["median_s"], naive["peak_bytes"], ""
    else:  # linear extrapolation from the reduced run (time) and the probe fit anchored at the reduced run (memory)
        naive_s = naive["median_s"] * anchors / check_anchors
        naive_mem = naive["peak_bytes"] + plan["per_anchor_bytes"] * (anchors - check_anchors)
        est = (f"ESTIMATE: naive ran at {check_anchors * block} slots ({naive['median_s']:.3g} s, "
               f"{naive['peak_bytes'] / gib:.2f} GiB), scaled linearly to {slots}; it needs ~"
               f"{(plan['baseline_rss'] + plan['estimate_bytes']) / gib:.1f} GiB resident, over the "
               f"{budget / gib:.1f} GiB budget ({'--naive-budget-gb' if budget_override is not None else 'MemAvailable - 4 GiB'})")
    out = dict(draft_vocab=draft_vocab, slots=slots, ours=ours, default=default, naive=naive, naive_plan=plan,
               naive_s=naive_s, naive_peak_bytes=naive_mem, naive_is_estimate=not plan["fits"], check=check,
               ratio_time_ours_over_naive=ours["median_s"] / naive_s,
               ratio_memory_ours_over_naive=ours["peak_bytes"] / max(naive_mem, 1))
    rep = f"median of {repeats}"
    at = f" at {slots} slots" if anchors != full_anchors else ""
    rows = [
        [f"{tag} ours time{at}", ours["median_s"], "s",
         f"{rep}; sampled_restricted, no full-vocab metrics"],
        [f"{tag} ours peak extra memory{at}", ours["peak_bytes"] / gib, "GiB", "peak RSS delta"],
        [f"{tag} default objective time{at}", default["median_s"], "s",
         f"{rep}; package defaults (full_vocab_metrics={default['config'].get('full_vocab_metrics', True)}, "
         f"confidence_target={default['config']['confidence_target']})"],
        [f"{tag} default objective peak extra memory{at}", default["peak_bytes"] / gib, "GiB", "peak RSS delta"],
        [f"{tag} naive time{at}", naive_s, "s", est or rep],
        [f"{tag} naive peak extra memory{at}", naive_mem / gib, "GiB", "ESTIMATE (linear)" if est else "peak RSS delta"],
        [f"{tag} time ours/naive{at}", out["ratio_time_ours_over_naive"], "x", "vs estimate" if est else ""],
        [f"{tag} memory ours/naive{at}", out["ratio_memory_ours_over_naive"], "x", "vs estimate" if est else ""],
        [f"{tag} loss rel diff ours vs naive", check["loss_rel_diff"], "", f"at {check['slots']} slots; "
                                                                         f"{'OK' if check['ok'] else 'FAIL'} (< 1e-5)"],
        [f"{tag} grad max abs diff ours vs naive", check["grad_max_abs_diff"], "",
         f"max |grad| {check['grad_max_abs']:.3g}, rel {check['grad_rel_diff']:.2g}"],
    ]
    if not plan["fits"]:
        sub = ours["check"]
        out["like_for_like"] = dict(slots=check_anchors * block, ours_s=sub["seconds"], naive_s=naive["median_s"],
                                    ours_peak_bytes=sub["peak_bytes"], naive_peak_bytes=naive["peak_bytes"])
        lf = out["like_for_like"]
        rows.append([f"{tag} time ours/naive at {lf['slots']} slots", lf["ours_s"] / lf["naive_s"], "x",
                     "measured (ours: one run after warm-up)"])
        rows.append([f"{tag} memory ours/naive at {lf['slots']} slots",
                     lf["ours_peak_bytes"] / max(lf["naive_peak_bytes"], 1), "x", "measured"])
    if anchors != full_anchors:  # the measured size is a subset of the benchmark's shape: extrapolate, labelled
        f = full_anchors / anchors
        out["full_size_estimate"] = dict(slots=full_slots, ours_s=ours["median_s"] * f,
                                         default_s=default["median_s"] * f, naive_s=naive_s * f,
                                         naive_peak_bytes=naive_mem * f)
        e = out["full_size_estimate"]
        note = f"ESTIMATE: {slots}-slot measurement x {f:g} (linear in slots)"
        rows += [[f"{tag} ours time at {full_slots} slots", e["ours_s"], "s", note],
                 [f"{tag} default objective time at {full_slots} slots", e["default_s"], "s", note],
                 [f"{tag} naive time at {full_slots} slots", e["naive_s"], "s", note],
                 [f"{tag} naive peak extra memory at {full_slots} slots", e["naive_peak_bytes"] / gib, "GiB",
                  note + f"; {'fits' if (e['naive_peak_bytes'] + plan['baseline_rss']) <= budget else 'does NOT fit'}"
                         f" the {budget / gib:.1f} GiB budget"]]
    return out, rows


def add_arguments(parser) -> None:
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads (default: torch's); on a shared machine --threads 1 is far steadier")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--vocab", default=None, help="comma-separated draft vocabulary sizes (default: 32000,V)")
    parser.add_argument("--anchors", type=int, default=None,
                        help="measure at the first N of the 512 anchors (full-size figures then extrapolated, labelled)")
    parser.add_argument("--naive-budget-gb", type=float, default=None, help=argparse.SUPPRESS)  # testing the fallback


def run(args) -> dict:
    if args.repeats < 1:
        raise UsageError(f"--repeats is {args.repeats}; pass at least 1.")
    if not os.path.exists("/proc/self/clear_refs"):
        raise RuntimeError("peak-memory measurement needs Linux /proc/self/clear_refs")
    shape = dict(QUICK if args.quick else FULL)
    try:
        vocabs = [int(v) for v in args.vocab.split(",")] if args.vocab else shape["draft_vocabs"]
    except ValueError:
        raise UsageError(f"--vocab {args.vocab!r} is not a comma-separated list of integers; pass e.g. "
                         f"--vocab 32000,{shape['vocab']}.") from None
    for v in vocabs:
        if not 1 <= v <= shape["vocab"]:
            raise UsageError(f"draft vocabulary {v} is out of range; pass --vocab sizes in 1..{shape['vocab']}.")
    anchors = args.anchors or shape["anchors"]
    if not 1 <= anchors <= shape["anchors"]:
        raise UsageError(f"--anchors is {anchors}; pass a number in 1..{shape['anchors']}.")
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    busy_warning()
    started = time.time()
    results, table = {}, []
    with tempfile.TemporaryDirectory(prefix="dspark-loss-bench-") as tmp:
        for v in vocabs:
            res, rows = benchmark_vocab(shape, v, anchors, args.repeats, tmp,
                                        None if args.naive_budget_gb is None else args.naive_budget_gb * 2**30,
                                        args.threads)
            results[str(v)] = res
            table += rows
    out = dict(shape=shape, measured_anchors=anchors, loss_weights=LOSS_WEIGHTS,
               torch=torch.__version__, threads=torch.get_num_threads(),
               cpu_count=os.cpu_count(), load_average=os.getloadavg(), seconds=time.time() - started,
               results=results, table=table)
    failed = [k for k, r in results.items() if not r["check"]["ok"]]
    if failed:
        out["failed"] = f"ours and naive disagree on the loss at Vd={','.join(failed)} (relative difference >= 1e-5)"
    return out


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":  # one measurement, in a fresh process (see `spawn`)
        worker(json.loads(sys.argv[2]))
    else:
        common.main(sys.modules[__name__])
