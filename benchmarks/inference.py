"""Inference-side costs on a real small verifier, SmolLM2-135M-Instruct (fp32, CPU, offline):

    python -m benchmarks.inference --json OUT [--quick] [--drafter DIR] [--max-new-tokens 64] [--prompts 3]

(a) hidden-state extraction in process: tokens/s of `trainer.states.in_process.InProcessVerifier.states` on one
    packed row of 4 documents x 512 tokens with the demo's aux layer ids, next to one plain decoder forward of
    the same documents as a batch (what `states` costs on top of the forward itself);
(b) `draft()` latency per block for a drafter of the demo's shape (configs/smollm2-135m.yaml, read through
    `trainer.config.RunConfig`; random weights unless `--drafter` names a trained one, then `attach_verifier`):
    steady state (a 512-token draft cache, 2 newly verified tokens per call, as in generation) and cold (the
    whole 512-token context projected in the call), plus the top torch ops of the steady-state calls;
(c) in-process speculative generation at T = 0 (`generation_dspark.speculative_generate`) against the verifier alone (`generate`,
    greedy, same prompts and max_new_tokens): tokens/s, whether the outputs are identical (they must be), and the
    share of the speculative steps' wall time spent outside the verifier's forward, `overhead = 1 -
    verifier_forward_time / total` (forward calls timed with hooks on the verifier; the prefill is excluded),
    split into `draft()`, `speculative_accept` and the rest, plus a cProfile of one speculative generation:
    the functions of modeling_dspark.py and generation_dspark.py and the builtins that take the time outside the
    verifier.

A random drafter accepts almost nothing (acceptance length ~1.0), so (c)'s speculative tokens/s is below the
verifier's; the overhead share is what this measures. The target is overhead <= 10%.
"""

from __future__ import annotations

import cProfile
import os
import pstats
import statistics
import sys
import time
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks import common  # noqa: E402
from benchmarks.common import busy_warning  # noqa: E402
from trainer.errors import UsageError  # noqa: E402

NAME = "inference"

VERIFIER = "HuggingFaceTB/SmolLM2-135M-Instruct"
DEMO_CONFIG = os.path.join(ROOT, "configs", "smollm2-135m.yaml")
PROMPT_DIR = os.path.join(ROOT, "data", "demo", "heldout")
FULL = dict(documents=4, doc_tokens=512, extract_repeats=3, context=512, draft_calls=40, new_per_call=2,
            prompts=3, max_new_tokens=64)
QUICK = dict(documents=2, doc_tokens=64, extract_repeats=2, context=64, draft_calls=6, new_per_call=2,
             prompts=1, max_new_tokens=12)
OVERHEAD_TARGET = 0.10


# ------------------------------------------------------------------------------------------------ helpers
class ForwardTimer:
    """Wall time of every forward call of a module (pre-hook starts the clock, forward hook stops it)."""

    def __init__(self, module):
        self.module = module
        self.calls: list[tuple[float, float]] = []  # (start, end) perf_counter stamps
        self._start = None
        self._handles = []

    def __enter__(self):
        self.calls.clear()

        def pre(module, args, kwargs):
            self._start = time.perf_counter()

        def post(module, args, kwargs, output):
            self.calls.append((self._start, time.perf_counter()))

        self._handles = [self.module.register_forward_pre_hook(pre, with_kwargs=True),
                         self.module.register_forward_hook(post, with_kwargs=True)]
        return self

    def __exit__(self, *exc):
        for h in self._handles:
            h.remove()
        self._handles = []

    def total(self, skip_first: bool = False) -> float:
        calls = self.calls[1:] if skip_first else self.calls
        return sum(end - start for start, end in calls)


