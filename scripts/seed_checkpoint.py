"""Build, save and reload a seed-recipe-shaped DSpark checkpoint on CPU (random weights, no download).

    python scripts/seed_checkpoint.py --out out/seed-shape [--dtype bfloat16]

Prints the file list, the saved key set with shapes/dtypes and the parameter count (about 0.55B), then
reloads the folder with `AutoModel.from_pretrained(..., trust_remote_code=True)` and checks the weights.
The verifier is a Gemma 4 E4B-shaped *config* (no weights), so the frozen verifier rows (lm_head) are
random here; a real run fills them with `attach_verifier`.
"""

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from configuration_dspark import DSparkConfig  # noqa: E402
from modeling_dspark import DSparkDraftModel  # noqa: E402
from trainer.errors import Parser, run_cli  # noqa: E402

# The drafter of the seed recipe (configs/gemma-4-E4B-it.yaml, model section).
SEED_DRAFTER = dict(
    num_hidden_layers=4, intermediate_size=8192, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
    layer_types=["sliding_attention"] * 3 + ["full_attention"], sliding_window=2048, block_size=8,
    draft_vocab_size=32000, aux_hidden_state_layer_ids=[2, 10, 20, 30, 40], markov_rank=256,
)


def gemma4_e4b_config():
    """google/gemma-4-E4B-it's text stack as a config (values from its published config.json)."""
    from transformers import Gemma4Config, Gemma4TextConfig

    text = Gemma4TextConfig(
        vocab_size=262144, hidden_size=2560, intermediate_size=10240, num_hidden_layers=42,
        num_attention_heads=8, num_key_value_heads=2, head_dim=256, global_head_dim=512,
        vocab_size_per_layer_input=262144, hidden_size_per_layer_input=256, num_kv_shared_layers=18,
        sliding_window=512, layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 7,
        final_logit_softcapping=30.0, max_position_embeddings=131072, rms_norm_eps=1e-6,
        pad_token_id=0, eos_token_id=1, bos_token_id=2,
    )
    cfg = Gemma4Config(text_config=text, vision_config=None, audio_config=None, tie_word_embeddings=True)
    cfg.architectures = ["Gemma4ForConditionalGeneration"]
    return cfg


def build_seed_drafter(mask_token_id: int | None = None) -> DSparkDraftModel:
    overrides = dict(SEED_DRAFTER)
    if mask_token_id is not None:
        overrides["mask_token_id"] = mask_token_id
    config = DSparkConfig.from_verifier(gemma4_e4b_config(), verifier_name_or_path="google/gemma-4-E4B-it", **overrides)
    drafter = DSparkDraftModel(config)
    vocab = torch.randperm(config.vocab_size, generator=torch.Generator().manual_seed(0))[: config.draft_vocab_size]
    drafter.set_draft_vocab(vocab.sort().values)
    with torch.no_grad():
        drafter.lm_head.weight.normal_(0.0, 0.02)  # stands in for the verifier's output rows
    return drafter


def main(argv: list[str] | None = None) -> None:
    parser = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--mask-token-id", type=int, default=None,
                        help="Gemma tokenizer's mask id; defaults to the config's pad id without a tokenizer")
    args = parser.parse_args(argv)
    t0 = time.time()
    drafter = build_seed_drafter(args.mask_token_id).to(getattr(torch, args.dtype))
    drafter.save_pretrained(args.out)
    print(f"built and saved in {time.time() - t0:.1f}s -> {args.out}")
    for name in sorted(os.listdir(args.out)):
        print(f"  {name:32s} {os.path.getsize(os.path.join(args.out, name)) / 2**20:10.1f} MiB")
    from safetensors import safe_open

    total = 0
    files = [f for f in os.listdir(args.out) if f.endswith(".safetensors")]
    print("saved tensors:")
    for file in sorted(files):
        with safe_open(os.path.join(args.out, file), "pt") as f:
            for key in sorted(f.keys()):
                t = f.get_slice(key)
                shape, dtype = t.get_shape(), t.get_dtype()
                if dtype not in ("BOOL", "I64"):
                    total += int(torch.tensor(shape).prod())
                print(f"  {key:48s} {str(shape):18s} {dtype}")
    print(f"saved floating-point parameters: {total:,} ({total / 1e9:.3f}B)")
    from transformers import AutoModel

    t0 = time.time()
    reloaded = AutoModel.from_pretrained(args.out, trust_remote_code=True)
    same = all(torch.equal(a, reloaded.state_dict()[k]) for k, a in drafter.state_dict().items())
    print(f"reloaded with AutoModel as {type(reloaded).__module__}.{type(reloaded).__name__} in "
          f"{time.time() - t0:.1f}s; weights identical: {same}")
    print(json.dumps({k: reloaded.config.to_dict()[k] for k in ("block_size", "draft_vocab_size",
                                                               "aux_hidden_state_layer_ids")}))
    if not same:
        raise SystemExit("reloaded weights differ from the saved ones")


if __name__ == "__main__":
    sys.exit(run_cli(main))
