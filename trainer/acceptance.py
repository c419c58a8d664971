"""Acceptance evaluation: measure a drafter by actually speculating against its verifier.

Prompt sets use the `RedHatAI/speculator_benchmarks` layout (one `<subset>.jsonl` per subset with a `prompt`
column), from a local directory or a Hub dataset id. For every prompt the verifier generates with the
drafter (lossless speculative decoding, `DSparkDraftModel.speculative_generate`) and each verification step
records how many tokens it committed. Per subset this gives

* `acceptance_length`: mean tokens committed per verification step, bonus included (1.0 .. B+1);
* `pos`: `pos[k]` = share of steps that accepted at least k+1 drafts (vLLM's per-position acceptance);
* `steps`, and tokens/s with and without the drafter at concurrency 1 when `--throughput` is on;

plus the weighted (by steps) and unweighted means over subsets. The JSON schema (`dspark-acceptance/1`) and
the metric code below are shared by every backend (this in-process one; a vLLM server backend produces the
same file), and `push_to_hub.py` renders it into the model card.

    python -m trainer.acceptance --drafter out/smollm2-135m-dspark --prompts data/demo/heldout \
        --temperature 0 --max-new-tokens 128 --out out/eval-greedy.json
"""

import argparse
import json
import os
import platform
import sys
import time
from dataclasses import dataclass, field

import torch

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SCHEMA = "dspark-acceptance/1"
SUBSETS = ("math_reasoning", "HumanEval", "question", "writing", "translation", "rag", "tool_call", "qa",
           "summarization")


# ------------------------------------------------------------------------------------------ metric code
@dataclass
class AcceptanceStats:
    """Committed tokens per verification step for one subset, reduced to the reported metrics."""

    block_size: int
    committed: list[int] = field(default_factory=list)
    prompts: int = 0
    generated_tokens: int = 0
    seconds: float = 0.0
    baseline_tokens: int = 0
    baseline_seconds: float = 0.0
    paired_tokens: int = 0  # drafter tokens and time on the prompts the baseline was also timed on
    paired_seconds: float = 0.0

    def add(self, committed_per_step: list[int], generated_tokens: int, seconds: float) -> None:
        bad = [c for c in committed_per_step if not 1 <= c <= self.block_size + 1]
        if bad:
            raise ValueError(f"a verification step committed {bad[0]} tokens, outside 1..{self.block_size + 1}.")
        self.committed.extend(committed_per_step)
        self.prompts += 1
        self.generated_tokens += generated_tokens
        self.seconds += seconds

    def to_dict(self) -> dict:
        steps = len(self.committed)
        out = {
            "acceptance_length": sum(self.committed) / steps if steps else None,
            "pos": [sum(c - 1 >= k + 1 for c in self.committed) / steps if steps else None
                    for k in range(self.block_size)],
            "steps": steps,
            "prompts": self.prompts,
            "generated_tokens": self.generated_tokens,
        }
        if self.seconds:
            out["tokens_per_s"] = self.generated_tokens / self.seconds
        if self.baseline_seconds:
            out["baseline_tokens_per_s"] = self.baseline_tokens / self.baseline_seconds
            if self.paired_seconds:  # same prompts for both sides of the ratio
                out["speedup"] = (self.paired_tokens / self.paired_seconds) / out["baseline_tokens_per_s"]
        return out


def summarize(subsets: dict[str, dict]) -> dict:
    """Weighted (by verification steps) and unweighted means of acceptance length over subsets."""
    measured = {k: v for k, v in subsets.items() if v.get("steps")}
    total = sum(v["steps"] for v in measured.values())
    return {
        "weighted_acceptance_length": (sum(v["acceptance_length"] * v["steps"] for v in measured.values()) / total
                                       if total else None),
        "unweighted_acceptance_length": (sum(v["acceptance_length"] for v in measured.values()) / len(measured)
                                         if measured else None),
        "total_steps": total,
    }


