"""Checks that need a CUDA device (marker `gpu`; skipped without one): the bf16 + flex attention path that real
training takes on a GPU must compute what the fp32/sdpa path computes on a CPU, and a bf16 run must train."""

import copy

import pytest
import torch

pytestmark = pytest.mark.gpu


def _inputs(verifier, drafter, rows: int = 2, length: int = 96):
    from trainer.states.in_process import verifier_hidden_states
    from trainer.train.anchors import sample_anchors

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, drafter.config.vocab_size, (rows, length), generator=g).cuda()
    documents = torch.zeros_like(ids)
    documents[:, length // 2:] = 1  # two documents per row: the mask must keep them apart
    aux, _ = verifier_hidden_states(verifier, drafter.config.aux_hidden_state_layer_ids, ids)
    anchors = sample_anchors(torch.ones_like(ids), documents, 8, generator=torch.Generator().manual_seed(1))
    return ids, aux, documents, anchors.cuda()


def _loss_and_grads(drafter, ids, aux, documents, anchors):
    drafter.zero_grad(set_to_none=True)
    out = drafter(ids, aux.to(torch.bfloat16), anchors, document_ids=documents)
    valid = anchors >= 0
    loss = out.logits.float().logsumexp(-1)[valid].mean()
    loss.backward()
    grads = {n: p.grad.float().clone() for n, p in drafter.named_parameters() if p.grad is not None}
    return loss.detach(), grads


def _assert_same_training_signal(reference, other):
    """Two `_loss_and_grads` results agree to bf16 precision: the loss within 2%, every gradient's direction."""
    (ref_loss, ref_grads), (loss, grads) = reference, other
    assert torch.isfinite(loss) and torch.allclose(loss, ref_loss, rtol=2e-2)
    assert set(grads) == set(ref_grads) and ref_grads
    for name, grad in ref_grads.items():
        cosine = torch.nn.functional.cosine_similarity(grad.flatten(), grads[name].flatten(), dim=0)
        assert cosine > 0.99, (name, float(cosine))


def test_flex_attention_in_bf16_matches_sdpa_forward_and_backward(gemma4_verifier):
    from tiny import tiny_drafter

    verifier = copy.deepcopy(gemma4_verifier).cuda()
    drafter = tiny_drafter(verifier).cuda().to(torch.bfloat16).train()
    inputs = _inputs(verifier, drafter)
    drafter.config._attn_implementation = "sdpa"
    sdpa = _loss_and_grads(drafter, *inputs)
    drafter.config._attn_implementation = "flex_attention"
    _assert_same_training_signal(sdpa, _loss_and_grads(drafter, *inputs))


def test_bf16_training_run_on_gpu(chat_verifier_dir, chat_data_file, tmp_path, monkeypatch):
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from trainer.config import RunConfig
    from trainer.run import train

    # The run must really take the GPU path: flex attention (the trainer's GPU default) on bf16 queries (autocast)
    seen = []
    flex = ALL_ATTENTION_FUNCTIONS["flex_attention"]

    def spy(module, query, *args, **kwargs):
        seen.append((query.dtype, query.device.type))
        return flex(module, query, *args, **kwargs)

    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS, "flex_attention", spy)
    import modeling_dspark
    import trainer.run

    compiled = []
    compile_layers = trainer.run.compile_decoder_layers
    monkeypatch.setattr(trainer.run, "compile_decoder_layers", lambda d: (compiled.append(d), compile_layers(d)))
    monkeypatch.setattr(modeling_dspark, "_COMPILED_CREATE_BLOCK_MASK",
                        modeling_dspark.CompiledOrEager(modeling_dspark.create_block_mask, "the flex attention mask"))
    summary = train(RunConfig.load(None, [
        "--verifier", chat_verifier_dir, "--train_data", chat_data_file, "--output_dir", str(tmp_path / "run"),
        "--num_hidden_layers", "1", "--num_attention_heads", "4", "--num_key_value_heads", "2", "--head_dim", "16",
        "--intermediate_size", "128", "--block_size", "4", "--draft_vocab_size", "500", "--markov_rank", "16",
        "--max_seq_length", "128", "--total_seq_length", "256", "--validation_ratio", "0.1", "--max_anchors", "16",
        "--learning_rate", "3e-3", "--max_steps", "20", "--eval_steps", "20", "--bf16", "auto"]))
    assert summary["global_step"] == 20
    assert seen and set(seen) == {(torch.bfloat16, "cuda")}, set(seen)
    # and compiled: the decoder layers (model.compile_layers is auto: on a GPU) and the flex masks, no fallback
    assert len(compiled) == 1 and not modeling_dspark._COMPILED_CREATE_BLOCK_MASK.failed
    # the random chat verifier puts almost all its mass outside the draft vocabulary, so the draft-vocabulary
    # (restricted) estimate is the one that measures learning here
    import json

    state = json.loads((tmp_path / "run" / "checkpoint-20" / "trainer_state.json").read_text())
    evals = [h["eval_restricted_accept_len"] for h in state["log_history"] if "eval_restricted_accept_len" in h]
    assert len(evals) >= 2 and evals[-1] > evals[0]


