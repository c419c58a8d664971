"""A trained drafter served by llama.cpp on this CPU, held against the in-process evaluator (`make bench-llamacpp`):

    python -m benchmarks.llamacpp --drafter out/demo/drafter --prompts data/demo/heldout --max-prompts 2 \
        --max-new-tokens 64 --out out/bench-llamacpp

(a) Agreement at T = 0. The checkpoint is converted to an f32 GGUF (`trainer.export.gguf`) and served by
    llama-server with f32 KV caches; the in-process evaluator speculates on the same prompt token ids with the
    float32 checkpoint (`generation_dspark.speculative_generate`). Both are lossless, so both give the verifier's
    greedy tokens; where they differ, the first differing position and the float64 logit gap between the two
    tokens there are reported (a gap at float32 rounding scale is an argmax tie that two implementations break
    differently). Acceptance is compared per subset over the same steps of the identical generations: the steps
    before a generation's last one (at an end-of-sequence token llama.cpp stops counting accepted drafts; vLLM
    and the in-process loop count those the verifier accepts past it) that draft a whole block on both engines (`left > B` tokens to `max_new_tokens`; llama.cpp cuts
    the last blocks of a generation to the tokens left and runs them as shorter blocks, vLLM and the in-process
    evaluator do not), and over all steps with the in-process counts clamped as llama.cpp takes them
    (`trainer.evaluation.results.clamp_last_block`).
(b) Confidence in a real engine. llama-server's `--spec-draft-p-min P` cuts each drafted block at the first slot
    whose confidence is below P. For each P: weighted acceptance length, tokens/s, and speedup over the verifier
    alone on the same server binary, for the drafter as trained (calibrated confidence head) and with the
    calibration undone (`trainer.train.calibration.unfold_head`).

Writes the protocol's JSON (`--json`, default out/benchmarks/llamacpp.json) and `<out>/llamacpp.md`; the last line
of the report reads `llama.cpp vs in-process at T=0: ...`. Needs `make llamacpp-env` and a trained drafter.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from pathlib import Path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks import common  # noqa: E402
from trainer.errors import UsageError  # noqa: E402


def whole_block_committed(committed: list[int], max_new_tokens: int, block: int) -> list[int]:
    """The in-process steps that llama.cpp would also draft as a whole block: those that start with more than
    `block` tokens left to `max_new_tokens` (the prefill's token counts as generated)."""
    out, generated = [], 1
    for c in committed:
        if max_new_tokens - generated > block:
            out.append(c)
        generated += c
    return out


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first position where two generations differ (a length when one is a prefix of the other), None if equal."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def tie_gap(verifier64, prompt_ids: list[int], ours: list[int], theirs: list[int]) -> float | None:
    """Where two lossless greedy generations part, the float64 logit gap between the two tokens chosen: a gap at
    float32 rounding scale means both engines took the verifier's argmax, within their arithmetic."""
    import torch

    n = first_difference(ours, theirs)
    if n is None or n >= min(len(ours), len(theirs)):
        return None
    with torch.no_grad():
        logits = verifier64(torch.tensor([prompt_ids + ours[:n]])).logits[0, -1]
    return abs(float(logits[ours[n]] - logits[theirs[n]]))


def mean(values: list[int]) -> float | None:
    return sum(values) / len(values) if values else None


def unfolded_copy(drafter: Path, out: Path) -> Path:
    """A copy of `drafter` with its confidence calibration undone (the head as trained), for comparison."""
    import torch
    from safetensors.torch import load_file, save_file

    from trainer.train.calibration import HEAD_BIAS, HEAD_WEIGHT, applied_fold, unfold

    fold = applied_fold(drafter)
    if fold is None:
        raise UsageError(f"{drafter} records no confidence calibration; pass a drafter trained with calibration on.")
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    for item in drafter.iterdir():
        if item.is_file() and item.suffix != ".safetensors":
            shutil.copy2(item, out / item.name)
    tensors = load_file(str(drafter / "model.safetensors"))
    weight, bias = unfold(tensors[HEAD_WEIGHT], tensors[HEAD_BIAS], float(fold["a"]), float(fold["c"]))
    tensors[HEAD_WEIGHT], tensors[HEAD_BIAS] = weight.to(torch.float32).contiguous(), bias.to(torch.float32)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def in_process(drafter_dir: Path, verifier_dir: Path, prompt_ids: dict, max_new_tokens: int,
               theirs: dict | None = None) -> dict:
    """Per subset, per prompt: generated tokens and committed counts of the in-process speculative loop at T=0, and
    where `theirs` (llama.cpp's generations) differs, the float64 logit gap there (`tie_gap`)."""
    import torch
    from tqdm.auto import tqdm

    from generation_dspark import speculative_generate
    from modeling_dspark import DSparkDraftModel
    from trainer.verifier.loading import load_verifier

    drafter = DSparkDraftModel.from_pretrained(drafter_dir, dtype=torch.float32)
    verifier = load_verifier(str(verifier_dir))
    drafter.attach_verifier(verifier)
    drafter.eval()
    out: dict = {}
    bar = tqdm(total=sum(map(len, prompt_ids.values())), desc="in-process", unit="prompt")
    for subset, prompts in prompt_ids.items():
        out[subset] = []
        for ids in prompts:
            x = torch.tensor([ids])
            started = time.perf_counter()
            g = speculative_generate(drafter, verifier, x, max_new_tokens=max_new_tokens, temperature=0.0)
            out[subset].append({"tokens": g.sequences[0, len(ids):].tolist(), "committed": g.committed_per_step,
                                "seconds": time.perf_counter() - started})
            bar.update(1)
    bar.close()
    verifier64 = None
    for subset, prompts in prompt_ids.items():
        for ids, mine, other in zip(prompts, out[subset], (theirs or {}).get(subset, [])):
            if mine["tokens"] != other.tokens:
                if verifier64 is None:
                    import copy

                    verifier64 = copy.deepcopy(verifier).to(torch.float64).eval()
                mine["tie_gap"] = tie_gap(verifier64, ids, mine["tokens"], other.tokens)
    return out


def agreement(ours: dict, theirs: dict, max_new_tokens: int, block: int) -> dict:
    """Per subset: identical generations, and acceptance over the whole-block steps and over all (clamped) steps."""
    from trainer.evaluation.results import clamp_last_block

    table = {}
    for subset, mine in ours.items():
        other = theirs[subset]
        identical, first_diff, gaps = 0, [], []
        ours_whole, theirs_whole, ours_clamped, theirs_all = [], [], [], []
        for a, b in zip(mine, other):
            if a["tokens"] == b.tokens:
                identical += 1
            else:
                first_diff.append(first_difference(a["tokens"], b.tokens))
                gaps.append(a.get("tie_gap"))
            if a["tokens"] == b.tokens:  # the same steps on both engines: compared exactly
                # a generation's last step is left out: when it ends at an end-of-sequence token, llama.cpp stops
                # counting accepted drafts there, while vLLM and the in-process loop count the drafts the verifier
                # accepts past it (docs/serving-llamacpp.md); when it ends at max_new_tokens it is cut anyway
                ours_whole += whole_block_committed(a["committed"][:-1], max_new_tokens, block)
                theirs_whole += [acc + 1 for drafted, acc in b.steps[:-1] if drafted == block]
            ours_clamped += clamp_last_block(a["committed"], max_new_tokens)
            theirs_all += b.committed
        row = {"prompts": len(mine), "identical": identical, "first_difference_at": first_diff,
               "float64_logit_gap_at_difference": gaps,
               "whole_block": {"steps": [len(ours_whole), len(theirs_whole)],
                               "in_process": mean(ours_whole), "llamacpp": mean(theirs_whole)},
               "clamped": {"steps": [len(ours_clamped), len(theirs_all)],
                           "in_process": mean(ours_clamped), "llamacpp": mean(theirs_all)}}
        table[subset] = row
    return table


def totals(table: dict, key: str) -> tuple[float, float, int, int]:
    """Step-weighted means over subsets: (in-process, llama.cpp, steps in-process, steps llama.cpp)."""
    steps_a = sum(r[key]["steps"][0] for r in table.values())
    steps_b = sum(r[key]["steps"][1] for r in table.values())
    a = sum((r[key]["in_process"] or 0) * r[key]["steps"][0] for r in table.values()) / max(steps_a, 1)
    b = sum((r[key]["llamacpp"] or 0) * r[key]["steps"][1] for r in table.values()) / max(steps_b, 1)
    return a, b, steps_a, steps_b


def report(result: dict) -> str:
    lines = []
    if result["agreement"]:
        lines += ["## (a) Agreement at T = 0 (f32 GGUF, f32 KV caches, vs the float32 checkpoint in process)", "",
                  "| subset | identical generations | float64 logit gap where not | whole-block steps (ours / "
                  "llama.cpp) | acceptance, ours | acceptance, llama.cpp | difference | all steps, clamped (ours / "
                  "llama.cpp) | ours | llama.cpp |", "|---|---|---|---|---|---|---|---|---|---|"]
        for subset, r in result["agreement"].items():
            w, c = r["whole_block"], r["clamped"]
            diff = (w["llamacpp"] - w["in_process"]) if None not in (w["llamacpp"], w["in_process"]) else None
            gaps = ", ".join(common.fmt(g) for g in r["float64_logit_gap_at_difference"]) or "-"
            lines.append(f"| {subset} | {r['identical']} of {r['prompts']} | {gaps} | {w['steps'][0]} / "
                         f"{w['steps'][1]} | {common.fmt(w['in_process'])} | {common.fmt(w['llamacpp'])} | "
                         f"{common.fmt(diff)} | {c['steps'][0]} / {c['steps'][1]} | {common.fmt(c['in_process'])} | "
                         f"{common.fmt(c['llamacpp'])} |")
    if result["confidence"]:
        lines += ["", "## (b) Confidence threshold (--spec-draft-p-min) in llama-server", "",
                  "| head | p_min | acceptance length | steps | tokens/s | verifier alone tokens/s | speedup |",
                  "|---|---|---|---|---|---|---|"]
        for row in result["confidence"]:
            lines.append(f"| {row['head']} | {row['p_min']:g} | {common.fmt(row['acceptance_length'])} | "
                         f"{row['steps']} | {row['tokens_per_s']:.1f} | {row['baseline_tokens_per_s']:.1f} | "
                         f"{row['speedup']:.2f}x |")
    if result["agreement"]:
        a, b, sa, sb = totals(result["agreement"], "whole_block")
        identical = sum(r["identical"] for r in result["agreement"].values())
        prompts = sum(r["prompts"] for r in result["agreement"].values())
        gaps = [g for r in result["agreement"].values() for g in r["float64_logit_gap_at_difference"]
                if g is not None]
        ties = (f" (the others part where the verifier's float64 logits of the two tokens are {max(gaps):.2g} "
                f"apart at most)") if gaps else ""
        lines += ["", f"llama.cpp vs in-process at T=0: {identical} of {prompts} generations identical{ties}; "
                      f"whole-block acceptance ours {a:.3f} over {sa} steps, llama.cpp {b:.3f} over {sb} steps "
                      f"(difference {b - a:+.3f})"]
    return "\n".join(lines)


def confidence_rows(head: str, gguf: Path, verifier_dir: Path, prompt_ids: dict, max_new_tokens: int,
                    p_mins: list[float]) -> list[dict]:
    from trainer.evaluation.llamacpp import serve_and_evaluate

    rows = []
    for p_min in p_mins:
        results, _, _ = serve_and_evaluate(str(gguf), "f32", prompt_ids, p_min=p_min, kv_type="f32",
                                           with_baseline=True, sampling={"temperature": 0.0},
                                           max_new_tokens=max_new_tokens, progress=False)
        subsets = list(results["subsets"].values())
        tokens = sum(v["generated_tokens"] for v in subsets)
        seconds = sum(v["generated_tokens"] / v["tokens_per_s"] for v in subsets)
        # at T = 0 the verifier alone generates the same tokens, so its seconds are tokens over its rate
        base_seconds = sum(v["generated_tokens"] / v["baseline_tokens_per_s"] for v in subsets)
        rows.append({"head": head, "p_min": p_min, "acceptance_length": results["weighted_acceptance_length"],
                     "steps": results["total_steps"], "tokens_per_s": tokens / seconds,
                     "baseline_tokens_per_s": tokens / base_seconds, "speedup": base_seconds / seconds})
        print(f"{head} p_min={p_min:g}: acceptance {common.fmt(rows[-1]['acceptance_length'])}, "
              f"{rows[-1]['tokens_per_s']:.1f} tokens/s ({rows[-1]['speedup']:.2f}x)", flush=True)
    return rows


NAME = "llamacpp"


def add_arguments(parser) -> None:
    parser.add_argument("--drafter", default="out/demo/drafter", help="trained drafter checkpoint (make demo's)")
    parser.add_argument("--verifier", default=None, help="default: the one the drafter's config names")
    parser.add_argument("--prompts", default="data/demo/heldout")
    parser.add_argument("--max-prompts", type=int, default=2, help="prompts per subset")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--p-min", default="0,0.3,0.5,0.7", help="comma-separated --spec-draft-p-min values")
    parser.add_argument("--only", choices=("all", "agreement", "confidence"), default="all",
                        help="run (a) the T = 0 agreement, (b) the confidence sweep, or both")
    parser.add_argument("--out", default="out/bench-llamacpp",
                        help="work folder: the GGUFs, the servers' logs and the Markdown report")


def unavailable(args) -> str | None:
    """Why this benchmark cannot run here (no llama.cpp build, no trained drafter), in one sentence."""
    from trainer.serving.llamacpp import locate

    if not (Path(args.drafter) / "config.json").is_file():
        return (f"drafter {args.drafter} has no config.json; train one first (make demo) or pass --drafter "
                f"(benchmarks.run: --bench-args 'llamacpp=--drafter DIR').")
    try:
        locate()
    except UsageError as e:
        return str(e)
    return None


def describe(result: dict) -> None:
    print()
    print(report(result))


def run(args) -> dict:
    from configuration_dspark import DSparkConfig
    from trainer.evaluation.prompts import chat_prompt_ids, load_prompt_sets
    from trainer.export.gguf import export_gguf
    from trainer.verifier.loading import local_folder

    drafter = Path(args.drafter)
    config = DSparkConfig.from_pretrained(drafter)
    verifier_dir = local_folder(args.verifier or config.verifier_local_path or config.verifier_name_or_path,
                                "verifier")
    subsets = ["writing"] if args.quick else None
    limit, tokens = (1, 24) if args.quick else (args.max_prompts, args.max_new_tokens)
    p_mins = [0.0, 0.5] if args.quick else [float(p) for p in args.p_min.split(",")]
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(verifier_dir)
    prompt_sets = load_prompt_sets(args.prompts, subsets, limit)
    prompt_ids = {k: [chat_prompt_ids(tokenizer, p) for p in v] for k, v in prompt_sets.items()}
    out = Path(args.out)
    started = time.time()
    print(">> exporting the drafter to GGUF (f32) and checking it serves", flush=True)
    export_gguf(str(drafter), str(out / "gguf"), str(verifier_dir), ("f32",))
    result = {"drafter": str(drafter), "verifier": str(verifier_dir), "prompts": args.prompts,
              "prompts_per_subset": limit, "max_new_tokens": tokens, "block_size": config.block_size,
              "agreement": {}, "confidence": []}
    if args.only in ("all", "agreement"):
        result.update(agreement_run(drafter, verifier_dir, out, prompt_ids, tokens, config.block_size))
    if args.only in ("all", "confidence"):
        print(">> confidence thresholds: calibrated head", flush=True)
        result["confidence"] = confidence_rows("calibrated", out / "gguf", verifier_dir, prompt_ids, tokens, p_mins)
        print(">> confidence thresholds: the head before calibration", flush=True)
        raw = unfolded_copy(drafter, out / "uncalibrated")
        export_gguf(str(raw), str(out / "gguf-uncalibrated"), str(verifier_dir), ("f32",), check=False)
        result["confidence"] += confidence_rows("before calibration", out / "gguf-uncalibrated", verifier_dir,
                                                prompt_ids, tokens, p_mins)
    result["seconds"] = time.time() - started
    (out / "llamacpp.md").write_text(report(result) + "\n")
    result["table"] = table(result)
    return result


def table(result: dict) -> list[list]:
    """The protocol's `[name, value, unit, note]` rows: the agreement's totals and each threshold's speed."""
    rows = []
    if result["agreement"]:
        a, b, sa, sb = totals(result["agreement"], "whole_block")
        identical = sum(r["identical"] for r in result["agreement"].values())
        prompts = sum(r["prompts"] for r in result["agreement"].values())
        rows += [["T=0 generations identical", identical, f"of {prompts}", "llama.cpp vs in process"],
                 ["whole-block acceptance, in process", a, "tokens/step", f"{sa} steps"],
                 ["whole-block acceptance, llama.cpp", b, "tokens/step", f"{sb} steps"]]
    for row in result["confidence"]:
        rows.append([f"{row['head']}, p_min {row['p_min']:g}", row["speedup"], "x verifier alone",
                     f"acceptance {common.fmt(row['acceptance_length'])}, {row['tokens_per_s']:.1f} tokens/s"])
    return rows


def agreement_run(drafter: Path, verifier_dir: Path, out: Path, prompt_ids: dict, tokens: int, block: int) -> dict:
    from trainer.evaluation.llamacpp import serve_and_evaluate

    print(">> llama.cpp at T=0 (f32 KV caches)", flush=True)
    served, _, generations = serve_and_evaluate(str(out / "gguf"), "f32", prompt_ids, kv_type="f32",
                                                with_baseline=False, sampling={"temperature": 0.0},
                                                max_new_tokens=tokens)
    print(">> in process at T=0 (float32)", flush=True)
    ours = in_process(drafter, verifier_dir, prompt_ids, tokens, generations)
    return {"agreement": agreement(ours, generations, tokens, block), "llamacpp_results": served}


if __name__ == "__main__":
    common.main(sys.modules[__name__])
