"""Our checkpoints load in speculators 0.9.0, and speculators' own load in our DSparkDraftModel, with identical
weights and an identical forward.

speculators pins transformers<=5.19.0 and torchvision, so it lives in its own venv (`make speculators-env`,
created by `make test`); the check runs there as a subprocess and reports JSON. Marker `speculators`: skipped
without that environment (tests/conftest.py).
"""

import json
import os
import subprocess
import sys

import pytest
from conftest import speculators_python

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

pytestmark = [pytest.mark.speculators, pytest.mark.slow]


def test_speculators_loads_our_checkpoint_and_computes_the_same_forward(tmp_path):
    report_file = tmp_path / "report.json"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONPATH": ""}
    proc = subprocess.run([speculators_python(), os.path.join(ROOT, "tests", "speculators_crosscheck.py"), str(report_file)],
                          capture_output=True, text=True, env=env, timeout=900)
    assert report_file.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(report_file.read_text())
    sys.stdout.write(json.dumps(report, indent=2) + "\n")
    assert report["versions"]["speculators"].startswith("0.9")
    for verifier in ("qwen3", "gemma4"):
        r = report[verifier]
        assert r["their_class"] == "speculators.models.dspark.core.DSparkDraftModel"
        assert r["weights_identical_float32"] and r["weights_identical_bfloat16"]
        assert r["embedding_from_verifier_float32"] and r["embedding_from_verifier_bfloat16"]
        for key in ("max_abs_diff_hidden", "max_abs_diff_logits", "max_abs_diff_confidence"):
            assert r[key] < 2e-5, (verifier, key, r[key])
    # and the other way round: drafters speculators built and saved itself, read by our DSparkDraftModel
    for name, draft_vocab in (("theirs-dspark-full", 512), ("theirs-dspark-reduced", 100)):
        r = report[name]
        assert r["weights_identical_float32"] and r["unexpected_keys"] == [] and r["draft_vocab_size"] == draft_vocab
        assert r["logit_scale"] > 0.5  # a real forward, not zeros
        for key in ("max_abs_diff_hidden", "max_abs_diff_logits", "max_abs_diff_confidence"):
            assert r[key] < 2e-5, (name, key, r[key])
    assert proc.returncode == 0
