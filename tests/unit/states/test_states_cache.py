"""The offline hidden-state cache: written from a real source, it serves the same states as that source; it
resumes after a crash or corruption, refuses what it cannot honour (another plan, a full disk, an unfinished
directory), backs the hybrid source, and its command caches exactly the documents training asks for."""

import errno
import json
import os
import shutil

import pytest
import torch

from tiny import VOCAB
from trainer.data.packing import DSparkCollator
from trainer.errors import DSparkError, UsageError, run_cli
from trainer.states import cache_cli
from trainer.states.cache_format import COMPLETE_FILE, PLAN_FILE
from trainer.states.hybrid import HybridSource
from trainer.states.in_process import InProcessVerifier
from trainer.states.offline_cache import MissingStatesError, OfflineCache, write_cache
from trainer.states.source import document_key

AUX = [1, 3]


def random_documents(n=20, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (int(k),), generator=g) for k in torch.randint(5, 60, (n,), generator=g)]


def packed(documents, per_row=5):
    """Documents packed into rows the way training packs conversations (DSparkCollator pads with -1)."""
    features = []
    for r in range(0, len(documents), per_row):
        row = documents[r : r + per_row]
        features.append({
            "input_ids": torch.cat(row),
            "document_ids": torch.cat([torch.full((d.numel(),), j) for j, d in enumerate(row)]),
            "position_ids": torch.cat([torch.arange(d.numel()) for d in row]),
            "loss_mask": torch.ones(sum(d.numel() for d in row), dtype=torch.long),
            "row_index": r // per_row,
        })
    return DSparkCollator(pad_token_id=0)(features)


def build(source, documents, directory, **kw):
    # one document per source call: each stored state is then bit-identical to `document_states([d])`
    kw = {"shard_tokens": 150, "progress": False, "tokens_per_call": 1, **kw}
    return write_cache(source, documents, str(directory), **kw)


def shard_files(directory):
    return sorted(f for f in os.listdir(directory) if f.endswith(".safetensors"))


@pytest.fixture(scope="module")
def source(llama_verifier):
    return InProcessVerifier(llama_verifier, AUX)


def test_cache_serves_the_in_process_states(source, tmp_path):
    documents = random_documents()
    summary = build(source, documents + [documents[3].clone()], tmp_path)  # a duplicate is stored once
    tokens = sum(d.numel() for d in documents)
    assert summary["documents"] == 20 and summary["tokens"] == tokens == summary["tokens_written"]
    assert summary["shards"] == summary["written"] == len(shard_files(tmp_path)) >= 4 and summary["skipped"] == 0
    assert summary["bytes"] == sum(os.path.getsize(tmp_path / f) for f in shard_files(tmp_path))
    assert (tmp_path / COMPLETE_FILE).exists() and not [f for f in os.listdir(tmp_path) if f.endswith(".tmp")]
    plan = json.loads((tmp_path / PLAN_FILE).read_text())
    assert plan["aux_layer_ids"] == AUX and plan["hidden_size"] == 64 and plan["dtype"] == "float32"
    assert [k for s in plan["shards"] for k in s["keys"]] == [document_key(d) for d in documents]
    assert all(s["tokens"] <= 150 for s in plan["shards"])

    from safetensors import safe_open

    with safe_open(str(tmp_path / "shard-00001.safetensors"), "pt") as f:  # a shard describes itself
        assert json.loads(f.metadata()["keys"]) == plan["shards"][1]["keys"]
        assert f.get_tensor("offsets").tolist()[-1] == plan["shards"][1]["tokens"]

    cache = OfflineCache(str(tmp_path), teacher=source.teacher(), aux_layer_ids=AUX)
    assert len(cache) == 20 and cache.contains(document_key(documents[0])) and cache.teacher() is source.teacher()
    for d, (aux, last) in zip(documents, cache.document_states(documents)):
        ref_aux, ref_last = source.document_states([d])[0]
        assert torch.equal(aux, ref_aux) and torch.equal(last, ref_last)  # the very states the source computed
    batch = packed(documents)
    ours, theirs = cache.states(batch), source.states(batch)
    assert ours.aux_hidden_states.shape == theirs.aux_hidden_states.shape == (4, batch["input_ids"].shape[1], 128)
    # the in-process source batches documents differently (padding, group sizes): fp32 noise of ~1e-8 only
    torch.testing.assert_close(ours.aux_hidden_states, theirs.aux_hidden_states, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours.last_hidden_state, theirs.last_hidden_state, atol=1e-5, rtol=1e-5)
    padding = batch["document_ids"] < 0
    assert padding.any() and not ours.aux_hidden_states[padding].any() and not ours.last_hidden_state[padding].any()


