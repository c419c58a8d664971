"""Run many CLI invocations in one Python process, each as `python ENTRY ARGS` would run it (test_cli_errors.py).

    python tests/cli_cases.py CASES_JSON RESULTS_JSON

CASES_JSON lists `{"entry", "args", "cwd"}`; an entry ending in `.py` is a script path, one with a dot a module
(`python -m entry`), anything else a package command (`python -m trainer entry`). Each case runs with its own
working directory, `sys.argv` and captured stderr, as `__main__` through `runpy`, and its exit status is the
`SystemExit` it raises. One process instead of one per case: the suite pays the torch/transformers import once,
not sixty times; a few cases still run in a fresh process of their own (the test keeps one per kind of entry).
"""

import contextlib
import io
import json
import os
import runpy
import sys


def run_case(entry: str, args: list[str], cwd: str) -> dict:
    err = io.StringIO()
    old_cwd, old_argv, old_path = os.getcwd(), sys.argv[:], sys.path[:]
    os.chdir(cwd)
    code = 0
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            if entry.endswith(".py"):
                sys.argv = [entry, *args]
                sys.path.insert(0, os.path.dirname(entry))
                runpy.run_path(entry, run_name="__main__")
            elif "." in entry:
                sys.argv = [entry, *args]
                runpy.run_module(entry, run_name="__main__", alter_sys=True)
            else:
                sys.argv = ["trainer", entry, *args]
                runpy.run_module("trainer", run_name="__main__", alter_sys=True)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException as e:  # noqa: BLE001 - reported to the test, which fails on it
        err.write(f"Traceback (escaped the CLI): {type(e).__name__}: {e}\n")
        code = -1
    finally:
        os.chdir(old_cwd)
        sys.argv, sys.path[:] = old_argv, old_path
    return {"returncode": code, "stderr": err.getvalue(), "wrote": sorted(os.listdir(cwd))}


def main() -> None:
    with open(sys.argv[1]) as f:
        cases = json.load(f)
    results = [run_case(c["entry"], c["args"], c["cwd"]) for c in cases]
    with open(sys.argv[2], "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main()
