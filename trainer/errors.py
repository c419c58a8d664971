"""The one error path of every command-line entry point.

Expected failures (bad input, a refusal, a missing file, a failed upload) raise a `DSparkError` whose message
is one sentence naming the cause and the fix. `run_cli` turns it into one line `error: <message>` on stderr and
an exit status (2 for bad input, 1 for a runtime failure); anything else is a genuine bug and keeps its
traceback. `--debug` (or `DSPARK_DEBUG=1`) shows the traceback of expected failures too. `run_cli` also sets up
logging (`setup_logging`), the same for every command. `Parser` is the argparse parser of every entry point, so a
bad command line takes the same path.
"""

from __future__ import annotations

import argparse
import difflib
import errno
import logging
import os
import sys
from collections.abc import Callable
from typing import NoReturn


class DSparkError(Exception):
    """A failure reported to the user as one sentence (cause and fix). Exit status 1: the input was fine but
    something at run time failed (disk, network, a diverged loss)."""

    exit_code = 1


class UsageError(DSparkError, ValueError):
    """Bad input: a config value, a flag, a path or a file the user can fix. Exit status 2. Also a
    `ValueError`, so library callers that catch `ValueError` keep working."""

    exit_code = 2


def is_disk_full(error: BaseException) -> bool:
    """A write failed because the disk (or the user's quota) is full. torch's own writer reports it as a
    RuntimeError without an errno, so that one is recognised by its message."""
    if isinstance(error, OSError):
        return error.errno in (errno.ENOSPC, errno.EDQUOT)
    return isinstance(error, RuntimeError) and "file write failed" in str(error)


class Parser(argparse.ArgumentParser):
    """`argparse.ArgumentParser` whose errors (an unknown flag, a missing argument, a value of the wrong type or
    outside the choices) raise a `UsageError` instead of printing the usage block and exiting: `run_cli` then
    reports them in one line like any other bad input, and in-process callers can catch them. Subcommand
    parsers inherit the class.

    Every flag answers to both spellings, `--max-new-tokens` and `--max_new_tokens`, whichever the parser
    declares: run-config keys are underscored (they are the YAML keys) and command flags dashed, and a user should
    not have to remember which is which. Abbreviations are off, so a run-config override such as `--conf...` is never
    taken for a command flag it happens to prefix."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def parse_known_args(self, args=None, namespace=None):
        args = list(sys.argv[1:] if args is None else args)
        return super().parse_known_args([self._declared_spelling(a) for a in args], namespace)

    def _declared_spelling(self, arg: str) -> str:
        if not arg.startswith("--") or arg == "--":
            return arg
        flag, eq, value = arg.partition("=")
        if flag in self._option_string_actions:
            return arg
        for other in ("--" + flag[2:].replace("_", "-"), "--" + flag[2:].replace("-", "_")):
            if other in self._option_string_actions:
                return other + eq + value
        return arg

    def error(self, message: str) -> NoReturn:
        fix = "run with --help to see the flags and what each takes"
        prefix = "unrecognized arguments: "
        if message.startswith(prefix):
            flag = next((a for a in message[len(prefix):].split() if a.startswith("-")), "").split("=")[0]
            close = difflib.get_close_matches(flag, list(self._option_string_actions), n=1, cutoff=0.75) if flag else []
            if close:  # the most common slip is a misspelt flag: name the one meant
                fix = f"did you mean {close[0]}? ({fix})"
        raise UsageError(f"{message}; {fix}.")


def report(error: DSparkError, redact: tuple[str, ...] = ()) -> int:
    """Print `error: <message>` on one line of stderr (secrets in `redact` masked); return the exit status."""
    message = " ".join(str(error).split())
    for secret in redact:
        if secret:
            message = message.replace(secret, "***")
    print(f"error: {message}", file=sys.stderr)
    return error.exit_code


def setup_logging() -> None:
    """The log format of every command: timestamped INFO lines on stdout, so progress and the one-line errors on
    stderr stay apart. A no-op when logging is already configured (an embedding program, pytest)."""
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.INFO,
                        stream=sys.stdout)


def run_cli(main: Callable[[list[str]], object], argv: list[str] | None = None, redact: tuple[str, ...] = ()) -> int:
    """Set up logging, call `main(argv)` and map expected failures to `error: ...` and an exit status.

    `redact` lists secrets (a Hub token) that must never be printed, even inside an error message."""
    setup_logging()
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv or os.environ.get("DSPARK_DEBUG") == "1"
    argv = [a for a in argv if a != "--debug"]
    try:
        main(argv)
    except DSparkError as e:
        if debug:
            raise
        return report(e, redact)
    except KeyboardInterrupt:
        print("error: interrupted; what was finished is kept (completed checkpoints, finished rows and files), so "
              "rerun the same command to continue (for training, add --resume_from_checkpoint latest).",
              file=sys.stderr)
        return 130
    return 0
