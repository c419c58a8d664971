"""A drafter as llama.cpp serves it: GGUF files written by llama.cpp's own converter, checked by loading them.

    python -m trainer export-gguf --drafter out/demo/drafter --out out/demo/gguf

writes, for each `--outtypes` entry (default `f32,f16`), `drafter-<type>.gguf` (the checkpoint converted with the
verifier as `--target-model-dir`: llama.cpp takes the tokenizer and token embeddings from it) and
`verifier-<type>.gguf` (the verifier itself, which llama-server needs beside it), then starts llama-server with each
pair and speculates a few tokens, so a GGUF that llama.cpp cannot serve is found here and not by a user. It
prints the command that serves the pair. The checkpoint is converted as it is: no file of it is changed.

Before anything is converted, a drafter that llama.cpp cannot serve is refused in one sentence naming why
(`llamacpp_problems`): llama.cpp's DSpark runs a Qwen3 backbone only, the vanilla Markov head only, and a draft
vocabulary that maps into the verifier's (`d2t`). The build it uses is `make llamacpp-env`'s
(trainer/serving/llamacpp.py).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from pathlib import Path

from trainer.errors import Parser, UsageError, run_cli

PROG = "python -m trainer export-gguf"
OUTTYPES = ("f32", "f16", "bf16", "q8_0")  # what the converter writes and llama.cpp's CPU backend runs
SERVED_BACKBONES = ("qwen3",)  # llama.cpp docs/speculative.md: "only drafts with a Qwen3 backbone are supported"
SERVED_MARKOV_HEADS = ("vanilla",)  # its converter refuses any other markov_head_type


def llamacpp_problems(drafter_config: dict, weight_names: set[str], verifier_vocab: int | None) -> list[str]:
    """Why llama.cpp cannot serve a drafter (its config.json as a dict, its tensor names, the verifier's vocabulary
    size), one clause each; empty when it can. Read from the files alone, before any conversion."""
    problems = []
    architectures = drafter_config.get("architectures") or []
    if not any("DSpark" in str(a) for a in architectures):
        problems.append(f"it is not a DSpark drafter (architectures {architectures})")
    layer = drafter_config.get("transformer_layer_config") or {}
    backbone = layer.get("model_type")
    if backbone not in SERVED_BACKBONES:
        problems.append(f"its layers are {backbone or 'unrecorded'}, and llama.cpp's DSpark runs a Qwen3 backbone only "
                        f"(transformer_layer_config.model_type qwen3)")
    head = drafter_config.get("markov_head_type", "vanilla")
    if head not in SERVED_MARKOV_HEADS:
        problems.append(f"its Markov head is {head!r}, and llama.cpp serves the vanilla head only")
    vocab = drafter_config.get("vocab_size") or layer.get("vocab_size")
    draft_vocab = drafter_config.get("draft_vocab_size") or vocab
    if vocab and draft_vocab and draft_vocab > vocab:
        problems.append(f"its draft vocabulary ({draft_vocab}) is larger than the verifier vocabulary ({vocab})")
    elif vocab and draft_vocab and draft_vocab < vocab and not {"d2t", "model.d2t"} & weight_names:
        problems.append(f"its draft vocabulary ({draft_vocab} of {vocab} tokens) has no d2t mapping in its weights")
    if verifier_vocab is not None and vocab and verifier_vocab != vocab:
        problems.append(f"it was built for a {vocab}-token vocabulary and the verifier has {verifier_vocab}")
    return problems


def weight_names(directory: Path) -> set[str]:
    """The tensor names of a checkpoint's safetensors files (headers only)."""
    from safetensors import safe_open

    names: set[str] = set()
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            names.update(f.keys())
    return names


def serve_command(llamacpp, verifier_gguf: Path, drafter_gguf: Path, block_size: int) -> str:
    """The llama-server command that serves a pair (paths relative to the working directory when under it)."""
    def shown(path: Path) -> str:
        relative = os.path.relpath(path)
        return relative if not relative.startswith("..") else str(path)

    return shlex.join([shown(llamacpp.server), "-m", shown(verifier_gguf), "-md", shown(drafter_gguf), "--spec-type",
                       "draft-dspark", "--spec-draft-n-max", str(block_size), "--host", "127.0.0.1", "--port",
                       "8080"])


def load_check(llamacpp, verifier_gguf: Path, drafter_gguf: Path, block_size: int, prompt_ids: list[int]) -> dict:
    """Serve the pair and speculate a few tokens: llama-server must load both files and count drafts."""
    from trainer.serving.llamacpp import LlamaCppError, LlamaServer, complete, spec_counters

    log = drafter_gguf.with_name(drafter_gguf.stem + ".load-check.log")
    log.unlink(missing_ok=True)
    with LlamaServer(llamacpp, verifier_gguf, drafter_gguf, block_size=block_size, ctx_size=512,
                     log_path=log) as server:
        out = complete(server.url, prompt_ids, 16, {"temperature": 0.0}, timeout=300)
        counters = spec_counters(server.url)
    if not out.tokens or not counters["drafts"]:
        raise LlamaCppError(f"llama-server loaded {drafter_gguf.name} but drafted nothing for a 16-token request "
                            f"(drafts counted: {counters['drafts']:.0f}); its log is {log}.")
    log.unlink(missing_ok=True)
    return {"tokens": len(out.tokens), "drafts": int(counters["drafts"]), "accepted": int(counters["accepted"])}


