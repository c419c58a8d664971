"""The `dspark-acceptance/1` results format: one home for writing, reading, the subset order and the means.

A results file is what an evaluation measured by actually speculating against the verifier (the in-process
backend in trainer/evaluation/in_process.py; a vLLM server backend writes the same file). The model card renders it
(trainer/export/card.py) through `read_results`. Keys:

    schema                        "dspark-acceptance/1"
    backend, block_size           how it was measured, and for which block size B
    sampling                      {"temperature": T, "top_p": .., "top_k": ..} (T = 0: greedy)
    draft_method                  how the drafts were drawn: "greedy" (vLLM's default `draft_sample_method`: the
                                  argmax, verified as one-hot), "probabilistic" (vLLM's other method: sampled at
                                  T only, no top-k/top-p) or "filtered" (sampled with the verifier's top-k/top-p,
                                  not what vLLM serves); always "greedy" at T = 0, where every method is.
                                  Files written before it was recorded have no key (see `recorded_draft_method`)
    max_new_tokens, concurrency
    last_block                    how a generation's last verification step counts when it runs into
                                  max_new_tokens: "full" (vLLM's way, and the in-process default: the step drafts a
                                  whole block and counts every token it accepts, though the output is cut at
                                  max_new_tokens) or "clamped" (llama.cpp's: the draft is cut to the tokens left, and
                                  with one token left there is no draft and no step; see `clamp_last_block`).
                                  Files written before it was recorded have no key (they count "full")
    subsets.<name>                acceptance_length (1.0 .. B+1), pos [B] (pos[k]: share of steps accepting
                                  >= k+1 drafts), steps, prompts, generated_tokens, and with throughput
                                  tokens_per_s, paired_tokens_per_s, baseline_tokens_per_s, speedup (paired / baseline: the same prompts)
                                  fidelity check (greedy only; null when not run, e.g. at T > 0):
                                  teacher_forced_acceptance_length (mean over the compared steps of the
                                  acceptance the drafter's training forward predicts on the generated
                                  sequence), measured_acceptance_length_compared (the measured acceptance
                                  over exactly those steps: the number to compare it with, since a prompt's
                                  last step may go uncompared), fidelity_steps (steps compared),
                                  fidelity_steps_differing (compared steps whose teacher-forced value differs
                                  from the measured one; 0 unless training forward and draft() disagree, or
                                  at argmax ties)
    weighted_acceptance_length    mean over all steps (subsets weighted by steps)
    unweighted_acceptance_length  plain mean of the subset means
    total_steps
    drafter, drafter_weights_sha256, verifier, dataset, date, machine, versions   provenance
    drafter_source_weights_sha256 when the drafter is an export (`push_to_hub.py`, also --dry-run): the
                                  weights sha256 of the checkpoint it was staged from, which its safetensors
                                  metadata records (`SOURCE_WEIGHTS_KEY`); null otherwise. The bf16 export's
                                  own sha256 differs from the checkpoint's, so this is what lets results
                                  measured on the export pair with the checkpoint when it is pushed
    other_drafters.<name>.<subset>   optional: other drafters on the same prompts (acceptance_length, tokens_per_s)

Acceptance length and `pos` are reduced from per-step committed counts by the `evaluate` metric module
`trainer/evaluation/metrics/dspark_acceptance` (`ACCEPTANCE_METRIC`), which every backend goes through.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path

from configuration_dspark import is_hub_id
from modeling_dspark import DRAFT_METHODS  # how `draft()` draws its tokens; results record which one
from trainer import REPO_ROOT
from trainer.errors import UsageError
from trainer.evaluation.metrics.dspark_acceptance.dspark_acceptance import means
from trainer.files import is_local, write_json_atomic, write_text_atomic

SCHEMA = "dspark-acceptance/1"
# The safetensors metadata key under which an export records the weights sha256 of the checkpoint it was staged from
# (metadata, not a tensor or a config key: vLLM and speculators reject unknown ones, and ignore metadata).
SOURCE_WEIGHTS_KEY = "dspark_source_weights_sha256"
# The nine RedHatAI/speculator_benchmarks subsets, in the order tables and cards list them.
SUBSETS = ("math_reasoning", "HumanEval", "question", "writing", "translation", "rag", "tool_call", "qa",
           "summarization")
ACCEPTANCE_METRIC = str(Path(__file__).resolve().parent / "metrics" / "dspark_acceptance")
DRAFT_DESCRIPTIONS = {
    "greedy": "the argmax of the draft logits, verified as a one-hot distribution (vLLM's default, "
              "`draft_sample_method: greedy`)",
    "probabilistic": "sampled from the draft logits at the verifier's temperature only, no top-k/top-p (vLLM's "
                     "`draft_sample_method: probabilistic`)",
    "filtered": "sampled from the draft logits with the verifier's temperature, top-k and top-p (not a method vLLM "
                "serves)",
}


class ResultsError(UsageError):
    """A results file that cannot be used as asked; one sentence with cause and fix."""


def ordered(subsets: dict) -> list[tuple[str, dict]]:
    """`(name, value)` pairs in the canonical subset order, other subsets after them by name."""
    known = [(k, subsets[k]) for k in SUBSETS if k in subsets]
    return known + sorted((k, v) for k, v in subsets.items() if k not in SUBSETS)


def is_hub_dataset(name) -> bool:
    """A Hub dataset id (metadata-worthy) rather than a local file or directory. Runs are usually launched from
    the package root, so a relative path is also looked up there, not only in the cwd."""
    return isinstance(name, str) and "/" in name and not is_local(name) and not (REPO_ROOT / name).exists()


# ------------------------------------------------------------------------------------------ measuring
LAST_BLOCK = ("full", "clamped")


def clamp_last_block(committed_per_step: list[int], max_new_tokens: int) -> list[int]:
    """A generation's committed tokens per step as llama.cpp counts them, from the full-block counts.

    The first generated token comes from the prefill (no step). llama.cpp drafts at most `left - 1` tokens when
    `left` tokens remain to `max_new_tokens`, so the step commits `min(committed, left)`; with one token left it
    drafts nothing and decodes plainly, which is not a verification step. This is the count of a cut block that
    drafts what the whole block's first `left - 1` slots draft. llama.cpp runs the cut block as a shorter block,
    whose slots attend to fewer mask slots than in training (full-attention layers see their whole block), so its
    drafts there can differ: only the steps that draft a whole block (`left > B`) compare exactly across engines
    (benchmarks/llamacpp.py compares those separately)."""
    out, generated = [], 1
    for committed in committed_per_step:
        left = max_new_tokens - generated
        if left <= 1:
            break
        out.append(min(committed, left))
        generated += out[-1]
    return out



@dataclass
class AcceptanceStats:
    """What one subset measured: committed tokens per verification step, plus generation timing."""

    block_size: int
    committed: list[int] = field(default_factory=list)
    prompts: int = 0
    generated_tokens: int = 0
    seconds: float = 0.0
    baseline_tokens: int = 0
    baseline_seconds: float = 0.0
    paired_tokens: int = 0  # drafter tokens and time on the prompts the baseline was also timed on
    paired_seconds: float = 0.0
    # fidelity check (trainer/evaluation/in_process.py `teacher_forced_acceptance`): None until a check was recorded
    teacher_forced: list[int] | None = None  # teacher-forced acceptance of each compared step
    measured_compared: list[int] | None = None  # measured acceptance of the same steps, in the same order
    fidelity_steps_differing: int = 0

    def add(self, committed_per_step: list[int], generated_tokens: int, seconds: float) -> None:
        bad = [c for c in committed_per_step if not 1 <= c <= self.block_size + 1]
        if bad:
            raise ValueError(f"a verification step committed {bad[0]} tokens, outside 1..{self.block_size + 1}.")
        self.committed.extend(committed_per_step)
        self.prompts += 1
        self.generated_tokens += generated_tokens
        self.seconds += seconds

    def add_fidelity(self, teacher_forced: list[int], measured: list[int]) -> None:
        """Record one prompt's fidelity check: the teacher-forced and the measured acceptance of each compared
        step, pairwise. The measured values are kept apart from `committed` because the check may leave steps
        out (a last step cut by the sequence end): the means to compare are over the same steps."""
        if len(teacher_forced) != len(measured):
            raise ValueError(f"{len(teacher_forced)} teacher-forced values for {len(measured)} measured steps; pass "
                             f"one of each per compared step.")
        bad = [c for c in [*teacher_forced, *measured] if not 1 <= c <= self.block_size + 1]
        if bad:
            raise ValueError(f"a compared acceptance of {bad[0]} is outside 1..{self.block_size + 1}.")
        if self.teacher_forced is None:
            self.teacher_forced, self.measured_compared = [], []
        self.teacher_forced.extend(teacher_forced)
        self.measured_compared.extend(measured)
        self.fidelity_steps_differing += sum(t != m for t, m in zip(teacher_forced, measured))


def reduce(stats: dict[str, AcceptanceStats], block_size: int) -> dict:
    """The `subsets` section and the means, reduced through the `dspark_acceptance` evaluate metric."""
    import evaluate

    metric = evaluate.load(ACCEPTANCE_METRIC)
    committed = [c for s in stats.values() for c in s.committed]
    names = [name for name, s in stats.items() for _ in s.committed]
    reduced = metric.compute(committed=committed, subset=names, block_size=block_size, subsets=list(stats))
    subsets = {}
    for name, s in stats.items():
        out = {**reduced["subsets"][name], "prompts": s.prompts, "generated_tokens": s.generated_tokens}
        checked = s.teacher_forced is not None
        out["measured_acceptance_length_compared"] = (sum(s.measured_compared) / len(s.measured_compared)
                                                      if checked and s.measured_compared else None)
        out["teacher_forced_acceptance_length"] = (sum(s.teacher_forced) / len(s.teacher_forced)
                                                   if checked and s.teacher_forced else None)
        out["fidelity_steps"] = len(s.teacher_forced) if checked else None
        out["fidelity_steps_differing"] = s.fidelity_steps_differing if checked else None
        if s.seconds:
            out["tokens_per_s"] = s.generated_tokens / s.seconds
        if s.baseline_seconds:
            out["baseline_tokens_per_s"] = s.baseline_tokens / s.baseline_seconds
            if s.paired_seconds:  # same prompts for both sides of the ratio, both recorded so the ratio reads off
                out["paired_tokens_per_s"] = s.paired_tokens / s.paired_seconds
                out["speedup"] = out["paired_tokens_per_s"] / out["baseline_tokens_per_s"]
        subsets[name] = out
    return {"subsets": subsets, **{k: v for k, v in reduced.items() if k != "subsets"}}


def summarize(subsets: dict[str, dict]) -> dict:
    """Weighted (by verification steps) and unweighted means of acceptance length over measured subsets."""
    return means(subsets)


def effective_draft_method(sampling: dict, draft_method: str | None) -> str | None:
    """The draft method a measurement actually used: "greedy" at temperature 0 whatever was asked (every method
    takes the argmax there, in vLLM as in `draft()`), else `draft_method` (None: not known)."""
    if draft_method is not None and draft_method not in DRAFT_METHODS:
        raise ValueError(f"draft method {draft_method!r} is not one of {', '.join(DRAFT_METHODS)}; pass one of them.")
    if isinstance(sampling, dict) and "temperature" in sampling and not sampling["temperature"]:
        return "greedy"
    return draft_method


def build_results(stats: dict[str, AcceptanceStats], *, backend: str, block_size: int, sampling: dict,
                  max_new_tokens: int, concurrency: int = 1, draft_method: str | None = None,
                  last_block: str = "full") -> dict:
    """A `dspark-acceptance/1` dict from what a backend measured (provenance is added by `with_provenance`).

    `draft_method` is recorded as `effective_draft_method` gives it (so "greedy" at temperature 0); a backend that
    does not know it at T > 0 passes None and the key is left out rather than guessed."""
    method = effective_draft_method(sampling, draft_method)
    if last_block not in LAST_BLOCK:
        raise ValueError(f"last_block {last_block!r} is not one of {', '.join(LAST_BLOCK)}.")
    return {"schema": SCHEMA, "backend": backend, "block_size": block_size, "sampling": sampling,
            **({"draft_method": method} if method is not None else {}),
            "max_new_tokens": max_new_tokens, "concurrency": concurrency, "last_block": last_block,
            **reduce(stats, block_size)}


def weights_sha256(directory: str | os.PathLike) -> str | None:
    """SHA-256 over a checkpoint's safetensors files (sorted by name): ties results to the exact weights."""
    directory = os.fspath(directory)
    if not os.path.isdir(directory):
        return None
    files = sorted(f for f in os.listdir(directory) if f.endswith(".safetensors"))
    if not files:
        return None
    digest = hashlib.sha256()
    for name in files:
        with open(os.path.join(directory, name), "rb") as f:
            for chunk in iter(lambda: f.read(1 << 24), b""):
                digest.update(chunk)
    return digest.hexdigest()


