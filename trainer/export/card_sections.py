"""The model card's sections, each rendered from `CardInputs` alone (trainer/export/card.py assembles them into the
template `card.md`): architecture, training, calibration, evaluation results, serving options, usage,
limitations and provenance.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path
from types import SimpleNamespace

from trainer.config import RUN_CONFIG_FILE
from trainer.contract import read_json
from trainer.evaluation.results import DRAFT_DESCRIPTIONS, AcceptanceResults, SubsetResult, is_hub_dataset
from trainer.export.plots import CALIBRATION_PLOT_FILE, PLOT_FILE
from trainer.train.checkpoints import CALIBRATION_FILE, DATA_STATS_FILE, Checkpoint, CheckpointError

_CALIBRATION_KEYS = {"a": (int, float), "c": (int, float), "n_slots": int, "ece_before": (int, float),
                     "ece_after": (int, float), "cumprod_bias_before": list, "cumprod_bias_after": list,
                     "reliability_before": list, "reliability_after": list}


@dataclass
class CardInputs:
    """Everything the card is generated from; no number in the card comes from anywhere else."""

    repo_id: str
    verifier_id: str
    config: dict  # the staged config.json
    tensors: dict  # the staged tensors
    checkpoint: Checkpoint
    run_config: dict | None
    trainer_state: dict | None
    summary: dict | None
    results: list[AcceptanceResults]
    license: str
    revision: str | None


def read_calibration(directory: Path) -> dict | None:
    """The checkpoint's confidence calibration record (`CALIBRATION_FILE`), None when it has none."""
    path = Path(directory) / CALIBRATION_FILE
    if not path.exists():
        return None
    record = read_json(path)
    bad = [k for k, kind in _CALIBRATION_KEYS.items() if not isinstance(record.get(k), kind)]
    if bad:
        raise CheckpointError(f"{path} lacks valid {', '.join(bad)}; restore it from the run, or delete it to export "
                              f"the checkpoint without its calibration record.")
    return record



def _fmt_count(n: int) -> str:
    for scale, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "k")):
        if n >= scale:
            return f"{n / scale:.3g}{suffix}"
    return str(n)


def _hub_link(repo: str, kind: str = "") -> str:
    return f"[{repo}](https://huggingface.co/{kind}{repo})"


def _train_datasets(run_config: dict | None) -> list[str]:
    data = (run_config or {}).get("data") or {}
    names = data.get("train_data")
    names = names if isinstance(names, list) else [names]
    return [n for n in names if is_hub_dataset(n)]


def _describe_data(names) -> str:
    names = names if isinstance(names, list) else [names]
    shown = [_hub_link(n, "datasets/") if is_hub_dataset(n) else f"a local dataset (`{Path(str(n)).name}`)"
             for n in names if n]
    return ", ".join(shown) or "not recorded"


def _layer_summary(types: list[str], window, non_causal: bool) -> str:
    """Runs of equal layer types, e.g. "layers 0–2: sliding-window attention (window 2048) ...; layer 3: full"."""
    runs, start = [], 0
    for i in range(1, len(types) + 1):
        if i == len(types) or types[i] != types[start]:
            runs.append((start, i - 1, types[start]))
            start = i
    parts = []
    for a, b, kind in runs:
        where = f"Layer {a}" if a == b else f"Layers {a}–{b}"
        if kind == "sliding_attention":
            inside = "bidirectional" if non_causal else "causal"
            parts.append(f"{where}: sliding-window attention (window {window}, {inside} inside the block)")
        else:
            parts.append(f"{where}: full attention (bidirectional inside the block)")
    return "; ".join(parts)