class CallTimer:
    """Accumulated wall time of a wrapped callable."""

    def __init__(self, fn):
        self.fn, self.seconds, self.count = fn, 0.0, 0

    def __call__(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - start
            self.count += 1


# ------------------------------------------------------------------------------------------------ setup
def load_models(drafter_dir: str | None, seed: int = 0):
    import torch
    from transformers import AutoTokenizer

    from configuration_dspark import DSparkConfig
    from modeling_dspark import DSparkDraftModel
    from trainer.config import RunConfig
    from trainer.verifier.loading import load_verifier
    from trainer.verifier.small_models import resolve_model

    path = resolve_model(VERIFIER)
    verifier = load_verifier(path, dtype="float32", device="cpu")
    tokenizer = AutoTokenizer.from_pretrained(path)
    run = RunConfig.load(DEMO_CONFIG, [])
    if drafter_dir:
        drafter = DSparkDraftModel.from_pretrained(drafter_dir, dtype=torch.float32)
        origin = f"trained drafter {drafter_dir}"
    else:
        config = DSparkConfig.from_verifier(verifier, verifier_name_or_path=VERIFIER, tokenizer=tokenizer,
                                            **run.model.architecture_overrides())
        torch.manual_seed(seed)
        drafter = DSparkDraftModel(config)
        if config.uses_draft_vocab:
            g = torch.Generator().manual_seed(seed)
            drafter.set_draft_vocab(torch.randperm(config.vocab_size, generator=g)[: config.draft_vocab_size].sort().values)
        origin = "random init (demo shape)"
    drafter.attach_verifier(verifier)
    drafter.config._attn_implementation = "sdpa"
    drafter.eval()
    cfg = drafter.config
    shape = dict(layers=cfg.num_hidden_layers, hidden=cfg.hidden_size,
                 intermediate=cfg.transformer_layer_config["intermediate_size"],
                 heads=cfg.transformer_layer_config["num_attention_heads"],
                 kv_heads=cfg.transformer_layer_config["num_key_value_heads"], block=cfg.block_size,
                 aux_ids=list(cfg.aux_hidden_state_layer_ids), draft_vocab=cfg.draft_vocab_size,
                 markov_rank=cfg.markov_rank, confidence_head=cfg.enable_confidence_head, origin=origin)
    return verifier, tokenizer, drafter, run, shape


def chat_prompts(tokenizer, count: int) -> list:
    """The first prompt of `count` held-out subsets (data/demo/heldout), rendered with the chat template."""
    from trainer.evaluation.prompts import load_prompt_sets

    sets = load_prompt_sets(PROMPT_DIR, limit=1)
    names = sorted(sets)[:count]
    out = []
    for name in names:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": sets[name][0]}], add_generation_prompt=True,
                                            tokenize=True, return_dict=True, return_tensors="pt")["input_ids"]
        out.append((name, ids))
    return out


# ------------------------------------------------------------------------------------------------ (a)
def bench_extraction(verifier, aux_ids, sizes) -> tuple[dict, list]:
    import torch

    from modeling_dspark import positions_from_document_ids, verifier_decoder
    from trainer.states.in_process import InProcessVerifier

    docs, per_doc, repeats = sizes["documents"], sizes["doc_tokens"], sizes["extract_repeats"]
    g = torch.Generator().manual_seed(0)
    vocab = verifier.config.vocab_size
    input_ids = torch.randint(0, vocab, (1, docs * per_doc), generator=g)
    document_ids = torch.arange(docs).repeat_interleave(per_doc).unsqueeze(0)
    batch = dict(input_ids=input_ids, document_ids=document_ids, position_ids=positions_from_document_ids(document_ids))
    source = InProcessVerifier(verifier, aux_ids)
    tokens = docs * per_doc

    def timed(fn) -> list[float]:
        fn()  # warm-up
        out = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            out.append(time.perf_counter() - start)
        return out

    states_s = timed(lambda: source.states(batch))
    decoder = verifier_decoder(verifier)
    as_batch = input_ids.view(docs, per_doc)

    def plain():
        with torch.no_grad():
            decoder(input_ids=as_batch, use_cache=False)

    plain_s = timed(plain)
    res = dict(tokens=tokens, documents=docs, doc_tokens=per_doc, aux_ids=list(aux_ids), states_s=states_s,
               plain_forward_s=plain_s, states_tokens_per_s=tokens / statistics.median(states_s),
               plain_tokens_per_s=tokens / statistics.median(plain_s))
    res["states_over_plain"] = statistics.median(states_s) / statistics.median(plain_s)
    rows = [
        ["(a) InProcessVerifier.states", res["states_tokens_per_s"], "tokens/s",
         f"{docs} docs x {per_doc} tokens packed in one row, aux ids {list(aux_ids)}; median of {repeats}"],
        ["(a) plain decoder forward, same docs", res["plain_tokens_per_s"], "tokens/s",
         f"[{docs}, {per_doc}] batch, no mask, no capture; states/plain time {res['states_over_plain']:.3f}x"],
    ]
    return res, rows


