"""The Makefile's test targets, read through `make -n` (a dry run: make prints the commands it would run and runs
none of them). The virtual environments are pointed at an empty temporary directory, so even the set-up recipes
make would print concern nothing that exists and nothing is (re)installed.

pytest keeps only the last `-m` it is given, so the user's marker expression (MARK) must be AND-ed into each
target's own, and a `-m` in PYTEST_ARGS (which would silently replace it, and let a "quick" `make test` start
real vLLM servers) must be refused.
"""

import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="needs GNU make")


def dry_run(tmp_path, target: str, **variables) -> subprocess.CompletedProcess:
    venvs = {"VENV": tmp_path / "venv", "SPEC_VENV": tmp_path / "spec", "VLLM_VENV": tmp_path / "vllm",
             "LLAMACPP_DIR": tmp_path / "llamacpp"}
    args = [f"{k}={v}" for k, v in {**venvs, **variables}.items()]
    return subprocess.run(["make", "-n", "--no-print-directory", "-C", str(ROOT), target, *args],
                          capture_output=True, text=True, timeout=60)


def pytest_argv(tmp_path, target: str, **variables) -> list[str]:
    """The argv the target would run pytest with (what follows `python -m pytest` on its command line)."""
    proc = dry_run(tmp_path, target, **variables)
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stdout.splitlines() if " -m pytest " in line]
    assert len(lines) == 1, proc.stdout
    argv = shlex.split(lines[0])
    return argv[argv.index("pytest") + 1:]


def marker_expression(argv: list[str]) -> str:
    assert argv.count("-m") == 1, argv  # pytest would keep only the last one
    return argv[argv.index("-m") + 1]


@pytest.mark.parametrize("target, own", [("test", "not vllm and not faults and not llamacpp"),
                                         ("test-faults", "faults and not vllm"), ("test-vllm", "vllm"),
                                         ("test-llamacpp", "llamacpp")])
def test_mark_is_anded_with_each_targets_own_expression(tmp_path, target, own):
    assert marker_expression(pytest_argv(tmp_path, target)) == own
    assert marker_expression(pytest_argv(tmp_path, target, MARK="not slow")) == f"{own} and (not slow)"
    # an expression with an `or` stays inside its parentheses, so it cannot widen the target's selection
    assert marker_expression(pytest_argv(tmp_path, target, MARK="slow or vllm")) == f"{own} and (slow or vllm)"


def test_pytest_args_still_pass_through_after_the_marker_expression(tmp_path):
    argv = pytest_argv(tmp_path, "test", MARK="not slow", PYTEST_ARGS="-x -k 'push and not hub'")
    assert argv == ["-m", "not vllm and not faults and not llamacpp and (not slow)", "-x", "-k", "push and not hub"]


def test_the_composed_expression_selects_what_it_says(tmp_path):
    """The expression make builds, given to a real pytest over one test per marker: `make test MARK="not slow"`
    collects neither the vLLM, the fault nor the slow test."""
    suite = tmp_path / "suite"
    suite.mkdir()
    (suite / "pytest.ini").write_text("[pytest]\nmarkers =\n    slow\n    vllm\n    faults\n    llamacpp\n")
    (suite / "test_marked.py").write_text(
        "import pytest\n\ndef test_plain(): pass\n\n@pytest.mark.slow\ndef test_slow(): pass\n\n"
        "@pytest.mark.vllm\ndef test_vllm(): pass\n\n@pytest.mark.faults\ndef test_faults(): pass\n\n"
        "@pytest.mark.vllm\n@pytest.mark.slow\ndef test_vllm_slow(): pass\n\n"
        "@pytest.mark.llamacpp\ndef test_llamacpp(): pass\n")

    def collected(target: str, **variables) -> set[str]:
        expression = marker_expression(pytest_argv(tmp_path, target, **variables))
        proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                               "--strict-markers", "-c", str(suite / "pytest.ini"), "--rootdir", str(suite), "-m",
                               expression, str(suite)], capture_output=True, text=True, timeout=120, cwd=suite)
        assert proc.returncode in (0, 5), proc.stdout + proc.stderr  # 5: nothing selected
        return {line.split("::")[1] for line in proc.stdout.splitlines() if "::" in line}

    assert collected("test") == {"test_plain", "test_slow"}
    assert collected("test", MARK="not slow") == {"test_plain"}
    assert collected("test-vllm", MARK="not slow") == {"test_vllm"}
    assert collected("test-llamacpp") == {"test_llamacpp"}
    assert collected("test-faults", MARK="slow") == set()


@pytest.mark.parametrize("pytest_args", ["-m 'not slow'", "-x -m slow", "-mslow"])
@pytest.mark.parametrize("target", ["test", "test-faults", "test-vllm"])
def test_a_marker_expression_in_pytest_args_is_refused_with_the_fix(tmp_path, target, pytest_args):
    proc = dry_run(tmp_path, target, PYTEST_ARGS=pytest_args)
    assert proc.returncode != 0 and "pytest" not in proc.stdout, proc.stdout
    error = [line for line in proc.stderr.splitlines() if "***" in line]
    assert len(error) == 1, proc.stderr
    assert "PYTEST_ARGS holds a pytest marker expression (-m)" in error[0]
    assert 'pass it as MARK instead, e.g. make test MARK="not slow"' in error[0]