def architecture_section(inputs: CardInputs) -> str:
    c = inputs.config
    layer = c["transformer_layer_config"]
    snap = c.get("verifier_text_config") or {}
    params = sum(t.numel() for t in inputs.tensors.values() if t.is_floating_point())
    heads, kv = layer["num_attention_heads"], layer["num_key_value_heads"]
    n_layers = layer["num_hidden_layers"]
    attention = "GQA" if kv < heads else "MHA"
    vocab, draft_vocab = layer["vocab_size"], c.get("draft_vocab_size") or layer["vocab_size"]
    non_causal = bool(c.get("sliding_window_non_causal"))
    rows = [
        f"- Qwen3-style decoder with {n_layers} draft layer{'s' if n_layers != 1 else ''}; {params:,} saved "
        f"parameters (~{_fmt_count(params)}), {c.get('dtype', 'bfloat16')}",
        f"- Hidden size {layer['hidden_size']} (the verifier's), MLP size {layer['intermediate_size']} (SwiGLU)",
        f"- {heads} query heads over {kv} KV heads ({attention}, head dim {layer.get('head_dim')}), RoPE theta "
        f"{(layer.get('rope_parameters') or {}).get('rope_theta')}",
        f"- {_layer_summary(layer.get('layer_types') or [], layer.get('sliding_window'), non_causal)}",
        f"- Block size {c['block_size']}: {c['block_size']} draft tokens per verification step (anchor-first "
        f"layout), so acceptance length ranges from 1.0 to {c['block_size'] + 1}.0",
    ]
    if draft_vocab < vocab:
        how = " (the most frequent supervised tokens of the training data)" if inputs.run_config else ""
        rows.append(f"- Draft vocabulary of {draft_vocab:,} tokens, reduced from the verifier's {vocab:,}{how}; "
                    f"`d2t` maps draft ids to verifier ids")
    else:
        rows.append(f"- Full verifier vocabulary ({vocab:,} tokens): the output head is the verifier's own, shared at "
                    f"load time and not stored here")
    aux = c.get("aux_hidden_state_layer_ids") or []
    of = f" of its {snap['num_hidden_layers']}" if snap.get("num_hidden_layers") else ""
    rows.append(f"- Aux hidden states from verifier layers {'/'.join(map(str, aux))}{of}, fused by `fc` into the "
                f"context every draft layer attends to")
    rank = c.get("markov_rank") or 0
    rows.append(f"- Rank-{rank} vanilla Markov logit bias over the previous token" if rank else "- No Markov head")
    if c.get("enable_confidence_head", True):
        extra = " (reads the Markov features)" if c.get("confidence_head_with_markov") and rank else ""
        rows.append(f"- Confidence head{extra}: predicts per position whether the verifier will accept the draft")
    rows.append(f"- Input embeddings are the verifier's (shared, not stored); mask token id {c.get('mask_token_id')}")
    return "\n".join(rows)


def _other(r: AcceptanceResults, drafter: str, subset: str) -> SimpleNamespace:
    """Another drafter's measurement on `subset`: its entry holds a subset's keys, so it reads with `SubsetResult`'s
    attribute names (None for whatever that drafter did not record)."""
    entry = r.other_drafters[drafter].get(subset)
    entry = entry if isinstance(entry, dict) else {}
    return SimpleNamespace(**{f.name: entry.get(f.name) for f in fields(SubsetResult)})


def _teacher_forced(inputs: CardInputs) -> float | None:
    """The trainer's validation accept_len for exactly these weights (training-time estimate)."""
    if inputs.checkpoint.kind == "checkpoint" and inputs.trainer_state:
        for entry in inputs.trainer_state.get("log_history", []):
            if entry.get("step") == inputs.checkpoint.step and "eval_accept_len" in entry:
                return float(entry["eval_accept_len"])
        return None
    value = (inputs.summary or {}).get("eval_accept_len")
    return float(value) if isinstance(value, (int, float)) else None


