"""Security properties, each against real behaviour: a vLLM server's answer cannot make the online hidden-state
source read or delete anything outside its states directory; a verifier's repo code is never executed; no token
reaches a vLLM server, a log line or an error; every `torch.load` is `weights_only=True` and the model weights
of a checkpoint are safetensors only."""

import ast
import json
import logging
import os
import shutil
import subprocess
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from stand_in import StandIn

from trainer.config import RunConfig
from trainer.errors import UsageError, run_cli
from trainer.serving.http import VLLMServerError, checked_url, request_json
from trainer.states.vllm import VLLMStatesError, VLLMStateSource
from trainer.verifier.teacher import Teacher

ROOT = Path(__file__).resolve().parents[2]
SECRET = "hf_SECRETtoken0123456789abcdef"
SERVED = "tiny/verifier"
IDS = torch.arange(6, dtype=torch.long) + 7


@pytest.fixture
def stand_in():
    servers = []

    def start(answer, **kw):
        servers.append(StandIn(answer, **{"served": SERVED, "root": SERVED, "max_model_len": 4096,
                                           "echo_headers": True, **kw}))
        return servers[-1]

    yield start
    for server in servers:
        server.close()


def states_source(states_dir, url, **kwargs) -> VLLMStateSource:
    teacher = Teacher(torch.nn.Identity(), None, torch.randn(50, 8))
    return VLLMStateSource([url], str(states_dir), [1, 2, 3], 4, 8, teacher, SERVED, backoff=0.01, **kwargs)


def write_states(path: Path, ids=IDS) -> bytes:
    """A valid states file (and its lock) for `ids` as the source requests them: [n, 4 layers, H 8]."""
    save_file({"hidden_states": torch.randn(ids.numel(), 4, 8), "token_ids": ids.clone()}, str(path))
    Path(f"{path}.lock").touch()
    return path.read_bytes()


def answering(path: str):
    """Every completion is answered with the hidden-states file `path`."""
    return lambda route, body: (200, {"choices": [{"text": "x"}], "kv_transfer_params": {"hidden_states_path": path}})


@pytest.fixture
def opened(monkeypatch):
    """Every path the states source opens, loads or deletes (its module's `open`, `load_file`, `os.remove`)."""
    import trainer.states.vllm as vs

    seen = []
    real_open, real_load, real_remove = open, vs.load_file, os.remove
    monkeypatch.setattr(vs, "open", lambda p, *a, **k: seen.append(str(p)) or real_open(p, *a, **k), raising=False)
    monkeypatch.setattr(vs, "load_file", lambda p, *a, **k: seen.append(str(p)) or real_load(p, *a, **k))
    monkeypatch.setattr(vs.os, "remove", lambda p, *a, **k: seen.append(str(p)) or real_remove(p, *a, **k))
    return seen