def format_table(results: dict) -> str:
    """A readable Markdown table of a results dict (per subset, then the means)."""
    B = results["block_size"]
    head = "| subset | acceptance_length | " + " | ".join(f"pos_{k}" for k in range(B)) + " | steps |"
    has_speed = any("tokens_per_s" in v for v in results["subsets"].values())
    has_baseline = any("baseline_tokens_per_s" in v for v in results["subsets"].values())
    if has_speed:
        head += " tokens/s |" + (" baseline tokens/s | speedup |" if has_baseline else "")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for name, v in ordered(results["subsets"]):
        if not v.get("steps"):
            continue
        row = f"| {name} | {v['acceptance_length']:.3f} | " + " | ".join(f"{p:.1%}" for p in v["pos"])
        row += f" | {v['steps']} |"
        if has_speed:
            row += f" {v['tokens_per_s']:.1f} |" if "tokens_per_s" in v else " - |"
            if has_baseline:
                row += (f" {v['baseline_tokens_per_s']:.1f} | {v['speedup']:.2f}x |" if "speedup" in v else " - | - |")
        lines.append(row)
    w, u = results.get("weighted_acceptance_length"), results.get("unweighted_acceptance_length")
    if w is not None:
        lines.append("")
        lines.append(f"Weighted mean acceptance length {w:.3f} over {results['total_steps']} verification steps "
                     f"(unweighted mean over subsets {u:.3f}).")
    return "\n".join(lines)


def ordered(subsets: dict) -> list[tuple[str, dict]]:
    known = [(k, subsets[k]) for k in SUBSETS if k in subsets]
    return known + sorted((k, v) for k, v in subsets.items() if k not in SUBSETS)


# ------------------------------------------------------------------------------------------ prompt sets
def load_prompt_sets(source: str, subsets: list[str] | None = None, limit: int | None = None) -> dict[str, list[str]]:
    """`{subset: [prompt, ...]}` from a local directory of `<subset>.jsonl` files or a Hub dataset id."""
    names = list(subsets or SUBSETS)
    out = {}
    if os.path.isdir(source):
        for name in names:
            path = os.path.join(source, f"{name}.jsonl")
            if not os.path.exists(path):
                if subsets:  # explicitly requested
                    raise FileNotFoundError(f"{path} does not exist; the prompt directory needs one <subset>.jsonl "
                                            f"per subset with a `prompt` column.")
                continue
            with open(path, encoding="utf-8") as f:
                out[name] = [json.loads(line)["prompt"] for line in f if line.strip()]
    else:
        from datasets import load_dataset

        for name in names:
            ds = load_dataset(source, data_files=f"{name}.jsonl", split="train")
            out[name] = list(ds["prompt"])
    if not out:
        raise ValueError(f"no prompt subsets found in {source}; expected files like {names[0]}.jsonl.")
    return {k: v[:limit] if limit else v for k, v in out.items()}


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
) -> dict:
    """Speculate on every prompt and return a `dspark-acceptance/1` results dict."""
    from tqdm.auto import tqdm

    gen = verifier.generation_config
    sampling = temperature if temperature is not None else (gen.temperature if gen.do_sample else 0.0)
    settings = {"temperature": float(sampling or 0.0)}
    if settings["temperature"] > 0:
        settings.update(top_p=top_p if top_p is not None else gen.top_p,
                        top_k=top_k if top_k is not None else gen.top_k)
    device = next(verifier.parameters()).device
    g = torch.Generator().manual_seed(seed)
    B = drafter.config.block_size
    stats = {name: AcceptanceStats(B) for name in prompt_sets}
    total = sum(len(v) for v in prompt_sets.values())
    bar = tqdm(total=total, desc="speculating", unit="prompt", disable=not progress)
    for name, prompts in prompt_sets.items():
        for index, prompt in enumerate(prompts):
            ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                                tokenize=True, return_dict=True, return_tensors="pt")["input_ids"]
            ids = ids.to(device)
            start = time.perf_counter()
            out = drafter.speculative_generate(verifier, ids, max_new_tokens=max_new_tokens,
                                               temperature=settings["temperature"], top_k=settings.get("top_k"),
                                               top_p=settings.get("top_p"), generator=g)
            elapsed = time.perf_counter() - start
            stats[name].add(out.committed_per_step, out.sequences.shape[1] - ids.shape[1], elapsed)
            if throughput and (throughput_prompts is None or index < throughput_prompts):
                stats[name].paired_tokens += out.sequences.shape[1] - ids.shape[1]
                stats[name].paired_seconds += elapsed
                start = time.perf_counter()
                kwargs = dict(do_sample=settings["temperature"] > 0, max_new_tokens=max_new_tokens,
                              pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id)
                if kwargs["do_sample"]:
                    kwargs.update(temperature=settings["temperature"], top_k=settings.get("top_k"),
                                  top_p=settings.get("top_p"))
                else:
                    kwargs.update(temperature=None, top_k=None, top_p=None)
                with torch.no_grad():
                    base = verifier.generate(ids, **kwargs)
                stats[name].baseline_seconds += time.perf_counter() - start
                stats[name].baseline_tokens += base.shape[1] - ids.shape[1]
            bar.update(1)
            done = [c for s in stats.values() for c in s.committed]
            bar.set_postfix(acceptance_length=f"{sum(done) / max(len(done), 1):.2f}")
    bar.close()
    subsets = {name: s.to_dict() for name, s in stats.items()}
    return {
        "schema": SCHEMA,
        "backend": "transformers",
        "block_size": B,
        "sampling": settings,
        "max_new_tokens": max_new_tokens,
        "concurrency": 1,
        "subsets": subsets,
        **summarize(subsets),
    }


