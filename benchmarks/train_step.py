"""Training-step benchmark, this package's side (runs in `.venv`); `benchmarks/speculators_step.py` is the other.

    .venv/bin/python -m benchmarks.train_step make-inputs --out DIR [--quick]
    .venv/bin/python -m benchmarks.train_step run --config small|large --impl ours|ours-default --inputs DIR --json OUT

`make-inputs` writes everything both implementations read, so they step on identical inputs and weights:

* `DIR/verifier/`: a random Qwen3 verifier (hidden 640, vocabulary 262,144, tied embeddings, 4 query heads / 1 KV
  head of 256, MLP 2048) with only the layers the aux ids need (aux ids [1, 2, 3]: 4 layers). speculators loads
  its frozen embedding, output head and final norm from here;
* `DIR/drafter/`: our drafter, `save_pretrained` in fp32 (2 Qwen3-style layers as `DSparkConfig.from_verifier`
  derives them, block 8, markov rank 256, confidence head on, a random 32,000-id draft vocabulary);
* `DIR/inputs-<config>.safetensors`, one per config: one packed row of T tokens holding 4 documents (a prompt
  part with loss mask 0, then a response part with loss mask 1), its document and position ids, the verifier's
  aux states and pre-norm last-layer states (from `InProcessVerifier.states`, documents run separately), and the
  explicit anchors: for every anchor p, tokens p..p+B lie in one document's supervised part, so both
  implementations supervise all B slots of every block (S = anchors x B);
* `DIR/meta.json`: the shapes.

Configs: small = T 1024, 64 anchors (512 slots); large = T 2048, 256 anchors (2,048 slots). `--quick` writes tiny
shapes under the same names (hidden 64, vocabulary 4,096, draft vocabulary 512, T 128 / 256) to check the harness.

`run` (one fresh process per run): loads the inputs and the drafter, builds the teacher exactly as
`trainer.states.in_process.InProcessVerifier` does, then runs 2 warm-up and N timed steps, each split into forward
(drafter forward + `trainer.train.loss.dspark_loss`), backward and optimizer (grad-norm clip to 1.0, step, zero_grad)
with `trainer.train.optim.MuonWithAdamW` (Muon on `muon_parameter_names`, float32 Newton-Schulz). `--impl ours` uses the
objective matched to speculators (`confidence_target="sampled_restricted"`, `full_vocab_metrics=False`);
`--impl ours-default` the package's default objective (full-vocabulary metrics included). Writes a JSON report
(see `benchmarks.common.train_steps`).
"""

import argparse
import dataclasses
import hashlib
import json
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import ROOT, BenchmarkError, fail, machine, train_steps, write_json
from benchmarks.common import objective as bench_objective
from trainer.errors import Parser, run_cli

META_FILE = "meta.json"
SPEC_VERSION = 1
LEARNING_RATE = 5e-4  # trainer/config.py defaults: learning_rate, weight_decay, muon_weight_decay, max_grad_norm
WEIGHT_DECAY = 0.01
MUON_WEIGHT_DECAY = 0.1
MUON_MOMENTUM = 0.95
MAX_GRAD_NORM = 1.0

FULL = {
    "verifier": dict(vocab_size=262144, hidden_size=640, intermediate_size=2048, num_hidden_layers=4,
                     num_attention_heads=4, num_key_value_heads=1, head_dim=256),
    "drafter": dict(num_hidden_layers=2, block_size=8, draft_vocab_size=32000, markov_rank=256,
                    aux_hidden_state_layer_ids=[1, 2, 3]),
    "configs": {"small": dict(tokens=1024, anchors=64), "large": dict(tokens=2048, anchors=256)},
}
QUICK = {
    "verifier": dict(vocab_size=4096, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                     num_attention_heads=4, num_key_value_heads=1, head_dim=16),
    "drafter": dict(num_hidden_layers=2, block_size=8, draft_vocab_size=512, markov_rank=16,
                    aux_hidden_state_layer_ids=[1, 2, 3]),
    "configs": {"small": dict(tokens=128, anchors=16), "large": dict(tokens=256, anchors=32)},
}
DOCUMENTS = 4  # per packed row
PROMPT_FRACTION = 0.25  # of each document: loss mask 0