# ------------------------------------------------------------------------------------------------ (a) states files
def hostile_answers(tmp_path: Path):
    """`(answered path, files outside the states dir that it must not touch)` for each hostile answer, with the
    states dir `tmp_path/run/hs` and valid states files placed where a path-following client would find them."""
    hs, outside = tmp_path / "run" / "hs", tmp_path / "elsewhere"
    hs.mkdir(parents=True)
    outside.mkdir()
    cases = {}
    # A system-file-like absolute path (a copy: this suite runs as root, a broken client must not delete /etc's).
    (outside / "passwd").write_text("root:x:0:0:root:/root:/bin/bash\n")
    cases["absolute non-states file"] = (str(outside / "passwd"), [outside / "passwd"])
    # An absolute path into another directory, holding a valid states file for exactly this request.
    write_states(outside / "cmpl-abs-0.safetensors")
    cases["absolute path elsewhere"] = (str(outside / "cmpl-abs-0.safetensors"),
                                        [outside / "cmpl-abs-0.safetensors", outside / "cmpl-abs-0.safetensors.lock"])
    # A relative path climbing out: valid files both where it points (from hs) and under its bare name in hs.
    write_states(tmp_path / "run" / "x.safetensors")
    write_states(hs / "x.safetensors")
    cases["relative path with .."] = ("../x.safetensors", [tmp_path / "run" / "x.safetensors",
                                                           tmp_path / "run" / "x.safetensors.lock",
                                                           hs / "x.safetensors", hs / "x.safetensors.lock"])
    # A link inside hs to a valid states file outside it (a plain lock next to it, as the server's writer leaves).
    write_states(outside / "real.safetensors")
    (hs / "cmpl-link-0.safetensors").symlink_to(outside / "real.safetensors")
    Path(f"{hs}/cmpl-link-0.safetensors.lock").touch()
    cases["link to a file outside"] = ("/server/mount/cmpl-link-0.safetensors",
                                       [outside / "real.safetensors", hs / "cmpl-link-0.safetensors"])
    # A plain states file whose lock is a link to a file outside (the client opens and deletes the lock too).
    save_file({"hidden_states": torch.randn(IDS.numel(), 4, 8), "token_ids": IDS.clone()},
              str(hs / "cmpl-lock-0.safetensors"))
    (outside / "victim.txt").write_text("keep me\n")
    (hs / "cmpl-lock-0.safetensors.lock").symlink_to(outside / "victim.txt")
    cases["lock linked outside"] = ("/server/mount/cmpl-lock-0.safetensors",
                                    [outside / "victim.txt", hs / "cmpl-lock-0.safetensors.lock"])
    cases["not a string"] = (["cmpl-0.safetensors"], [])
    return hs, cases


@pytest.mark.parametrize("case", ["absolute non-states file", "absolute path elsewhere", "relative path with ..",
                                  "link to a file outside", "lock linked outside", "not a string"])
def test_a_server_answer_cannot_point_the_states_source_outside_its_directory(case, tmp_path, stand_in, opened):
    hs, cases = hostile_answers(tmp_path)
    answered, protected = cases[case]
    before = {p: (p.is_symlink(), p.read_bytes()) for p in protected}
    server = stand_in(answering(answered))
    with pytest.raises(VLLMStatesError, match=rf"the (vLLM server {server.url} |hidden-states file .* that the "
                                              rf"vLLM server {server.url} )"):
        states_source(hs, server.url).check()
    # during training: refused on every attempt (retried like any failed request, then the run stops)
    source = states_source(hs, server.url, retries=1)
    with pytest.raises(VLLMStatesError, match=rf"failed all 2 hidden-state requests \(last: {server.url}: "):
        source.document_states([IDS])
    source.close()
    assert {p: (p.is_symlink(), p.read_bytes()) for p in protected} == before  # not deleted, not rewritten
    assert opened == []  # refused before opening, loading or deleting anything


def test_the_refusal_names_the_server_and_the_fix(tmp_path, stand_in):
    hs, _ = hostile_answers(tmp_path)
    server = stand_in(answering("../x.safetensors"))
    with pytest.raises(VLLMStatesError) as refused:
        states_source(hs, server.url).check()
    assert str(refused.value) == (
        f"the vLLM server {server.url} named the hidden-states file '../x.safetensors', which is not a "
        f"`<request id>.safetensors` file of its states directory, so it is neither read nor deleted; point "
        f"train.vllm_urls at a server of this run (start it with the command `python -m trainer vllm-server "
        f"--config <run config>` prints).")
    server = stand_in(answering("/server/mount/cmpl-link-0.safetensors"))
    with pytest.raises(VLLMStatesError, match=rf"^the hidden-states file {hs}/cmpl-link-0.safetensors that the vLLM "
                                              rf"server {server.url} named links to {tmp_path}/elsewhere/real"
                                              rf".safetensors, outside train.vllm_states_dir {hs}, so it is neither "
                                              rf"read nor deleted; remove the link and leave that directory to the "
                                              rf"server's files.$"):
        states_source(hs, server.url).check()