def source_weights_sha256(directory: str | os.PathLike) -> str | None:
    """The weights sha256 of the checkpoint that `directory` was exported from, as the export recorded it in its
    safetensors metadata (`SOURCE_WEIGHTS_KEY`); None when it is not an export (a training checkpoint, a Hub id,
    or shards that disagree)."""
    from safetensors import SafetensorError, safe_open

    directory = os.fspath(directory)
    if not os.path.isdir(directory):
        return None
    files = sorted(f for f in os.listdir(directory) if f.endswith(".safetensors"))
    found = set()
    for name in files:
        try:
            with safe_open(os.path.join(directory, name), framework="pt") as f:
                found.add((f.metadata() or {}).get(SOURCE_WEIGHTS_KEY))
        except (SafetensorError, OSError):
            return None
    return found.pop() if len(found) == 1 else None


def with_provenance(results: dict, drafter: str, verifier: str, dataset: str) -> dict:
    """Add what was measured (drafter, its weights' hash and, for an export, its checkpoint's; verifier, prompts)
    and where (date, machine)."""
    import torch
    import transformers

    return {
        **results,
        "drafter": drafter,
        "drafter_weights_sha256": weights_sha256(drafter),
        "drafter_source_weights_sha256": source_weights_sha256(drafter),
        "verifier": verifier,
        "dataset": dataset,
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores"
                   + (f", {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ", no GPU"),
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "python": platform.python_version()},
    }


