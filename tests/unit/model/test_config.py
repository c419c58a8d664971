"""DSparkConfig: the config.json contract (docs/checkpoint-format.md), derivation from the verifier, bad input."""

import json
import os
import sys

import pytest
from transformers import AutoConfig

from configuration_dspark import DSparkConfig, default_aux_layer_ids
from tiny import tiny_config

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__)))), "scripts"))
from seed_checkpoint import SEED_DRAFTER, gemma4_e4b_config  # noqa: E402

# The seed recipe's config.json (docs/checkpoint-format.md), verbatim except the two values that depend on the
# tokenizer / library version (mask_token_id, transformers_version) and dtype (set when the model is saved).
SEED_CONFIG_JSON = {
    "architectures": ["DSparkDraftModel"],
    "auto_map": {"AutoConfig": "configuration_dspark.DSparkConfig", "AutoModel": "modeling_dspark.DSparkDraftModel"},
    "aux_hidden_state_layer_ids": [2, 10, 20, 30, 40],
    "block_size": 8,
    "confidence_head_with_markov": True,
    "draft_vocab_size": 32000,
    "enable_confidence_head": True,
    "markov_head_type": "vanilla",
    "markov_rank": 256,
    "sample_from_anchor": True,
    "sliding_window_non_causal": False,
    "speculators_config": {
        "algorithm": "dspark",
        "default_proposal_method": "greedy",
        "proposal_methods": [{"accept_tolerance": 0.0, "proposal_type": "greedy", "speculative_tokens": 8,
                              "verifier_accept_k": 1}],
        "verifier": {"architectures": ["Gemma4ForConditionalGeneration"], "name_or_path": "google/gemma-4-E4B-it"},
    },
    "speculators_model_type": "dspark",
    "speculators_version": "0.9.0",
    "target_hidden_size": None,
    "tie_word_embeddings": False,
    "transformer_layer_config": {
        "model_type": "qwen3", "hidden_act": "silu", "hidden_size": 2560, "intermediate_size": 8192,
        "num_hidden_layers": 4, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
        "layer_types": ["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"],
        "sliding_window": 2048, "use_sliding_window": True, "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-06, "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
        "attention_bias": False, "attention_dropout": 0.0, "tie_word_embeddings": False, "vocab_size": 262144,
    },
}
# Keys this package adds beyond the contract (tolerated by speculators and vLLM; see README).
EXTRA_KEYS = {"verifier_local_path", "verifier_text_config"}
LAYER_EXTRA_KEYS = {"initializer_range"}


def seed_config(**kw) -> DSparkConfig:
    return DSparkConfig.from_verifier(gemma4_e4b_config(), verifier_name_or_path="google/gemma-4-E4B-it",
                                      **{**SEED_DRAFTER, **kw})