def test_rerun_redoes_only_missing_and_damaged_shards(source, tmp_path, caplog):
    documents = random_documents(seed=1)
    first = build(source, documents, tmp_path)
    files = shard_files(tmp_path)
    before = {f: (tmp_path / f).stat().st_mtime_ns for f in files}
    reference = OfflineCache(str(tmp_path)).document_states(documents)
    again = build(source, documents, tmp_path)
    assert again["written"] == 0 and again["skipped"] == first["shards"] and again["bytes_written"] == 0

    os.remove(tmp_path / files[1])                                  # lost
    with open(tmp_path / files[2], "r+b") as f:                     # truncated by a crash
        f.truncate(os.path.getsize(tmp_path / files[2]) // 2)
    shutil.copy(tmp_path / files[0], tmp_path / files[3])           # another shard's documents
    (tmp_path / (files[4] + ".tmp")).write_bytes(b"half a shard")   # a half-written leftover
    kept = [f for f in files if f not in files[1:4]]
    caplog.set_level("WARNING", logger="dspark")
    summary = build(source, documents, tmp_path)
    assert summary["written"] == 3 and summary["skipped"] == first["shards"] - 3
    assert summary["tokens_written"] == sum(s["tokens"] for s in json.loads(
        (tmp_path / PLAN_FILE).read_text())["shards"][1:4])
    assert {f: (tmp_path / f).stat().st_mtime_ns for f in kept} == {f: before[f] for f in kept}
    assert shard_files(tmp_path) == files and not [f for f in os.listdir(tmp_path) if f.endswith(".tmp")]
    warnings = caplog.text
    assert "truncated" in warnings and "not the plan's" in warnings and "half-written" in warnings
    for (a, x), (ra, rx) in zip(OfflineCache(str(tmp_path)).document_states(documents), reference):
        assert torch.equal(a, ra) and torch.equal(x, rx)


def test_another_plan_is_refused(source, llama_verifier, tmp_path):
    documents = random_documents(8, seed=2)
    build(source, documents, tmp_path)
    plan = (tmp_path / PLAN_FILE).read_text()
    refusals = [
        (InProcessVerifier(llama_verifier, [1, 2]), documents, {}, r"aux_layer_ids \[1, 3\], not \[1, 2\]"),
        (source, random_documents(8, seed=3), {}, r"other documents \(8 documents of \d+ tokens, 0 of them"),
        (source, documents, {"shard_tokens": 100}, r"shard_tokens 150, not 100 \(pass --shard_tokens 150"),
        (source, documents, {"dtype": torch.bfloat16}, r"dtype 'float32', not 'bfloat16'"),
    ]
    for other, docs, kw, message in refusals:
        with pytest.raises(UsageError, match=rf"cache {tmp_path} was planned with {message}.*new cache_dir, or "
                                             rf"delete {tmp_path} to rebuild it\."):
            build(other, docs, tmp_path, **kw)
    assert (tmp_path / PLAN_FILE).read_text() == plan


def test_a_full_disk_is_refused_before_anything_is_written(source, tmp_path, monkeypatch):
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage._replace(free=1 << 20))
    directory = tmp_path / "cache"
    with pytest.raises(UsageError, match=r"cache .* needs 16\.\d\d MiB for the \d+ shards still to write but its disk "
                                         r"has 1\.00 MiB free; free some space"):
        build(source, random_documents(), directory)
    assert os.listdir(directory) == []


