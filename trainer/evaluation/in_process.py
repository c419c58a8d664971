"""Acceptance evaluation: measure a drafter by actually speculating against its verifier.

Prompt sets use the `RedHatAI/speculator_benchmarks` layout (one `<subset>.jsonl` per subset with a `prompt`
column), from a local directory or a Hub dataset id. For every prompt the verifier generates with the
drafter (lossless speculative decoding, `generation_dspark.speculative_generate`) and each verification step
records how many tokens it committed. Per subset this gives

* `acceptance_length`: mean tokens committed per verification step, bonus included (1.0 .. B+1);
* `pos`: `pos[k]` = share of steps that accepted at least k+1 drafts (vLLM's per-position acceptance);
* `steps`, and tokens/s with and without the drafter at concurrency 1 when `--throughput` is on;

plus the weighted (by steps) and unweighted means over subsets.

How the drafter draws its drafts is `--draft-method` (`draft()`'s `draft_method`, recorded as the results'
`draft_method`): `greedy` (the default) takes the argmax even when the verifier samples, which is what `vllm serve`
does unless its speculative config sets `draft_sample_method: probabilistic`; `probabilistic` samples at the
temperature only, as vLLM's probabilistic drafting does (no top-k/top-p); `filtered` samples with the verifier's
top-k/top-p too (this backend's behaviour before the methods existed; not what vLLM serves). At temperature 0 all
three are greedy. The output is the verifier's either way; only the acceptance differs, so to report what vLLM gets at
T = 1 run both vLLM methods:

    python -m trainer evaluate --drafter D --prompts P --temperature 1 --draft-method probabilistic --out X.json

At temperature 0 every prompt also gets a *fidelity check* (on by default, `--no-fidelity-check` turns it off):
the drafter's training `forward` is run teacher-forced on the generated sequence (one plain verifier forward
for its aux states, `verifier_hidden_states`), with one block anchored at each actual verification step, and
the greedy acceptance it predicts per step must equal the measured one (see `teacher_forced_acceptance`). A
layout difference between training and `draft()` (anchor, positions, mask, Markov chain, vocabulary mapping)
shows up as differing steps wherever it changes a greedy draft, reported per subset (`teacher_forced_acceptance_length`
beside `measured_acceptance_length_compared`, both over the `fidelity_steps` compared: a prompt's last step may
go uncompared, so `acceptance_length`, over all steps, is not the number to hold it against; and
`fidelity_steps_differing`) and warned about (`FidelityWarning`). At T > 0 acceptance is random, so the check
is skipped and the fields are null.

The JSON format (`dspark-acceptance/1`) and its reduction (the `dspark_acceptance` evaluate metric) live in
`trainer/evaluation/results.py`, shared by every backend (this in-process one; a vLLM server backend writes the same
file); `push_to_hub.py` renders it into the model card.

    python -m trainer evaluate --drafter out/smollm2-135m-dspark --prompts data/demo/heldout \
        --temperature 0 --max-new-tokens 128 --out out/eval-greedy.json
"""

import argparse
import os
import sys
import time
import warnings
from dataclasses import dataclass

import torch

from trainer.errors import Parser, UsageError, run_cli
from trainer.evaluation.prompts import chat_prompt_ids, load_prompt_sets
from trainer.evaluation.results import (
    DRAFT_METHODS,
    LAST_BLOCK,
    AcceptanceStats,
    build_results,
    clamp_last_block,
    format_table,
    with_provenance,
    write_results,
)
from trainer.verifier.loading import generation_kwargs, resolve_sampling

PROG = "python -m trainer evaluate"

__all__ = ["AcceptanceStats", "FidelityCheck", "FidelityWarning", "evaluate_in_process", "format_table",
           "load_prompt_sets", "main", "step_anchors", "teacher_forced_acceptance", "write_results"]


# ------------------------------------------------------------------------------------------ fidelity check
class FidelityWarning(UserWarning):
    """The drafter's training forward predicts another greedy acceptance than `draft()` measured."""