def code_digest() -> str:
    """Digest of the two remote-code files: inputs saved by another version of the drafter are rebuilt."""
    h = hashlib.sha256()
    for name in ("configuration_dspark.py", "modeling_dspark.py"):
        h.update((ROOT / name).read_bytes())
    return h.hexdigest()[:16]


def spec(quick: bool) -> dict:
    """What `make-inputs` builds (also what decides whether existing inputs can be reused)."""
    base = QUICK if quick else FULL
    return {"spec_version": SPEC_VERSION, "quick": quick, "documents": DOCUMENTS, "prompt_fraction": PROMPT_FRACTION,
            "code_digest": code_digest(), **json.loads(json.dumps(base))}


def inputs_match(directory: Path, quick: bool) -> bool:
    """True when `directory` holds complete inputs built from the same spec."""
    try:
        meta = json.loads((directory / META_FILE).read_text())
    except (OSError, ValueError):
        return False
    wanted = spec(quick)
    configs = wanted.pop("configs")
    if not all(meta.get(k) == v for k, v in wanted.items()) or set(meta.get("configs", {})) != set(configs):
        return False
    if any({k: meta["configs"][name].get(k) for k in c} != c for name, c in configs.items()):
        return False
    if not all((directory / c["file"]).is_file() for c in meta["configs"].values()):
        return False
    try:  # the drafter names its verifier folder by absolute path (speculators loads it): it must still be there
        drafter = json.loads((directory / "drafter" / "config.json").read_text())
        verifier = Path(drafter["speculators_config"]["verifier"]["name_or_path"])
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return verifier.resolve() == (directory / "verifier").resolve() and (verifier / "config.json").is_file()


def read_meta(directory: Path) -> dict:
    try:
        return json.loads((directory / META_FILE).read_text())
    except (OSError, ValueError) as e:
        raise BenchmarkError(f"{directory} holds no benchmark inputs ({e.__class__.__name__}); create them with "
                             f"`python -m benchmarks.train_step make-inputs --out {directory}`.") from None


def load_inputs(directory: Path, config: str) -> tuple[dict, dict]:
    """(meta of `config`, its tensors) from a `make-inputs` folder."""
    from safetensors.torch import load_file

    meta = read_meta(directory)
    if config not in meta["configs"]:
        raise BenchmarkError(f"config {config!r} is not in {directory / META_FILE}; use one of "
                             f"{sorted(meta['configs'])}.")
    return meta, load_file(str(directory / meta["configs"][config]["file"]))


# ------------------------------------------------------------------------------------------------ make-inputs
def _packed_row(tokens: int, anchors: int, block: int, vocab: int, draft_ids, generator):
    """One packed row of `DOCUMENTS` documents and anchors whose blocks lie inside the supervised parts."""
    import torch

    if tokens % DOCUMENTS:
        raise BenchmarkError(f"T={tokens} is not a multiple of {DOCUMENTS} documents.")
    doc_len = tokens // DOCUMENTS
    prompt = int(doc_len * PROMPT_FRACTION)
    per_doc, extra = divmod(anchors, DOCUMENTS)
    # token ids: mostly draft-vocabulary tokens (as real supervised text), some from the rest of the vocabulary
    from_draft = draft_ids[torch.randint(len(draft_ids), (tokens,), generator=generator)]
    anywhere = torch.randint(3, vocab, (tokens,), generator=generator)
    input_ids = torch.where(torch.rand(tokens, generator=generator) < 0.9, from_draft, anywhere)
    document_ids = torch.arange(DOCUMENTS).repeat_interleave(doc_len)
    loss_mask = torch.zeros(tokens, dtype=torch.long)
    chosen = []
    for d in range(DOCUMENTS):
        start, end = d * doc_len, (d + 1) * doc_len
        loss_mask[start + prompt:end] = 1
        # p..p+B inside the response part: p >= start + prompt and p + B <= end - 1
        candidates = torch.arange(start + prompt, end - block)
        want = per_doc + (1 if d < extra else 0)
        if want > candidates.numel():
            raise BenchmarkError(f"a document of {doc_len} tokens has only {candidates.numel()} anchor positions "
                                 f"for {want} anchors; use fewer anchors or longer rows.")
        chosen.append(candidates[torch.randperm(candidates.numel(), generator=generator)[:want]])
    anchor_positions = torch.cat(chosen).sort().values
    return input_ids[None], loss_mask[None], document_ids[None], anchor_positions