# ------------------------------------------------------------------------------------------------ (b)
def bench_draft(verifier, drafter, tokenizer, sizes) -> tuple[dict, list]:
    import torch

    from modeling_dspark import DSparkDraftCache
    from trainer.states.in_process import verifier_hidden_states

    context, calls, new = sizes["context"], sizes["draft_calls"], sizes["new_per_call"]
    g = torch.Generator().manual_seed(1)
    total = context + calls * new
    ids = torch.randint(0, verifier.config.vocab_size, (1, total), generator=g)
    aux, _ = verifier_hidden_states(verifier, drafter.config.aux_hidden_state_layer_ids, ids)
    aux = aux[0]

    def steady() -> list[float]:
        cache = DSparkDraftCache()
        drafter.draft(aux[:context], ids[0, context], cache=cache, temperature=0.0)
        out = []
        for i in range(calls):
            lo = context + i * new
            start = time.perf_counter()
            drafter.draft(aux[lo: lo + new], ids[0, lo + new - 1], cache=cache, temperature=0.0)
            out.append(time.perf_counter() - start)
        return out

    steady()  # warm-up
    steady_s = steady()
    cold_s = []
    for _ in range(3):
        start = time.perf_counter()
        drafter.draft(aux[:context], ids[0, context], temperature=0.0)
        cold_s.append(time.perf_counter() - start)

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        steady()
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total_us = sum(e.self_cpu_time_total for e in events) or 1.0
    top_ops = [dict(op=e.key, calls=e.count // (calls + 1), self_ms=e.self_cpu_time_total / 1e3 / (calls + 1),
                    share=e.self_cpu_time_total / total_us) for e in events[:12]]
    res = dict(context=context, new_tokens_per_call=new, calls=calls, steady_s=steady_s,
               steady_median_ms=statistics.median(steady_s) * 1e3, cold_s=cold_s,
               cold_median_ms=statistics.median(cold_s) * 1e3, block=drafter.config.block_size,
               top_ops_per_call=top_ops, profiled_ms_per_call=total_us / 1e3 / (calls + 1))
    rows = [
        ["(b) draft() latency per block, steady", res["steady_median_ms"], "ms",
         f"block {res['block']}, {context}-token cache, {new} new tokens per call; median of {calls}"],
        ["(b) draft() latency per block, cold", res["cold_median_ms"], "ms",
         f"whole {context}-token context projected in the call; median of 3"],
    ]
    return res, rows