def step_anchors(prompt_length: int, committed_per_step: list[int]) -> list[int]:
    """Sequence index of each verification step's anchor (the last committed token before the step).

    The verifier's prefill produces the first generated token, at index `prompt_length`: the first step drafts
    after it. Each step then commits `committed_per_step[i]` tokens (accepted drafts + the corrected or bonus
    token), and the last of them anchors the next step. So anchor i = `prompt_length + sum(committed[:i])`."""
    anchors, anchor = [], prompt_length
    for committed in committed_per_step:
        anchors.append(anchor)
        anchor += committed
    return anchors


@dataclass
class FidelityCheck:
    """One prompt's fidelity check: per verification step, the anchor, the measured committed count and the
    teacher-forced greedy acceptance (None where the sequence does not determine it: the block runs past the
    end of the sequence while every slot that fits still matches)."""

    anchors: list[int]
    measured: list[int]
    teacher_forced: list[int | None]

    @property
    def compared(self) -> list[int]:
        """Indices of the steps whose teacher-forced value is determined (and so compared)."""
        return [i for i, t in enumerate(self.teacher_forced) if t is not None]

    @property
    def differing(self) -> list[int]:
        """Indices of the compared steps whose teacher-forced value differs from the measured one."""
        return [i for i in self.compared if self.teacher_forced[i] != self.measured[i]]

    @property
    def skipped(self) -> int:
        return len(self.teacher_forced) - len(self.compared)


