"""Drafters saved by speculators 0.9.0 itself, for the tests that read them (run inside .venv-speculators).

    .venv-speculators/bin/python tests/speculators_checkpoints.py OUT_DIR [VERIFIER_DIR]

Builds each drafter the way `speculators train` does (`create_transformer_layer_config`, then the model class's
`from_training_args`, which loads the vocabulary mappings and the verifier's embedding) and saves it with
speculators' own `save_pretrained`, so the folders hold exactly what a speculators user has: `auto_map` to
speculators' own `config.py`, no top-level `model_type`, `d2t`/`t2d` only with a reduced vocabulary. Nothing of
speculators is committed to this repository; the folders are generated per test session.

OUT_DIR gets `dspark-full/`, `dspark-reduced/` (a 100-token draft vocabulary),
`dspark-gated/` (a Markov head vLLM cannot serve), `dflash/` (another algorithm), and `manifest.json` naming them,
their verifier and the draft vocabulary's verifier ids. The verifier is VERIFIER_DIR (the suite passes its tiny
chat verifier, which has a real tokenizer) or, without it, a tiny Qwen3 saved to `OUT_DIR/verifier/`.
"""

import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

import torch  # noqa: E402
from speculators.models.dflash.core import DFlashDraftModel  # noqa: E402
from speculators.models.dspark.core import DSparkDraftModel  # noqa: E402
from speculators.train.cli import create_transformer_layer_config  # noqa: E402

from tiny import tiny_qwen3_verifier  # noqa: E402

LAYERS = 2
BLOCK = 4
# longer than the cross-check's packed row: speculators counts a sliding window from the anchor, vLLM and this
# package per query position, so forwards agree exactly only where the window covers every context
WINDOW = 64
REDUCED = 100


def build(model_class, verifier_dir: str, draft_ids: torch.Tensor | None, seed: int, **kwargs):
    """One drafter through speculators' own training-time construction, its weights given non-trivial values."""
    torch.manual_seed(seed)
    layer = create_transformer_layer_config(
        verifier_name_or_path=verifier_dir, num_layers=LAYERS, draft_arch="qwen3", hidden_act=None,
        sliding_window=WINDOW, full_attention_indices=[LAYERS - 1])
    vocab = layer.vocab_size
    t2d = d2t = None
    draft_vocab_size = vocab
    if draft_ids is not None:
        draft_vocab_size = int(draft_ids.numel())
        d2t = draft_ids - torch.arange(draft_vocab_size)
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[draft_ids] = True
    model = model_class.from_training_args(
        layer, t2d=t2d, d2t=d2t, draft_vocab_size=draft_vocab_size, block_size=BLOCK,
        verifier_name_or_path=verifier_dir, target_layer_ids=[1, 3], mask_token_id=3,
        draft_attn_impl="sdpa", **kwargs)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not p.requires_grad:
                continue
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif name.startswith(("markov_head", "confidence_head")) or p.abs().max() == 0:
                p.normal_(0.0, 0.3)
    return model.float()


def main(out: str, verifier_dir: str | None = None) -> None:
    torch.set_num_threads(2)
    os.makedirs(out, exist_ok=True)
    if verifier_dir is None:
        verifier_dir = os.path.join(out, "verifier")
        tiny_qwen3_verifier().save_pretrained(verifier_dir)
    verifier_dir = os.path.abspath(verifier_dir)
    with open(os.path.join(verifier_dir, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    g = torch.Generator().manual_seed(1)
    draft_ids = torch.randperm(vocab, generator=g)[:REDUCED].sort().values
    made = {
        "dspark-full": build(DSparkDraftModel, verifier_dir, None, 0, markov_rank=16),
        "dspark-reduced": build(DSparkDraftModel, verifier_dir, draft_ids, 1, markov_rank=16),
        "dspark-gated": build(DSparkDraftModel, verifier_dir, None, 2, markov_rank=16, markov_head_type="gated"),
        "dflash": build(DFlashDraftModel, verifier_dir, None, 3),
    }
    for name, model in made.items():
        model.save_pretrained(os.path.join(out, name))
    with open(os.path.join(out, "manifest.json"), "w") as f:
        json.dump({"verifier": verifier_dir, "drafters": sorted(made), "reduced_draft_ids": draft_ids.tolist()}, f)


if __name__ == "__main__":
    main(*sys.argv[1:3])