@pytest.mark.parametrize("answered", ["/server/mount/cmpl-5f3e9a1c2b7d4e60a1b2c3d4e5f60718-0.safetensors",
                                      "out/hidden-states/cmpl-5f3e9a1c2b7d4e60a1b2c3d4e5f60718-0.safetensors",
                                      "cmpl-5f3e9a1c2b7d4e60a1b2c3d4e5f60718-0-a1b2c3d4.safetensors"])
def test_a_servers_own_file_is_still_read_and_deleted(answered, tmp_path, stand_in, opened):
    """The legitimate answer, whatever directory the server mounts the shared one at: the file of that name in
    the trainer's states dir is read, then it and its lock are deleted (and nothing else is touched)."""
    hs = tmp_path / "hs"
    hs.mkdir()
    name = os.path.basename(answered)
    write_states(hs / name)
    keep = hs / "cmpl-other-0.safetensors"
    write_states(keep)  # another request's file in flight
    server = stand_in(answering(answered))
    source = states_source(hs, server.url, retries=0)
    [(aux, last)] = source.document_states([IDS])
    source.close()
    assert aux.shape == (IDS.numel(), 3 * 8) and last.shape == (IDS.numel(), 8)
    assert sorted(os.listdir(hs)) == ["cmpl-other-0.safetensors", "cmpl-other-0.safetensors.lock"]
    assert {os.path.realpath(p) for p in opened} == {str(hs / name), f"{hs / name}.lock"}


# ------------------------------------------------------------------------------------------------ (b) remote code
EVIL = """import pathlib
pathlib.Path({marker!r}).write_text("executed")
from transformers import LlamaConfig, LlamaForCausalLM
class EvilConfig(LlamaConfig):
    pass
class EvilModel(LlamaForCausalLM):
    config_class = EvilConfig
"""


@pytest.fixture
def remote_code_verifier(chat_verifier_dir, tmp_path):
    """The tiny verifier, plus repo code that (if anything ever executes it) leaves a marker file; its config
    and tokenizer config point at that code through `auto_map`, as a repo needing trust_remote_code does."""
    directory, marker = tmp_path / "verifier", tmp_path / "remote-code-ran"
    shutil.copytree(chat_verifier_dir, directory)
    (directory / "evil.py").write_text(EVIL.format(marker=str(marker)))
    for name, auto_map in (("config.json", {"AutoConfig": "evil.EvilConfig", "AutoModelForCausalLM": "evil.EvilModel"}),
                           ("tokenizer_config.json", {"AutoTokenizer": ["evil.EvilTokenizer", None]})):
        data = json.loads((directory / name).read_text())
        data["auto_map"] = auto_map
        (directory / name).write_text(json.dumps(data))
    return str(directory), marker


def test_a_verifier_is_loaded_without_ever_trusting_its_remote_code(remote_code_verifier, monkeypatch):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    import trainer.verifier.loading as tv
    from trainer.data.generators import TransformersGenerator

    directory, marker = remote_code_verifier
    calls = []
    for cls in (AutoConfig, AutoModelForCausalLM, AutoTokenizer):
        original = cls.from_pretrained  # bound to cls
        monkeypatch.setattr(cls, "from_pretrained", staticmethod(
            lambda *a, _cls=cls, _original=original, **k: calls.append((_cls.__name__, k)) or _original(*a, **k)))
    path, config = tv.resolve_pretrained(directory, "verifier")
    model = tv.load_verifier(path, dtype="float32", device="cpu")
    shell = tv.load_verifier_shell(path, dtype="float32", device="cpu")
    generator = TransformersGenerator(directory, "float32", 0.0, None, None, 1)  # the regeneration path
    assert type(model) is LlamaForCausalLM and type(shell) is LlamaForCausalLM and type(generator.model) is \
        LlamaForCausalLM and type(config).__name__ == "LlamaConfig"
    assert not marker.exists()  # the repo's code never ran
    assert {name for name, _ in calls} == {"AutoConfig", "AutoModelForCausalLM", "AutoTokenizer"}
    assert [k for _, k in calls if k.get("trust_remote_code") not in (None, False)] == []