def test_a_disk_filling_up_mid_run_keeps_the_finished_shards(source, tmp_path, monkeypatch):
    documents = random_documents(seed=4)
    real_fsync = os.fsync

    def full_after_two_shards(fd):  # the disk: the third shard's bytes no longer fit
        if os.readlink(f"/proc/self/fd/{fd}").endswith("shard-00002.safetensors.tmp"):
            raise OSError(errno.ENOSPC, "No space left on device")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", full_after_two_shards)
    with pytest.raises(DSparkError, match=r"filled up while writing shard-00002.safetensors \(2 of \d+ shards are "
                                          r"finished and kept\); free some space and rerun the same command"):
        build(source, documents, tmp_path)
    monkeypatch.setattr(os, "fsync", real_fsync)
    assert shard_files(tmp_path) == ["shard-00000.safetensors", "shard-00001.safetensors"]
    assert not [f for f in os.listdir(tmp_path) if f.endswith(".tmp")]
    shards = len(json.loads((tmp_path / PLAN_FILE).read_text())["shards"])
    with pytest.raises(UsageError, match=rf"^cache {tmp_path} is incomplete \(2 of {shards} shards\); rerun the cache "
                                         rf"command to finish it\.$"):
        OfflineCache(str(tmp_path))
    summary = build(source, documents, tmp_path)
    assert summary["skipped"] == 2 and summary["written"] == shards - 2
    assert len(OfflineCache(str(tmp_path))) == 20


def test_reader_refusals(source, tmp_path):
    documents = random_documents(6, seed=5)
    build(source, documents, tmp_path)
    with pytest.raises(UsageError, match=r"holds aux layers \[1, 3\], but this run uses \[1, 2\]; rebuild the cache"):
        OfflineCache(str(tmp_path), aux_layer_ids=[1, 2])
    cache = OfflineCache(str(tmp_path))
    with pytest.raises(UsageError, match="opened without a teacher; pass teacher="):
        cache.teacher()
    stranger = random_documents(1, seed=6)[0]
    with pytest.raises(KeyError) as raised:
        cache.document_states([documents[0], stranger])
    assert isinstance(raised.value, MissingStatesError) and str(raised.value) == (
        f"document {document_key(stranger)} ({stranger.numel()} tokens) is not in cache {tmp_path}; rebuild the "
        f"cache for this data or use train.hidden_states: hybrid.")
    os.remove(tmp_path / COMPLETE_FILE)
    with pytest.raises(UsageError, match=r"is incomplete \((\d+) of \1 shards\)"):
        OfflineCache(str(tmp_path))
    with pytest.raises(UsageError, match="holds no hidden-state cache"):
        OfflineCache(str(tmp_path / "nothing"))


def reference_full_vocabulary(source, last):
    """float64 over the whole head at once: the log-normaliser and argmax of softmax(norm(last) @ W^T)."""
    teacher = source.teacher()
    logits = teacher.normed(last).double() @ teacher.output_weight.double().T
    return torch.logsumexp(logits, dim=-1), logits.argmax(dim=-1)