# ------------------------------------------------------------------------------------------------ (c)
def bench_generation(verifier, drafter, tokenizer, sizes) -> tuple[dict, list, dict]:
    import torch

    import generation_dspark
    from trainer.verifier.loading import generation_kwargs

    max_new = sizes["max_new_tokens"]
    prompts = chat_prompts(tokenizer, sizes["prompts"])
    kwargs = generation_kwargs({"temperature": 0.0}, max_new, tokenizer.pad_token_id or tokenizer.eos_token_id)

    def baseline(ids):
        with torch.no_grad():
            return verifier.generate(ids, **kwargs)

    def speculative(ids):
        return generation_dspark.speculative_generate(drafter, verifier, ids, max_new_tokens=max_new, temperature=0.0)

    # warm-up both paths on a short run
    short = prompts[0][1]
    verifier.generate(short, **dict(kwargs, max_new_tokens=4))
    generation_dspark.speculative_generate(drafter, verifier, short, max_new_tokens=4, temperature=0.0)

    per_prompt = []
    accept_timer = CallTimer(generation_dspark.speculative_accept)
    draft_timer = CallTimer(drafter.draft)
    for name, ids in prompts:
        with ForwardTimer(verifier) as vt:
            start = time.perf_counter()
            base = baseline(ids)
            base_s = time.perf_counter() - start
        base_forward = vt.total()
        base_calls = len(vt.calls)
        accept_timer.seconds = draft_timer.seconds = 0.0
        accept_timer.count = draft_timer.count = 0
        generation_dspark.speculative_accept = accept_timer
        drafter.draft = draft_timer  # speculative_generate calls drafter.draft: the instance attribute wins
        try:
            with ForwardTimer(verifier) as vt:
                start = time.perf_counter()
                spec = speculative(ids)
                end = time.perf_counter()
        finally:
            generation_dspark.speculative_accept = accept_timer.fn
            del drafter.draft
        prefill_end = vt.calls[0][1]
        steps_wall = end - prefill_end
        steps_forward = vt.total(skip_first=True)
        new_base = base.shape[1] - ids.shape[1]
        new_spec = spec.sequences.shape[1] - ids.shape[1]
        per_prompt.append(dict(
            subset=name, prompt_tokens=ids.shape[1], baseline_s=base_s, baseline_new_tokens=new_base,
            baseline_forward_s=base_forward, baseline_forward_calls=base_calls, speculative_s=end - start,
            speculative_new_tokens=new_spec, prefill_s=vt.calls[0][1] - vt.calls[0][0], steps=len(spec.committed_per_step),
            steps_wall_s=steps_wall, steps_verifier_forward_s=steps_forward, steps_draft_s=draft_timer.seconds,
            steps_accept_s=accept_timer.seconds,
            acceptance_length=sum(spec.committed_per_step) / max(len(spec.committed_per_step), 1),
            identical=bool(torch.equal(base[0, : spec.sequences.shape[1]], spec.sequences[0, : base.shape[1]])
                           and new_base == new_spec)))

    def tot(key):
        return sum(p[key] for p in per_prompt)

    steps_wall = tot("steps_wall_s")
    overhead = 1.0 - tot("steps_verifier_forward_s") / steps_wall
    res = dict(
        prompts=[p["subset"] for p in per_prompt], max_new_tokens=max_new, per_prompt=per_prompt,
        baseline_tokens_per_s=tot("baseline_new_tokens") / tot("baseline_s"),
        speculative_tokens_per_s=tot("speculative_new_tokens") / tot("speculative_s"),
        acceptance_length=sum(p["acceptance_length"] * p["steps"] for p in per_prompt) / max(tot("steps"), 1),
        identical=all(p["identical"] for p in per_prompt), steps=tot("steps"),
        overhead=overhead, overhead_target=OVERHEAD_TARGET,
        overhead_whole_call=1.0 - (tot("steps_verifier_forward_s") + tot("prefill_s")) / tot("speculative_s"),
        share_verifier_forward=tot("steps_verifier_forward_s") / steps_wall,
        share_draft=tot("steps_draft_s") / steps_wall, share_accept=tot("steps_accept_s") / steps_wall,
        ms_per_step=dict(total=steps_wall / max(tot("steps"), 1) * 1e3,
                         verifier_forward=tot("steps_verifier_forward_s") / max(tot("steps"), 1) * 1e3,
                         draft=tot("steps_draft_s") / max(tot("steps"), 1) * 1e3,
                         accept=tot("steps_accept_s") / max(tot("steps"), 1) * 1e3),
        baseline_overhead=1.0 - tot("baseline_forward_s") / tot("baseline_s"),
        baseline_ms_per_forward=tot("baseline_forward_s") / max(tot("baseline_forward_calls"), 1) * 1e3,
    )
    res["share_other"] = 1.0 - res["share_verifier_forward"] - res["share_draft"] - res["share_accept"]
    profile = profile_generation(verifier, drafter, prompts[0][1], max_new)
    res["profile"] = profile
    ms = res["ms_per_step"]
    rows = [
        ["(c) verifier alone (generate, greedy)", res["baseline_tokens_per_s"], "tokens/s",
         f"{len(per_prompt)} prompts x {max_new} new tokens; {res['baseline_ms_per_forward']:.1f} ms per forward; "
         f"generate's own overhead {res['baseline_overhead']:.1%}"],
        ["(c) speculative_generate T=0", res["speculative_tokens_per_s"], "tokens/s",
         f"acceptance length {res['acceptance_length']:.3f} ({drafter_origin(drafter)}); outputs identical: "
         f"{res['identical']}"],
        ["(c) speculative speedup", res["speculative_tokens_per_s"] / res["baseline_tokens_per_s"], "x", ""],
        ["(c) overhead outside the verifier forward", overhead, "share",
         f"{'OK' if overhead <= OVERHEAD_TARGET else 'ABOVE'} target {OVERHEAD_TARGET:.0%}; steps only (prefill "
         f"excluded); {ms['total']:.1f} ms/step = verifier {ms['verifier_forward']:.1f} + draft() {ms['draft']:.1f} + "
         f"accept {ms['accept']:.2f} + other {ms['total'] - ms['verifier_forward'] - ms['draft'] - ms['accept']:.2f}"],
        ["(c) step share: draft()", res["share_draft"], "share", ""],
        ["(c) step share: speculative_accept", res["share_accept"], "share", ""],
        ["(c) step share: other (generation loop)", res["share_other"], "share",
         "distribution(), q scatter, cache crop, capture concat, Python loop"],
    ]
    for item in profile["modeling_dspark"][:6]:
        rows.append([f"(c) profile: {item['function']}", item["share_of_non_verifier"], "share",
                     f"cumulative, of the time outside the verifier forward (cProfile); {item['calls']} calls"])
    return res, rows, profile