# ------------------------------------------------------------------------------------------ writing
def format_table(results: dict) -> str:
    """A readable Markdown table of a results dict (per subset, then the means)."""
    B = results["block_size"]
    head = "| subset | acceptance_length | " + " | ".join(f"pos_{k}" for k in range(B)) + " | steps |"
    has_fidelity = any(v.get("fidelity_steps") is not None for v in results["subsets"].values())
    if has_fidelity:  # the measured and teacher-forced means over the same (compared) steps, side by side
        head += " measured_acceptance_length_compared | teacher_forced_acceptance_length | fidelity_steps_differing |"
    has_speed = any("tokens_per_s" in v for v in results["subsets"].values())
    has_baseline = any("baseline_tokens_per_s" in v for v in results["subsets"].values())
    if has_speed:
        # tokens/s is over every prompt; the speedup is over the prompts the baseline was timed on, so the table
        # shows the drafter's tokens/s on those same prompts beside the baseline's: speedup = their ratio.
        head += " tokens/s |" + (" tokens/s, baseline's prompts | baseline tokens/s | speedup |" if has_baseline else "")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for name, v in ordered(results["subsets"]):
        if not v.get("steps"):
            continue
        row = f"| {name} | {v['acceptance_length']:.3f} | " + " | ".join(f"{p:.1%}" for p in v["pos"])
        row += f" | {v['steps']} |"
        if has_fidelity:
            compared = v.get("fidelity_steps")
            for key in ("measured_acceptance_length_compared", "teacher_forced_acceptance_length"):
                row += f" {v[key]:.3f} |" if v.get(key) is not None else " - |"
            row += f" {v['fidelity_steps_differing']} of {compared} |" if compared is not None else " - |"
        if has_speed:
            row += f" {v['tokens_per_s']:.1f} |" if "tokens_per_s" in v else " - |"
            if has_baseline:
                paired = f" {v['paired_tokens_per_s']:.1f} |" if v.get("paired_tokens_per_s") is not None else " - |"
                row += (paired + f" {v['baseline_tokens_per_s']:.1f} | {v['speedup']:.2f}x |" if "speedup" in v
                        else " - | - | - |")
        lines.append(row)
    w, u = results.get("weighted_acceptance_length"), results.get("unweighted_acceptance_length")
    if w is not None:
        lines.append("")
        lines.append(f"Weighted mean acceptance length {w:.3f} over {results['total_steps']} verification steps "
                     f"(unweighted mean over subsets {u:.3f}).")
    if results.get("draft_method") in DRAFT_DESCRIPTIONS:
        lines.append("")
        lines.append(f"Drafts: {results['draft_method']}, {DRAFT_DESCRIPTIONS[results['draft_method']]}.")
    if has_fidelity:
        checked = [v for v in results["subsets"].values() if v.get("fidelity_steps") is not None]
        compared = sum(v["fidelity_steps"] for v in checked)
        differing = sum(v.get("fidelity_steps_differing") or 0 for v in checked)
        lines.append("")
        lines.append(f"Fidelity check (the training forward, teacher-forced on the generated sequences, against the "
                     f"measured greedy acceptance): {differing} of {compared} compared verification steps differ.")
    return "\n".join(lines)