def export_gguf(drafter: str, out: str, verifier: str | None = None, outtypes: tuple[str, ...] = ("f32", "f16"),
                check: bool = True) -> dict:
    """Convert `drafter` (and its verifier) to GGUF in `out`, one pair per outtype; returns what was written."""
    from configuration_dspark import DSparkConfig
    from trainer.evaluation.in_process import run_selection
    from trainer.serving.llamacpp import VERSION, convert, locate
    from trainer.verifier.loading import local_folder

    drafter_dir = Path(run_selection(drafter))
    if not (drafter_dir / "config.json").is_file():
        raise UsageError(f"drafter {drafter} has no config.json; pass a checkpoint directory (or OUTPUT_DIR:final).")
    config = json.loads((drafter_dir / "config.json").read_text())
    verifier_name = verifier or config.get("verifier_local_path") or DSparkConfig.from_pretrained(
        drafter_dir).verifier_name_or_path
    if not verifier_name:
        raise UsageError("the drafter's config names no verifier; pass --verifier <directory or Hub id>.")
    verifier_dir = local_folder(verifier_name, "verifier")
    verifier_config = json.loads((verifier_dir / "config.json").read_text())
    verifier_vocab = (verifier_config.get("text_config") or verifier_config).get("vocab_size")
    problems = llamacpp_problems(config, weight_names(drafter_dir), verifier_vocab)
    if problems:
        raise UsageError(f"llama.cpp cannot serve the drafter {drafter}: {'; '.join(problems)}.")
    llamacpp = locate()
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    block = int(config.get("block_size") or 0)
    written: dict = {"llamacpp": VERSION, "drafter": str(drafter_dir), "verifier": str(verifier_dir), "files": {}}
    prompt_ids = None
    if check:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(verifier_dir)
        prompt_ids = tokenizer.apply_chat_template([{"role": "user", "content": "Count from one to twenty."}],
                                                   add_generation_prompt=True, tokenize=True, return_dict=True)[
            "input_ids"]
    for outtype in outtypes:
        verifier_gguf = out_dir / f"verifier-{outtype}.gguf"
        drafter_gguf = out_dir / f"drafter-{outtype}.gguf"
        print(f">> converting the verifier ({verifier_dir.name}) to {verifier_gguf}", flush=True)
        convert(llamacpp, verifier_dir, verifier_gguf, outtype)
        print(f">> converting the drafter to {drafter_gguf}", flush=True)
        convert(llamacpp, drafter_dir, drafter_gguf, outtype, target_model_dir=verifier_dir)
        entry = {"verifier": str(verifier_gguf), "drafter": str(drafter_gguf),
                 "drafter_bytes": drafter_gguf.stat().st_size}
        if check:
            print(f">> serving the {outtype} pair with llama-server to check it loads and drafts", flush=True)
            entry["load_check"] = load_check(llamacpp, verifier_gguf, drafter_gguf, block, prompt_ids)
        written["files"][outtype] = entry
    first = written["files"][outtypes[0]]
    written["serve"] = serve_command(llamacpp, Path(first["verifier"]), Path(first["drafter"]), block)
    return written


def main(argv: list[str] | None = None) -> dict:
    parser = Parser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--drafter", required=True,
                        help="drafter checkpoint directory or a run's OUTPUT_DIR:best|latest|final|<step>")
    parser.add_argument("--verifier", default=None,
                        help="the verifier's directory or Hub id (default: the one the drafter's config names)")
    parser.add_argument("--out", required=True, help="directory for the GGUF files")
    parser.add_argument("--outtypes", default="f32,f16",
                        help=f"comma-separated GGUF types, one drafter and verifier pair each ({', '.join(OUTTYPES)})")
    parser.add_argument("--no-load-check", dest="check", action="store_false",
                        help="skip serving each pair with llama-server after converting it")
    args = parser.parse_args(argv)
    outtypes = tuple(t.strip() for t in args.outtypes.split(",") if t.strip())
    unknown = [t for t in outtypes if t not in OUTTYPES]
    if not outtypes or unknown:
        raise UsageError(f"--outtypes {args.outtypes!r} names {unknown or 'nothing'}; pass some of "
                         f"{', '.join(OUTTYPES)}, e.g. --outtypes f32,f16.")
    if os.path.isfile(args.out):
        raise UsageError(f"--out {args.out} is a file; pass a directory for the GGUF files.")
    written = export_gguf(args.drafter, args.out, args.verifier, outtypes, args.check)
    for outtype, entry in written["files"].items():
        check = entry.get("load_check")
        line = f"{outtype}: {entry['drafter']} ({entry['drafter_bytes'] / 1e6:.1f} MB) + {entry['verifier']}"
        if check:
            line += (f"; served: {check['tokens']} tokens, {check['drafts']} drafts, {check['accepted']} drafted "
                     f"tokens accepted")
        print(line)
    print(f"serve it:\n  {written['serve']}")
    return written


if __name__ == "__main__":
    sys.exit(run_cli(main))
