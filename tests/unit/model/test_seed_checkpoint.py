"""The seed recipe's shapes build, save (bf16) and reload on CPU: scripts/seed_checkpoint.py."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


@pytest.mark.slow
def test_seed_shaped_checkpoint_builds_saves_and_reloads(tmp_path):
    out = tmp_path / "seed"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "seed_checkpoint.py"), "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = proc.stdout
    assert "weights identical: True" in text
    count = int(text.split("saved floating-point parameters: ")[1].split(" ")[0].replace(",", ""))
    assert 0.53e9 < count < 0.57e9
    assert "markov_head.markov_w1.weight                     [262144, 256]      BF16" in text
    assert "embed_tokens" not in text and "verifier_" not in text.split("saved tensors:")[1]
    assert sorted(os.listdir(out)) == ["config.json", "configuration_dspark.py", "model.safetensors",
                                       "modeling_dspark.py"]