def training_section(inputs: CardInputs) -> str:
    rc = inputs.run_config
    if not rc:
        return (f"No run configuration (`{RUN_CONFIG_FILE}`) was found in the checkpoint, so the training setup is "
                f"not recorded here.")
    m, d, t = rc.get("model") or {}, rc.get("data") or {}, rc.get("train") or {}
    rows = []
    step = inputs.checkpoint.step
    where = "the run's final model" if inputs.checkpoint.kind == "final" else inputs.checkpoint.path.name
    length = f"{t.get('max_steps')} steps" if (t.get("max_steps") or -1) > 0 else f"{t.get('num_train_epochs')} epochs"
    rows.append(f"- Weights from {where}" + (f" (optimizer step {step:,})" if step is not None else "") +
                f" of a run planned for {length}")
    if t.get("optimizer") == "muon":
        muon_lr = t.get("muon_learning_rate") or t.get("learning_rate")
        rows.append(f"- Optimizer: Muon for `fc` and the draft layers' projection matrices (lr {muon_lr}, weight "
                    f"decay {t.get('muon_weight_decay')}), AdamW for norms and the Markov and confidence heads (lr "
                    f"{t.get('learning_rate')}, weight decay {t.get('weight_decay')})")
    else:
        rows.append(f"- Optimizer: {t.get('optimizer')} (lr {t.get('learning_rate')}, weight decay "
                    f"{t.get('weight_decay')})")
    warmup = t.get("warmup_ratio")
    rows.append(f"- Schedule: {t.get('lr_scheduler_type')}" +
                (f" with {warmup:.0%} warmup" if isinstance(warmup, (int, float)) else "") +
                f", gradient clipping {t.get('max_grad_norm')}")
    rows_per_step = t.get("per_device_train_batch_size")
    rows.append(f"- Batch: {rows_per_step} packed row{'' if rows_per_step == 1 else 's'} per device and step, "
                f"gradient accumulation {t.get('gradient_accumulation_steps')} (device count not recorded)")
    rows.append(f"- Loss: {json.dumps(t.get('loss_weights'))} (CE target: {t.get('ce_target')}), confidence BCE weight "
                f"{t.get('confidence_weight')}, position decay exp(−k/γ) with γ = {t.get('decay_gamma')}")
    if t.get("teacher_vocab") or t.get("confidence_target"):  # recorded by runs since these options exist
        teacher = {"draft": "the verifier's distribution renormalised over the draft vocabulary",
                   "full": "the verifier's full-vocabulary probabilities of the draft tokens"}.get(
                       t.get("teacher_vocab"), f"`{t.get('teacher_vocab')}`")
        target = _TARGETS.get(t.get("confidence_target"), f"`{t.get('confidence_target')}`")
        rows.append(f"- Teacher: {teacher}; confidence head trained for {target}")
    rows.append(f"- Anchors: up to {t.get('max_anchors')} per document, sampled fresh each step on supervised "
                f"positions")
    samples = f", up to {d['max_samples']:,} samples" if d.get("max_samples") else ""
    rows.append(f"- Data: {_describe_data(d.get('train_data'))} (split `{d.get('train_split')}`{samples}), "
                f"assistant tokens supervised; {1 - (d.get('validation_ratio') or 0):.0%}/"
                f"{(d.get('validation_ratio') or 0):.0%} train/validation split")
    stats = _data_stats(inputs)
    if stats:
        rows.append(f"- Trained on {stats['train_conversations']:,} conversations "
                    f"({stats['train_supervised_tokens']:,} supervised tokens in {stats['train_rows']:,} packed rows); "
                    f"{stats['validation_conversations']:,} held out for validation; data preparation kept "
                    f"{stats['kept']:,} of {stats['total']:,} rows")
    else:
        rows.append(f"- Data statistics: not recorded (`{DATA_STATS_FILE}` missing from the checkpoint)")
    rows.append(f"- Sequence lengths: conversations capped at {d.get('max_seq_length')} tokens, packed into training "
                f"rows of {d.get('total_seq_length')} tokens")
    if m.get("init_from"):
        lora = f", adapted with LoRA rank {m.get('lora_rank')} (merged)" if m.get("lora_rank") else ""
        rows.append(f"- Initialised from an existing drafter (`{Path(str(m['init_from'])).name}`){lora}")
    rows.append(f"- Seed {t.get('seed')}")
    estimate = _teacher_forced(inputs)
    if estimate is not None:
        rows.append(f"- Validation acceptance length for these weights, teacher-forced during training: {estimate:.3f} "
                    f"(a training-time estimate, not a serving measurement)")
    return "\n".join(rows)


def _data_stats(inputs: CardInputs) -> dict | None:
    """The data statistics (`DATA_STATS_FILE`) the trainer writes into every checkpoint (None for older ones)."""
    path = inputs.checkpoint.path / DATA_STATS_FILE
    if not path.exists():
        return None
    stats = read_json(path)
    keys = ("train_conversations", "train_supervised_tokens", "train_rows", "validation_conversations", "kept", "total")
    return stats if all(isinstance(stats.get(k), int) for k in keys) else None


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def _speedup(s: SubsetResult) -> float | None:
    if s.speedup is not None:
        return s.speedup
    if s.tokens_per_s and s.baseline_tokens_per_s:
        return s.tokens_per_s / s.baseline_tokens_per_s
    return None


