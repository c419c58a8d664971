"""DSparkDraftModel: saved tensors, remote-code round trip, trainable parameters, attention mask and backend,
document segments, draft() vs training forward, the draft cache, gradient checkpointing, verifier-state
conventions and bad input."""

import json
import os
import warnings

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModel

import modeling_dspark
from configuration_dspark import DSparkConfig
from modeling_dspark import (
    DSparkDecoderLayer,
    DSparkDraftCache,
    DSparkDraftModel,
    VerifierStateCapture,
    build_attention_mask,
    dspark_mask_mod,
    index_within_runs,
    positions_from_document_ids,
)
from tiny import VOCAB, draft_vocab, tiny_config, tiny_drafter
from trainer.states.in_process import verifier_hidden_states
from trainer.states.source import document_segments

LAYER_KEYS = [
    "input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_proj.weight",
    "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight", "self_attn.q_norm.weight",
    "self_attn.k_norm.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
]


def saved_tensors(directory):
    out = {}
    for file in os.listdir(directory):
        if file.endswith(".safetensors"):
            with safe_open(os.path.join(directory, file), "pt") as f:
                out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def packed_batch(verifier, drafter, seed=0):
    """Two packed rows with several documents, padding, and anchors including a padding anchor."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (2, 40), generator=g)
    documents = torch.tensor([[0] * 18 + [1] * 14 + [2] * 8, [0] * 35 + [-1] * 5])
    positions = positions_from_document_ids(documents)
    aux, last = verifier_hidden_states(verifier, drafter.config.aux_hidden_state_layer_ids, ids)
    anchors = torch.tensor([[1, 3, 9, 18, 20, 33], [0, 2, 5, 7, 30, -1]])
    return ids, aux, last, documents, positions, anchors


# ------------------------------------------------------------------------------------------ saved tensors
def test_saved_tensors_are_exactly_the_contract(tmp_path, gemma4_verifier):
    drafter = tiny_drafter(gemma4_verifier)
    drafter.to(torch.bfloat16).save_pretrained(tmp_path)
    assert sorted(os.listdir(tmp_path)) == ["config.json", "configuration_dspark.py", "model.safetensors",
                                            "modeling_dspark.py"]
    tensors = saved_tensors(tmp_path)
    cfg = drafter.config
    H, V, Vd, r, k = 64, VOCAB, 100, 16, len(cfg.aux_hidden_state_layer_ids)
    expected = {
        "fc.weight": [H, k * H], "hidden_norm.weight": [H], "norm.weight": [H], "lm_head.weight": [Vd, H],
        "d2t": [Vd], "t2d": [V], "markov_head.markov_w1.weight": [V, r], "markov_head.markov_w2.weight": [Vd, r],
        "confidence_head.proj.weight": [1, H + r], "confidence_head.proj.bias": [1],
    }
    heads, head_dim, kv_heads, mlp = 4, 16, 2, 96
    shapes = {"input_layernorm.weight": [H], "post_attention_layernorm.weight": [H],
              "self_attn.q_proj.weight": [heads * head_dim, H], "self_attn.k_proj.weight": [kv_heads * head_dim, H],
              "self_attn.v_proj.weight": [kv_heads * head_dim, H], "self_attn.o_proj.weight": [H, heads * head_dim],
              "self_attn.q_norm.weight": [head_dim], "self_attn.k_norm.weight": [head_dim],
              "mlp.gate_proj.weight": [mlp, H], "mlp.up_proj.weight": [mlp, H], "mlp.down_proj.weight": [H, mlp]}
    for i in range(cfg.num_hidden_layers):
        expected.update({f"layers.{i}.{name}": shape for name, shape in shapes.items()})
    assert {k: list(t.shape) for k, t in tensors.items()} == expected
    for name, t in tensors.items():
        want = {"d2t": torch.int64, "t2d": torch.bool}.get(name, torch.bfloat16)
        assert t.dtype == want, name
    # d2t holds offsets and lm_head the verifier's output rows of the draft vocabulary, in ascending id order
    ids = torch.arange(Vd) + tensors["d2t"]
    assert torch.equal(ids, drafter.draft_vocab_ids.cpu()) and bool((ids[1:] > ids[:-1]).all())
    assert int(tensors["t2d"].sum()) == Vd and bool(tensors["t2d"][ids].all())
    head = gemma4_verifier.get_output_embeddings().weight
    assert torch.equal(tensors["lm_head.weight"], head[ids].to(torch.bfloat16))
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "bfloat16"


def test_full_vocabulary_drafter_saves_no_head_and_no_maps(tmp_path, qwen3_verifier):
    drafter = tiny_drafter(qwen3_verifier, draft_vocab_size=None)
    assert drafter.lm_head.weight.data_ptr() == qwen3_verifier.lm_head.weight.data_ptr()  # shared, not copied
    drafter.save_pretrained(tmp_path)
    tensors = saved_tensors(tmp_path)
    assert not {"lm_head.weight", "d2t", "t2d"} & set(tensors)
    assert all(t.dtype == torch.float32 for t in tensors.values())  # training checkpoints keep fp32 masters
    reloaded = AutoModel.from_pretrained(tmp_path, trust_remote_code=True)
    reloaded.attach_verifier(qwen3_verifier)
    assert torch.equal(reloaded.lm_head.weight, qwen3_verifier.lm_head.weight)


def test_seed_recipe_shapes_match_the_weights_table():
    from test_config import seed_config

    with torch.device("meta"):
        model = DSparkDraftModel(seed_config(mask_token_id=4))
    state = {k: list(v.shape) for k, v in model.state_dict().items()}
    assert state["fc.weight"] == [2560, 12800]
    assert state["layers.0.self_attn.q_proj.weight"] == [4096, 2560]
    assert state["layers.3.self_attn.k_proj.weight"] == [1024, 2560]
    assert state["layers.3.self_attn.o_proj.weight"] == [2560, 4096]
    assert state["layers.2.self_attn.q_norm.weight"] == [128]
    assert state["layers.1.mlp.gate_proj.weight"] == [8192, 2560]
    assert state["layers.1.mlp.down_proj.weight"] == [2560, 8192]
    assert state["lm_head.weight"] == [32000, 2560] and state["d2t"] == [32000] and state["t2d"] == [262144]
    assert state["markov_head.markov_w1.weight"] == [262144, 256]
    assert state["markov_head.markov_w2.weight"] == [32000, 256]
    assert state["confidence_head.proj.weight"] == [1, 2816]
    assert not any("embed" in k or k.startswith("verifier") for k in state)
    floats = sum(int(torch.tensor(s).prod()) for k, s in state.items() if k not in ("d2t", "t2d"))
    assert 0.53e9 < floats < 0.57e9  # "about 0.55B saved"


# ------------------------------------------------------------------------------------------ loading
def test_remote_code_round_trip_gives_identical_outputs(tmp_path, gemma4_verifier):
    drafter = tiny_drafter(gemma4_verifier)
    drafter.save_pretrained(tmp_path)
    loaded = AutoModel.from_pretrained(tmp_path, trust_remote_code=True)
    assert type(loaded).__module__.startswith("transformers_modules")
    assert type(loaded) is not DSparkDraftModel
    ids, aux, _, documents, positions, anchors = packed_batch(gemma4_verifier, drafter)
    with pytest.raises(RuntimeError, match="no verifier weights attached.*attach_verifier"):
        loaded(ids, aux, anchors, document_ids=documents)
    with pytest.raises(RuntimeError, match="no verifier weights attached"):
        loaded.draft(aux[0, :10], ids[0, 10])
    loaded.attach_verifier(gemma4_verifier)
    loaded.eval()
    a = drafter(ids, aux, anchors, document_ids=documents, position_ids=positions)
    b = loaded(ids, aux, anchors, document_ids=documents, position_ids=positions)
    for name in ("logits", "last_hidden_state", "confidence_logits"):
        assert torch.equal(a[name], b[name]), name
    pa, pb = drafter.draft(aux[0, :10], ids[0, 10]), loaded.draft(aux[0, :10], ids[0, 10])
    assert torch.equal(pa.token_ids, pb.token_ids) and torch.equal(pa.confidence, pb.confidence)


def test_bf16_export_round_trip(tmp_path, gemma4_verifier):
    drafter = tiny_drafter(gemma4_verifier).to(torch.bfloat16)
    drafter.save_pretrained(tmp_path)
    loaded = AutoModel.from_pretrained(tmp_path, trust_remote_code=True)
    assert loaded.fc.weight.dtype == torch.bfloat16
    for key, value in drafter.state_dict().items():
        assert torch.equal(value, loaded.state_dict()[key]), key


# ------------------------------------------------------------------------------------------ trainable parameters
def trainable(model):
    return {n for n, p in model.named_parameters() if p.requires_grad}


def expected_trainable(config):
    """Everything the drafter owns except `lm_head` (the verifier's frozen output rows)."""
    names = {"fc.weight", "hidden_norm.weight", "norm.weight", "markov_head.markov_w1.weight",
             "markov_head.markov_w2.weight", "confidence_head.proj.weight", "confidence_head.proj.bias"}
    return names | {f"layers.{i}.{key}" for i in range(config.num_hidden_layers) for key in LAYER_KEYS}


@pytest.mark.parametrize("draft_vocab_size", [100, None])
def test_only_the_drafters_own_weights_train_whatever_the_entry_point(tmp_path, qwen3_verifier, draft_vocab_size):
    config = tiny_config(qwen3_verifier, draft_vocab_size=draft_vocab_size)
    expected = expected_trainable(config)
    drafter = DSparkDraftModel(config)
    assert trainable(drafter) == expected
    if config.uses_draft_vocab:
        drafter.set_draft_vocab(draft_vocab(config))
    drafter.attach_verifier(qwen3_verifier)
    assert trainable(drafter) == expected
    drafter.save_pretrained(tmp_path)
    for loaded in (DSparkDraftModel.from_pretrained(tmp_path, dtype=torch.float32),
                   AutoModel.from_pretrained(tmp_path, trust_remote_code=True)):
        assert trainable(loaded) == expected  # the loader installs fresh (trainable) parameters
        loaded.attach_verifier(qwen3_verifier)
        assert trainable(loaded) == expected
        assert trainable(loaded.to(torch.bfloat16)) == expected
    assert not any(p.requires_grad for p in qwen3_verifier.parameters())


def test_under_lora_only_the_adapters_train(gemma4_verifier):
    from trainer.train.adapters import add_lora

    drafter = tiny_drafter(gemma4_verifier)
    targets = ["q_proj", "v_proj", "down_proj"]
    model = add_lora(drafter, rank=4, alpha=8, dropout=0.0, target_modules=targets)
    wrapped = [f"base_model.model.layers.{i}.{'mlp' if m == 'down_proj' else 'self_attn'}.{m}"
               for i in range(drafter.config.num_hidden_layers) for m in targets]
    assert trainable(model) == {f"{w}.lora_{ab}.default.weight" for w in wrapped for ab in "AB"}


def test_fresh_weights_get_the_initialisation_the_model_file_states(gemma4_verifier):
    """Every init the model file states must really land. transformers v5 skips `_init_weights` for a custom-code
    module without parameters of its own: a Markov-head branch once never ran (its std 0.01 for markov_w1 was dead
    code; the measured recipe had always used 0.02, which is now what the file says)."""
    config = tiny_config(gemma4_verifier, draft_vocab_size=100, markov_rank=64)
    torch.manual_seed(0)
    drafter = DSparkDraftModel(config)
    w1, w2 = drafter.markov_head.markov_w1.weight, drafter.markov_head.markov_w2.weight
    assert w1.std().item() == pytest.approx(config.initializer_range, rel=0.05) and w1.mean().abs() < 1e-3
    assert w2.std().item() == pytest.approx(config.initializer_range, rel=0.1)
    assert torch.isnan(drafter.lm_head.weight).all()  # filled from the verifier only: fails loudly if it is not
    proj = drafter.confidence_head.proj
    assert proj.weight.std().item() == pytest.approx(config.initializer_range, rel=0.2) and (proj.bias == 0).all()


def test_attaching_the_wrong_verifier_fails(gemma4_verifier, qwen3_verifier, llama_verifier):
    drafter = DSparkDraftModel(tiny_config(gemma4_verifier))
    drafter.set_draft_vocab(torch.arange(100))
    with pytest.raises(ValueError, match=r"does not fit the given verifier \(.*softcap None.*\); attach the verifier"):
        drafter.attach_verifier(qwen3_verifier)  # same width and vocabulary, different model
    bigger = tiny_config(llama_verifier, aux_hidden_state_layer_ids=[1, 4])
    drafter = DSparkDraftModel(bigger)
    drafter.set_draft_vocab(torch.arange(100))
    from tiny import tiny_gemma4_verifier

    shallow = tiny_gemma4_verifier(num_layers=3)
    with pytest.raises(ValueError, match="3 layers"):
        drafter.attach_verifier(shallow)


def test_draft_vocab_errors(gemma4_verifier):
    drafter = DSparkDraftModel(tiny_config(gemma4_verifier))
    with pytest.raises(ValueError, match="has 99 ids but config.draft_vocab_size is 100"):
        drafter.set_draft_vocab(torch.arange(99))
    with pytest.raises(ValueError, match="sorted ascending without duplicates"):
        drafter.set_draft_vocab(torch.arange(100).flip(0))
    with pytest.raises(ValueError, match="must lie in 0..511"):
        drafter.set_draft_vocab(torch.arange(450, 550))
    with pytest.raises(RuntimeError, match="draft vocabulary is not set"):
        drafter.attach_verifier(gemma4_verifier)


def test_vocab_maps_are_inverse(gemma4_verifier):
    drafter = tiny_drafter(gemma4_verifier)
    draft = torch.arange(100)
    ids = drafter.draft_to_verifier_ids(draft)
    assert torch.equal(drafter.verifier_to_draft_ids(ids), draft)
    outside = torch.tensor([i for i in range(VOCAB) if i not in set(ids.tolist())][:5])
    assert torch.equal(drafter.verifier_to_draft_ids(outside), torch.full((5,), -1))


# ------------------------------------------------------------------------------------------ attention mask
def reference_mask(documents, anchors, block, window, causal):
    """Brute force over every (query, key) pair, written from vLLM's DSpark runtime rule, by positions.

    Positions restart at 0 in every document; slot k of the block anchored at p sits at position pos[p] + k.
    Query slot k of block j sees context index c iff the anchor is real, c is in the anchor's document and
    c < p (strictly before the anchor); it sees slot k2 of its own block iff k2 <= k (causal) or always
    (bidirectional); nothing of any other block. With a window W (sliding layers), every query additionally
    sees only keys at positions >= its own position - W + 1, context and own-block keys alike."""
    rows, T = documents.shape
    N = anchors.shape[1]
    positions = torch.zeros(rows, T, dtype=torch.long)
    for r in range(rows):
        for t in range(1, T):
            positions[r, t] = positions[r, t - 1] + 1 if documents[r, t] == documents[r, t - 1] else 0

    def in_window(key_position, query_position):
        return window is None or key_position >= query_position - window + 1

    out = torch.zeros(rows, N * block, T + N * block, dtype=torch.bool)
    for r in range(rows):
        for j in range(N):
            p = int(anchors[r, j])
            real = p >= 0 and bool(documents[r, p] >= 0)
            anchor_position = int(positions[r, p]) if real else 0
            for k in range(block):
                q = j * block + k
                query_position = anchor_position + k
                for c in range(T):
                    out[r, q, c] = (real and bool(documents[r, c] == documents[r, p]) and c < p
                                    and in_window(int(positions[r, c]), query_position))
                for k2 in range(block):
                    out[r, q, T + j * block + k2] = (((k2 <= k) if causal else True)
                                                     and in_window(anchor_position + k2, query_position))
    return out


def flex_visible(block_mask, rows, q_len, kv_len):
    """What flex attention lets each query see under `block_mask`: attend with equal scores to one-hot values,
    so output column `kv` of query `q` is positive iff key `kv` is visible to `q`."""
    from torch.nn.attention.flex_attention import flex_attention

    width = 1 << max(4, (kv_len - 1).bit_length())
    values = torch.zeros(rows, 1, kv_len, width)
    values[:, 0, torch.arange(kv_len), torch.arange(kv_len)] = 1.0
    zeros = torch.zeros(rows, 1, q_len, 16), torch.zeros(rows, 1, kv_len, 16)
    out = flex_attention(zeros[0], zeros[1], values, block_mask=block_mask)
    return out[:, 0, :, :kv_len] > 0


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("window,causal", [
    (None, False), (None, True),  # full-attention layers (and a causal block without a window)
    (5, True), (5, False),  # documents of 9-12 tokens: contexts longer than the window
    (2, True), (2, False), (1, True),  # window < block size: the own-block window clause
    (40, True),  # a window longer than every document: no effect
])
def test_attention_mask_equals_brute_force(window, causal):
    documents = torch.tensor([[0] * 12 + [1] * 9 + [-1] * 3, [0, 0, 0] + [1] * 10 + [2] * 11])
    anchors = torch.tensor([[0, 4, 11, 12, 15, 20, -1], [1, 3, 4, 12, 13, 16, 23]])
    block = 3
    valid = anchors >= 0
    anchor_docs = documents.gather(1, anchors.clamp(min=0)).masked_fill(~valid, -1)
    mod = dspark_mask_mod(documents, anchors.clamp(min=0), anchor_docs, block, window, causal)
    q, kv = anchors.shape[1] * block, documents.shape[1] + anchors.shape[1] * block
    dense = build_attention_mask(mod, 2, q, kv, torch.device("cpu"), "sdpa", torch.float32)
    assert dense.shape == (2, 1, q, kv) and dense.dtype == torch.bool
    expected = reference_mask(documents, anchors, block, window, causal)
    assert torch.equal(dense[:, 0], expected)
    additive = build_attention_mask(mod, 2, q, kv, torch.device("cpu"), "eager", torch.float32)
    assert torch.equal(additive[:, 0] == 0, expected)
    flex = build_attention_mask(mod, 2, q, kv, torch.device("cpu"), "flex_attention", torch.float32)
    assert torch.equal(flex_visible(flex, 2, q, kv), expected)
    assert bool(expected.any(-1).all())  # every query sees at least itself


@pytest.mark.slow
def test_compiled_block_mask_equals_brute_force_or_falls_back_to_the_eager_one(monkeypatch):
    """GPU training builds its flex masks through `torch.compile(create_block_mask)`. Whether the compiler succeeds
    here (inductor's CPU code generation fails at these shapes on some CPUs under torch 2.13) or fails, the mask
    is the brute force's; a failure warns once and later masks are built eagerly without trying again."""
    builder = modeling_dspark.CompiledOrEager(modeling_dspark.create_block_mask, "the flex attention mask")
    monkeypatch.setattr(modeling_dspark, "_COMPILED_CREATE_BLOCK_MASK", builder)
    documents = torch.tensor([[0] * 12 + [1] * 9 + [-1] * 3, [0, 0, 0] + [1] * 10 + [2] * 11])
    block = 3
    for anchors in (torch.tensor([[0, 4, 11, 12, 15, 20, -1], [1, 3, 4, 12, 13, 16, 23]]),
                    torch.tensor([[2, 5, 6, 13, 17, -1, -1], [0, 4, 8, 9, 14, 18, 20]])):
        valid = anchors >= 0
        anchor_docs = documents.gather(1, anchors.clamp(min=0)).masked_fill(~valid, -1)
        for window, causal in ((None, False), (4, True)):
            mod = dspark_mask_mod(documents, anchors.clamp(min=0), anchor_docs, block, window, causal)
            q, kv = anchors.shape[1] * block, documents.shape[1] + anchors.shape[1] * block
            failed_before = builder.failed
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                flex = build_attention_mask(mod, 2, q, kv, torch.device("cpu"), "flex_attention", torch.float32,
                                            compiled=True)
            fallbacks = [w for w in caught if "it runs eagerly from now on" in str(w.message)]
            assert len(fallbacks) == int(builder.failed and not failed_before)
            assert torch.equal(flex_visible(flex, 2, q, kv), reference_mask(documents, anchors, block, window, causal))


def test_a_failing_mask_compiler_warns_once_and_builds_the_eager_mask(monkeypatch):
    calls = []

    def broken(*args, **kwargs):
        calls.append(1)
        raise RuntimeError("inductor exploded\nsecond line")

    builder = modeling_dspark.CompiledOrEager(modeling_dspark.create_block_mask, "the flex attention mask")
    builder.compiled = broken  # what a compiled function whose compile fails does on its first call
    monkeypatch.setattr(modeling_dspark, "_COMPILED_CREATE_BLOCK_MASK", builder)
    documents = torch.zeros(1, 16, dtype=torch.long)
    anchors = torch.tensor([[2, 7]])
    mod = dspark_mask_mod(documents, anchors, torch.zeros_like(anchors), 4, None, False)
    with pytest.warns(UserWarning, match=r"the flex attention mask failed \(RuntimeError: inductor exploded\); it "
                                         r"runs eagerly from now on"):
        first = build_attention_mask(mod, 1, 8, 24, torch.device("cpu"), "flex_attention", torch.float32, compiled=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no second warning, no second attempt
        second = build_attention_mask(mod, 1, 8, 24, torch.device("cpu"), "flex_attention", torch.float32, compiled=True)
    assert len(calls) == 1 and builder.failed
    expected = reference_mask(documents, anchors, 4, None, False)
    assert torch.equal(flex_visible(first, 1, 8, 24), expected) and torch.equal(flex_visible(second, 1, 8, 24), expected)


@pytest.mark.slow
def test_compiled_layers_train_as_the_eager_ones(gemma4_verifier):
    """`model.compile_layers` (on by default on a GPU) compiles each decoder layer in place: the forward and every
    gradient are the eager ones, and the parameter names (what checkpoints and the exported folder hold) do not
    change."""
    from trainer.train.compilation import compile_decoder_layers, compile_layers_enabled

    assert compile_layers_enabled(None, "cuda") and not compile_layers_enabled(None, "cpu")
    assert compile_layers_enabled(True, "cpu") and not compile_layers_enabled(False, "cuda")
    eager = tiny_drafter(gemma4_verifier, layer_types=["sliding_attention", "full_attention"], sliding_window=4)
    compiled = tiny_drafter(gemma4_verifier, layer_types=["sliding_attention", "full_attention"], sliding_window=4)
    compiled.load_state_dict(eager.state_dict())
    names = list(dict(compiled.named_parameters()))
    compile_decoder_layers(compiled)
    assert list(dict(compiled.named_parameters())) == names and list(compiled.state_dict()) == list(eager.state_dict())
    ids, aux, _, documents, positions, anchors = packed_batch(gemma4_verifier, eager)
    results = []
    for drafter in (eager, compiled):
        drafter.train()
        out = drafter(ids, aux, anchors, document_ids=documents, position_ids=positions)
        valid = anchors >= 0
        out.logits[valid].square().mean().backward()
        results.append((out.logits[valid].detach(), {n: p.grad for n, p in drafter.named_parameters()
                                                     if p.grad is not None}))
    (eager_logits, eager_grads), (compiled_logits, compiled_grads) = results
    assert torch.allclose(eager_logits, compiled_logits, atol=1e-5)
    assert eager_grads.keys() == compiled_grads.keys() and len(eager_grads) > 10
    for name, grad in eager_grads.items():
        assert torch.allclose(grad, compiled_grads[name], atol=1e-5, rtol=1e-4), name


def test_sliding_window_is_per_query_position():
    """The window counts from each query's own position (vLLM's rule), not from the anchor: slot k of the block
    anchored at p sees context from p + k - W + 1 on, and own-block slots from k - W + 1 on."""
    W, block, T = 3, 4, 10
    documents = torch.zeros(1, T, dtype=torch.long)
    anchors = torch.tensor([[8]])
    mod = dspark_mask_mod(documents, anchors, torch.zeros(1, 1, dtype=torch.long), block, W, True)
    mask = build_attention_mask(mod, 1, block, T + block, torch.device("cpu"), "sdpa", torch.float32)[0, 0]
    for k in range(block):
        assert mask[k, :T].nonzero().flatten().tolist() == list(range(8 + k - W + 1, 8)), k
        assert mask[k, T:].nonzero().flatten().tolist() == list(range(max(0, k - W + 1), k + 1)), k


def test_outputs_depend_only_on_visible_context(gemma4_verifier):
    """The mask as the model uses it: perturbing invisible verifier states changes nothing, visible ones do."""
    drafter = tiny_drafter(gemma4_verifier, layer_types=["sliding_attention", "sliding_attention"], sliding_window=4)
    ids, aux, _, documents, positions, _ = packed_batch(gemma4_verifier, drafter)
    anchors = torch.tensor([[10], [25]])
    base = drafter(ids, aux, anchors, document_ids=documents, position_ids=positions).logits
    # anchor itself, after it, other doc, outside the window (slot 0 at position p sees p-3..p-1 with W=4)
    for r, invisible in ((0, [10, 11, 30, 6]), (1, [25, 20, 21, 39])):
        changed = aux.clone()
        changed[r, invisible] += 5.0
        out = drafter(ids, changed, anchors, document_ids=documents, position_ids=positions).logits
        assert torch.allclose(out, base, atol=1e-6), (r, invisible)
    for r, visible in ((0, 9), (0, 7), (1, 22)):
        changed = aux.clone()
        changed[r, visible] += 5.0
        out = drafter(ids, changed, anchors, document_ids=documents, position_ids=positions).logits
        assert not torch.allclose(out[r], base[r], atol=1e-4), (r, visible)


# the default drafter (sliding window 6, then a full layer) and one whose window (2) is smaller than the block,
# every layer sliding, over documents of 8-35 tokens
WINDOWS = [dict(), dict(layer_types=["sliding_attention"] * 2, sliding_window=2)]


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("overrides", WINDOWS)
def test_flex_attention_matches_sdpa(gemma4_verifier, overrides):
    drafter = tiny_drafter(gemma4_verifier, **overrides)
    ids, aux, _, documents, positions, anchors = packed_batch(gemma4_verifier, drafter)
    with torch.no_grad():
        sdpa = drafter(ids, aux, anchors, document_ids=documents, position_ids=positions)
        drafter.config._attn_implementation = "flex_attention"
        try:
            flex = drafter(ids, aux, anchors, document_ids=documents, position_ids=positions)
        finally:
            drafter.config._attn_implementation = "sdpa"
    valid = anchors >= 0
    assert torch.allclose(sdpa.logits[valid], flex.logits[valid], atol=1e-5)


@pytest.mark.parametrize("overrides", WINDOWS)
def test_eager_matches_sdpa(gemma4_verifier, overrides):
    drafter = tiny_drafter(gemma4_verifier, **overrides)
    ids, aux, _, documents, positions, anchors = packed_batch(gemma4_verifier, drafter)
    sdpa = drafter(ids, aux, anchors, document_ids=documents, position_ids=positions)
    drafter.config._attn_implementation = "eager"
    try:
        eager = drafter(ids, aux, anchors, document_ids=documents, position_ids=positions)
    finally:
        drafter.config._attn_implementation = "sdpa"
    assert torch.allclose(sdpa.logits, eager.logits, atol=1e-5)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_under_autocast_every_attention_backend_gets_one_low_precision_dtype(gemma4_verifier, monkeypatch):
    """GPU training runs fp32 master weights under bf16 autocast: the projections come out in bf16 but the q/k
    norms' fp32 weights upcast query and key. sdpa re-casts its inputs itself; flex and eager do not, so the
    attention casts all three to the autocast dtype (CPU autocast takes the same path)."""
    drafter = tiny_drafter(gemma4_verifier)
    seen = []

    def spy(name, attention):
        def recorded(module, query, key, value, *args, **kwargs):
            if isinstance(module, modeling_dspark.DSparkAttention):
                seen.append((name, query.dtype, key.dtype, value.dtype))
            return attention(module, query, key, value, *args, **kwargs)

        return recorded

    interfaces = modeling_dspark.ALL_ATTENTION_FUNCTIONS
    monkeypatch.setattr(modeling_dspark, "eager_attention_forward", spy("eager", modeling_dspark.eager_attention_forward))
    for name in ("sdpa", "flex_attention"):
        monkeypatch.setitem(interfaces, name, spy(name, interfaces[name]))
    ids, aux, _, documents, positions, anchors = packed_batch(gemma4_verifier, drafter)
    for impl in ("eager", "sdpa", "flex_attention"):
        drafter.config._attn_implementation = impl
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            out = drafter(ids, aux, anchors, document_ids=documents, position_ids=positions)
        assert torch.isfinite(out.logits.float()).all()
    drafter.config._attn_implementation = "sdpa"
    layers = drafter.config.num_hidden_layers
    assert [s[0] for s in seen] == ["eager"] * layers + ["sdpa"] * layers + ["flex_attention"] * layers
    assert {s[1:] for s in seen} == {(torch.bfloat16,) * 3}
    seen.clear()
    drafter(ids, aux, anchors, document_ids=documents, position_ids=positions)  # no autocast: fp32 throughout
    assert {s[1:] for s in seen} == {(torch.float32,) * 3}


def test_attention_backend_follows_the_live_config(gemma4_verifier, monkeypatch):
    """Setting `drafter.config._attn_implementation` after construction switches the attention function every
    layer calls (and the mask built for it), with the same outputs."""
    drafter = tiny_drafter(gemma4_verifier)
    calls = []

    def spy(name, attention):
        def recorded(module, query, key, value, attention_mask, **kwargs):
            if isinstance(module, modeling_dspark.DSparkAttention):  # not the verifier's layers
                calls.append((name, attention_mask.dtype))
            return attention(module, query, key, value, attention_mask, **kwargs)

        return recorded

    interfaces = modeling_dspark.ALL_ATTENTION_FUNCTIONS
    eager = modeling_dspark.eager_attention_forward  # the default get_interface falls back to for "eager"
    monkeypatch.setattr(modeling_dspark, "eager_attention_forward", spy("eager", eager))
    monkeypatch.setitem(interfaces, "sdpa", spy("sdpa", interfaces["sdpa"]))
    ids, aux, _, documents, positions, anchors = packed_batch(gemma4_verifier, drafter)
    layers = drafter.config.num_hidden_layers
    logits, proposals = {}, {}
    for impl in ("eager", "sdpa", "eager"):
        drafter.config._attn_implementation = impl
        mask_dtype = torch.bool if impl == "sdpa" else torch.float32
        calls.clear()
        logits[impl] = drafter(ids, aux, anchors, document_ids=documents, position_ids=positions).logits
        assert calls == [(impl, mask_dtype)] * layers, impl
        calls.clear()
        proposals[impl] = drafter.draft(aux[0, :10], ids[0, 10])
        assert calls == [(impl, mask_dtype)] * layers, impl
    assert torch.allclose(logits["eager"], logits["sdpa"], atol=1e-5)
    assert torch.equal(proposals["eager"].token_ids, proposals["sdpa"].token_ids)
    assert torch.allclose(proposals["eager"].logits, proposals["sdpa"].logits, atol=1e-5)


# ------------------------------------------------------------------------------------------ document segments
def runs_brute_force(row):
    """Index within the run of equal consecutive values, element by element."""
    out = []
    for t, value in enumerate(row):
        out.append(out[-1] + 1 if t and value == row[t - 1] else 0)
    return out


def segments_brute_force(documents):
    segments = []
    for r, row in enumerate(documents.tolist()):
        start = 0
        while start < len(row):
            end = start
            while end < len(row) and row[end] == row[start]:
                end += 1
            if row[start] >= 0:
                segments.append((r, start, end))
            start = end
    return segments


def test_runs_and_document_segments_equal_brute_force():
    g = torch.Generator().manual_seed(7)
    cases = [torch.tensor([[7, 7, 7, 2, 2, 7]]), torch.tensor([[0, 0, 1, 0, -1, -1], [-1, 2, 2, 2, 2, 2]]),
             torch.tensor([[-1, -1, -1]]), torch.tensor([[5]]), torch.zeros(2, 0, dtype=torch.long),
             torch.zeros(0, 4, dtype=torch.long), torch.tensor([[0] * 18 + [1] * 14 + [2] * 8, [0] * 35 + [-1] * 5])]
    for _ in range(50):
        rows, length = int(torch.randint(1, 4, (1,), generator=g)), int(torch.randint(1, 30, (1,), generator=g))
        cases.append(torch.randint(-1, 3, (rows, length), generator=g))
    for documents in cases:
        expected = torch.tensor([runs_brute_force(row) for row in documents.tolist()], dtype=torch.long)
        assert torch.equal(index_within_runs(documents), expected.view(documents.shape)), documents
        assert torch.equal(positions_from_document_ids(documents), expected.view(documents.shape)), documents
        assert document_segments(documents) == segments_brute_force(documents), documents


# ------------------------------------------------------------------------------------------ forward semantics
def test_blocks_are_built_as_specified(gemma4_verifier):
    drafter = tiny_drafter(gemma4_verifier)
    ids, aux, _, documents, positions, anchors = packed_batch(gemma4_verifier, drafter)
    out = drafter(ids, aux, anchors, document_ids=documents, position_ids=positions)
    B = drafter.block_size
    assert out.logits.shape == (2, 6, B, 100) and out.confidence_logits.shape == (2, 6, B)
    assert torch.equal(out.anchor_mask, anchors >= 0)
    # teacher forcing: slot k is conditioned on x[p+k]
    assert torch.equal(out.previous_token_ids[0, 2], ids[0, 9:9 + B])
    # logits are lm_head(h) + Markov bias; the confidence head reads [h ; markov_w1[prev]]
    h, prev = out.last_hidden_state, out.previous_token_ids
    w1 = drafter.markov_head.markov_w1.weight[prev]
    bias = w1 @ drafter.markov_head.markov_w2.weight.T
    assert torch.equal(drafter.markov_head.previous_features(prev), w1)
    assert torch.allclose(drafter.markov_head.logit_bias(w1), bias, atol=1e-6)
    assert torch.allclose(drafter.markov_head(prev), bias, atol=1e-6)
    manual = h @ drafter.lm_head.weight.T + bias
    assert torch.allclose(out.logits, manual, atol=1e-5)
    conf = torch.cat([h, w1], -1) @ drafter.confidence_head.proj.weight[0] + drafter.confidence_head.proj.bias
    assert torch.allclose(out.confidence_logits, conf, atol=1e-5)
    # the anchor token and mask rows are the verifier's raw (unscaled) embedding rows
    raw = gemma4_verifier.get_input_embeddings().weight
    assert torch.equal(drafter.embed_tokens(torch.tensor([5, 0])), raw[[5, 0]])


def test_gradients_reach_exactly_the_trainable_parameters(gemma4_verifier):
    drafter = tiny_drafter(gemma4_verifier).train()
    ids, aux, _, documents, positions, anchors = packed_batch(gemma4_verifier, drafter)
    out = drafter(ids, aux, anchors, document_ids=documents, position_ids=positions)
    (out.logits.logsumexp(-1).mean() + out.confidence_logits.mean()).backward()
    trainable = {n for n, p in drafter.named_parameters() if p.requires_grad}
    assert "lm_head.weight" not in trainable
    assert all(drafter.get_parameter(n).grad is not None for n in trainable)
    assert not any(p.grad is not None for p in gemma4_verifier.parameters())
    assert sum(p.numel() for p in drafter.parameters()) < 200_000  # the verifier's tables are not inside


@pytest.mark.parametrize("overrides, prefix, lengths", [
    (dict(), 0, (1, 7, 20)),
    # contexts far longer than a window smaller than the block, every layer sliding, in a packed row whose
    # document starts after another one (indices and positions differ)
    (dict(layer_types=["sliding_attention"] * 2, sliding_window=2), 9, (1, 3, 12, 25)),
    (dict(sliding_window=3), 5, (2, 20)),
])
def test_draft_greedy_equals_training_argmax_chain(gemma4_verifier, overrides, prefix, lengths):
    drafter = tiny_drafter(gemma4_verifier, **overrides)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, VOCAB, (1, 30), generator=g)
    aux, _ = verifier_hidden_states(gemma4_verifier, drafter.config.aux_hidden_state_layer_ids, ids)
    other = torch.randint(3, VOCAB, (1, prefix), generator=g)
    other_aux = torch.randn(1, prefix, aux.shape[-1], generator=g)
    B = drafter.block_size
    for n in lengths:
        proposal = drafter.draft(aux[0, :n], ids[0, n])
        # teacher-force the proposed chain: row = [other document], context, bonus, proposals; anchor at the bonus
        chain = torch.cat([ids[0, : n + 1], proposal.token_ids[: B - 1]])
        row = torch.cat([other[0], chain]).unsqueeze(0)
        row_aux = torch.cat([other_aux, aux[:, :n], torch.zeros(1, chain.shape[0] - n, aux.shape[-1])], dim=1)
        documents = torch.tensor([[0] * prefix + [1] * chain.shape[0]])
        out = drafter(row, row_aux, torch.tensor([[prefix + n]]), document_ids=documents)
        argmax = out.logits[0, 0].argmax(-1)
        assert torch.equal(argmax, proposal.draft_token_ids), n
        assert torch.equal(drafter.draft_to_verifier_ids(argmax), proposal.token_ids)
        assert torch.allclose(out.logits[0, 0], proposal.logits, atol=1e-5)
        assert torch.allclose(torch.sigmoid(out.confidence_logits[0, 0]), proposal.confidence, atol=1e-6)
        assert torch.equal(proposal.probs.argmax(-1), proposal.draft_token_ids)


def test_sliding_window_is_per_query_in_the_model(gemma4_verifier):
    """One sliding layer with W=3 < B=4, anchor at p: slot k sees context from p+k-2 on (and before p) and
    own-block slots from k-2 on, so p-2 reaches slot 0 only, p-1 slots 0 and 1, p-3 none (the anchor-based
    window showed every slot p-3..p-1), and the anchor token reaches slots 0..2."""
    W = 3
    drafter = tiny_drafter(gemma4_verifier, num_hidden_layers=1, layer_types=["sliding_attention"], sliding_window=W)
    ids = torch.randint(3, VOCAB, (1, 24), generator=torch.Generator().manual_seed(5))
    aux, _ = verifier_hidden_states(gemma4_verifier, drafter.config.aux_hidden_state_layer_ids, ids)
    p, B = 12, drafter.block_size
    anchors = torch.tensor([[p]])
    base = drafter(ids, aux, anchors).last_hidden_state[0, 0]
    for c in range(p - W - 1, p + 1):
        changed = aux.clone()
        changed[0, c] += 5.0
        moved = ~torch.isclose(drafter(ids, changed, anchors).last_hidden_state[0, 0], base, atol=1e-6).all(-1)
        assert moved.tolist() == [p + k - W + 1 <= c < p for k in range(B)], c
    changed = ids.clone()
    changed[0, p] = (ids[0, p] + 1) % VOCAB
    moved = ~torch.isclose(drafter(changed, aux, anchors).last_hidden_state[0, 0], base, atol=1e-6).all(-1)
    assert moved.tolist() == [k < W for k in range(B)]


@pytest.mark.parametrize("overrides", [dict(), dict(layer_types=["sliding_attention"] * 2, sliding_window=2)])
def test_draft_cache_matches_full_recompute(gemma4_verifier, overrides):
    drafter = tiny_drafter(gemma4_verifier, **overrides)
    ids = torch.randint(3, VOCAB, (1, 30), generator=torch.Generator().manual_seed(4))
    aux, _ = verifier_hidden_states(gemma4_verifier, drafter.config.aux_hidden_state_layer_ids, ids)
    cache = DSparkDraftCache()
    for start, end in ((0, 6), (6, 13), (13, 25)):
        incremental = drafter.draft(aux[0, start:end], ids[0, end], cache=cache)
        full = drafter.draft(aux[0, :end], ids[0, end])
        assert cache.length == end
        assert torch.equal(incremental.token_ids, full.token_ids)
        assert torch.allclose(incremental.logits, full.logits, atol=1e-5)


def test_draft_cache_update_appends_per_layer_and_advances_length():
    g = torch.Generator().manual_seed(8)
    chunks = [[(torch.randn(1, 2, n, 4, generator=g), torch.randn(1, 2, n, 4, generator=g)) for _ in range(3)]
              for n in (5, 1, 3)]
    cache = DSparkDraftCache()
    for i, chunk in enumerate(chunks):
        cache.update(chunk)
        assert cache.length == sum(c[0][0].shape[2] for c in chunks[: i + 1])
    for layer in range(3):
        assert torch.equal(cache.keys[layer], torch.cat([c[layer][0] for c in chunks], dim=2))
        assert torch.equal(cache.values[layer], torch.cat([c[layer][1] for c in chunks], dim=2))
    with pytest.raises(ValueError, match="holds 3 layers but the update has 2"):
        cache.update(chunks[0][:2])


def test_draft_sampling_is_seeded_and_uses_the_returned_distribution(gemma4_verifier):
    drafter = tiny_drafter(gemma4_verifier)
    ids = torch.randint(3, VOCAB, (1, 12), generator=torch.Generator().manual_seed(5))
    aux, _ = verifier_hidden_states(gemma4_verifier, drafter.config.aux_hidden_state_layer_ids, ids)
    kwargs = dict(temperature=1.0, top_k=5, draft_method="filtered")  # the method that applies top-k to drafts
    a = drafter.draft(aux[0, :10], ids[0, 10], generator=torch.Generator().manual_seed(0), **kwargs)
    b = drafter.draft(aux[0, :10], ids[0, 10], generator=torch.Generator().manual_seed(0), **kwargs)
    assert torch.equal(a.token_ids, b.token_ids)
    assert torch.allclose(a.probs.sum(-1), torch.ones(drafter.block_size))
    assert bool(((a.probs > 0).sum(-1) <= 5).all())  # top-k applied
    assert bool((a.probs[torch.arange(drafter.block_size), a.draft_token_ids] > 0).all())


# ------------------------------------------------------------------------------------------ verifier states
@pytest.mark.parametrize("name", ["gemma4", "qwen3", "llama"])
def test_aux_layer_id_convention_and_prenorm_capture(name, request):
    verifier = request.getfixturevalue(f"{name}_verifier")
    ids = torch.randint(3, VOCAB, (2, 17), generator=torch.Generator().manual_seed(6))
    n_layers = verifier.config.get_text_config().num_hidden_layers
    layer_ids = list(range(1, n_layers))
    with torch.no_grad(), VerifierStateCapture(verifier, layer_ids) as capture:
        full = verifier(input_ids=ids, output_hidden_states=True)
    hs = full.hidden_states
    assert len(hs) == n_layers + 1
    H = hs[0].shape[-1]
    aux = capture.aux_hidden_states
    for j, layer in enumerate(layer_ids):  # id L == output_hidden_states=True index L
        assert torch.equal(aux[..., j * H:(j + 1) * H], hs[layer]), layer
    # the teacher input is the last layer's output *before* the final norm; HF's hs[-1] is after it
    last = capture.last_hidden_state
    from modeling_dspark import verifier_decoder

    decoder = verifier_decoder(verifier)
    assert not torch.allclose(last, hs[-1])
    assert torch.allclose(decoder.norm(last), hs[-1], atol=1e-6)
    logits = verifier.get_output_embeddings()(decoder.norm(last))
    cap = getattr(verifier.config.get_text_config(), "final_logit_softcapping", None)
    if cap:
        logits = cap * torch.tanh(logits / cap)
    assert torch.allclose(logits, full.logits, atol=1e-5)
    # the decoder-only path (no full-vocabulary logits) captures the same states
    aux2, last2 = verifier_hidden_states(verifier, layer_ids, ids)
    assert torch.allclose(aux2, aux) and torch.allclose(last2, last)


def test_aux_width_mismatch_is_explained(gemma4_verifier):
    drafter = tiny_drafter(gemma4_verifier)
    ids = torch.randint(3, VOCAB, (1, 10))
    with pytest.raises(ValueError, match=r"aux hidden states have width 64 but the drafter expects 128"):
        drafter(ids, torch.zeros(1, 10, 64), torch.tensor([[2]]))


def test_capture_rejects_out_of_range_layers(gemma4_verifier):
    with pytest.raises(ValueError, match="aux layer id 6 is out of range for a 6-layer verifier; use ids in 1..5."):
        VerifierStateCapture(gemma4_verifier, [2, 6])


def test_model_construction_requires_mask_and_aux_ids(gemma4_verifier):
    config = tiny_config(gemma4_verifier)
    config.mask_token_id = None
    with pytest.raises(ValueError, match="mask_token_id is not set"):
        DSparkDraftModel(config)
    assert isinstance(DSparkConfig(), DSparkConfig)


def test_gradient_checkpointing_gives_the_same_gradients(gemma4_verifier, monkeypatch):
    """Same gradients, and checkpointing really engages: every decoder layer runs once more during backward."""
    drafter = tiny_drafter(gemma4_verifier).train()
    ids, aux, _, documents, positions, anchors = packed_batch(gemma4_verifier, drafter)
    layer_calls = [0]
    forward = DSparkDecoderLayer.forward

    def counted(self, *args, **kwargs):
        layer_calls[0] += 1
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(DSparkDecoderLayer, "forward", counted)
    grads, calls = [], []
    for checkpointing in (False, True):
        if checkpointing:
            drafter.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        drafter.zero_grad()
        layer_calls[0] = 0
        out = drafter(ids, aux, anchors, document_ids=documents, position_ids=positions)
        in_forward = layer_calls[0]
        (out.logits.logsumexp(-1).mean() + out.confidence_logits.mean()).backward()
        calls.append((in_forward, layer_calls[0] - in_forward))
        grads.append({n: p.grad.clone() for n, p in drafter.named_parameters() if p.requires_grad})
    layers = drafter.config.num_hidden_layers
    assert calls == [(layers, 0), (layers, layers)]  # (forward, backward) calls: backward recomputes each layer
    assert all(torch.allclose(grads[0][n], grads[1][n], atol=1e-6) for n in grads[0])


def test_forward_rejects_unknown_arguments(gemma4_verifier):
    drafter = tiny_drafter(gemma4_verifier)
    ids = torch.randint(3, VOCAB, (1, 10))
    aux, _ = verifier_hidden_states(gemma4_verifier, drafter.config.aux_hidden_state_layer_ids, ids)
    with pytest.raises(TypeError, match="attention_mask"):
        drafter(ids, aux, torch.tensor([[2]]), attention_mask=torch.ones_like(ids))
