"""The benchmarks follow one protocol (benchmarks/common.py `PROTOCOL`) and `benchmarks.run` drives every one of
them: each one's smallest configuration runs end to end through it, one whose prerequisite is missing is skipped
in one sentence, and the training-step comparison runs both implementations on the same inputs, which agree on
the loss. The numbers themselves live in benchmarks/RESULTS.md; speed is never asserted here (benchmarks check
speed, tests check behaviour)."""

import importlib
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NOT_BENCHMARKS = {"common", "run", "speculators_step", "speculators_recipe", "speculators_gpu_step"}  # the protocol,
# the driver, the speculators sides of train_step, recipe and gpu_check
PROVENANCE = ("schema", "benchmark", "date", "command", "quick", "machine", "versions", "git")


def run_benchmarks(tmp_path, *args, timeout=600):
    report = tmp_path / "results.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.run", *args, "--json", str(report),
                           "--work", str(tmp_path / "work")], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc, json.loads(report.read_text())


def test_every_benchmark_module_follows_the_protocol_and_run_drives_it():
    from benchmarks import common, run

    modules = sorted(p.stem for p in (ROOT / "benchmarks").glob("*.py") if p.stem not in NOT_BENCHMARKS | {"__init__"})
    assert sorted(run.BENCHMARKS) == modules, "every benchmarks/*.py is driven by benchmarks.run"
    for name in modules:
        module = importlib.import_module(f"benchmarks.{name}")
        assert module.NAME == name and callable(module.run) and callable(module.add_arguments), name
        args = common.protocol_parser(module).parse_args(list(getattr(module, "QUICK_ARGS", ["--quick"])))
        assert args.quick and args.json is None, name
    assert {run.ALIASES[a] for a in run.DEFAULT if a in run.ALIASES} | {"train_step"} == {
        "train_step", "loss_alone", "inference"}  # the default set of old: train_step, loss, extraction, drafting


def test_write_result_records_date_machine_command_and_versions(tmp_path):
    from benchmarks.common import write_result

    path = tmp_path / "r.json"
    record = write_result(path, "x", {"table": [["a", 1.0, "s", ""]], "machine": "not this"}, "python -m x", True)
    assert json.loads(path.read_text()) == record
    assert all(key in record for key in PROVENANCE) and record["benchmark"] == "x"
    assert isinstance(record["machine"]["cpu"], str) and isinstance(record["machine"]["cpu_flags"], list)
    assert record["versions"]["torch"] and record["versions"]["transformers"]


def test_an_unavailable_benchmark_is_skipped_in_one_sentence(tmp_path):
    missing = str(tmp_path / "no-such-python")
    proc, data = run_benchmarks(tmp_path, "--only", "train_step,regeneration,hidden_states",
                                "--speculators-python", missing, "--vllm-python", missing, timeout=120)
    assert set(data["skipped"]) == {"train_step", "regeneration", "hidden_states"}
    for name, why in data["skipped"].items():
        assert missing in why and "\n" not in why and why.endswith("."), why
        assert f"{name}: skipped: {why}" in proc.stdout


@pytest.mark.slow
def test_the_benchmarks_outside_the_default_set_run_through_the_protocol(tmp_path):
    """muon_step and gpu_step (its CPU smoke without a GPU), as `--quick` configures them; loss_alone and inference
    run in the default set below, and the vLLM ones (regeneration, hidden_states) take a server each, which the
    suite's time budget leaves to `make bench`."""
    names = ["muon_step", "gpu_step"]
    _, data = run_benchmarks(tmp_path, "--quick", "--only", ",".join(names))
    for name in names:
        result = data[name]
        assert all(key in result for key in PROVENANCE) and result["benchmark"] == name and result["quick"]
        assert result["table"] and all(len(row) == 4 for row in result["table"]), name
        assert result["command"].startswith(f"python -m benchmarks.{name} --quick"), result["command"]