def weights_sha256(directory: str | os.PathLike) -> str | None:
    """SHA-256 over a checkpoint's safetensors files (sorted by name): ties results to the exact weights."""
    import hashlib

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


def provenance(results: dict, drafter: str, verifier: str, dataset: str) -> dict:
    import transformers

    return {
        **results,
        "drafter": drafter,
        "drafter_weights_sha256": weights_sha256(drafter),
        "verifier": verifier,
        "dataset": dataset,
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores"
                   + (f", {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ", no GPU"),
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "python": platform.python_version()},
    }


def write_results(results: dict, path: str) -> str:
    """Write the JSON (atomically) and a Markdown table next to it; return the table."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(results, f, indent=2)
    os.replace(tmp, path)
    table = format_table(results)
    with open(os.path.splitext(path)[0] + ".md", "w") as f:
        f.write(table + "\n")
    return table


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--drafter", required=True, help="drafter checkpoint directory or Hub id")
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
    parser.add_argument("--throughput", action="store_true", help="also time the verifier alone (concurrency 1)")
    parser.add_argument("--throughput-prompts", type=int, default=None,
                        help="time the verifier alone on the first N prompts of each subset only (speedup is computed "
                             "on those same prompts)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True, help="results JSON (a Markdown table is written beside it)")
    args = parser.parse_args(argv)

    from transformers import AutoTokenizer

    from modeling_dspark import DSparkDraftModel
    from trainer.hidden_states import load_verifier
    from trainer.small_models import resolve_model

    drafter = DSparkDraftModel.from_pretrained(resolve_model(args.drafter), dtype=torch.float32)
    verifier_name = args.verifier or drafter.config.verifier_local_path or drafter.config.verifier_name_or_path
    if not verifier_name:
        raise SystemExit("the drafter's config names no verifier; pass --verifier <hub id or directory>.")
    verifier_path = resolve_model(verifier_name)
    verifier = load_verifier(verifier_path)
    drafter.attach_verifier(verifier)
    drafter.to(verifier.device).eval()
    tokenizer = AutoTokenizer.from_pretrained(verifier_path)
    prompt_sets = load_prompt_sets(args.prompts, args.subsets.split(",") if args.subsets else None, args.max_prompts)
    results = evaluate_in_process(drafter, verifier, tokenizer, prompt_sets, max_new_tokens=args.max_new_tokens,
                                  temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                                  throughput=args.throughput, throughput_prompts=args.throughput_prompts,
                                  seed=args.seed)
    results = provenance(results, args.drafter, drafter.config.verifier_name_or_path or verifier_name, args.prompts)
    print(write_results(results, args.out))
    return results


if __name__ == "__main__":
    main()