def test_the_cache_stores_the_full_vocabulary_pass_and_the_loss_reads_it(source, llama_verifier, tmp_path):
    """The V x H pass the default objective needs is computed once at cache time, from the states as stored, and
    served with them: a loss over the cache's states then runs no full-vocabulary pass and gives what the fresh
    pass gives (fp32: the summation order differs)."""
    from tiny import tiny_drafter
    from trainer.config import ObjectiveConfig
    from trainer.train.anchors import sample_anchors
    from trainer.train.loss import dspark_loss

    documents = random_documents(seed=11)
    build(source, documents, tmp_path, tokens_per_call=100)  # several documents per pass
    plan = json.loads((tmp_path / PLAN_FILE).read_text())
    assert plan["format_version"] == 2 and plan["full_vocabulary"]
    cache = OfflineCache(str(tmp_path), teacher=source.teacher())
    for d, (log_z, argmax), (_, last) in zip(documents, cache.document_full_vocabulary(documents),
                                             cache.document_states(documents)):
        ref_z, ref_a = reference_full_vocabulary(source, last)
        assert log_z.dtype == torch.float32 and argmax.dtype == torch.int64 and log_z.shape == (d.numel(),)
        torch.testing.assert_close(log_z.double(), ref_z, rtol=1e-6, atol=1e-6)
        assert torch.equal(argmax, ref_a)
    batch = packed(documents)
    states = cache.states(batch)
    full, padding = states.full_vocabulary, batch["document_ids"] < 0
    assert (full.argmax[padding] == -1).all() and full.log_z[padding].isnan().all()
    assert (full.argmax[~padding] >= 0).all()
    segments, docs = cache.documents(batch)
    for (r, s, e), (log_z, argmax) in zip(segments, cache.document_full_vocabulary(docs)):
        assert torch.equal(full.log_z[r, s:e], log_z) and torch.equal(full.argmax[r, s:e], argmax)

    drafter = tiny_drafter(llama_verifier, aux_hidden_state_layer_ids=AUX).train()
    teacher = cache.teacher()
    calls = []
    real = teacher.full_vocabulary
    teacher.full_vocabulary = lambda normed, chunk: calls.append(normed.shape[0]) or real(normed, chunk)
    try:
        cfg = ObjectiveConfig(block_size=drafter.block_size)  # the default objective: it needs the pass
        anchors = sample_anchors(batch["loss_mask"], batch["document_ids"], 8, generator=torch.Generator().manual_seed(0))
        results = []
        for known in (states.full_vocabulary, None):
            out = drafter(batch["input_ids"], states.aux_hidden_states, anchors, document_ids=batch["document_ids"],
                          position_ids=batch["position_ids"], return_logits=False)
            kwargs = {"full_vocabulary": known} if known is not None else {}
            results.append(dspark_loss(drafter, out, batch["input_ids"], batch["loss_mask"], batch["document_ids"],
                                       anchors, states.last_hidden_state, teacher, cfg, **kwargs))
            if known is not None:
                assert calls == []  # read from the cache, not computed
        assert len(calls) == 1 and calls[0] > 0  # the fresh loss did run it
        torch.testing.assert_close(results[0][0], results[1][0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(results[0][1], results[1][1], rtol=1e-5, atol=1e-5, equal_nan=True)
    finally:
        del teacher.full_vocabulary


def test_a_cache_without_the_full_vocabulary_pass_is_still_read(source, tmp_path):
    """A format-1 cache (written before the pass was stored) and one written with full_vocabulary=False serve
    their states as before; the loss then computes the pass itself."""
    documents = random_documents(6, seed=12)
    build(source, documents, tmp_path / "without", full_vocabulary=False)
    plan = json.loads((tmp_path / "without" / PLAN_FILE).read_text())
    assert not plan["full_vocabulary"]
    from safetensors import safe_open

    with safe_open(str(tmp_path / "without" / "shard-00000.safetensors"), "pt") as f:
        assert set(f.keys()) == {"aux", "last", "offsets"}
    old = {k: v for k, v in plan.items() if k != "full_vocabulary"} | {"format_version": 1}
    (tmp_path / "without" / PLAN_FILE).write_text(json.dumps(old))
    cache = OfflineCache(str(tmp_path / "without"))
    assert not cache.full_vocabulary and cache.document_full_vocabulary(documents) is None
    batch = packed(documents)
    states = cache.states(batch)
    assert states.full_vocabulary is None
    torch.testing.assert_close(states.last_hidden_state, source.states(batch).last_hidden_state, atol=1e-5, rtol=1e-5)
    # the writer refuses to continue it: its shards lack what this format stores
    with pytest.raises(UsageError, match="planned with cache format version 1, not 2"):
        build(source, documents, tmp_path / "without")


def test_the_row_cache_starts_from_the_stored_pass(source, tmp_path):
    """In front of the offline cache, the in-memory row cache hands out the stored pass: with the rows read from
    the cache, and then with the rows from memory (its views carry the pass over)."""
    from trainer.states.memory import MemoryRowCache

    documents = random_documents(10, seed=13)
    build(source, documents, tmp_path)
    cache = OfflineCache(str(tmp_path), teacher=source.teacher())
    rows = MemoryRowCache(cache, max_bytes=1 << 30)
    batch = packed(documents)
    stored = cache.states(batch).full_vocabulary
    first = rows.states(batch).full_vocabulary
    assert torch.equal(first.argmax, stored.argmax) and torch.equal(first.log_z.nan_to_num(), stored.log_z.nan_to_num())
    second = rows.states(batch).full_vocabulary  # every row now from memory: the views carry the pass over
    assert torch.equal(second.argmax, stored.argmax)


class RecordingVerifier(InProcessVerifier):
    """The in-process source, remembering which documents it was announced and asked for (as an online one
    would fetch them)."""

    def __init__(self, *args):
        super().__init__(*args)
        self.prefetched, self.asked = [], []

    def prefetch(self, batch):
        self.prefetched.append([document_key(d) for d in self.documents(batch)[1]])

    def document_states(self, documents):
        self.asked.append([document_key(d) for d in documents])
        return super().document_states(documents)


def test_hybrid_takes_cached_documents_from_the_cache_and_the_rest_from_the_fallback(source, llama_verifier,
                                                                                      tmp_path):
    documents = random_documents(seed=7)
    cached = documents[::2]
    build(source, cached, tmp_path)
    fallback = RecordingVerifier(llama_verifier, AUX)
    hybrid = HybridSource(OfflineCache(str(tmp_path)), fallback)
    assert hybrid.teacher() is fallback.teacher()
    batch = packed(documents)
    missing = [document_key(d) for d in documents[1::2]]
    hybrid.prefetch(batch)
    assert fallback.prefetched == [missing]  # a cached document is never fetched
    hybrid.prefetch(packed(cached))
    assert len(fallback.prefetched) == 1  # nothing to announce
    with pytest.raises(MissingStatesError):
        hybrid.cache.states(batch)
    ours, theirs = hybrid.states(batch), source.states(batch)
    assert fallback.asked == [missing]  # one call, in batch order
    torch.testing.assert_close(ours.aux_hidden_states, theirs.aux_hidden_states, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours.last_hidden_state, theirs.last_hidden_state, atol=1e-5, rtol=1e-5)
    cached_tokens, all_tokens = sum(d.numel() for d in cached), sum(d.numel() for d in documents)
    assert hybrid.served == {"cache": {"documents": 10, "tokens": cached_tokens},
                             "fallback": {"documents": 10, "tokens": all_tokens - cached_tokens}}
    assert hybrid.share() == pytest.approx(cached_tokens / all_tokens)
    share = 100 * cached_tokens / all_tokens
    assert hybrid.report() == (f"hidden states: {share:.1f}% of tokens (10 of 20 documents) from the cache, "
                               f"{100 - share:.1f}% from the in-process verifier")
    full = hybrid.states(batch).full_vocabulary  # the stored pass of the cached documents only
    segments, docs = hybrid.documents(batch)
    for (r, s, e), d in zip(segments, docs):
        assert bool((full.argmax[r, s:e] >= 0).all()) == hybrid.cache.contains(document_key(d))
        assert bool((full.argmax[r, s:e] < 0).all()) != hybrid.cache.contains(document_key(d))
    with pytest.raises(UsageError, match="the fallback serves"):
        HybridSource(hybrid.cache, InProcessVerifier(llama_verifier, [1, 2]))


def test_command_caches_every_document_training_asks_for(chat_verifier_dir, chat_data_file, tmp_path, capsys):
    from transformers import AutoTokenizer

    from trainer.config import RunConfig
    from trainer.data.packing import PackedDataset, pack_conversations
    from trainer.data.prepare import prepare_data
    from trainer.verifier.loading import load_verifier

    overrides = ["--verifier", chat_verifier_dir, "--train_data", chat_data_file, "--max_seq_length", "128",
                 "--total_seq_length", "256", "--validation_ratio", "0.1", "--aux_hidden_state_layer_ids", "[1,2]"]
    cache_dir = str(tmp_path / "cache")
    summary = cache_cli.main([*overrides, "--cache_dir", cache_dir, "--shard_tokens", "2000"])
    config = RunConfig.load(None, overrides)
    train_set, validation_set, _ = prepare_data(config, AutoTokenizer.from_pretrained(chat_verifier_dir))
    conversations = len(train_set) + len(validation_set)
    assert summary["documents"] == conversations == len(OfflineCache(cache_dir)) > 100
    assert summary["tokens"] == sum(train_set["length"]) + sum(validation_set["length"])
    assert summary["shards"] == summary["written"] > 1
    rerun = cache_cli.main([*overrides, f"--cache_dir={cache_dir}", "--shard_tokens=2000"])
    assert rerun["skipped"] == summary["shards"] and rerun["written"] == 0
    with pytest.raises(UsageError, match=r"planned with aux_layer_ids \[1, 2\], not \[1, 3\]"):
        cache_cli.main([*overrides, "--aux_hidden_state_layer_ids", "[1,3]", "--cache_dir", cache_dir,
                           "--shard_tokens", "2000"])
    assert OfflineCache(cache_dir).full_vocabulary  # the default stores the pass
    with pytest.raises(UsageError, match=r"planned with full_vocabulary True, not False"):
        cache_cli.main([*overrides, "--cache_dir", cache_dir, "--shard_tokens", "2000", "--full_vocabulary", "false"])
    without = str(tmp_path / "without")
    cache_cli.main([*overrides, "--cache_dir", without, "--shard_tokens", "2000", "--full_vocabulary", "false"])
    assert not OfflineCache(without).full_vocabulary and len(OfflineCache(without)) == conversations

    # the rows training packs find all their documents in the cache, with the verifier's states
    rows = pack_conversations(list(train_set["length"]), 256, seed=config.data.split_seed)
    data = PackedDataset(train_set, rows)
    batch = DSparkCollator(pad_token_id=0)([data[0], data[1]])
    assert int(batch["document_ids"].max()) >= 1  # several documents in a row
    verifier = InProcessVerifier(load_verifier(chat_verifier_dir, "float32", "cpu"), [1, 2])
    ours, theirs = OfflineCache(cache_dir, aux_layer_ids=[1, 2]).states(batch), verifier.states(batch)
    torch.testing.assert_close(ours.aux_hidden_states, theirs.aux_hidden_states, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours.last_hidden_state, theirs.last_hidden_state, atol=1e-5, rtol=1e-5)

    capsys.readouterr()
    assert run_cli(cache_cli.main, overrides) == 2
    assert capsys.readouterr().err.strip() == ("error: no --cache_dir was given; pass the directory to write the "
                                               "cache into, e.g. --cache_dir out/states-cache.")


@pytest.mark.slow
def test_training_from_the_cache_matches_training_with_the_verifier_in_process(chat_verifier_dir, chat_data_file,
                                                                              tmp_path):
    """The same run twice: states from the in-process verifier, then from the cache the command wrote (the
    trainer then loads only the verifier's embedding, norm and head). Same losses and metrics."""
    from tiny import TINY_RUN as TINY
    from trainer.config import RunConfig
    from trainer.run import train

    run = ["--verifier", chat_verifier_dir, "--train_data", chat_data_file, *TINY, "--max_steps", "4",
           "--eval_steps", "4", "--eval_at_start", "false", "--calibrate_confidence", "false"]
    cache_cli.main([*run, "--cache_dir", str(tmp_path / "cache"), "--aux_hidden_state_layer_ids", "[1, 2]"])
    results = {}
    for name, extra in (("in_process", []), ("cache", ["--hidden_states", "cache", "--states_cache_dir",
                                                       str(tmp_path / "cache")])):
        config = RunConfig.load(None, [*run, "--aux_hidden_state_layer_ids", "[1, 2]", "--output_dir",
                                       str(tmp_path / name), *extra])
        train(config)
        results[name] = json.loads((tmp_path / name / "dspark_train_summary.json").read_text())
    ours, ref = results["cache"], results["in_process"]
    assert ours["hidden_states"]["source"] == "OfflineCache" and ref["hidden_states"]["source"] == "InProcessVerifier"
    assert ours["train_loss"] == pytest.approx(ref["train_loss"], rel=1e-5)
    for key in ("eval_loss", "eval_accept_len", "eval_tv"):
        assert ours["final_metrics"][key] == pytest.approx(ref["final_metrics"][key], rel=1e-5), key