@torch.no_grad()
def teacher_forced_acceptance(drafter, verifier, sequences: torch.Tensor, prompt_length: int,
                              committed_per_step: list[int], anchors: list[int] | None = None,
                              chunk_slots: int = 512) -> FidelityCheck:
    """The greedy acceptance the drafter's *training* forward predicts for each step of a T=0 generation.

    `sequences` `[1, L]` (prompt + generated tokens) and `committed_per_step` are `speculative_generate`'s
    outputs. The whole sequence is one document; its aux states come from one plain verifier forward
    (`verifier_hidden_states`, as training reads them) and the drafter's `forward` (in the drafter's own
    dtype, fp32 as the CLI loads it) places one block at each step's anchor (`step_anchors`, or `anchors`).
    For the block at anchor p, slot k predicts `x[p+k+1]`; the step's teacher-forced acceptance is the number
    of leading slots whose argmax (mapped to verifier ids) equals `x[p+k+1]`, at most B, plus 1 for the
    corrected or bonus token. At T=0 that is exactly what `draft()` + verification committed (the Markov
    chain conditions slot k on `x[p+k]` in training and on the previous draft when drafting, the same token
    while the drafts match), up to numerical argmax ties. A step is compared only where the sequence
    determines the value (a mismatch inside the sequence, or the whole block inside it); the last step,
    cut by `max_new_tokens` or the end of sequence, may not be.
    """
    from trainer.states.in_process import verifier_hidden_states

    anchors = step_anchors(prompt_length, committed_per_step) if anchors is None else list(anchors)
    measured = list(committed_per_step)
    if len(anchors) != len(measured):
        raise ValueError(f"{len(anchors)} anchors for {len(measured)} verification steps; pass one per step.")
    if not anchors:
        return FidelityCheck(anchors=[], measured=[], teacher_forced=[])
    sequences = sequences.reshape(1, -1)
    length = sequences.shape[1]
    if min(anchors) < 0 or max(anchors) >= length:
        raise ValueError(f"step anchors {min(anchors)}..{max(anchors)} fall outside the sequence of {length} "
                         f"tokens; pass the prompt length and committed counts of this very generation.")
    device = next(drafter.parameters()).device
    verifier_device = next(verifier.parameters()).device
    aux, _ = verifier_hidden_states(verifier, drafter.config.aux_hidden_state_layer_ids,
                                    sequences.to(verifier_device))
    input_ids = sequences.to(device)
    anchor_positions = torch.tensor([anchors], dtype=torch.long, device=device)
    out = drafter(input_ids=input_ids, aux_hidden_states=aux.to(device), anchor_positions=anchor_positions,
                  return_logits=False)
    hidden, previous = out.last_hidden_state[0], out.previous_token_ids[0]  # [N, B, H], [N, B]
    n, block = previous.shape
    per_chunk = max(1, chunk_slots // block)  # bounds the [anchors, B, Vd] logits
    predicted = torch.cat([
        drafter.draft_to_verifier_ids(drafter.compute_logits(hidden[i: i + per_chunk], previous[i: i + per_chunk])
                                      .argmax(-1))
        for i in range(0, n, per_chunk)
    ])  # [N, B] verifier ids
    targets_at = anchor_positions[0].unsqueeze(-1) + torch.arange(1, block + 1, device=device)  # x[p+k+1]
    inside = targets_at < length
    targets = input_ids[0, targets_at.clamp(max=length - 1)]
    match = (predicted == targets) & inside
    leading = match.long().cumprod(-1).sum(-1)  # leading matching slots, <= B
    available = inside.sum(-1)
    determined = (leading < available) | (available == block)
    teacher_forced = [int(a) + 1 if d else None for a, d in zip(leading.tolist(), determined.tolist())]
    return FidelityCheck(anchors=anchors, measured=measured, teacher_forced=teacher_forced)


# ------------------------------------------------------------------------------------------ in-process backend
def evaluate_in_process(
    drafter,
    verifier,
    tokenizer,
    prompt_sets: dict[str, list[str]],
    max_new_tokens: int = 256,
    temperature: float | None = None,
    top_k: int | None = None,
    top_p: float | None = None,
    throughput: bool = False,
    throughput_prompts: int | None = None,
    seed: int = 0,
    progress: bool = True,
    fidelity_check: bool = True,
    draft_method: str = "greedy",
    last_block: str = "full",
) -> dict:
    """Speculate on every prompt and return a `dspark-acceptance/1` results dict.

    `draft_method` is how the drafter draws its drafts (`DSparkDraftModel.draft`; "greedy", the default, is what
    vLLM serves by default), recorded as the results' `draft_method` ("greedy" at temperature 0, where every
    method is).

    With `fidelity_check` (the default) and temperature 0, each prompt's generation is also checked against the
    drafter's training forward (`teacher_forced_acceptance`); a subset with differing steps is warned about
    (`FidelityWarning`). The check runs after the timed generation, so it never enters tokens/s."""
    from tqdm.auto import tqdm

    from generation_dspark import speculative_generate

    if draft_method not in DRAFT_METHODS:
        raise UsageError(f"draft method {draft_method!r} is not one of {', '.join(DRAFT_METHODS)}; pass one of them "
                         f"(greedy is what vLLM serves by default).")
    settings = resolve_sampling(verifier, temperature, top_k, top_p)
    check = fidelity_check and settings["temperature"] <= 0  # at T > 0 acceptance is random: nothing to match
    device = next(verifier.parameters()).device
    g = torch.Generator().manual_seed(seed)
    B = drafter.config.block_size
    stats = {name: AcceptanceStats(B) for name in prompt_sets}
    total = sum(len(v) for v in prompt_sets.values())
    bar = tqdm(total=total, desc="speculating", unit="prompt", disable=not progress)
    for name, prompts in prompt_sets.items():
        for index, prompt in enumerate(prompts):
            ids = torch.tensor([chat_prompt_ids(tokenizer, prompt)], device=device)
            start = time.perf_counter()
            out = speculative_generate(drafter, verifier, ids, max_new_tokens=max_new_tokens,
                                       temperature=settings["temperature"], top_k=settings.get("top_k"),
                                       top_p=settings.get("top_p"), generator=g, draft_method=draft_method)
            elapsed = time.perf_counter() - start
            committed = out.committed_per_step
            if last_block == "clamped":  # count the steps as llama.cpp takes them (results.clamp_last_block)
                committed = clamp_last_block(committed, max_new_tokens)
            stats[name].add(committed, out.sequences.shape[1] - ids.shape[1], elapsed)
            if check:
                result = teacher_forced_acceptance(drafter, verifier, out.sequences, ids.shape[1],
                                                   out.committed_per_step)
                stats[name].add_fidelity([result.teacher_forced[i] for i in result.compared],
                                         [result.measured[i] for i in result.compared])
            if throughput and (throughput_prompts is None or index < throughput_prompts):
                stats[name].paired_tokens += out.sequences.shape[1] - ids.shape[1]
                stats[name].paired_seconds += elapsed
                start = time.perf_counter()
                kwargs = generation_kwargs(settings, max_new_tokens, tokenizer.pad_token_id or tokenizer.eos_token_id)
                with torch.no_grad():
                    base = verifier.generate(ids, **kwargs)
                stats[name].baseline_seconds += time.perf_counter() - start
                stats[name].baseline_tokens += base.shape[1] - ids.shape[1]
            bar.update(1)
            done = [c for s in stats.values() for c in s.committed]
            bar.set_postfix(acceptance_length=f"{sum(done) / max(len(done), 1):.2f}")
    bar.close()
    for name, s in stats.items():
        if check and s.fidelity_steps_differing:
            warnings.warn(
                f"fidelity check failed on subset {name}: on {s.fidelity_steps_differing} of "
                f"{len(s.teacher_forced)} compared verification steps the drafter's training forward, teacher-forced "
                f"on the generated sequence, predicts another greedy acceptance than draft() measured; the training "
                f"and serving layouts disagree (or the argmax is numerically tied there).",
                FidelityWarning, stacklevel=2)
    return build_results(stats, backend="transformers", block_size=B, sampling=settings,
                         max_new_tokens=max_new_tokens, concurrency=1, draft_method=draft_method,
                         last_block=last_block)


def run_selection(drafter: str) -> str:
    """`OUTPUT_DIR:best|latest|final|<step>` -> that checkpoint's directory, as push_to_hub.py reads it (so one
    spelling names the same weights in both commands); anything else is returned unchanged."""
    from trainer.train.checkpoints import resolve_checkpoint

    head, sep, _ = drafter.rpartition(":")
    if sep and head and os.path.isdir(head) and not os.path.exists(drafter):
        return str(resolve_checkpoint(drafter).path)
    return drafter


def main(argv: list[str] | None = None) -> dict:
    parser = Parser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--drafter", required=True, help="drafter checkpoint directory, a run's OUTPUT_DIR:best|latest|"
                        "final|<step> (as push_to_hub.py reads it), or a Hub id")
    parser.add_argument("--verifier", default=None,
                        help="verifier Hub id or directory (default: the one named in the drafter's config)")
    parser.add_argument("--prompts", default="RedHatAI/speculator_benchmarks",
                        help="directory of <subset>.jsonl files or a Hub dataset id")
    parser.add_argument("--subsets", default=None, help="comma-separated subset names (default: all nine)")
    parser.add_argument("--max-prompts", type=int, default=None, help="first N prompts of each subset")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=None, help="default: the verifier's generation config")
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--draft-method", choices=DRAFT_METHODS, default="greedy",
                        help="how the drafter draws its drafts when sampling: greedy (vLLM's default), probabilistic "
                             "(vLLM's draft_sample_method: probabilistic, temperature only) or filtered (with the "
                             "verifier's top-k/top-p too, not what vLLM serves); all are greedy at temperature 0")
    parser.add_argument("--last-block", choices=LAST_BLOCK, default="full",
                        help="how a generation's last step counts when it runs into --max-new-tokens: full (vLLM's "
                             "way: every token the whole block accepted) or clamped (llama.cpp's: the block cut to "
                             "the tokens left, no step with one token left)")
    parser.add_argument("--throughput", action="store_true", help="also time the verifier alone (concurrency 1)")
    parser.add_argument("--throughput-prompts", type=int, default=None,
                        help="time the verifier alone on the first N prompts of each subset only (speedup is computed "
                             "on those same prompts)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-fidelity-check", dest="fidelity_check", action="store_false",
                        help="at temperature 0, skip checking the drafter's training forward (teacher-forced on the "
                             "generated sequences) against the measured acceptance")
    parser.add_argument("--out", required=True, help="results JSON (a Markdown table is written beside it)")
    args = parser.parse_args(argv)

    for flag, value in (("--max-new-tokens", args.max_new_tokens), ("--max-prompts", args.max_prompts),
                        ("--throughput-prompts", args.throughput_prompts)):
        if value is not None and value < 1:
            raise UsageError(f"{flag} is {value}; pass a positive number.")
    if args.temperature is not None and args.temperature < 0:
        raise UsageError(f"--temperature is {args.temperature}; pass 0 (greedy) or a positive temperature.")
    if os.path.isdir(args.out):
        raise UsageError(f"--out {args.out} is a directory; pass the path of the results JSON file to write.")

    from transformers import AutoTokenizer

    from modeling_dspark import DSparkDraftModel
    from trainer.verifier.loading import load_verifier, resolve_drafter, resolve_pretrained

    # Everything that can be refused is refused before either model's weights are loaded.
    args.drafter = run_selection(args.drafter)
    drafter_path, dconfig = resolve_drafter(args.drafter)
    verifier_name = args.verifier or dconfig.verifier_local_path or dconfig.verifier_name_or_path
    if not verifier_name:
        raise UsageError("the drafter's config names no verifier; pass --verifier <hub id or directory>.")
    verifier_path, vconfig = resolve_pretrained(verifier_name, "verifier")
    check_pairing(dconfig, vconfig, verifier_name)
    prompt_sets = load_prompt_sets(args.prompts, args.subsets.split(",") if args.subsets else None, args.max_prompts)

    drafter = DSparkDraftModel.from_pretrained(drafter_path, dtype=torch.float32)
    verifier = load_verifier(verifier_path)
    drafter.attach_verifier(verifier)
    drafter.to(verifier.device).eval()
    tokenizer = AutoTokenizer.from_pretrained(verifier_path)
    results = evaluate_in_process(drafter, verifier, tokenizer, prompt_sets, max_new_tokens=args.max_new_tokens,
                                  temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                                  throughput=args.throughput, throughput_prompts=args.throughput_prompts,
                                  seed=args.seed, fidelity_check=args.fidelity_check,
                                  draft_method=args.draft_method, last_block=args.last_block)
    results = with_provenance(results, args.drafter, drafter.config.verifier_name_or_path or verifier_name, args.prompts)
    print(write_results(results, args.out))
    return results