def drafter_origin(drafter) -> str:
    return "random drafter" if getattr(drafter, "_benchmark_random", True) else "trained drafter"


def profile_generation(verifier, drafter, ids, max_new) -> dict:
    """cProfile one speculative generation; report what takes the time outside the verifier's forward."""
    import generation_dspark

    prof = cProfile.Profile()
    start = time.perf_counter()
    prof.enable()
    generation_dspark.speculative_generate(drafter, verifier, ids, max_new_tokens=max_new, temperature=0.0)
    prof.disable()
    wall = time.perf_counter() - start
    stats = pstats.Stats(prof)
    raw = stats.stats  # (file, line, name) -> (primitive calls, calls, tottime, cumtime, callers)
    verifier_cls = type(verifier).__name__
    total = sum(v[2] for v in raw.values())
    # the verifier's forward: the cumulative time of the top-level module call of the verifier
    top = [(k, v) for k, v in raw.items() if k[2] == "speculative_generate"]
    gen_cum = top[0][1][3] if top else total
    # the verifier calls are the module calls made directly by speculative_generate
    verifier_cum = 0.0
    for key, value in raw.items():
        if key[2] == "_wrapped_call_impl" and key[0].endswith("module.py"):
            for caller, cstats in value[4].items():
                if caller[2] == "speculative_generate":
                    verifier_cum += cstats[3]
    non_verifier = max(gen_cum - verifier_cum, 1e-9)
    ours = []
    for (file, line, name), (_, nc, tt, ct, _) in raw.items():
        if os.path.basename(file) in ("modeling_dspark.py", "generation_dspark.py") and name != "speculative_generate":
            ours.append(dict(function=f"{name} ({os.path.basename(file)}:{line})", calls=nc, cumulative_s=ct, self_s=tt,
                             share_of_non_verifier=ct / non_verifier))
    ours.sort(key=lambda d: d["cumulative_s"], reverse=True)
    # self time of every function and builtin over the whole call (the verifier's own ops included)
    selfs = []
    for (file, line, name), (_, nc, tt, _, _) in raw.items():
        label = name if file == "~" else f"{name} ({os.path.basename(file)}:{line})"
        selfs.append(dict(function=label, calls=nc, self_s=tt, share_of_total=tt / max(total, 1e-9)))
    selfs.sort(key=lambda d: d["self_s"], reverse=True)
    return dict(wall_s=wall, profiled_total_s=gen_cum, verifier_forward_cumulative_s=verifier_cum,
                non_verifier_s=non_verifier, non_verifier_share=non_verifier / max(gen_cum, 1e-9),
                verifier=verifier_cls, modeling_dspark=ours[:15], top_self=selfs[:15],
                note="cProfile inflates Python-heavy code; shares are of the profiled call")


