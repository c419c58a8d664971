"""Fault injection for the subprocesses of tests/integration/test_faults.py; inert unless DSPARK_FAULT is set.

`DSPARK_FAULT="<module>:<function>:<pattern>:<action>"` wraps `<module>.<function>` at interpreter start
(before the package imports it by name; `<function>` may be `Class.method`), and the first call with a path
argument that matches the fnmatch `<pattern>` (or, for `#N`, the N-th call) does `<action>` instead of
returning normally:

    pause          touch $DSPARK_FAULT_REACHED and sleep, so the test can kill the process right there
    half-pause     write the file, cut it to half its size (a write the kill interrupted), then pause
    half-enospc    write the file, cut it to half, then raise ENOSPC (the disk filled up mid-write)

Only tests put this directory on PYTHONPATH.
"""

import errno
import fnmatch
import functools
import importlib
import os
import time

_SPEC = os.environ.get("DSPARK_FAULT")


def _install(spec: str) -> None:
    module_name, function_name, pattern, action = spec.split(":")
    owner = importlib.import_module(module_name)
    *parents, function_name = function_name.split(".")
    for name in parents:
        owner = getattr(owner, name)
    original = getattr(owner, function_name)
    fired, calls = [], []

    def path_argument(args, kwargs):
        if pattern.startswith("#"):
            calls.append(None)
            return "" if len(calls) == int(pattern[1:]) else None
        for value in [*args, *kwargs.values()]:
            if isinstance(value, (str, os.PathLike)) and fnmatch.fnmatch(os.fspath(value), pattern):
                return os.fspath(value)
        return None

    def pause():
        open(os.environ["DSPARK_FAULT_REACHED"], "w").close()
        time.sleep(3600)

    @functools.wraps(original)
    def faulty(*args, **kwargs):
        path = None if fired else path_argument(args, kwargs)
        if path is None:
            return original(*args, **kwargs)
        fired.append(path)
        if action == "pause":
            pause()
        result = original(*args, **kwargs)
        if path and os.path.isfile(path):
            os.truncate(path, os.path.getsize(path) // 2)
        if action == "half-pause":
            pause()
        if action == "half-enospc":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
        return result

    setattr(owner, function_name, faulty)


if _SPEC:
    _install(_SPEC)
