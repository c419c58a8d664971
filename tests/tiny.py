"""Tiny random verifiers and drafters for CPU tests (imports only torch/transformers and the two remote-code
modules, so the speculators cross-check script can reuse it from its own environment)."""

import torch
from transformers import (
    Gemma4Config,
    Gemma4ForConditionalGeneration,
    Gemma4TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from configuration_dspark import DSparkConfig
from modeling_dspark import DSparkDraftModel

VOCAB = 512


def tiny_gemma4_config(vocab_size: int = VOCAB, num_layers: int = 6) -> Gemma4Config:
    """Gemma 4 E4B's *structure* at tiny size: per-layer embeddings, KV sharing, sliding + full layers,
    softcap 30, tied embeddings and a full-attention head_dim different from the sliding one."""
    layer_types = ["sliding_attention", "sliding_attention", "full_attention"] * (num_layers // 3)
    text = Gemma4TextConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=num_layers,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, global_head_dim=16,
        vocab_size_per_layer_input=vocab_size, hidden_size_per_layer_input=16, num_kv_shared_layers=2,
        sliding_window=16, layer_types=layer_types, final_logit_softcapping=30.0, max_position_embeddings=1024,
        pad_token_id=0, eos_token_id=1, bos_token_id=2,
    )
    return Gemma4Config(text_config=text, vision_config=None, audio_config=None, tie_word_embeddings=True)


def tiny_gemma4_verifier(seed: int = 0, **kw) -> Gemma4ForConditionalGeneration:
    torch.manual_seed(seed)
    return Gemma4ForConditionalGeneration(tiny_gemma4_config(**kw)).eval().requires_grad_(False)


def tiny_qwen3_verifier(seed: int = 0, vocab_size: int = VOCAB) -> Qwen3ForCausalLM:
    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=5,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=1024,
                      pad_token_id=0, eos_token_id=1, bos_token_id=2, tie_word_embeddings=False)
    return Qwen3ForCausalLM(cfg).eval().requires_grad_(False)


def tiny_llama_verifier(seed: int = 0, vocab_size: int = VOCAB) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=5,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      pad_token_id=0, eos_token_id=1, bos_token_id=2, tie_word_embeddings=True)
    return LlamaForCausalLM(cfg).eval().requires_grad_(False)


def tiny_chat_verifier(tokenizer, seed: int = 0) -> LlamaForCausalLM:
    """A tiny random Llama over a real tokenizer's vocabulary, with a sharpened output head so its next-token
    distributions are peaked like a trained model's (a near-uniform teacher makes every drafter look good)."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                      pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                      bos_token_id=tokenizer.bos_token_id, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).eval().requires_grad_(False)
    with torch.no_grad():
        model.lm_head.weight.mul_(40.0)
    return model


DRAFT_OVERRIDES = dict(
    num_hidden_layers=2, block_size=4, markov_rank=16, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, intermediate_size=96, sliding_window=6,
)


def tiny_config(verifier, draft_vocab_size: int | None = 100, **overrides) -> DSparkConfig:
    kw = {**DRAFT_OVERRIDES, **overrides}
    kw.setdefault("verifier_name_or_path", "google/gemma-4-E4B-it")
    if draft_vocab_size is not None:
        kw["draft_vocab_size"] = draft_vocab_size
    return DSparkConfig.from_verifier(verifier, **kw)


def draft_vocab(config: DSparkConfig, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randperm(config.vocab_size, generator=g)[: config.draft_vocab_size].sort().values


def tiny_drafter(verifier, seed: int = 0, draft_vocab_size: int | None = 100, **overrides) -> DSparkDraftModel:
    """A randomly initialised drafter with its draft vocabulary set and the verifier attached. The
    confidence head and Markov factors get non-trivial random weights so tests see their effect."""
    config = tiny_config(verifier, draft_vocab_size=draft_vocab_size, **overrides)
    torch.manual_seed(seed)
    drafter = DSparkDraftModel(config)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if p.requires_grad and (name.startswith("markov_head") or name.startswith("confidence_head")):
                p.normal_(0.0, 0.3)
            elif p.requires_grad and name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    drafter.set_draft_vocab(draft_vocab(config))
    drafter.attach_verifier(verifier)
    return drafter.eval()


# The flags of a tiny real run (test_train.py, test_states_cache.py): a 1-layer drafter on a tiny random verifier.
TINY_RUN = ["--num_hidden_layers", "1", "--num_attention_heads", "4", "--num_key_value_heads", "2", "--head_dim", "16",
            "--intermediate_size", "128", "--block_size", "4", "--draft_vocab_size", "500", "--markov_rank", "16",
            "--max_seq_length", "128", "--total_seq_length", "256", "--validation_ratio", "0.1", "--logging_steps", "5",
            "--learning_rate", "3e-3", "--max_anchors", "16", "--save_total_limit", "5"]