def make_inputs(out: Path, quick: bool) -> dict:
    import torch
    from safetensors.torch import save_file
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from configuration_dspark import DSparkConfig
    from modeling_dspark import DSparkDraftModel, positions_from_document_ids
    from trainer.states.in_process import InProcessVerifier
    from trainer.train.anchors import block_supervision

    s = spec(quick)
    out.mkdir(parents=True, exist_ok=True)
    (out / META_FILE).unlink(missing_ok=True)  # written last: present means complete
    v, d = s["verifier"], s["drafter"]
    torch.manual_seed(0)
    vcfg = Qwen3Config(**v, max_position_embeddings=32768, pad_token_id=0, eos_token_id=1, bos_token_id=2,
                       tie_word_embeddings=True)
    verifier = Qwen3ForCausalLM(vcfg).eval().requires_grad_(False)
    verifier_dir = out / "verifier"
    verifier.save_pretrained(verifier_dir)

    # speculators reloads the frozen embedding / head / norm from `speculators_config.verifier.name_or_path`:
    # the verifier folder itself (absolute, so both processes find it whatever their working directory).
    config = DSparkConfig.from_verifier(verifier, verifier_name_or_path=str(verifier_dir.resolve()), **d)
    torch.manual_seed(0)
    drafter = DSparkDraftModel(config)
    g = torch.Generator().manual_seed(1)
    draft_ids = torch.randperm(v["vocab_size"], generator=g)[: d["draft_vocab_size"]].sort().values
    drafter.set_draft_vocab(draft_ids)
    drafter.attach_verifier(verifier)
    drafter.to(torch.float32).save_pretrained(out / "drafter")

    source = InProcessVerifier(verifier, d["aux_hidden_state_layer_ids"])
    block = d["block_size"]
    configs = {}
    for name, c in s["configs"].items():
        ids, loss_mask, documents, anchors = _packed_row(c["tokens"], c["anchors"], block, v["vocab_size"],
                                                         draft_ids, g)
        positions = positions_from_document_ids(documents)
        states = source.states({"input_ids": ids, "document_ids": documents, "position_ids": positions})
        supervised = int(block_supervision(loss_mask, documents, anchors[None], block).sum())
        theirs = int(loss_mask[0, (anchors[:, None] + torch.arange(block)).flatten()].sum())
        if not supervised == theirs == anchors.numel() * block:
            raise RuntimeError(f"anchors of {name} do not supervise every slot ({supervised}, {theirs}).")
        file = f"inputs-{name}.safetensors"
        save_file({"input_ids": ids, "loss_mask": loss_mask, "document_ids": documents, "position_ids": positions,
                   "aux_hidden_states": states.aux_hidden_states.contiguous(),
                   "last_hidden_state": states.last_hidden_state.contiguous(), "anchors": anchors},
                  str(out / file))
        configs[name] = {**c, "file": file, "block_size": block, "supervised_slots": supervised}
    meta = {**s, "configs": configs}
    write_json(out / META_FILE, meta)
    return meta