_BACKENDS = {"transformers": "in-process", "vllm": "vLLM server", "llama.cpp": "llama.cpp server (CPU)"}


_DRAFTS_AS = {"greedy": "greedy drafts as vLLM serves by default",
              "probabilistic": "probabilistic drafts (temperature only) as vLLM samples them",
              "filtered": "top-k/top-p-filtered drafts, not what vLLM serves"}


def _heading(r: AcceptanceResults) -> str:
    """A results file's section heading: where it was measured, the sampling settings and how the drafts were drawn
    (the same sampling reads differently with greedy and with probabilistic drafts), e.g. "Acceptance (in-process;
    T = 1; greedy drafts as vLLM serves by default)"."""
    parts = [_BACKENDS.get(r.backend, r.backend)] if r.backend else []
    if not r.sampling:
        parts.append("sampling settings not recorded")
    elif r.greedy:
        parts.append("T = 0: greedy decoding and greedy drafts")
    else:
        extra = [f"{k} {r.sampling[k]}" for k in ("top_p", "top_k", "min_p") if r.sampling.get(k) is not None]
        parts.append(", ".join([f"T = {r.sampling['temperature']:g}", *extra]))
        parts.append(_DRAFTS_AS.get(r.draft_method, "draft method not recorded"))
    return f"Acceptance ({'; '.join(parts)})"


def _drafts_line(r: AcceptanceResults) -> str | None:
    """The setup line saying how the drafts were drawn, and whether the file records it or it was inferred."""
    if r.draft_method not in DRAFT_DESCRIPTIONS:
        return None
    line = f"- Drafts: {r.draft_method}, {DRAFT_DESCRIPTIONS[r.draft_method]}"
    if r.greedy:
        line += "; at temperature 0 every draft method takes the argmax"
    if not r.draft_method_recorded:
        line += " (not recorded in this file, which predates the record: inferred from its backend and temperature)"
    return line


def _results_section(r: AcceptanceResults, block: int) -> str:
    out = []
    dataset = _hub_link(r.dataset, "datasets/") if is_hub_dataset(r.dataset) else \
        f"local prompt set `{r.dataset_label}`" if r.dataset else "not recorded"
    prompts = sum(s.prompts for s in r.subsets if s.prompts)
    setup = [f"- Dataset: {dataset} ({len(r.subsets)} subsets" + (f", {prompts:,} prompts)" if prompts else ")")]
    if r.unmeasured:
        setup.append(f"- Not measured (no verification steps): {', '.join(r.unmeasured)}")
    drafts = _drafts_line(r)
    if drafts:
        setup.append(drafts)
    if r.max_new_tokens:
        setup.append(f"- Up to {r.max_new_tokens} new tokens per prompt" + (
            "; the last blocks of a generation cut to the tokens left, as llama.cpp drafts them"
            if r.last_block == "clamped" else ""))
    if r.backend:
        setup.append(f"- Backend: {r.backend}")
    if r.machine:
        setup.append(f"- Hardware: {r.machine}")
    if r.versions:
        setup.append("- Versions: " + ", ".join(f"{k} {v}" for k, v in r.versions.items()))
    if r.date:
        setup.append(f"- Date: {r.date}")
    out.append("\n".join(setup))
    out.append(f"`acceptance_length` is the mean number of tokens committed per verification step, bonus token "
               f"included: its floor is 1.0 and its ceiling is {block + 1}.0 at block size {block}. `pos_k` is the "
               f"share of steps that accepted at least k+1 drafts.")
    header = ["subset", "acceptance_length", *[f"pos_{k}" for k in range(block)]]
    out.append(_table(header, [[s.name, f"{s.acceptance_length:.3f}", *map(_pct, s.pos)] for s in r.subsets]))
    if r.weighted is not None and r.total_steps:
        out.append(f"Weighted across all subsets: {r.weighted:.3f} over {r.total_steps:,} verification steps "
                   f"(unweighted mean of the subsets: {r.unweighted:.3f}).")
    else:
        out.append(f"Unweighted mean across subsets: {r.unweighted:.3f} (step counts were not recorded, so no weighted "
                   f"mean).")
    best, worst = r.best(), min(r.subsets, key=lambda s: s.acceptance_length)
    if len(r.subsets) > 1:
        out.append(f"Highest on {best.name} ({best.acceptance_length:.2f}, pos_{block - 1} {_pct(best.pos[-1])}), "
                   f"lowest on {worst.name} ({worst.acceptance_length:.2f}).")
    fidelity = _fidelity(r)
    if fidelity:
        out.append(fidelity)
    out.append(_throughput(r))
    comparison = _comparison(r)
    if comparison:
        out.append(comparison)
    return "\n\n".join(out)


