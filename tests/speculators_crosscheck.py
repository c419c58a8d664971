"""Cross-check our checkpoints against speculators 0.9.0 (run inside .venv-speculators, which has
speculators and the same transformers 5.19.0; our two remote-code modules import only torch/transformers).

    .venv-speculators/bin/python tests/speculators_crosscheck.py OUT_JSON

For a tiny Qwen3 and a tiny Gemma 4 verifier: build our drafter, save it (fp32 and bf16), load it with
`SpeculatorModel.from_pretrained`, compare every saved tensor, then run both forwards on the same packed
row and the same explicit anchors and compare draft hidden states, Markov-corrected logits and confidence
logits. Writes a JSON report (max abs differences) and exits non-zero on a mismatch.
"""

import copy
import json
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

import speculators_checkpoints  # noqa: E402
import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from speculators import SpeculatorModel  # noqa: E402
from speculators.models.dflash import core as dflash_core  # noqa: E402
from torch.nn.attention.flex_attention import create_mask  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from modeling_dspark import DSparkDraftModel, positions_from_document_ids  # noqa: E402
from tiny import tiny_drafter, tiny_gemma4_verifier, tiny_qwen3_verifier  # noqa: E402
from trainer.states.in_process import verifier_hidden_states  # noqa: E402

TOL = 2e-5


def check(kind: str, make_verifier, work: str) -> dict:
    verifier = make_verifier()
    vdir = os.path.join(work, f"{kind}-verifier")
    verifier.save_pretrained(vdir)
    # speculators reloads the embedding from `speculators_config.verifier.name_or_path`; point it at the local copy
    # A window longer than the packed row: speculators 0.9.0 counts the sliding window from the anchor, vLLM (and
    # this package) per query position, so the two agree exactly only when the window covers every context.
    ours = tiny_drafter(verifier, verifier_name_or_path=vdir, sliding_window=64)
    report = {"verifier": type(verifier).__name__}
    for dtype in (torch.float32, torch.bfloat16):
        ddir = os.path.join(work, f"{kind}-drafter-{dtype}".replace("torch.", ""))
        exported = copy.deepcopy(ours).to(dtype)
        exported.save_pretrained(ddir)
        theirs = SpeculatorModel.from_pretrained(ddir)
        state = theirs.state_dict()
        saved = exported.state_dict()
        mismatched = [k for k, v in saved.items() if k not in state or not torch.equal(v, state[k].to(v.dtype))]
        report[f"weights_identical_{dtype}".replace("torch.", "")] = not mismatched
        if mismatched:
            report[f"mismatched_{dtype}".replace("torch.", "")] = mismatched
        report["their_class"] = f"{type(theirs).__module__}.{type(theirs).__name__}"
        embed = verifier.get_input_embeddings().weight
        their_embed = theirs.embed_tokens.weight
        report[f"embedding_from_verifier_{dtype}".replace("torch.", "")] = bool(
            torch.equal(their_embed, embed.to(their_embed.dtype)))
    theirs = SpeculatorModel.from_pretrained(os.path.join(work, f"{kind}-drafter-float32")).float().eval()
    report.update(compare_forwards(ours, theirs, verifier))
    report["ok"] = (
        all(v for k, v in report.items() if k.startswith(("weights_identical", "embedding_from")))
        and max(report[k] for k in report if k.startswith("max_abs_diff")) < TOL
    )
    return report


