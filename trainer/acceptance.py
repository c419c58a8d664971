"""Acceptance evaluation: measure a drafter by actually speculating against its verifier.

Prompt sets use the `RedHatAI/speculator_benchmarks` layout (one `<subset>.jsonl` per subset with a `prompt`
column), from a local directory or a Hub dataset id. For every prompt the verifier generates with the
drafter (lossless speculative decoding, `DSparkDraftModel.speculative_generate`) and each verification step
records how many tokens it committed. Per subset this gives

* `acceptance_length`: mean tokens committed per verification step, bonus included (1.0 .. B+1);
* `pos`: `pos[k]` = share of steps that accepted at least k+1 drafts (vLLM's per-position acceptance);
* `steps`, and tokens/s with and without the drafter at concurrency 1 when `--throughput` is on;

plus the weighted (by steps) and unweighted means over subsets. The JSON format (`dspark-acceptance/1`) and
its reduction (the `dspark_acceptance` evaluate metric) live in `trainer/results.py`, shared by every backend
(this in-process one; a vLLM server backend writes the same file); `push_to_hub.py` renders it into the
model card.

    python -m trainer.acceptance --drafter out/smollm2-135m-dspark --prompts data/demo/heldout \
        --temperature 0 --max-new-tokens 128 --out out/eval-greedy.json
"""

import argparse
import json
import os
import sys
import time

import torch

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from configuration_dspark import is_hub_id  # noqa: E402
from trainer.errors import UsageError, run_cli  # noqa: E402
from trainer.results import (  # noqa: E402
    SUBSETS,
    AcceptanceStats,
    build_results,
    format_table,
    with_provenance,
    write_results,
)
from trainer.verifier import generation_kwargs, resolve_sampling  # noqa: E402

__all__ = ["AcceptanceStats", "evaluate_in_process", "format_table", "load_prompt_sets", "main", "write_results"]


# ------------------------------------------------------------------------------------------ prompt sets
def load_prompt_sets(source: str, subsets: list[str] | None = None, limit: int | None = None) -> dict[str, list[str]]:
    """`{subset: [prompt, ...]}` from a local directory of `<subset>.jsonl` files or a Hub dataset id.

    Every problem is one sentence naming the file (and line): a missing directory, a directory without any
    subset file, a line that is not JSON or has no string `prompt`, a subset file without prompts."""
    names = list(subsets or SUBSETS)
    out = {}
    local = os.path.exists(source) or source.startswith((".", "/", "~")) or not is_hub_id(source)
    if local:
        if not os.path.isdir(source):
            raise UsageError(f"prompt directory {source} does not exist or is not a directory; pass a directory of "
                             f"<subset>.jsonl files (one `prompt` per line) or a Hub dataset id.")
        for name in names:
            path = os.path.join(source, f"{name}.jsonl")
            if not os.path.exists(path):
                if subsets:  # explicitly requested
                    raise UsageError(f"{path} does not exist; the prompt directory needs one <subset>.jsonl per "
                                     f"subset with a `prompt` column.")
                continue
            out[name] = _read_prompts(path)
        if not out:
            raise UsageError(f"prompt directory {source} holds none of the subset files ({', '.join(n + '.jsonl' for n in names[:3])}, "
                             f"...); add <subset>.jsonl files with a `prompt` column or pass --subsets.")
    else:
        from datasets import load_dataset

        for name in names:
            try:
                ds = load_dataset(source, data_files=f"{name}.jsonl", split="train")
            except Exception as e:  # offline, missing file, no access: name the dataset and the fix
                raise UsageError(f"cannot load subset {name} of the Hub dataset {source} "
                                 f"({type(e).__name__}: {' '.join(str(e).split())[:160]}); check the id and network, or "
                                 f"pass a local directory of <subset>.jsonl files.") from e
            if "prompt" not in ds.column_names:
                raise UsageError(f"subset {name} of {source} has no `prompt` column (columns {ds.column_names}); pass "
                                 f"a dataset in the speculator_benchmarks layout.")
            out[name] = list(ds["prompt"])
    return {k: v[:limit] if limit else v for k, v in out.items()}


def _read_prompts(path: str) -> list[str]:
    prompts = []
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise UsageError(f"{path} line {number} is not valid UTF-8 ({e.reason}); save the file as UTF-8.") from e
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise UsageError(f"{path} line {number} is not valid JSON ({e.msg}, column {e.colno}): "
                                 f"{line.strip()[:60]!r}; fix or delete that line.") from e
            if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
                keys = sorted(row) if isinstance(row, dict) else type(row).__name__
                raise UsageError(f"{path} line {number} has no string `prompt` field (found {keys}); write one "
                                 f'{{"prompt": "..."}} object per line.')
            prompts.append(row["prompt"])
    if not prompts:
        raise UsageError(f"{path} holds no prompts; add lines like {{\"prompt\": \"...\"}} or delete the file.")
    return prompts


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

    settings = resolve_sampling(verifier, temperature, top_k, top_p)
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
                kwargs = generation_kwargs(settings, max_new_tokens, tokenizer.pad_token_id or tokenizer.eos_token_id)
                with torch.no_grad():
                    base = verifier.generate(ids, **kwargs)
                stats[name].baseline_seconds += time.perf_counter() - start
                stats[name].baseline_tokens += base.shape[1] - ids.shape[1]
            bar.update(1)
            done = [c for s in stats.values() for c in s.committed]
            bar.set_postfix(acceptance_length=f"{sum(done) / max(len(done), 1):.2f}")
    bar.close()
    return build_results(stats, backend="transformers", block_size=B, sampling=settings,
                         max_new_tokens=max_new_tokens, concurrency=1)


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

    for flag, value in (("--max-new-tokens", args.max_new_tokens), ("--max-prompts", args.max_prompts),
                        ("--throughput-prompts", args.throughput_prompts)):
        if value is not None and value < 1:
            raise UsageError(f"{flag} is {value}; pass a positive number.")
    if args.temperature is not None and args.temperature < 0:
        raise UsageError(f"--temperature is {args.temperature}; pass 0 (greedy) or a positive temperature.")
    if os.path.isdir(args.out):
        raise UsageError(f"--out {args.out} is a directory; pass the path of the results JSON file to write.")

    from transformers import AutoTokenizer

    from configuration_dspark import DSparkConfig
    from modeling_dspark import DSparkDraftModel
    from trainer.verifier import load_verifier, resolve_pretrained

    # Everything that can be refused is refused before either model's weights are loaded.
    drafter_path, _ = resolve_pretrained(args.drafter, "drafter")
    dconfig = DSparkConfig.from_pretrained(drafter_path)
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
                                  seed=args.seed)
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