def test_the_vllm_server_command_does_not_trust_remote_code(chat_verifier_dir, tmp_path):
    from trainer.serving.server import spec_for_config

    config = RunConfig.load(None, ["--verifier", chat_verifier_dir, "--train_data", "x.jsonl",
                                   "--aux_hidden_state_layer_ids", "[1, 2]"])
    for device in ("cpu", "gpu"):
        argv = spec_for_config(config, str(tmp_path / "hs"), device=device).argv("py")
        assert not [a for a in argv if "trust" in a.lower() and "remote" in a.lower()], argv


def package_files() -> list[Path]:
    """The package's own Python files (root modules, trainer/, scripts/, benchmarks/), as git tracks them."""
    listed = subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True, check=True)
    files = [ROOT / f for f in listed.stdout.split() if not f.startswith("tests/")]
    assert ROOT / "push_to_hub.py" in files and ROOT / "trainer" / "verifier" / "loading.py" in files
    return files


def calls_with(keyword: str):
    """`(file, line, call source, keyword value node)` for every call in the package passing `keyword`."""
    for path in package_files():
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                for kw in node.keywords:
                    if kw.arg == keyword:
                        yield path, node.lineno, ast.unparse(node), kw.value, tree


def test_no_verifier_load_in_the_package_passes_trust_remote_code():
    """`trust_remote_code` may be true only in `AutoModel.from_pretrained` (the drafter's auto class: this package's
    own remote code, which a user of the exported folder runs anyway; a verifier is an `AutoModelForCausalLM`).
    A drafter's config is read by this package's `DSparkConfig` (`resolve_drafter`), never through `AutoConfig`."""
    offending, seen = [], 0
    for path, line, source, value, _tree in calls_with("trust_remote_code"):
        seen += 1
        where = f"{path.relative_to(ROOT)}:{line}: {source}"
        if isinstance(value, ast.Constant) and value.value in (False, None):
            continue
        if source.startswith("AutoModel.from_pretrained("):
            continue
        offending.append(where)
    assert seen >= 1 and offending == []
    for path in package_files():  # nor the vLLM server flag, in a command the package builds or prints
        assert "--trust-remote-code" not in path.read_text(), path


def test_a_drafter_folders_own_config_code_never_runs(qwen3_verifier, tmp_path):
    """A drafter folder as speculators saves it (`auto_map` to a `config.py` beside it), here with code that leaves
    a marker: evaluating, continuing and exporting read it with this package's classes, so the code never runs."""
    from modeling_dspark import DSparkDraftModel
    from tiny import tiny_drafter
    from trainer.verifier.loading import resolve_drafter

    directory, marker = tmp_path / "drafter", tmp_path / "remote-code-ran"
    tiny_drafter(qwen3_verifier).save_pretrained(directory)
    (directory / "config.py").write_text(EVIL.format(marker=str(marker)))
    data = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**data, "auto_map": {"": "config.EvilConfig"}}))
    path, config = resolve_drafter(str(directory))
    drafter = DSparkDraftModel.from_pretrained(path)
    assert type(config).__name__ == "DSparkConfig" and type(drafter).__name__ == "DSparkDraftModel"
    assert not marker.exists()


# ------------------------------------------------------------------------------------------------ (c) secrets
@pytest.fixture
def token_everywhere(monkeypatch):
    """A token in every variable a client might read one from. The vLLM clients support no API key (they send no
    Authorization header at all, so a server started with vLLM's --api-key is out of reach): none may leave."""
    for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "OPENAI_API_KEY", "VLLM_API_KEY"):
        monkeypatch.setenv(name, SECRET)


