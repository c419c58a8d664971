"""The benchmark command works end to end (tiny shapes): both training-step implementations run on the same
inputs and agree on the loss, and every section reports. The numbers themselves live in benchmarks/RESULTS.md;
speed is never asserted here (benchmarks check speed, tests check behaviour)."""

import json
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SPECULATORS_PYTHON = os.path.join(ROOT, ".venv-speculators", "bin", "python")


@pytest.mark.slow
@pytest.mark.speculators
@pytest.mark.skipif(not os.path.exists(SPECULATORS_PYTHON), reason="needs .venv-speculators (make speculators-env)")
def test_quick_benchmark_run_compares_identical_steps_and_reports_every_section(tmp_path):
    report = tmp_path / "results.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.run", "--quick", "--json", str(report),
                           "--work", str(tmp_path / "work")], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    assert re.fullmatch(r"step speedup vs speculators: \d+\.\d\dx, peak memory ratio: \d+\.\d\d", last), last
    data = json.loads(report.read_text())
    for config in ("small", "large"):
        summary = data["train_step"]["summary"][config]
        # same weights, inputs, anchors and loss terms: the first-step losses agree to float32 round-off
        assert summary["loss_first_step"]["rel_diff"] < 1e-5, summary["loss_first_step"]
        for impl in ("ours", "speculators", "ours-default"):
            assert summary[impl]["step_s"]["median"] > 0 and summary[impl]["flops_per_step"] > 0
    for module in ("loss_alone", "inference"):  # every other section ran and reported its table
        assert data[module]["table"], f"{module} reported nothing"
    rows = {row[0] for row in data["inference"]["table"]}
    assert any("draft()" in name for name in rows) and any("states" in name for name in rows), sorted(rows)
