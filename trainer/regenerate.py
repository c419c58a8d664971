"""Regenerate chat responses with the verifier itself.

A drafter learns to predict the verifier, so its training conversations should be the verifier's own
outputs (the seed recipe regenerated every Open PerfectBlend response with gemma-4-E4B-it). This tool takes
prompts (a `prompt` column, or `messages`/ShareGPT conversations whose final assistant turn is replaced),
renders them with the verifier's chat template, generates in batches and writes chat JSONL in `messages`
form that `trainer/run.py` reads directly.

    python -m trainer.regenerate --verifier HuggingFaceTB/SmolLM2-135M-Instruct \
        --prompts data/demo/prompts.jsonl --split train --out out/demo/conversations.jsonl --temperature 0

Rows are appended as they finish and a rerun skips ids already written, so an interrupted run loses
nothing. Sampling defaults to the verifier's generation config; `--temperature 0` is greedy (deterministic).
For hundreds of thousands of prompts use vLLM; this path is for small models and CPUs.
"""

import argparse
import json
import os
import sys
import time

import torch

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from transformers import AutoTokenizer  # noqa: E402

from configuration_dspark import is_hub_id  # noqa: E402
from trainer.data import normalize_messages  # noqa: E402
from trainer.data_files import read_jsonl_objects  # noqa: E402
from trainer.errors import UsageError, run_cli  # noqa: E402
from trainer.verifier import generation_kwargs, load_verifier, resolve_pretrained, resolve_sampling  # noqa: E402


def prompt_rows(source: str, split: str | None = None, max_samples: int | None = None) -> list[dict]:
    """Rows with an `id` and the `messages` to answer (system/user turns, ending before the reply)."""
    local = os.path.exists(source) or source.endswith((".json", ".jsonl", ".parquet")) or \
        source.startswith((".", "/", "~")) or not is_hub_id(source)
    if local and not os.path.exists(source):
        raise UsageError(f"prompt file {source} does not exist; pass a JSONL file with a `prompt` column, chat rows, "
                         f"or a Hub dataset id.")
    if source.endswith(".jsonl") and os.path.isfile(source):
        raw = _read_jsonl(source)
    else:  # a Hub dataset or local files: prompts-only sets are fine here, unlike for training
        from datasets import load_dataset

        raw = list(load_dataset(source, split="train")) if not os.path.exists(source) else \
            list(load_dataset("json" if source.endswith((".json", ".jsonl")) else "parquet", data_files=source,
                              split="train"))
    rows = []
    for i, row in enumerate(raw):
        if split and row.get("split", split) != split:
            continue
        if "prompt" in row:
            messages = [{"role": "user", "content": row["prompt"]}]
        elif "messages" in row or "conversations" in row:
            messages = normalize_messages(row.get("messages") or row.get("conversations"))
            while messages and messages[-1]["role"] == "assistant":
                messages = messages[:-1]
        else:
            raise UsageError(f"row {i} of {source} has neither a `prompt` nor a `messages`/`conversations` field; "
                             f"give prompts as JSONL with a `prompt` column or chat rows.")
        if not messages:
            continue
        rows.append({"id": str(row.get("id", i)), "subset": row.get("subset"), "messages": messages})
        if max_samples and len(rows) >= max_samples:
            break
    return rows


def _read_jsonl(path: str) -> list[dict]:
    return [row for _, row in read_jsonl_objects(path)]


def _read_finished(path: str) -> list[dict]:
    """Rows already written by an earlier run; a truncated last line (a kill mid-write) is dropped from the file
    so it is regenerated, any other unreadable line is refused (the file is not ours to rewrite)."""
    with open(path, "rb") as f:
        data = f.read()
    if data and not data.endswith(b"\n"):
        cut = data.rfind(b"\n") + 1
        with open(path, "r+b") as f:
            f.truncate(cut)
    return _read_jsonl(path)


def regenerate(
    verifier: str,
    prompts: str,
    out: str,
    split: str | None = None,
    max_new_tokens: int = 256,
    batch_size: int = 16,
    temperature: float | None = None,
    max_samples: int | None = None,
    seed: int = 0,
    dtype: str = "auto",
) -> dict:
    rows = prompt_rows(prompts, split=split, max_samples=max_samples)  # bad prompts are refused before any load
    path, _ = resolve_pretrained(verifier, "verifier")
    tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left")
    if tokenizer.chat_template is None:
        raise UsageError(f"the tokenizer of {verifier} has no chat template; regenerate with an instruction-tuned "
                         f"verifier.")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = load_verifier(path, dtype=dtype)
    device = model.device
    sampling = resolve_sampling(model, temperature)
    kwargs = generation_kwargs(sampling, max_new_tokens, tokenizer.pad_token_id)

    done = set()
    if os.path.isdir(out):
        raise UsageError(f"--out {out} is a directory; pass the path of the chat JSONL file to write.")
    if os.path.exists(out):  # a rerun resumes: finished ids are skipped (a line cut by a kill is redone)
        done = {str(r.get("id")) for r in _read_finished(out)}
    todo = [r for r in rows if r["id"] not in done]
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    torch.manual_seed(seed)
    started, new_tokens = time.time(), 0
    from tqdm.auto import tqdm

    bar = tqdm(total=len(todo), desc=f"regenerating with {os.path.basename(path.rstrip('/'))}", unit="prompt")
    # longest prompts first: fewer pad tokens per batch, and the slowest batches show up early in the ETA
    todo.sort(key=lambda r: -sum(len(m["content"]) for m in r["messages"]))
    with open(out, "a", encoding="utf-8") as f:
        for start in range(0, len(todo), batch_size):
            batch = todo[start : start + batch_size]
            texts = [tokenizer.apply_chat_template(r["messages"], add_generation_prompt=True, tokenize=False)
                     for r in batch]
            enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(device)
            with torch.no_grad():
                output = model.generate(**enc, **kwargs)
            for row, ids in zip(batch, output[:, enc["input_ids"].shape[1]:]):
                text = tokenizer.decode(ids, skip_special_tokens=True).strip()
                new_tokens += len(tokenizer(text, add_special_tokens=False)["input_ids"])
                record = {"id": row["id"], "messages": [*row["messages"], {"role": "assistant", "content": text}]}
                if row.get("subset"):
                    record["subset"] = row["subset"]
                f.write(json.dumps(record, ensure_ascii=False) + "\n")
            f.flush()
            bar.update(len(batch))
            bar.set_postfix(tok_s=f"{new_tokens / max(time.time() - started, 1e-6):.0f}")
    bar.close()
    return {"written": len(todo), "skipped_existing": len(rows) - len(todo), "new_tokens": new_tokens,
            "seconds": time.time() - started, "out": out}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--verifier", required=True, help="Hub id or local directory of the verifier")
    parser.add_argument("--prompts", required=True, help="JSONL with a `prompt` column, chat JSONL, or a Hub dataset")
    parser.add_argument("--out", required=True, help="output chat JSONL (appended; existing ids are skipped)")
    parser.add_argument("--split", default=None, help="keep rows whose `split` field equals this (e.g. train)")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--temperature", type=float, default=None, help="0 = greedy; default: generation config")
    parser.add_argument("--max-samples", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    result = regenerate(args.verifier, args.prompts, args.out, split=args.split, max_new_tokens=args.max_new_tokens,
                        batch_size=args.batch_size, temperature=args.temperature, max_samples=args.max_samples,
                        seed=args.seed)
    print(json.dumps(result))


if __name__ == "__main__":
    sys.exit(run_cli(main))