def _fidelity(r: AcceptanceResults) -> str | None:
    """The fidelity check of a greedy run (None when it was not run): the measured and the teacher-forced acceptance
    side by side over the same compared steps, so equal numbers mean training and serving agree. Files written
    before the measured mean over the compared steps was recorded show a dash there (their `acceptance_length`
    covers more steps and is no comparison)."""
    checked = [s for s in r.subsets if s.fidelity_steps is not None]
    if not checked:
        return None
    fmt = lambda x: "–" if x is None else f"{x:.3f}"  # noqa: E731
    rows = [[s.name, f"{s.fidelity_steps} of {s.steps}" if s.steps else str(s.fidelity_steps),
             fmt(s.measured_acceptance_length_compared), fmt(s.teacher_forced_acceptance_length),
             str(s.fidelity_steps_differing) if s.fidelity_steps_differing is not None else "–"] for s in checked]
    return ("#### Fidelity check (training forward against serving-time drafting)\n\nThe drafter's training forward, "
            "teacher-forced on each generated sequence with one block at every actual verification step, predicts "
            "the greedy acceptance of each step; both means are over the same compared steps (a prompt's last step "
            "goes uncompared when its block runs past the sequence), so they agree exactly unless training and "
            "drafting compute different things (or at numerical argmax ties).\n\n"
            + _table(["subset", "steps compared", "measured acceptance_length", "teacher-forced acceptance_length",
                      "steps differing"], rows))


def _throughput(r: AcceptanceResults) -> str:
    measured = [s for s in r.subsets if s.tokens_per_s is not None]
    if not measured:
        return "Throughput was not measured in these results."
    others = list(r.other_drafters)
    header = ["subset", "baseline (no drafter)", *others, "DSpark (this model)", "DSpark speedup"]
    rows, ratios = [], {name: [] for name in ["baseline", *others, "this"]}
    for s in measured:
        base = s.baseline_tokens_per_s
        row = [s.name, f"{base:.1f}" if base else "–"]
        for name in others:
            tps = _other(r, name, s.name).tokens_per_s
            row.append(f"{tps:.1f}" if isinstance(tps, (int, float)) else "–")
            if isinstance(tps, (int, float)) and base:
                ratios[name].append(tps / base)
        speed = _speedup(s)
        # on the baseline's prompts when it was timed on fewer, so the speedup is the ratio of the row's numbers
        tps = s.paired_tokens_per_s if s.paired_tokens_per_s is not None else s.tokens_per_s
        row += [f"{tps:.1f}", f"{speed:.2f}×" if speed is not None else "–"]
        if speed is not None:
            ratios["this"].append(speed)
        rows.append(row)
    mean = lambda xs: f"{sum(xs) / len(xs):.2f}×" if xs else "–"  # noqa: E731
    if ratios["this"]:
        rows.append(["average speedup", "1.00×", *[mean(ratios[n]) for n in others], mean(ratios["this"]),
                     mean(ratios["this"])])
    at = f" at concurrency {r.concurrency}" if r.concurrency else ""
    text = (f"#### Throughput (tokens/s)\n\nMean output throughput{at} with the setup above; the last column is "
            f"this drafter's speedup over the verifier alone"
            + (", and the last row each method's mean per-subset speedup." if ratios["this"] else "."))
    return text + "\n\n" + _table(header, rows)