def compare_forwards(ours, theirs, verifier) -> dict:
    """Both forwards on one packed row (two documents) with the same explicit anchors: the max abs differences
    of the draft hidden states, the Markov-corrected logits and the confidence logits."""
    # run speculators with dense sdpa masks (its default flex path compiles, and needs a GPU for backward)
    theirs.config.transformer_layer_config._attn_implementation = "sdpa"
    theirs._attn_impl, theirs._create_mask_fn = "sdpa", create_mask

    g = torch.Generator().manual_seed(0)
    T = 48
    vocab = verifier.config.get_text_config().vocab_size
    ids = torch.randint(3, vocab, (1, T), generator=g)
    documents = torch.tensor([[0] * 20 + [1] * 28])
    positions = positions_from_document_ids(documents)
    loss_mask = torch.ones(1, T, dtype=torch.long)
    aux, last = verifier_hidden_states(verifier, ours.config.aux_hidden_state_layer_ids, ids)
    B = theirs.block_size
    assert B == 4, "the anchors below keep blocks of 4 inside their documents"
    anchors = torch.tensor([1, 5, 9, 14, 20, 23, 30, 41])
    valid = torch.ones_like(anchors, dtype=torch.bool)
    original = dflash_core.select_anchors
    dflash_core.select_anchors = lambda loss_mask, n, block: (anchors.clone(), valid.clone())
    try:
        with torch.no_grad():
            hidden, base_logits, _, _, idx = theirs._backbone_forward(
                aux, ids, loss_mask, last, documents, positions, max_anchors=len(anchors))
            prev = ids[0, idx].view(len(anchors), B)
            prev_emb = theirs.markov_head.prev_embeddings(prev)
            h = hidden.view(len(anchors), B, -1)
            logits = base_logits.view(len(anchors), B, -1) + theirs.markov_head.block_bias(
                prev_token_ids=prev, hidden_states=h, prev_emb=prev_emb)
            conf = theirs.confidence_head(torch.cat([h, prev_emb.to(h.dtype)], -1)).view(len(anchors), B)
            mine = ours.eval()(ids, aux, anchors.unsqueeze(0), document_ids=documents, position_ids=positions)
    finally:
        dflash_core.select_anchors = original
    return {
        "max_abs_diff_hidden": float((mine.last_hidden_state[0] - h).abs().max()),
        "max_abs_diff_logits": float((mine.logits[0] - logits).abs().max()),
        "max_abs_diff_confidence": float((mine.confidence_logits[0] - conf).abs().max()),
        "logit_scale": float(logits.abs().max()),
    }


def check_their_checkpoint(name: str, work: str) -> dict:
    """A drafter speculators built and saved itself (tests/speculators_checkpoints.py), loaded by our
    `DSparkDraftModel.from_pretrained`: every saved tensor identical, and the same forward as speculators' own
    model loaded from the same folder."""
    folder = os.path.join(work, "theirs", name)
    verifier = AutoModelForCausalLM.from_pretrained(os.path.join(work, "theirs", "verifier")).float().eval()
    ours, info = DSparkDraftModel.from_pretrained(folder, dtype=torch.float32, output_loading_info=True)
    ours.attach_verifier(verifier)
    saved = load_file(os.path.join(folder, "model.safetensors"))
    state = ours.state_dict()
    report = {"unexpected_keys": sorted(info["unexpected_keys"]),
              "weights_identical_float32": all(k in state and torch.equal(v, state[k]) for k, v in saved.items()),
              "draft_vocab_size": ours.config.draft_vocab_size}
    theirs = SpeculatorModel.from_pretrained(folder).float().eval()
    report.update(compare_forwards(ours, theirs, verifier))
    report["ok"] = (report["weights_identical_float32"] and not report["unexpected_keys"]
                    and max(report[k] for k in report if k.startswith("max_abs_diff")) < TOL)
    return report


def main() -> None:
    torch.set_num_threads(2)
    results = {}
    with tempfile.TemporaryDirectory() as work:
        results["qwen3"] = check("qwen3", tiny_qwen3_verifier, work)
        results["gemma4"] = check("gemma4", tiny_gemma4_verifier, work)
        speculators_checkpoints.main(os.path.join(work, "theirs"))
        for name in ("dspark-full", "dspark-reduced"):
            results[f"theirs-{name}"] = check_their_checkpoint(name, work)
    import speculators
    import transformers

    results["versions"] = {"speculators": getattr(speculators, "__version__", "0.9.0"),
                           "transformers": transformers.__version__, "torch": torch.__version__}
    text = json.dumps(results, indent=2)
    print(text)
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            f.write(text)
    sys.exit(0 if all(r["ok"] for k, r in results.items() if k != "versions") else 1)


if __name__ == "__main__":
    main()