# ------------------------------------------------------------------------------------------------ run
def run(config: str, impl: str, inputs: Path, json_out: Path, warmup: int, steps: int, flops: bool) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from modeling_dspark import DSparkDraftModel
    from trainer.states.in_process import InProcessVerifier
    from trainer.train.anchors import block_supervision
    from trainer.train.loss import dspark_loss
    from trainer.train.optim import MuonWithAdamW, muon_parameter_names

    start = time.perf_counter()
    meta, t = load_inputs(inputs, config)
    c = meta["configs"][config]
    drafter = DSparkDraftModel.from_pretrained(str(inputs / "drafter"), dtype=torch.float32,
                                               attn_implementation="sdpa")
    verifier = AutoModelForCausalLM.from_pretrained(str(inputs / "verifier"), dtype=torch.float32)
    verifier.eval().requires_grad_(False)
    drafter.attach_verifier(verifier)
    drafter.train()
    # The teacher exactly as the trainer builds it: Teacher(final_norm, softcap, the verifier's own output head).
    teacher = InProcessVerifier(verifier, drafter.config.aux_hidden_state_layer_ids).teacher()
    objective = bench_objective("default" if impl == "ours-default" else "matched", c["block_size"], c["anchors"])
    optimizer = MuonWithAdamW(drafter.named_parameters(), lr=LEARNING_RATE, weight_decay=WEIGHT_DECAY,
                              muon_weight_decay=MUON_WEIGHT_DECAY, momentum=MUON_MOMENTUM,
                              muon_names=set(muon_parameter_names(drafter)), newton_schulz_dtype="float32")
    params = [p for p in drafter.parameters() if p.requires_grad]
    ids, loss_mask, documents, positions = t["input_ids"], t["loss_mask"], t["document_ids"], t["position_ids"]
    aux, last = t["aux_hidden_states"], t["last_hidden_state"]
    anchors = t["anchors"][None]
    supervised = int(block_supervision(loss_mask, documents, anchors, c["block_size"]).sum())
    load_s = time.perf_counter() - start

    def forward():
        out = drafter(input_ids=ids, aux_hidden_states=aux, anchor_positions=anchors, document_ids=documents,
                      position_ids=positions, return_logits=False)
        loss, _ = dspark_loss(drafter, out, ids, loss_mask, documents, anchors, last, teacher, objective)
        return loss

    def backward(loss):
        loss.backward()

    def optimizer_step():
        torch.nn.utils.clip_grad_norm_(params, MAX_GRAD_NORM)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    report = train_steps(forward, backward, optimizer_step, warmup=warmup, steps=steps, flops=flops)
    result = {
        "impl": impl, "config": config, "quick": meta["quick"], "inputs": c, "supervised_slots": supervised,
        "objective": dataclasses.asdict(objective), "load_s": load_s,
        "optimizer": {"muon": "trainer.train.optim.DtypeMuon (float32 Newton-Schulz)", "lr": LEARNING_RATE,
                      "weight_decay": WEIGHT_DECAY, "muon_weight_decay": MUON_WEIGHT_DECAY,
                      "momentum": MUON_MOMENTUM, "max_grad_norm": MAX_GRAD_NORM,
                      "muon_params": len(muon_parameter_names(drafter))},
        "machine": machine(), **report,
    }
    write_json(json_out, result)
    print(f"{impl} {config}: first-step loss {result['loss_first_step']:.9g}, median step "
          f"{result['total_s']['median']:.3f} s", flush=True)
    return result


def main(argv=None) -> None:
    parser = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    make = sub.add_parser("make-inputs", help="write the inputs, drafter and verifier both implementations read")
    make.add_argument("--out", type=Path, required=True)
    make.add_argument("--quick", action="store_true", help="tiny shapes (checks the harness in seconds)")
    r = sub.add_parser("run", help="time training steps of this package's trainer")
    r.add_argument("--config", required=True, choices=["small", "large"])
    r.add_argument("--impl", default="ours", choices=["ours", "ours-default"])
    r.add_argument("--inputs", type=Path, required=True)
    r.add_argument("--json", type=Path, required=True)
    r.add_argument("--warmup", type=int, default=2)
    r.add_argument("--steps", type=int, default=5)
    r.add_argument("--no-flops", action="store_true", help="skip the FLOP count of one extra step")
    args = parser.parse_args(argv)
    try:
        if args.command == "make-inputs":
            meta = make_inputs(args.out, args.quick)
            print(f"wrote inputs for {', '.join(meta['configs'])} to {args.out}", flush=True)
        else:
            if args.warmup < 1 or args.steps < 1:
                raise BenchmarkError("--warmup and --steps must be at least 1.")
            read_meta(args.inputs)  # refused before torch and the models are imported
            run(args.config, args.impl, args.inputs, args.json, args.warmup, args.steps, not args.no_flops)
    except BenchmarkError as e:
        fail(str(e))


if __name__ == "__main__":
    sys.exit(run_cli(main))