def write_results(results: dict, path: str) -> str:
    """Write the JSON (atomically) and a Markdown table next to it; return the table."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    write_json_atomic(path, results)
    table = format_table(results)
    write_text_atomic(os.path.splitext(path)[0] + ".md", table + "\n")
    return table


# ------------------------------------------------------------------------------------------ reading
@dataclass
class SubsetResult:
    name: str
    acceptance_length: float
    pos: list[float]
    steps: int | None = None
    prompts: int | None = None
    generated_tokens: int | None = None
    tokens_per_s: float | None = None
    baseline_tokens_per_s: float | None = None
    paired_tokens_per_s: float | None = None  # the drafter's tokens/s on the prompts the baseline was timed on
    speedup: float | None = None
    teacher_forced_acceptance_length: float | None = None  # fidelity check; None when not run or not recorded
    measured_acceptance_length_compared: float | None = None  # the measured one over the same steps (newer files)
    fidelity_steps: int | None = None
    fidelity_steps_differing: int | None = None


@dataclass
class AcceptanceResults:
    path: Path
    block_size: int
    subsets: list[SubsetResult]
    sampling: dict = field(default_factory=dict)
    draft_method: str | None = None  # `recorded_draft_method`: None only when the sampling was not recorded either
    draft_method_recorded: bool = True  # False: the file predates the key and `draft_method` is inferred
    backend: str | None = None
    verifier: str | None = None
    dataset: str | None = None
    max_new_tokens: int | None = None
    date: str | None = None
    machine: str | None = None
    versions: dict = field(default_factory=dict)
    weighted: float | None = None
    unweighted: float | None = None
    total_steps: int | None = None
    other_drafters: dict = field(default_factory=dict)
    concurrency: int | None = None
    unmeasured: list[str] = field(default_factory=list)
    last_block: str = "full"  # how the last step of a generation counts (files without the key count "full")

    @property
    def dataset_label(self) -> str:
        """The Hub dataset id, or the last component of a local prompt directory (no machine paths in cards)."""
        if not self.dataset:
            return "unrecorded prompts"
        return self.dataset if is_hub_dataset(self.dataset) else Path(self.dataset).name

    @property
    def greedy(self) -> bool:
        return not self.sampling.get("temperature")

    @property
    def drafts(self) -> str | None:
        """The draft method in two words ("greedy drafts"), None when not known; at temperature 0 it goes without
        saying (every method is greedy there), so `title` and `short` name it only when sampling."""
        return f"{self.draft_method} drafts" if self.draft_method else None

    @property
    def title(self) -> str:
        """The sampling settings and, when sampling, the draft method: they title this file's section and plot
        panel (greedy and T=1 results read differently, and so do greedy and probabilistic drafts at T=1)."""
        if not self.sampling:
            return "Sampling settings not recorded"
        if self.greedy:
            return "Greedy decoding (temperature 0)"
        parts = [f"temperature {self.sampling['temperature']}"]
        parts += [f"{k} {self.sampling[k]}" for k in ("top_p", "top_k", "min_p") if self.sampling.get(k) is not None]
        return "Sampling: " + ", ".join(parts) + (f"; {self.drafts}" if self.drafts else "")

    @property
    def short(self) -> str:
        if self.greedy:
            return "greedy" if self.sampling else "sampling not recorded"
        keys = (("temperature", "T"), ("top_p", "top_p"), ("top_k", "top_k"))
        parts = [f"{label}={self.sampling[k]}" for k, label in keys if self.sampling.get(k) is not None]
        return ", ".join(parts + ([self.drafts] if self.drafts else []))

    def best(self) -> SubsetResult:
        return max(self.subsets, key=lambda s: s.acceptance_length)


def _number(value, where: str, path: Path, integer: bool = False, required: bool = False):
    if value is None and not required:
        return None
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or (integer and float(value) != int(value)):
        kind = "integer" if integer else "number"
        raise ResultsError(f"eval results {path}: {where} is {value!r}, not a finite {kind}; regenerate the file with "
                        f"trainer/evaluation/in_process.py.")
    return int(value) if integer else float(value)


def recorded_draft_method(data: dict, path: Path) -> tuple[str | None, bool]:
    """`(draft method, whether the file records it)` of a results dict.

    Files written before the key existed hold none, and get the method their backend drafted with then: "greedy"
    at temperature 0 (every method is greedy there); at T > 0 "filtered" for the in-process backend (`draft()`
    sampled from the top-k/top-p-filtered distribution until the draft methods existed) and "greedy" for a vLLM
    server (vLLM's default `draft_sample_method`). Without recorded sampling settings the method is unknown (None).
    A recorded method is normalised to "greedy" at temperature 0, as `build_results` writes it."""
    sampling = data.get("sampling") if isinstance(data.get("sampling"), dict) else {}
    recorded = data.get("draft_method")
    if recorded is not None:
        if recorded not in DRAFT_METHODS:
            raise ResultsError(f"eval results {path} record draft_method {recorded!r}, not one of "
                               f"{', '.join(DRAFT_METHODS)}; regenerate the file with trainer/evaluation/in_process.py.")
        return effective_draft_method(sampling, recorded), True
    if "temperature" not in sampling:
        return None, False
    if not sampling["temperature"]:
        return "greedy", False
    return ("greedy" if data.get("backend") == "vllm" else "filtered"), False


def read_results(path: str | os.PathLike, block_size: int, verifier_id: str | None = None,
                      weights_sha256: str | None = None) -> AcceptanceResults:
    """Read one results JSON defensively: every required field is checked, optional ones may be absent."""
    path = Path(path)
    if not path.is_file():
        raise ResultsError(f"eval results file {path} does not exist; pass the JSON written by trainer/evaluation/in_process.py.")
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ResultsError(f"eval results {path} is not valid JSON ({e}); pass the file written by "
                        f"trainer/evaluation/in_process.py.") from e
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        schema = data.get("schema") if isinstance(data, dict) else None
        raise ResultsError(f"eval results {path} has schema {schema!r}, not {SCHEMA!r}; pass a file written by "
                        f"trainer/evaluation/in_process.py.")
    measured = _number(data.get("block_size"), "block_size", path, integer=True, required=True)
    if measured != block_size:
        raise ResultsError(f"eval results {path} were measured with block size {measured} but this drafter has block size "
                        f"{block_size}; pass results measured for this drafter.")
    verifier = data.get("verifier")
    if verifier_id and is_hub_id(verifier) and verifier != verifier_id:
        raise ResultsError(f"eval results {path} were measured with verifier {verifier} but this drafter's verifier is "
                        f"{verifier_id}; pass results measured for this drafter.")
    # Measured on this checkpoint itself, or on an export of it (whose bf16 weights hash differently, so the export
    # records the checkpoint's hash, `drafter_source_weights_sha256`); results that record neither are not refused.
    measured_weights, source = data.get("drafter_weights_sha256"), data.get("drafter_source_weights_sha256")
    if weights_sha256 and (measured_weights or source) and weights_sha256 not in (measured_weights, source):
        what = f"sha256 {measured_weights[:12]}" if measured_weights else "an export"
        what += f", exported from {source[:12]}," if source else ""
        raise ResultsError(f"eval results {path} were measured on different drafter weights than this checkpoint's "
                        f"({what} vs {weights_sha256[:12]}); evaluate this checkpoint, or its push_to_hub.py "
                        f"--dry-run export, and pass that file.")
    raw = data.get("subsets")
    if not isinstance(raw, dict) or not raw:
        raise ResultsError(f"eval results {path} has no subsets; regenerate the file with trainer/evaluation/in_process.py.")
    ordered = [s for s in SUBSETS if s in raw] + sorted(s for s in raw if s not in SUBSETS)
    subsets, unmeasured = [], []
    for name in ordered:
        entry = raw[name] if isinstance(raw[name], dict) else {}
        if entry.get("acceptance_length") is None and not entry.get("steps"):
            unmeasured.append(name)  # trainer/evaluation/in_process.py writes nulls for a subset without verification steps
            continue
        pos = entry.get("pos")
        if not isinstance(pos, list) or len(pos) != block_size:
            raise ResultsError(f"eval results {path}: subsets.{name}.pos has "
                            f"{len(pos) if isinstance(pos, list) else 'no'} values, expected {block_size} (one per "
                            f"draft position); regenerate the file with trainer/evaluation/in_process.py.")
        w = f"subsets.{name}."
        subsets.append(SubsetResult(
            name=name,
            acceptance_length=_number(entry.get("acceptance_length"), w + "acceptance_length", path, required=True),
            pos=[_number(p, f"{w}pos[{k}]", path, required=True) for k, p in enumerate(pos)],
            steps=_number(entry.get("steps"), w + "steps", path, integer=True),
            prompts=_number(entry.get("prompts"), w + "prompts", path, integer=True),
            generated_tokens=_number(entry.get("generated_tokens"), w + "generated_tokens", path, integer=True),
            tokens_per_s=_number(entry.get("tokens_per_s"), w + "tokens_per_s", path),
            baseline_tokens_per_s=_number(entry.get("baseline_tokens_per_s"), w + "baseline_tokens_per_s", path),
            paired_tokens_per_s=_number(entry.get("paired_tokens_per_s"), w + "paired_tokens_per_s", path),
            speedup=_number(entry.get("speedup"), w + "speedup", path),
            teacher_forced_acceptance_length=_number(entry.get("teacher_forced_acceptance_length"),
                                                     w + "teacher_forced_acceptance_length", path),
            measured_acceptance_length_compared=_number(entry.get("measured_acceptance_length_compared"),
                                                        w + "measured_acceptance_length_compared", path),
            fidelity_steps=_number(entry.get("fidelity_steps"), w + "fidelity_steps", path, integer=True),
            fidelity_steps_differing=_number(entry.get("fidelity_steps_differing"), w + "fidelity_steps_differing",
                                             path, integer=True),
        ))
    if not subsets:
        raise ResultsError(f"eval results {path} has no measured subset (no verification steps in {unmeasured}); rerun "
                        f"trainer/evaluation/in_process.py with prompts that generate tokens.")
    total = _number(data.get("total_steps"), "total_steps", path, integer=True) or None
    weighted = _number(data.get("weighted_acceptance_length"), "weighted_acceptance_length", path)
    recomputed = means({s.name: {"acceptance_length": s.acceptance_length, "steps": s.steps or 0} for s in subsets})
    if all(s.steps for s in subsets):
        total = total if total is not None else recomputed["total_steps"]
        if weighted is None:
            weighted = recomputed["weighted_acceptance_length"]
    unweighted = _number(data.get("unweighted_acceptance_length"), "unweighted_acceptance_length", path)
    if unweighted is None:
        unweighted = sum(s.acceptance_length for s in subsets) / len(subsets)
    others = data.get("other_drafters") if isinstance(data.get("other_drafters"), dict) else {}
    sampling = data.get("sampling") if isinstance(data.get("sampling"), dict) else {}
    draft_method, draft_method_recorded = recorded_draft_method(data, path)
    return AcceptanceResults(
        path=path, block_size=block_size, subsets=subsets, sampling=sampling, draft_method=draft_method,
        draft_method_recorded=draft_method_recorded, backend=data.get("backend"),
        verifier=verifier, dataset=data.get("dataset"), max_new_tokens=data.get("max_new_tokens"),
        date=data.get("date"), machine=data.get("machine"),
        versions=data.get("versions") if isinstance(data.get("versions"), dict) else {},
        weighted=weighted, unweighted=unweighted, total_steps=total,
        other_drafters={k: v for k, v in others.items() if isinstance(v, dict)},
        concurrency=_number(data.get("concurrency"), "concurrency", path, integer=True), unmeasured=unmeasured,
        last_block="clamped" if data.get("last_block") == "clamped" else "full",
    )