def _comparison(r: AcceptanceResults) -> str | None:
    def measured(name: str, subset: str):
        value = _other(r, name, subset).acceptance_length
        return value if isinstance(value, (int, float)) else None

    others = [n for n in r.other_drafters if any(measured(n, s.name) is not None for s in r.subsets)]
    if not others:
        return None
    header = ["subset", *others, "DSpark (this model)", "best"]
    rows, sums = [], {n: [] for n in [*others, "this"]}
    for s in r.subsets:
        values = {n: measured(n, s.name) for n in others if measured(n, s.name) is not None}
        if not values:
            continue
        candidates = {**values, "DSpark": s.acceptance_length}
        rows.append([s.name, *[f"{values[n]:.3f}" if n in values else "–" for n in others],
                     f"{s.acceptance_length:.3f}", max(candidates, key=candidates.get)])
        if len(values) == len(others):
            for n in others:
                sums[n].append(values[n])
            sums["this"].append(s.acceptance_length)
    if sums["this"]:
        means = {n: sum(v) / len(v) for n, v in sums.items()}
        best = max(means, key=means.get)
        rows.append(["mean (unweighted)", *[f"{means[n]:.3f}" for n in others], f"{means['this']:.3f}",
                     "DSpark" if best == "this" else best])
    return ("#### Comparison with other drafters (acceptance length)\n\nSame prompts and sampling settings. Per-step "
            "draft cost differs between drafters, so acceptance length alone does not determine speed.\n\n"
            + _table(header, rows))




_TARGETS = {"greedy": "greedy drafts checked by a sampling verifier, `p(argmax q)` (vLLM's default drafting)",
            "greedy_t0": "greedy drafts checked by a greedy verifier, `1[argmax q = argmax p]`",
            "sampled": "sampled drafts, `1 - TV(p, q)`",
            "sampled_restricted": "sampled drafts against the teacher renormalised over the draft vocabulary "
                                  "(speculators' target), `1 - TV(p_draft, q)`"}


def calibration_section(inputs: CardInputs) -> str | None:
    """"Confidence calibration": the fold the checkpoint's confidence head carries and what it changed; None for
    a drafter without a confidence head."""
    if not inputs.config.get("enable_confidence_head", True):
        return None
    cal = read_calibration(inputs.checkpoint.path)
    if cal is None:
        return (f"### Confidence calibration\n\nNot recorded: the checkpoint has no `{CALIBRATION_FILE}`, so whether "
                f"the confidence head is calibrated is unknown.")
    block = len(cal["cumprod_bias_before"])
    target = _TARGETS.get(cal.get("confidence_target"), f"`{cal.get('confidence_target')}`")
    fmt = lambda x: "–" if x is None else f"{x:+.3f}"  # noqa: E731
    table = _table(["", *[f"pos_{k}" for k in range(block)]],
                   [["cumulative-product bias before", *map(fmt, cal["cumprod_bias_before"])],
                    ["cumulative-product bias after", *map(fmt, cal["cumprod_bias_after"])]])
    return (f"### Confidence calibration\n\nThe confidence head predicts, per position, the probability that the "
            f"verifier accepts the draft given the earlier ones were accepted, for {target}; vLLM's adaptive "
            f"verification ranks positions by the cumulative product of these probabilities. After training, a "
            f"logistic map `sigmoid(a·z + c)` of the confidence logits z was fitted on {cal['n_slots']:,} validation "
            f"positions (a = {cal['a']:.4f}, c = {cal['c']:+.4f}) and folded into the head's weights, so the "
            f"confidences served are calibrated with no extra configuration. Expected calibration error (10 "
            f"equal-width bins): {cal['ece_before']:.4f} before, {cal['ece_after']:.4f} after.\n\n"
            f"The cumulative-product bias at position k is the mean over validation blocks of the predicted survival "
            f"`prod_(j<=k) sigmoid(c_j)` minus the realised one `prod_(j<=k) target_j` (positive: over-confident).\n\n"
            f"{table}\n\n![Confidence reliability per position]({CALIBRATION_PLOT_FILE})\n\nObserved against "
            f"predicted acceptance per position, before and after the fold.")


def evaluation_section(inputs: CardInputs) -> str:
    calibration = calibration_section(inputs)
    tail = f"\n\n{calibration}" if calibration else ""
    if not inputs.results:
        return ("No evaluation results were given to this export (`push_to_hub.py --eval-results`), so this card "
                "reports no measured acceptance length or throughput." + tail)
    block = inputs.config["block_size"]
    headings = [_heading(r) for r in inputs.results]
    parts = []
    for r, heading in zip(inputs.results, headings):
        heading = heading if headings.count(heading) == 1 else f"{heading} ({r.path.name})"
        parts.append(f"### {heading}\n\n{_results_section(r, block)}")
    parts.append(f"### Per-position acceptance\n\n![Per-position acceptance by subset]({PLOT_FILE})\n\n"
                 f"Share of verification steps that accepted at least k+1 drafts, per subset"
                 + (" (one panel per sampling setting)." if len(inputs.results) > 1 else "."))
    return "\n\n".join(parts) + tail


