"""Evaluation prompts: a `RedHatAI/speculator_benchmarks`-style prompt set (a Hub dataset or a local directory of
`<subset>.jsonl` files with a `prompt` field), read per subset. Both evaluators read prompts here.
"""

import os

from trainer.errors import UsageError  # noqa: E402
from trainer.evaluation.results import (
    SUBSETS,
)
from trainer.files import is_local


# ------------------------------------------------------------------------------------------ prompt sets
def load_prompt_sets(source: str, subsets: list[str] | None = None, limit: int | None = None) -> dict[str, list[str]]:
    """`{subset: [prompt, ...]}` from a local directory of `<subset>.jsonl` files or a Hub dataset id. Without
    `subsets`, a directory's every `<name>.jsonl` is a subset (the benchmark's nine in their order, then the rest);
    a Hub dataset is read for the benchmark's nine.

    Every problem is one sentence naming the file (and line): a missing directory, a directory without any
    subset file, a line that is not JSON or has no string `prompt`, a subset file without prompts."""
    names = list(subsets or SUBSETS)
    out = {}
    if is_local(source):
        if not os.path.isdir(source):
            raise UsageError(f"prompt directory {source} does not exist or is not a directory; pass a directory of "
                             f"<subset>.jsonl files (one `prompt` per line) or a Hub dataset id.")
        if not subsets:  # a user's own subsets count too: every <name>.jsonl of the directory, known names first
            names += sorted(f[: -len(".jsonl")] for f in os.listdir(source)
                            if f.endswith(".jsonl") and f[: -len(".jsonl")] not in SUBSETS)
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
    from trainer.data.files import read_jsonl_objects

    prompts = []
    for number, row in read_jsonl_objects(path):
        if not isinstance(row.get("prompt"), str):
            raise UsageError(f"{path} line {number} has no string `prompt` field (found {sorted(row)}); write one "
                             f'{{"prompt": "..."}} object per line.')
        prompts.append(row["prompt"])
    if not prompts:
        raise UsageError(f"{path} holds no prompts; add lines like {{\"prompt\": \"...\"}} or delete the file.")
    return prompts


def chat_prompt_ids(tokenizer, prompt: str) -> list[int]:
    """A benchmark prompt as the verifier sees it: one user turn in its chat template, the generation prompt
    added. Every evaluator builds its prompt tokens here, so the engines compared see the very same ids."""
    ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                        tokenize=True, return_dict=True)["input_ids"]
    return [int(t) for t in ids]