def busy_then_broken(busy: int):
    """503 (`busy` times), then 500 for good: every retry path runs and then the error path."""
    count = {"n": 0}
    lock = threading.Lock()

    def answer(route, body):
        with lock:
            count["n"] += 1
            n = count["n"]
        return (503, {"error": "busy"}) if n <= busy else (500, {"error": "boom"})

    return answer


def assert_secret_free(server: StandIn, *texts: str):
    assert server.requests  # the client did talk to it
    for route, headers, body in server.requests:
        assert not {k.lower() for k in headers} & {"authorization", "proxy-authorization", "x-api-key"}, headers
        assert SECRET not in json.dumps(headers) + json.dumps(body), route
    for text in texts:
        assert SECRET not in text


def test_no_token_reaches_the_vllm_server_or_the_states_clients_messages(token_everywhere, tmp_path, stand_in, caplog,
                                                                          capsys):
    caplog.set_level(logging.DEBUG)
    caplog.set_level(logging.DEBUG, logger="dspark")
    server = stand_in(busy_then_broken(3))
    with pytest.raises(VLLMServerError) as plain:
        request_json(server.url, "/v1/completions", {"prompt": [1]}, timeout=10)
    assert plain.value.status == 503 and "busy" in str(plain.value)  # the echoed answer is in the message
    source = states_source(tmp_path, server.url, retries=4)
    with pytest.raises(VLLMStatesError) as failed:
        source.document_states([IDS])
    source.close()
    assert "HTTP 500" in str(failed.value) and len([r for r in caplog.records if "attempt" in r.getMessage()]) == 5
    out, err = capsys.readouterr()
    assert_secret_free(server, str(plain.value), str(failed.value), caplog.text, out, err)


def test_no_token_reaches_the_vllm_server_or_the_regeneration_clients_messages(token_everywhere, tmp_path, stand_in,
                                                                               caplog, capsys):
    from trainer.data.regenerate import regenerate

    caplog.set_level(logging.DEBUG)
    caplog.set_level(logging.DEBUG, logger="dspark")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": str(i), "prompt": f"p{i}"}) + "\n" for i in range(2)))
    server = stand_in(busy_then_broken(3), served="demo/model")
    out_file = tmp_path / "out.jsonl"

    def main(argv):  # the CLI's path, with a short backoff (the retries are checked, not their timing)
        regenerate("demo/model", str(prompts), str(out_file), temperature=0.0, backend="vllm", server=server.url,
                   concurrency=1, retries=2, max_failures=2, timeout=10.0, backoff=0.01)

    assert run_cli(main, []) == 1
    out, err = capsys.readouterr()
    assert "error: 2 requests to the vLLM server" in err and "HTTP 500" in err
    assert len([r for r in caplog.records if "row" in r.getMessage() and "failed" in r.getMessage()]) == 2
    posts = [r for r in server.requests if r[0] == "/v1/chat/completions"]
    assert len(posts) == 2 * 3  # each of the two rows: one request and two retries
    assert_secret_free(server, caplog.text, out, err)


@pytest.mark.parametrize("url", [f"http://user:{SECRET}@127.0.0.1:9", f"https://{SECRET}@vllm.internal:8000/v1",
                                 f"user:{SECRET}@127.0.0.1:9"])
def test_a_url_with_credentials_is_refused_without_printing_them(url, tmp_path, capsys):
    from trainer.data.generators import VLLMChatClient
    from trainer.data.regenerate import main

    for attempt in (lambda: checked_url(url), lambda: request_json(url, "/v1/models", timeout=5),
                    lambda: states_source(tmp_path, url), lambda: VLLMChatClient(url, "demo/model")):
        with pytest.raises(UsageError, match=r"carries credentials \(user:password@\)") as refused:
            attempt()
        assert SECRET not in str(refused.value) and "***@" in str(refused.value)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "hi"}) + "\n")
    assert run_cli(main, ["--backend", "vllm", "--server", url, "--verifier", "demo/model", "--prompts",
                          str(prompts), "--out", str(tmp_path / "out.jsonl")]) == 2
    out, err = capsys.readouterr()
    assert err.startswith("error: --server ") and SECRET not in out + err
    assert checked_url("http://127.0.0.1:8000/v1") == "http://127.0.0.1:8000/v1"  # the ordinary form is unchanged