def check_pairing(drafter_config, verifier_config, verifier_name: str) -> None:
    """Refuse a drafter built for another verifier from the two configs alone (hidden size, vocabulary, layers)."""
    text = verifier_config.get_text_config()
    snap = drafter_config.verifier_text_config or {}
    problems = []
    if getattr(text, "hidden_size", None) != (drafter_config.target_hidden_size or drafter_config.hidden_size):
        problems.append(f"hidden size {getattr(text, 'hidden_size', None)} vs the drafter's {drafter_config.hidden_size}")
    if getattr(text, "vocab_size", None) != drafter_config.vocab_size:
        problems.append(f"vocabulary {getattr(text, 'vocab_size', None)} vs the drafter's {drafter_config.vocab_size}")
    layers = getattr(text, "num_hidden_layers", None)
    if snap.get("num_hidden_layers") not in (None, layers):
        problems.append(f"{layers} layers vs the {snap['num_hidden_layers']} the drafter was built for")
    if problems:
        raise UsageError(f"the drafter does not fit the verifier {verifier_name} ({'; '.join(problems)}); pass the "
                         f"verifier it was trained for with --verifier "
                         f"({drafter_config.verifier_name_or_path or 'see its config.json'}).")


if __name__ == "__main__":
    sys.exit(run_cli(main))
