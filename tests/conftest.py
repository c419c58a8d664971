import os
import sys
import tempfile
from pathlib import Path

# Offline, with a private remote-code module cache: must be set before transformers is imported.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ["HF_MODULES_CACHE"] = tempfile.mkdtemp(prefix="dspark-hf-modules-")
ROOT = Path(__file__).resolve().parents[1]
for p in (str(ROOT), str(ROOT / "tests")):
    if p not in sys.path:
        sys.path.insert(0, p)

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(min(2, torch.get_num_threads()))


@pytest.fixture(scope="session")
def gemma4_verifier():
    from tiny import tiny_gemma4_verifier

    return tiny_gemma4_verifier()


@pytest.fixture(scope="session")
def qwen3_verifier():
    from tiny import tiny_qwen3_verifier

    return tiny_qwen3_verifier()


@pytest.fixture(scope="session")
def llama_verifier():
    from tiny import tiny_llama_verifier

    return tiny_llama_verifier()


@pytest.fixture(params=["gemma4", "qwen3"])
def verifier(request):
    return request.getfixturevalue(f"{request.param}_verifier")