# ------------------------------------------------------------------------------------------------ main
def add_arguments(parser) -> None:
    """`--quick` (the protocol's): small sizes (about a minute), for checking the harness."""
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads (default: torch's); on a shared machine --threads 1 is far steadier")
    parser.add_argument("--drafter", default=None, help="a trained drafter directory (default: random init, demo shape)")
    parser.add_argument("--max-new-tokens", type=int, default=None)
    parser.add_argument("--prompts", type=int, default=None, help="held-out prompts for (c) (one per subset)")
    parser.add_argument("--skip", default="", help="comma-separated parts to skip: a,b,c")


def run(args) -> dict:
    sizes = dict(QUICK if args.quick else FULL)
    if args.max_new_tokens is not None:
        sizes["max_new_tokens"] = args.max_new_tokens
    if args.prompts is not None:
        sizes["prompts"] = args.prompts
    if sizes["max_new_tokens"] < 2 or sizes["prompts"] < 1:
        raise UsageError(f"--max-new-tokens {sizes['max_new_tokens']} / --prompts {sizes['prompts']} is out of range; "
                         f"pass --max-new-tokens >= 2 and --prompts >= 1.")
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    if args.drafter:
        from trainer.verifier.loading import resolve_drafter

        resolve_drafter(args.drafter)  # refused before the verifier loads
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    busy_warning()
    warnings.filterwarnings("ignore", category=UserWarning, module="transformers")
    started = time.time()
    print("loading SmolLM2-135M-Instruct and the drafter ...", flush=True)
    verifier, tokenizer, drafter, _, shape = load_models(args.drafter)
    drafter._benchmark_random = args.drafter is None
    out = dict(benchmark="inference", quick=args.quick, sizes=sizes, drafter=shape, verifier=VERIFIER,
               torch=torch.__version__, threads=torch.get_num_threads(), cpu_count=os.cpu_count())
    table = []
    if "a" not in skip:
        print("(a) hidden-state extraction ...", flush=True)
        out["extraction"], rows = bench_extraction(verifier, drafter.config.aux_hidden_state_layer_ids, sizes)
        table += rows
    if "b" not in skip:
        print("(b) draft() latency ...", flush=True)
        out["draft"], rows = bench_draft(verifier, drafter, tokenizer, sizes)
        table += rows
    if "c" not in skip:
        print("(c) speculative generation vs the verifier alone ...", flush=True)
        out["generation"], rows, profile = bench_generation(verifier, drafter, tokenizer, sizes)
        table += rows
    out["load_average"] = os.getloadavg()
    out["seconds"] = time.time() - started
    out["table"] = table
    return out


def describe(out: dict) -> None:
    if "draft" in out:
        print("\n(b) top torch ops per steady-state draft() call (self CPU):")
        for op in out["draft"]["top_ops_per_call"][:8]:
            print(f"  {op['op']:<40} {op['self_ms']:8.3f} ms  {op['share']:6.1%}  x{op['calls']}")
    if "generation" in out:
        prof = out["generation"]["profile"]
        print(f"\n(c) cProfile of one speculative generation: {prof['profiled_total_s']:.2f} s, of which "
              f"{prof['non_verifier_share']:.1%} outside the verifier forward; modeling_dspark.py/generation_dspark.py by cumulative time:")
        for item in prof["modeling_dspark"][:10]:
            print(f"  {item['function']:<60} {item['cumulative_s'] * 1e3:9.1f} ms  "
                  f"{item['share_of_non_verifier']:6.1%}  x{item['calls']}")


if __name__ == "__main__":
    common.main(sys.modules[__name__])