@pytest.mark.slow
@pytest.mark.speculators
def test_quick_benchmark_run_compares_identical_steps_and_reports_every_section(tmp_path):
    from conftest import speculators_python

    proc, data = run_benchmarks(tmp_path, "--quick", "--speculators-python", speculators_python(), timeout=1800)
    last = proc.stdout.strip().splitlines()[-1]
    assert re.fullmatch(r"step speedup vs speculators: \d+\.\d\dx, peak memory ratio: \d+\.\d\d", last), last
    # the headline is the default objective: speculators' step over ours-default's; the line before it names
    # that objective and gives the matched objective's ratio, speculators' step over ours'
    small = data["train_step"]["summary"]["small"]
    steps = {impl: small[impl]["step_s"]["median"] for impl in ("ours", "speculators", "ours-default")}
    headline = re.fullmatch(r"step speedup vs speculators: (\d+\.\d\d)x, .*", last)
    assert abs(float(headline.group(1)) - steps["speculators"] / steps["ours-default"]) < 0.011, (last, steps)
    named = proc.stdout.strip().splitlines()[-2]
    match = re.fullmatch(r"headline objective: the package's default \(.*\); matched objective \(.*\): "
                         r"(\d+\.\d\d)x, peak memory ratio \d+\.\d\d", named)
    assert match, named
    assert abs(float(match.group(1)) - steps["speculators"] / steps["ours"]) < 0.011, (named, steps)
    for config in ("small", "large"):
        summary = data["train_step"]["summary"][config]
        # same weights, inputs, anchors and loss terms: the first-step losses agree to float32 round-off
        assert summary["loss_first_step"]["rel_diff"] < 1e-5, summary["loss_first_step"]
        for impl in ("ours", "speculators", "ours-default"):
            assert summary[impl]["step_s"]["median"] > 0 and summary[impl]["flops_per_step"] > 0
    for module in ("loss_alone", "inference"):  # every other section of the default set ran and reported its table
        assert data[module]["table"], f"{module} reported nothing"
    rows = {row[0] for row in data["inference"]["table"]}
    assert any("draft()" in name for name in rows) and any("states" in name for name in rows), sorted(rows)