def summary_section(inputs: CardInputs) -> str:
    c, v = inputs.config, inputs.verifier_id
    block = c["block_size"]
    trained = " trained with the dspark-hf package (a `transformers.Trainer`)" if inputs.run_config else ""
    text = (f"A DSpark draft model for speculative decoding with {_hub_link(v)} as the verifier,{trained}. "
            f"The drafter proposes {block} tokens at a time from the "
            f"verifier's hidden states and the verifier checks them in one forward pass, so the output is identical to "
            f"running the verifier alone: any speedup is lossless.")
    if not inputs.results:
        return text + " No acceptance was measured for this export (see Evaluation)."
    r = inputs.results[0]
    top = sorted(r.subsets, key=lambda s: -s.acceptance_length)[:2]
    mean = (f"Mean acceptance length is {r.weighted:.2f} tokens committed per verification step over "
            f"{r.total_steps:,} steps" if r.weighted is not None and r.total_steps else
            f"Mean acceptance length (unweighted over subsets) is {r.unweighted:.2f} tokens per verification step")
    text += f" {mean} ({r.short})"
    if len(r.subsets) > 1:
        text += ", up to " + " and ".join(f"{s.acceptance_length:.2f} on {s.name}" for s in top)
    text += "."
    speeds = sorted(((s, _speedup(s)) for s in r.subsets if _speedup(s) is not None), key=lambda x: -x[1])[:2]
    if speeds:
        where = f" on {r.machine}" if r.machine else ""
        at = f" at concurrency {r.concurrency}" if r.concurrency else ""
        if speeds[0][1] >= 1.0:
            text += (f" Measured{where}{at}, that gives a throughput speedup over the verifier alone of "
                     + " and ".join(f"{x:.2f}× on {s.name}" for s, x in speeds if x >= 1.0) + ".")
        else:  # say it plainly: a measured slowdown is not a speedup
            s, x = speeds[0]
            text += (f" Measured{where}{at}, generation with the drafter was slower than the verifier alone on every "
                     f"subset (at best {x:.2f}× on {s.name}).")
    return text








def limitations_section(inputs: CardInputs) -> str:
    v = inputs.verifier_id
    rows = [f"- Works only with {_hub_link(v)}: it reads that model's hidden states and shares its embeddings, and is "
            f"not usable as a standalone model or with another verifier."]
    if inputs.results:
        r = inputs.results[0]
        best, worst = r.best(), min(r.subsets, key=lambda s: s.acceptance_length)
        rows.append(f"- Acceptance depends on the traffic: in the measurements above ({r.short}) it ranges from "
                    f"{worst.acceptance_length:.2f} on {worst.name} to {best.acceptance_length:.2f} on {best.name}, so "
                    f"real-world speedup depends on your mix of requests.")
        if not any(x.greedy for x in inputs.results):
            rows.append("- All results were measured with sampling; greedy decoding typically accepts more, so they "
                        "are closer to the conservative case.")
    else:
        rows.append("- Acceptance depends on the traffic, and it was not measured for this export: measure it on your "
                    "own requests before relying on a speedup.")
    rows.append("- Verification is lossless, so the verifier's own behaviour and biases carry through unchanged.")
    return "\n".join(rows)


def provenance_section(inputs: CardInputs, run_config_sha: str | None) -> str:
    ckpt = inputs.checkpoint
    source = ckpt.path.name if ckpt.kind == "checkpoint" else "the run's final model"
    step = f" (step {ckpt.step:,})" if ckpt.step is not None else ""
    rows = [f"- Exported by `push_to_hub.py` from {source}{step}; weights converted to bfloat16 and checked against "
            f"the checkpoint"]
    if run_config_sha:
        rows.append(f"- Run configuration sha256 {run_config_sha[:16]}")
    rows.append(f"- Results files: {', '.join(f'`{r.path.name}`' for r in inputs.results)}" if inputs.results else
                "- Results files: none")
    rows.append("- Every number in this card was read from the checkpoint's `config.json` and weights, its saved run "
                "configuration and trainer state, and the results files listed here; none was typed by hand.")
    return "\n".join(rows)