def test_compiled_flex_mask_and_layers_on_gpu_match_the_eager_ones(gemma4_verifier):
    """What GPU training compiles, against the eager path: the `BlockMask` from `torch.compile(create_block_mask)`
    has the eager one's blocks (the CPU tests check the eager one against the brute force), and compiled decoder
    layers give the eager loss and gradients in bf16."""
    import modeling_dspark
    from modeling_dspark import build_attention_mask, dspark_mask_mod
    from tiny import tiny_drafter
    from trainer.train.compilation import compile_decoder_layers

    documents = torch.zeros(1, 4096, dtype=torch.long, device="cuda")
    documents[:, 3000:] = 1
    anchors = torch.randperm(4000, generator=torch.Generator().manual_seed(0))[:512].sort().values.view(1, -1).cuda()
    anchor_documents = documents.gather(1, anchors)
    for window in (None, 2048):
        mod = dspark_mask_mod(documents, anchors, anchor_documents, 8, window, window is not None)
        masks = [build_attention_mask(mod, 1, 4096, 8192, torch.device("cuda"), "flex_attention", torch.float32,
                                      compiled=compiled) for compiled in (False, True)]
        assert not modeling_dspark._COMPILED_CREATE_BLOCK_MASK.failed
        assert torch.equal(masks[0].to_dense(), masks[1].to_dense())
        assert torch.equal(masks[0].full_kv_num_blocks, masks[1].full_kv_num_blocks)

    verifier = copy.deepcopy(gemma4_verifier).cuda()
    drafter = tiny_drafter(verifier).cuda().to(torch.bfloat16).train()
    drafter.config._attn_implementation = "flex_attention"
    inputs = _inputs(verifier, drafter)
    eager = _loss_and_grads(drafter, *inputs)
    compile_decoder_layers(drafter)
    _assert_same_training_signal(eager, _loss_and_grads(drafter, *inputs))


def test_compiled_full_vocabulary_reduction_matches_the_eager_one():
    """On a GPU each vocabulary chunk of the teacher's full-vocabulary pass is reduced by the compiled
    `softcapped_max_logsumexp`: the eager values (float64 reference for the log-normaliser), the same argmax,
    the first id on a tie, and no fallback to eager."""
    from trainer.verifier.teacher import _FUSED_MAX_LOGSUMEXP, softcapped_max_logsumexp

    g = torch.Generator(device="cuda").manual_seed(0)
    for rows, vocab in ((700, 9000), (513, 20000)):  # a second shape: the compiled reduction is reused or re-made
        raw = (torch.randn(rows, vocab, device="cuda", generator=g) * 40).to(torch.bfloat16)
        raw[:5, 100] = raw[:5, 7] = raw[:5].float().max() + 1  # ties: id 7 must win
        value, index, log_z = _FUSED_MAX_LOGSUMEXP(raw.clone(), 30.0)
        e_value, e_index, _ = softcapped_max_logsumexp(raw.clone(), 30.0)
        reference = (torch.tanh(raw.double() / 30.0) * 30.0).logsumexp(-1)
        assert not _FUSED_MAX_LOGSUMEXP.failed
        assert torch.equal(index, e_index) and bool((index[:5] == 7).all())
        assert torch.allclose(value, e_value) and torch.allclose(log_z.double(), reference, atol=1e-4, rtol=0)