# ------------------------------------------------------------------------------------------------ (d) torch.load
def test_every_torch_load_in_the_package_is_weights_only():
    loads = []
    for path in package_files():
        tree = ast.parse(path.read_text(), str(path))
        aliases = {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module == "torch"
                   for a in n.names if a.name == "load"}
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            if (isinstance(func, ast.Attribute) and func.attr == "load" and isinstance(func.value, ast.Name)
                    and func.value.id == "torch") or (isinstance(func, ast.Name) and func.id in aliases):
                safe = any(k.arg == "weights_only" and isinstance(k.value, ast.Constant) and k.value.value is True
                           for k in node.keywords)
                loads.append((f"{path.relative_to(ROOT)}:{node.lineno}", safe))
    assert loads and [where for where, safe in loads if not safe] == []


TINY = ["--num_hidden_layers", "1", "--num_attention_heads", "4", "--num_key_value_heads", "2", "--head_dim", "16",
        "--intermediate_size", "128", "--block_size", "4", "--draft_vocab_size", "500", "--markov_rank", "16",
        "--max_seq_length", "128", "--total_seq_length", "256", "--validation_ratio", "0.1", "--logging_steps", "1",
        "--learning_rate", "3e-3", "--max_anchors", "16", "--eval_at_start", "false"]
# What the Trainer itself writes into a checkpoint besides the model: its optimizer, scheduler, RNG and AMP
# scaler states (torch files, which transformers 5 reads back with torch.load(..., weights_only=True) on resume,
# as the resume below checks), and training_args.bin (the pickled TrainingArguments, written for reference:
# neither transformers nor this package ever loads it, and an export never includes it).
TRAINER_STATE_FILES = {"optimizer.pt", "scheduler.pt", "scaler.pt", "rng_state.pth", "training_args.bin"}


@pytest.mark.slow
def test_checkpoints_hold_safetensors_weights_and_resume_loads_weights_only(chat_verifier_dir, chat_data_file,
                                                                            tmp_path, monkeypatch):
    from trainer.run import train

    def run(steps: int, *extra):
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # a 64-wide model gains nothing from more threads on a shared CPU
        try:
            return train(RunConfig.load(None, ["--verifier", chat_verifier_dir, "--train_data", chat_data_file,
                                               "--output_dir", str(out), *TINY, "--max_steps", str(steps),
                                               "--eval_steps", "2", *extra]))
        finally:
            torch.set_num_threads(threads)

    out = tmp_path / "run"
    run(2)
    for folder in (out / "checkpoint-2", out):
        names = set(os.listdir(folder))
        assert "model.safetensors" in names
        pickled = {n for n in names if n.endswith((".bin", ".pt", ".pth", ".pkl", ".ckpt"))}
        assert pickled <= TRAINER_STATE_FILES, pickled  # no pytorch_model.bin or other pickled weights
    assert {"optimizer.pt", "scheduler.pt", "rng_state.pth"} <= set(os.listdir(out / "checkpoint-2"))
    loads = []
    real_load = torch.load
    monkeypatch.setattr(torch, "load", lambda *a, **k: loads.append((str(a[0] if a else k.get("f")), k.get(
        "weights_only"))) or real_load(*a, **k))
    assert run(4, "--resume_from_checkpoint", "latest")["global_step"] == 4
    read = {os.path.basename(f) for f, _ in loads}
    assert {"optimizer.pt", "scheduler.pt", "rng_state.pth"} <= read  # the resume did read the Trainer's state
    assert [(f, w) for f, w in loads if w is not True] == []
