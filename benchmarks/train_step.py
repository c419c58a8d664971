"""Training-step benchmark: a DSpark training step of this package against speculators 0.9.0 on identical inputs
and weights. This is this package's side (runs in `.venv`); `benchmarks/speculators_step.py` is the other.

    .venv/bin/python -m benchmarks.run --only train_step [--quick] [--configs small,large] [--reps 2]   # the benchmark
    .venv/bin/python -m benchmarks.train_step compare [--quick] [--json OUT] [...]                      # the same, alone
    .venv/bin/python -m benchmarks.train_step make-inputs --out DIR [--quick]
    .venv/bin/python -m benchmarks.train_step run --config small|large --impl ours|ours-default|ours-default-known \
        --inputs DIR --json OUT

`compare` (the benchmark, `run(args)` of the protocol in benchmarks/common.py) writes the inputs once (reused while
their shapes match), then, per config, runs the three implementations interleaved (ours, speculators,
ours-default, ours, ...: `--reps` each, every run a fresh process): `ours` on the objective matched to speculators',
`ours-default` on the package's default objective (greedy confidence target, full-vocabulary metrics included),
which is the headline (`default_step_speedup`, `default_peak_memory_ratio`); then, once per config,
`ours-default-known`: the default objective with the full-vocabulary pass already known at every position (what
`MemoryRowCache` gives the loss from a row's second visit on, `cache_verifier_states_gb`), its one-time cost
reported as `full_vocabulary_fill_s`. Reported per implementation: the median and min step time over all timed
steps of all repetitions, the forward / backward / optimizer split, supervised slots/s, the peak RSS the timed
steps add over the RSS before them, the first-step loss (ours and speculators must agree to ~1e-5 relative; the
difference is reported as is), and the achieved FLOP/s (FlopCounterMode: matmuls and attention) against the
measured fp32 matmul peak. Speedup = speculators' median / ours; memory ratio = ours / speculators'. Without the
speculators environment (`make speculators-env`) it is unavailable, in one sentence.

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
`--impl ours-default` the package's default objective (full-vocabulary metrics included); `--impl ours-default-known`
the same with a `FullVocabulary` filled by one untimed pass first. Writes a JSON report
(see `benchmarks.common.train_steps`).
"""

import argparse
import dataclasses
import hashlib
import json
import os
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import common
from benchmarks.common import (
    ROOT,
    BenchmarkError,
    Runner,
    fail,
    machine,
    matmul_peak_gflops,
    rel,
    summary,
    train_steps,
    write_json,
)
from benchmarks.common import objective as bench_objective
from trainer.errors import Parser, run_cli

NAME = "train_step"
IN_PROCESS = True  # it starts a fresh process per measurement itself
COMMAND = "python -m benchmarks.train_step compare"  # its command line alone (benchmarks.run records it)
CONFIGS = ("small", "large")
IMPLS = ("ours", "speculators")
# the package's default objective, and the same with the full-vocabulary pass already known (the row cache's
# later epochs: `cache_verifier_states_gb`), run once per config after the interleaved repetitions
OURS_EXTRA = ("ours-default", "ours-default-known")
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
def run_steps(config: str, impl: str, inputs: Path, json_out: Path, warmup: int, steps: int, flops: bool) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from modeling_dspark import DSparkDraftModel
    from trainer.states.in_process import InProcessVerifier
    from trainer.train.anchors import block_supervision
    from trainer.train.loss import dspark_loss
    from trainer.train.optim import MuonWithAdamW, muon_parameter_names
    from trainer.verifier.teacher import FullVocabulary

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
    objective = bench_objective("matched" if impl == "ours" else "default", c["block_size"], c["anchors"])
    optimizer = MuonWithAdamW(drafter.named_parameters(), lr=LEARNING_RATE, weight_decay=WEIGHT_DECAY,
                              muon_weight_decay=MUON_WEIGHT_DECAY, momentum=MUON_MOMENTUM,
                              muon_names=set(muon_parameter_names(drafter)), newton_schulz_dtype="float32")
    params = [p for p in drafter.parameters() if p.requires_grad]
    ids, loss_mask, documents, positions = t["input_ids"], t["loss_mask"], t["document_ids"], t["position_ids"]
    aux, last = t["aux_hidden_states"], t["last_hidden_state"]
    anchors = t["anchors"][None]
    supervised = int(block_supervision(loss_mask, documents, anchors, c["block_size"]).sum())
    load_s = time.perf_counter() - start

    known, fill_s = {}, None
    if impl == "ours-default-known":  # what MemoryRowCache hands the loss once it has seen these positions
        with torch.no_grad():
            known["full_vocabulary"] = FullVocabulary.unknown(*ids.shape, last.dtype)
            fill = time.perf_counter()
            out = drafter(input_ids=ids, aux_hidden_states=aux, anchor_positions=anchors, document_ids=documents,
                          position_ids=positions, return_logits=False)
            dspark_loss(drafter, out, ids, loss_mask, documents, anchors, last, teacher, objective, **known)
            fill_s = time.perf_counter() - fill

    def forward():
        out = drafter(input_ids=ids, aux_hidden_states=aux, anchor_positions=anchors, document_ids=documents,
                      position_ids=positions, return_logits=False)
        loss, _ = dspark_loss(drafter, out, ids, loss_mask, documents, anchors, last, teacher, objective, **known)
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
        "full_vocabulary_known": bool(known), "full_vocabulary_fill_s": fill_s,
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