@pytest.mark.slow
@pytest.mark.speculators
def test_quick_recipe_benchmark_trains_both_packages_on_the_same_data_and_evaluates_them_alike(tmp_path):
    """Both sides train from one vocabulary, one set of rows and one states cache, each with its own defaults (the
    speculators side really is speculators: its resolved loss and anchors, its own save_pretrained), and one
    evaluator measures both; the headline is the ratio of the two weighted T = 0 acceptance lengths."""
    import numpy as np
    from conftest import speculators_python
    from safetensors.torch import load_file

    work, report = tmp_path / "work", tmp_path / "recipe.json"
    command = [sys.executable, "-m", "benchmarks.recipe", "--quick", "--seeds", "0", "--attribution", "confidence,last",
               "--work", str(work), "--json", str(report), "--speculators-python", speculators_python()]
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(report.read_text())
    assert all(key in data for key in PROVENANCE) and data["benchmark"] == "recipe" and data["quick"]
    ours, theirs = data["runs"]["ours"]["0"], data["runs"]["speculators"]["0"]
    assert ours["global_step"] == theirs["global_step"] == data["steps"] == 4
    # speculators' own defaults, resolved by its own TrainConfig
    assert theirs["resolved"]["loss_fn"] == "kl_div" and theirs["resolved"]["max_anchors"] == 512
    assert theirs["argv"][:2] == ["speculators", "train"]
    saved = json.loads((work / "speculators-seed0" / "drafter" / "config.json").read_text())
    assert "model_type" not in saved and saved["speculators_model_type"] == "dspark", "saved by speculators itself"
    # one draft vocabulary: the one speculators was given is the one our run chose
    given = np.flatnonzero(np.load(work / "data" / "t2d.npy"))
    for drafter in (work / "ours-seed0", work / "speculators-seed0" / "drafter"):
        d2t = load_file(str(drafter / "model.safetensors"))["d2t"].numpy()
        assert (d2t + np.arange(d2t.size) == given).all(), drafter
    for side in (ours, theirs):
        t0 = side["held_out_t0"]
        assert t0["steps"] > 0 and t0["fidelity_steps_differing"] == 0 and t0["sampling"]["temperature"] == 0
        assert side["held_out_sampled"]["sampling"]["temperature"] > 0
        assert 1.0 <= side["validation"]["accept_len"] <= 5.0
    sides = data["sides"]
    ratio = sides["ours"]["held_out_t0"]["mean"] / sides["speculators"]["held_out_t0"]["mean"]
    # attribution: one of speculators' settings on our side alone (really trained with it), or our run's last
    # checkpoint instead of its best; each row's delta is against our default's mean
    rows = data["attribution"]
    assert set(rows) == {"confidence", "last"}
    from trainer.config import RUN_CONFIG_FILE
    assert "confidence_target: sampled_restricted" in (work / "ours-confidence-seed0" / RUN_CONFIG_FILE).read_text()
    assert rows["last"]["runs"]["0"]["drafter"].endswith("ours-seed0/checkpoint-4")
    for row in rows.values():
        assert row["delta"] == pytest.approx(row["mean"] - sides["ours"]["held_out_t0"]["mean"])
        assert row["within_noise"] is None  # one seed: the noise is not known, and the table says so
    last = proc.stdout.strip().splitlines()[-1]
    assert last == (f"held-out acceptance vs speculators: {ratio:.2f}x (ours {sides['ours']['held_out_t0']['mean']:.3f}"
                    f", speculators {sides['speculators']['held_out_t0']['mean']:.3f}, T=0, 4 steps each)"), last
    # a rerun with the same settings reuses every finished stage
    again = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert again.stdout.count(": reused (") == 1 + 2 + 4 + 1 + 2, again.stdout
    assert again.stdout.strip().splitlines()[-1] == last
    # --ours-only: the rows against our default without speculators' side (nothing of it runs or is read), reusing
    # our finished stages; no ratio, and the headline says why
    alone_report = tmp_path / "alone.json"
    alone = subprocess.run([sys.executable, "-m", "benchmarks.recipe", "--quick", "--seeds", "0", "--attribution",
                            "last", "--ours-only", "--work", str(work), "--json", str(alone_report),
                            "--speculators-python", str(tmp_path / "no-such-python")],
                           cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert alone.returncode == 0, alone.stdout[-3000:] + alone.stderr[-3000:]
    assert alone.stdout.count(": reused (") == 1 + 1 + 1 + 1 and "speculators-seed0" not in alone.stdout
    solo = json.loads(alone_report.read_text())
    assert set(solo["runs"]) == {"ours"} and solo["ratio_t0"] is None and set(solo["attribution"]) == {"last"}
    assert solo["sides"]["ours"]["held_out_t0"] == sides["ours"]["held_out_t0"]
    assert solo["attribution"]["last"]["mean"] == pytest.approx(rows["last"]["mean"])
    assert alone.stdout.strip().splitlines()[-1] == (
        f"held-out acceptance, ours alone: {sides['ours']['held_out_t0']['mean']:.3f} (T=0, 4 steps; speculators not "
        f"run: --ours-only)")


@pytest.mark.slow
def test_make_gpu_check_cpu_smoke_runs_every_part_and_writes_one_json_and_one_table(tmp_path):
    """`make gpu-check GPU_CHECK_ARGS=--cpu-smoke`, the command as a user types it: every part runs on tiny CPU
    shapes (the gpu tests are collected and skipped here: no CUDA), and both objectives really differ."""
    out = tmp_path / "gpu_check.json"
    proc = subprocess.run(["make", "--no-print-directory", "gpu-check",
                           f"GPU_CHECK_ARGS=--cpu-smoke --quick --json {out}"], cwd=ROOT, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert all(key in data for key in PROVENANCE) and data["benchmark"] == "gpu_check" and data["smoke"]
    assert data["matrix_rate"]["flops_per_s"] > 0 and data["matrix_rate"]["dtype"] == "float32"
    tests = data["gpu_tests"]
    assert tests["returncode"] == 0 and tests["counts"].get("skipped", 0) >= 3 and not tests["counts"].get("failed")
    default, matched = data["ours"]["default"], data["ours"]["matched"]
    for result in (default, matched):
        assert result["losses_finite"] and result["step_median_s"] > 0 and result["mfu_measured_rate"] > 0
    assert default["objective"]["confidence_target"] == "greedy" and default["objective"]["full_vocab_metrics"]
    assert matched["objective"]["confidence_target"] == "sampled_restricted"
    assert not matched["objective"]["full_vocab_metrics"]
    # speculators' own step through its CLI's builders, from .venv-speculators (eager loss and sdpa on the CPU)
    theirs = data["speculators"]
    assert "not_run" not in theirs and "failed" not in theirs, theirs
    assert theirs["losses_finite"] and theirs["step_median_s"] > 0 and theirs["optimizers"] == ["Muon", "AdamW"]
    assert (theirs["attention"], theirs["loss_implementation"]) == ("sdpa", "eager")
    assert theirs["shape"]["block_size"] == 8 and theirs["flops"]["total"] > 0
    # speculators' step by region, as ours (its forward returns the loss: one region)
    assert list(theirs["regions"]["host_s"]) == ["forward and loss", "backward", "clip", "optimizer"]
    assert all(seconds > 0 for seconds in theirs["regions"]["host_s"].values()) and theirs["regions"]["gpu_s"] is None
    table = (tmp_path / "gpu_check.md").read_text().splitlines()
    assert table[0] == "| measurement | value | unit | note |" and len(table) == len(data["table"]) + 2
    assert any(line.startswith("| ours, default objective: step |") for line in table)
    assert any(line.startswith("| speculators: step by region |") for line in table)
    speedup = [line for line in table if line.startswith("| step speedup vs speculators, default objective |")]
    assert len(speedup) == 1 and float(speedup[0].split("|")[2]) == pytest.approx(
        theirs["step_median_s"] / default["step_median_s"], rel=1e-3)
    assert f"table: {out.with_suffix('.md')}" in proc.stdout or "gpu_check.md" in proc.stdout
    # after each part, the parts so far (a short lease that ends mid-run keeps them): the last write holds them all
    partial = json.loads((tmp_path / "gpu_check.partial.json").read_text())
    assert partial["ours"]["default"]["step_median_s"] == default["step_median_s"]
    assert partial["speculators"]["step_median_s"] == theirs["step_median_s"]
    assert "   ours: default: step " in proc.stdout and "   speculators: as it ships: step " in proc.stdout


def test_gpu_step_profile_splits_the_step_by_region(tmp_path):
    """`gpu_step --profile`: besides the whole-step table, one table per region of the step, holding what ran in that
    region: the loss's autograd Function in `loss` (opened one level), the autograd engine's ops in `backward`, the
    optimizer step in `optimizer`, and never one region's operation in another's."""
    out = tmp_path / "step.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.gpu_step", "--cpu-smoke", "--quick", "--profile",
                           "--json", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    tables = json.loads(out.read_text())["profile_regions"]
    assert list(tables) == ["anchors", "forward", "loss", "backward", "clip", "optimizer"]
    rows = {name: [line.rsplit(None, 2)[0] for line in table.splitlines()[1:-1]] for name, table in tables.items()}
    assert "_DraftLoss" in rows["loss"] and any(r.startswith("_DraftLoss > aten::") for r in rows["loss"])
    assert rows["backward"] and all(r.startswith("autograd::engine::evaluate_function") for r in rows["backward"])
    assert any(r.startswith("Optimizer.step#MuonWithAdamW.step") for r in rows["optimizer"])
    assert "_DraftLoss" not in rows["forward"] and "aten::_foreach_norm" in rows["clip"]
    assert "aten::linear" in rows["forward"] and "aten::argsort" in rows["anchors"]


def test_gpu_check_starts_no_part_that_its_budget_cannot_hold(tmp_path):
    """A device lease is short: with its --budget spent, the check starts nothing more, says so per part and fails,
    after writing what it has."""
    out = tmp_path / "gpu_check.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.gpu_check", "--cpu-smoke", "--budget", "15", "--json",
                           str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and proc.stdout.strip().splitlines()[-1] == "table: " + str(out.with_suffix(".md"))
    data = json.loads(out.read_text())
    assert data["matrix_rate"]["flops_per_s"] > 0
    spent = " not started: under 20 s of the check's --budget of 15 s was left."
    assert data["gpu_tests"] == {"failed": "the gpu tests" + spent}
    assert data["speculators"] == {"failed": "speculators' step" + spent}
    assert data["ours"] == {"default": {"failed": "our step" + spent}, "matched": {"failed": "our step" + spent}}
    assert proc.stderr.startswith("error: ") and data["failed"].startswith("the gpu tests" + spent)


@pytest.mark.speculators
@pytest.mark.slow
def test_gpu_check_measures_speculators_with_its_eager_loss_where_the_shipped_loss_fails(tmp_path):
    """On the H200 (torch 2.11) speculators' fused Triton loss failed under Dynamo: the check then measures its step
    with the eager loss and keeps the failure beside it. Here the fused loss fails for real (no Triton on a CPU)."""
    from conftest import speculators_python

    from benchmarks.gpu_check import speculators_step

    result = speculators_step(True, 1, 0, speculators_python(), tmp_path / "s.json", 300, "fused")
    assert "failed" not in result and result["loss_implementation"] == "eager" and result["step_median_s"] > 0
    assert result["as_shipped_failed"].startswith("speculators' step exited with status 1: RuntimeError: Fused")
    assert result["command"].endswith("--loss-implementation fused --loss-implementation eager")


def test_gpu_check_says_how_to_bring_speculators_where_it_does_not_import(tmp_path):
    """The GPU machine has no speculators and no network: the check names the way to carry it, and runs nothing."""
    from benchmarks.gpu_check import speculators_step

    result = speculators_step(True, 1, 0, sys.executable, tmp_path / "s.json", 60)  # .venv: no speculators
    assert set(result) == {"not_run"} and "make gpu-wheels" in result["not_run"]
    assert "No module named 'speculators'" in result["not_run"] and not (tmp_path / "s.json").exists()