def test_seed_recipe_config_json_matches_the_contract_key_by_key(tmp_path):
    seed_config(mask_token_id=4).save_pretrained(tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    assert "model_type" not in written
    assert set(written) == set(SEED_CONFIG_JSON) | {"mask_token_id", "transformers_version", "dtype"} | EXTRA_KEYS
    for key, expected in SEED_CONFIG_JSON.items():
        if key == "transformer_layer_config":
            layer = written[key]
            assert set(layer) == set(expected) | LAYER_EXTRA_KEYS
            assert {k: layer[k] for k in expected} == expected
        else:
            assert written[key] == expected, key
    assert written["mask_token_id"] == 4
    assert written["verifier_text_config"] == {
        "architectures": ["Gemma4ForConditionalGeneration"], "final_logit_softcapping": 30.0, "hidden_size": 2560,
        "model_type": "gemma4_text", "num_hidden_layers": 42, "tie_word_embeddings": True, "vocab_size": 262144,
    }


def test_autoconfig_reads_it_back_through_remote_code(tmp_path):
    config = seed_config(mask_token_id=4)
    config.save_pretrained(tmp_path)
    assert sorted(os.listdir(tmp_path)) == ["config.json", "configuration_dspark.py"]
    loaded = AutoConfig.from_pretrained(tmp_path, trust_remote_code=True)
    assert type(loaded).__name__ == "DSparkConfig"
    assert type(loaded).__module__.startswith("transformers_modules")  # the copied file, not our import
    assert loaded.to_dict() == config.to_dict()
    assert loaded.verifier_name_or_path == "google/gemma-4-E4B-it"


def test_block_size_drives_the_served_proposal_length():
    config = seed_config(block_size=5)
    assert config.to_dict()["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 5


def test_from_verifier_derives_what_the_verifier_determines(gemma4_verifier):
    config = tiny_config(gemma4_verifier)
    text = gemma4_verifier.config.get_text_config()
    layer = config.transformer_layer_config
    assert layer["hidden_size"] == text.hidden_size == 64
    assert layer["vocab_size"] == config.vocab_size == 512
    # Gemma's per-layer-type RoPE resolves to the sliding variant, partial rotary dropped, theta explicit.
    assert layer["rope_parameters"] == {"rope_type": "default", "rope_theta": 10000.0}
    # [2, L//2, L-3] for L=6 is [2, 3, 3]: deduplicated.
    assert config.aux_hidden_state_layer_ids == [2, 3]
    assert config.mask_token_id == 0  # no tokenizer given: the verifier's pad id
    assert config.verifier_text_config["final_logit_softcapping"] == 30.0
    assert config.speculators_config["verifier"]["architectures"] == ["Gemma4ForConditionalGeneration"]


@pytest.mark.parametrize("layers,expected", [(42, [2, 21, 39]), (30, [2, 15, 27]), (4, [1, 2]), (2, [1])])
def test_default_aux_layer_ids(layers, expected):
    assert default_aux_layer_ids(layers) == expected


def test_mask_token_comes_from_the_tokenizer_when_given(qwen3_verifier):
    class Tok:  # the attributes resolve_mask_token_id reads, as a real tokenizer exposes them
        mask_token_id, pad_token_id, eos_token_id, unk_token_id = None, 7, 8, None

        def __len__(self):
            return 500

    # no mask token, the tokenizer has fewer entries than the embedding: the first unused row
    assert tiny_config(qwen3_verifier, tokenizer=Tok()).mask_token_id == 500
    Tok.mask_token_id = 3
    assert tiny_config(qwen3_verifier, tokenizer=Tok()).mask_token_id == 3


def test_from_verifier_accepts_a_local_directory(tmp_path, qwen3_verifier):
    qwen3_verifier.save_pretrained(tmp_path / "verifier")
    config = DSparkConfig.from_verifier(str(tmp_path / "verifier"), num_hidden_layers=1)
    assert config.verifier_local_path == str(tmp_path / "verifier")
    assert config.verifier_name_or_path is None  # a local path is never written as the serving id
    config = DSparkConfig.from_verifier(str(tmp_path / "verifier"), verifier_name_or_path="Qwen/Qwen3-8B")
    assert config.verifier_name_or_path == "Qwen/Qwen3-8B"


@pytest.mark.parametrize(
    "overrides,message",
    [
        (dict(aux_hidden_state_layer_ids=[2, 44]),
         "aux layer id 44 is out of range for a 42-layer verifier; use ids in 1..41."),
        (dict(aux_hidden_state_layer_ids=[42]), "aux layer id 42 is out of range for a 42-layer verifier"),
        (dict(aux_hidden_state_layer_ids=[20, 10]), "must be strictly ascending without duplicates; use [10, 20]"),
        (dict(aux_hidden_state_layer_ids=[10, 10]), "must be strictly ascending without duplicates; use [10]"),
        (dict(hidden_size=4096), "hidden_size=4096 conflicts with the verifier's hidden_size 2560"),
        (dict(draft_vocab_size=300000), "draft_vocab_size 300000 does not fit the verifier vocabulary of 262144"),
        (dict(block_size=0), "block_size must be a positive integer (got 0)"),
        (dict(mask_token_id=262144), "mask_token_id 262144 is outside the verifier vocabulary of 262144 tokens"),
        (dict(markov_rank=0), "confidence_head_with_markov=True needs a Markov head"),
        (dict(markov_head_type="rnn"), "markov_head_type 'rnn' is not supported"),
        (dict(sample_from_anchor=False), "sample_from_anchor=False (the DFlash 1+N layout) is not supported"),
        (dict(layer_types=["full_attention"]), "must list 'sliding_attention' or 'full_attention' once per draft"),
        (dict(hidden_act="gelu"), "hidden_act must be 'silu'"),
    ],
)
def test_bad_input_gives_one_sentence_errors(overrides, message):
    with pytest.raises(ValueError) as err:
        seed_config(**overrides)
    assert message in str(err.value)
    assert str(err.value).count(". ") == 0  # one sentence


def test_loading_a_config_that_does_not_fit_its_snapshot_fails(tmp_path):
    seed_config().save_pretrained(tmp_path)
    data = json.loads((tmp_path / "config.json").read_text())
    data["transformer_layer_config"]["hidden_size"] = 4096
    (tmp_path / "config.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match="differs from the verifier's hidden size 2560"):
        AutoConfig.from_pretrained(tmp_path, trust_remote_code=True)


def test_generation_parameters_are_never_in_the_config(tmp_path):
    written = json.dumps(seed_config().to_dict())
    for key in ("temperature", "top_p", "top_k", "do_sample"):
        assert f'"{key}"' not in written


def test_run_config_refuses_a_non_causal_sliding_window():
    """vLLM never reads `sliding_window_non_causal` (it serves sliding layers causal), so a run that would train
    bidirectional sliding layers is refused up front, in one sentence; the key itself stays in config.json."""
    from trainer.config import RunConfig
    from trainer.errors import UsageError

    base = ["--verifier", "x", "--train_data", "y"]
    assert RunConfig.load(None, base).model.sliding_window_non_causal is False
    with pytest.raises(UsageError) as err:
        RunConfig.load(None, [*base, "--sliding_window_non_causal", "true"])
    message = str(err.value)
    assert message.startswith("model.sliding_window_non_causal is true, but vLLM ignores it and serves the sliding "
                              "layers causal inside the block")
    assert message.endswith("set it to false.") and message.count(". ") == 0 and "\n" not in message


def test_skipping_the_full_vocabulary_pass_needs_a_loss_that_does_not_read_it():
    """`full_vocab_metrics: false` only saves time when nothing in the loss reads the verifier's full head; with a
    confidence target or teacher that does, the setting would silently do nothing, so it is refused."""
    from trainer.config import RunConfig
    from trainer.errors import UsageError

    base = ["--verifier", "x", "--train_data", "y", "--full_vocab_metrics", "false"]
    with pytest.raises(UsageError, match=r"confidence_target 'greedy' needs the full-vocabulary pass anyway"):
        RunConfig.load(None, base)
    ok = RunConfig.load(None, [*base, "--confidence_target", "sampled_restricted"])
    assert ok.objective().full_vocab_metrics is False and ok.objective().confidence_target == "sampled_restricted"
    with pytest.raises(UsageError, match=r"teacher_vocab 'full' with confidence_target 'sampled_restricted'"):
        RunConfig.load(None, [*base, "--confidence_target", "sampled_restricted", "--teacher_vocab", "full"])