# ------------------------------------------------------------------------------------------------ the benchmark
def _configs(text: str) -> list[str]:
    configs = [c.strip() for c in text.split(",") if c.strip()]
    if not configs or set(configs) - set(CONFIGS):
        raise argparse.ArgumentTypeError(f"{text!r} is not a subset of {','.join(CONFIGS)}; use e.g. small")
    return [c for c in CONFIGS if c in configs]


def _at_least_1(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is below 1; pass at least 1")
    return value


_at_least_1.__name__ = "int"  # argparse names the type in its message: "invalid int value: 'abc'"


def add_arguments(parser) -> None:
    parser.add_argument("--configs", type=_configs, default=list(CONFIGS), help="configs (default small,large)")
    parser.add_argument("--reps", type=_at_least_1, default=2, help="runs per implementation and config (default 2)")
    parser.add_argument("--warmup", type=_at_least_1, default=None, help="warm-up steps per run (default 2; --quick 1)")
    parser.add_argument("--steps", type=_at_least_1, default=None, help="timed steps per run (default 5; --quick 2)")
    parser.add_argument("--work", type=Path, default=Path("out") / "benchmarks",
                        help="inputs, per-run JSON and logs (default out/benchmarks)")
    parser.add_argument("--fresh-inputs", action="store_true", help="rebuild the inputs even if they match")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds per subprocess (default 3600)")
    common.speculators_python_argument(parser)


def unavailable(args) -> str | None:
    if not os.path.isfile(args.speculators_python):
        return (f"no speculators 0.9.0 environment at {rel(args.speculators_python)} (the train_step comparison runs "
                f"speculators' side there); create it with `make speculators-env` or pass --speculators-python.")
    return None


def run(args) -> dict:
    """The comparison: inputs, then every run in a fresh process, then the summaries and the table."""
    warmup = args.warmup if args.warmup is not None else (1 if args.quick else 2)
    steps = args.steps if args.steps is not None else (2 if args.quick else 5)
    work = args.work if args.work.is_absolute() else ROOT / args.work
    runner = Runner(work, 1 + len(args.configs) * ((len(IMPLS) + 1) * args.reps + 1))
    import torch

    print(f"measuring the fp32 matmul peak ({common.cpu_model()}, {torch.get_num_threads()} threads) ...", flush=True)
    matmul = matmul_peak_gflops()
    inputs = work / ("inputs-quick" if args.quick else "inputs")
    if args.fresh_inputs or not inputs_match(inputs, args.quick):
        runner("make inputs", [sys.executable, "-m", "benchmarks.train_step", "make-inputs", "--out", str(inputs)]
               + (["--quick"] if args.quick else []), "make-inputs")
    else:
        runner.note("make inputs", f"reusing {rel(inputs)}")
    meta = read_meta(inputs)
    timing = ["--warmup", str(warmup), "--steps", str(steps)]
    runs: dict[str, dict[str, list[dict]]] = {c: {i: [] for i in (*IMPLS, *OURS_EXTRA)} for c in args.configs}
    for config in args.configs:
        order = [(impl, rep) for rep in range(args.reps) for impl in (*IMPLS, "ours-default")]
        order.append(("ours-default-known", 0))
        for impl, rep in order:
            name = f"{config}-{impl}-{rep + 1}"
            out = work / "runs" / f"{name}.json"
            out.unlink(missing_ok=True)
            if impl == "speculators":
                command = [str(args.speculators_python), "-m", "benchmarks.speculators_step"]
            else:
                command = [sys.executable, "-m", "benchmarks.train_step", "run", "--impl", impl]
            command += ["--config", config, "--inputs", str(inputs), "--json", str(out), *timing]
            if rep:  # the FLOPs of a step do not change between repetitions: count them once
                command.append("--no-flops")
            reps = 1 if impl == "ours-default-known" else args.reps
            runner(f"{config} {impl} (repetition {rep + 1}/{reps})", command, name, timeout=args.timeout)
            runs[config][impl].append(json.loads(out.read_text()))
    summaries = {config: summarize(runs[config], matmul) for config in args.configs}
    section = {"inputs": rel(inputs), "meta": meta, "matmul_peak": matmul, "warmup": warmup, "steps": steps,
               "reps": args.reps, "summary": summaries, "runs": runs}
    section["table"] = table_rows(section, matmul)
    return section


def summarize(runs: dict[str, list[dict]], matmul: dict) -> dict:
    """Per-implementation statistics over all timed steps of all repetitions, and the comparisons."""
    out: dict = {}
    for impl, reps in runs.items():
        if not reps:
            continue
        steps = [s for r in reps for s in r["steps"]]
        slots = reps[0]["supervised_slots"]
        total = summary([s["total_s"] for s in steps])
        deltas = [r["peak_rss_delta_bytes"] for r in reps if r.get("peak_rss_delta_bytes") is not None]
        flops = reps[0].get("flops", {}).get("total")
        entry = {
            "repetitions": len(reps), "timed_steps": len(steps), "supervised_slots": slots,
            "step_s": total,
            **{phase: summary([s[f"{phase}_s"] for s in steps]) for phase in ("forward", "backward", "optimizer")},
            "slots_per_s": slots / total["median"] if total["median"] else None,
            "peak_rss_delta_bytes": summary(deltas),
            "peak_rss_bytes": summary([r["peak_rss_bytes"] for r in reps if r.get("peak_rss_bytes") is not None]),
            "loss_first_step": [r["loss_first_step"] for r in reps],
            "flops_per_step": flops,
            "flops_by_phase": reps[0].get("flops"),
            "achieved_gflops": flops / total["median"] / 1e9 if flops and total["median"] else None,
            "max_load_average": max(max(r.get("load_average_before", 0), r.get("load_average_after", 0))
                                    for r in reps),
            "cpu_utilization": summary([r["cpu_utilization"] for r in reps if r.get("cpu_utilization")]),
        }
        if entry["achieved_gflops"] and matmul.get("gflops"):
            entry["fraction_of_matmul_peak"] = entry["achieved_gflops"] / matmul["gflops"]
        out[impl] = entry
    ours, theirs = out.get("ours"), out.get("speculators")
    if ours and theirs:
        out["step_speedup"] = theirs["step_s"]["median"] / ours["step_s"]["median"]
        out["step_speedup_min"] = theirs["step_s"]["min"] / ours["step_s"]["min"]
        a, b = ours["peak_rss_delta_bytes"]["median"], theirs["peak_rss_delta_bytes"]["median"]
        out["peak_memory_ratio"] = a / b if a is not None and b else None
        la, lb = ours["loss_first_step"][0], theirs["loss_first_step"][0]
        out["loss_first_step"] = {"ours": la, "speculators": lb, "abs_diff": abs(la - lb),
                                  "rel_diff": abs(la - lb) / abs(lb) if lb else None}
    known = out.get("ours-default-known")
    if known and theirs:
        out["known_step_speedup"] = theirs["step_s"]["median"] / known["step_s"]["median"]
        out["full_vocabulary_fill_s"] = runs["ours-default-known"][0].get("full_vocabulary_fill_s")
    default = out.get("ours-default")
    if ours and default:
        out["default_objective_cost"] = default["step_s"]["median"] / ours["step_s"]["median"]
    if default and theirs:  # the headline: what a user running the defaults gets
        out["default_step_speedup"] = theirs["step_s"]["median"] / default["step_s"]["median"]
        a, b = default["peak_rss_delta_bytes"]["median"], theirs["peak_rss_delta_bytes"]["median"]
        out["default_peak_memory_ratio"] = a / b if a is not None and b else None
    return out


def table_rows(section: dict, matmul: dict) -> list[list]:
    """The table: per config, each implementation's step, throughput, memory and FLOP/s, then the comparisons."""
    rows = []
    mib = 2**20
    for config, s in section["summary"].items():
        c = section["meta"]["configs"][config]
        rows.append([f"{config}: T {c['tokens']}, {c['anchors']} anchors x B {c['block_size']}",
                     c["supervised_slots"], "slots", "one packed row of 4 documents"])
        for impl in (*IMPLS, *OURS_EXTRA):
            e = s.get(impl)
            if not e:
                continue
            rows.append([f"  {impl} step", round(e["step_s"]["median"], 4), "s",
                         f"median of {e['timed_steps']} steps ({e['repetitions']} run{'s' if e['repetitions'] > 1 else ''}), "
                         f"min {e['step_s']['min']:.4f}; "
                         f"fwd {e['forward']['median']:.4f} / bwd {e['backward']['median']:.4f} / "
                         f"opt {e['optimizer']['median']:.4f}"])
            rows.append([f"  {impl} throughput", round(e["slots_per_s"], 1), "slots/s",
                         f"CPU {e['cpu_utilization']['median']:.2f} s per s of wall time, 1-min load average up to "
                         f"{e['max_load_average']:.1f}" if e["cpu_utilization"]["median"] else ""])
            peak = e["peak_rss_delta_bytes"]["median"]
            process = e["peak_rss_bytes"]["max"]
            rows.append([f"  {impl} peak memory", round(peak / mib, 1) if peak is not None else None, "MiB",
                         "peak RSS of the timed steps over the RSS before them (process peak "
                         f"{process / 2**30:.2f} GiB)" if process else "peak RSS of the timed steps over the RSS "
                         "before them"])
            if e.get("achieved_gflops"):
                rows.append([f"  {impl} achieved", round(e["achieved_gflops"], 1), "GFLOP/s",
                             f"{e['flops_per_step'] / 1e9:.1f} GFLOP/step counted, "
                             f"{100 * e.get('fraction_of_matmul_peak', 0):.0f}% of the 2048^2 fp32 matmul rate"])
        if "step_speedup" in s:
            rows.append(["  step speedup vs speculators", round(s["step_speedup"], 3), "x",
                         f"speculators median / ours median (min / min: {s['step_speedup_min']:.3f}x)"])
            ratio = s["peak_memory_ratio"]
            rows.append(["  peak memory ratio", round(ratio, 3) if ratio is not None else None, "ours/speculators",
                         ""])
            loss = s["loss_first_step"]
            rows.append(["  first-step loss difference", f"{loss['rel_diff']:.2e}", "relative",
                         f"ours {loss['ours']:.9g}, speculators {loss['speculators']:.9g}"])
        if "default_objective_cost" in s:
            rows.append(["  default objective cost", round(s["default_objective_cost"], 3), "x ours",
                         "ours-default / ours median step (full-vocabulary metrics)"])
        if "default_step_speedup" in s:
            ratio = s["default_peak_memory_ratio"]
            rows.append(["  default objective: step speedup vs speculators", round(s["default_step_speedup"], 3), "x",
                         "speculators median / ours-default median (the headline)"])
            rows.append(["  default objective: peak memory ratio", round(ratio, 3) if ratio is not None else None,
                         "ours-default/speculators", ""])
        if "known_step_speedup" in s:
            rows.append(["  default objective, full-vocabulary pass known: step speedup vs speculators",
                         round(s["known_step_speedup"], 3), "x",
                         f"the row cache's later epochs; filling it took {s['full_vocabulary_fill_s']:.3f} s once"])
    rows.append(["fp32 matmul peak", round(matmul["gflops"], 1), "GFLOP/s",
                 f"{matmul['n']}x{matmul['n']}, best of {matmul['repeats']}, {matmul['threads']} threads (a reference, "
                 f"not a bound: larger GEMMs can run faster)"])
    return rows


def main(argv=None) -> None:
    parser = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    make = sub.add_parser("make-inputs", help="write the inputs, drafter and verifier both implementations read")
    make.add_argument("--out", type=Path, required=True)
    make.add_argument("--quick", action="store_true", help="tiny shapes (checks the harness in seconds)")
    r = sub.add_parser("run", help="time training steps of this package's trainer")
    r.add_argument("--config", required=True, choices=["small", "large"])
    r.add_argument("--impl", default="ours", choices=["ours", *OURS_EXTRA])
    r.add_argument("--inputs", type=Path, required=True)
    r.add_argument("--json", type=Path, required=True)
    r.add_argument("--warmup", type=int, default=2)
    r.add_argument("--steps", type=int, default=5)
    r.add_argument("--no-flops", action="store_true", help="skip the FLOP count of one extra step")
    common.protocol_parser(sys.modules[__name__], sub.add_parser(
        "compare", help="the benchmark: ours against speculators on the same inputs (what benchmarks.run runs)"))
    args = parser.parse_args(argv)
    try:
        if args.command == "compare":
            common.execute(sys.modules[__name__], args, "python -m benchmarks.train_step " + " ".join(
                sys.argv[1:] if argv is None else argv))
        elif args.command == "make-inputs":
            meta = make_inputs(args.out, args.quick)
            print(f"wrote inputs for {', '.join(meta['configs'])} to {args.out}", flush=True)
        else:
            if args.warmup < 1 or args.steps < 1:
                raise BenchmarkError("--warmup and --steps must be at least 1.")
            read_meta(args.inputs)  # refused before torch and the models are imported
            run_steps(args.config, args.impl, args.inputs, args.json, args.warmup, args.steps, not args.no_flops)
    except BenchmarkError as e:
        fail(str(e))


if __name__ == "__main__":
    sys.exit(run_cli(main))
