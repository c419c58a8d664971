"""The fidelity check: the drafter's training forward, teacher-forced on a greedy speculative generation with one
block at each actual verification step, predicts exactly the acceptance that `draft()` + verification measured.

Real verifiers and drafters throughout. A random drafter almost never gets past slot 0, so most tests use a
*bigram* drafter: a random backbone whose Markov head holds a (deliberately incomplete) bigram table of the
verifier's own greedy continuations. Its drafts then run long and break off where the table has no entry, so
steps accept 0..B drafts, and the Markov chain (the previous draft when drafting, `x[p+k]` in training) is what
decides every accepted run.
"""

import warnings

import pytest
import torch

from generation_dspark import speculative_generate
from tiny import VOCAB, tiny_drafter, tiny_gemma4_verifier, tiny_qwen3_verifier
from trainer.evaluation.in_process import FidelityWarning, evaluate_in_process, step_anchors, teacher_forced_acceptance


def bigram_drafter(verifier, references: list[list[int]], keep: float = 0.7, seed: int = 0, scale: float = 1000.0,
                   draft_vocab_size: int | None = None, **overrides):
    """A random drafter whose Markov head maps each previous token of a random `keep` share of the references'
    bigrams to its successor with logit bias `scale` (far above the random backbone's logits), and gives every
    other token no bias. With `draft_vocab_size`, the draft vocabulary is the references' tokens plus random
    others (so the draft-to-verifier id mapping is exercised on accepted runs)."""
    g = torch.Generator().manual_seed(seed)
    table: dict[int, int] = {}
    for ref in references:
        for a, b in zip(ref[:-1], ref[1:]):
            table.setdefault(a, b)
    entries = [(a, b) for a, b in table.items() if float(torch.rand((), generator=g)) < keep]
    drafter = tiny_drafter(verifier, seed=seed, draft_vocab_size=draft_vocab_size, markov_rank=len(entries),
                           **overrides)
    if draft_vocab_size is not None:
        used = sorted({t for ref in references for t in ref})
        rest = [t for t in torch.randperm(drafter.config.vocab_size, generator=g).tolist() if t not in set(used)]
        drafter.set_draft_vocab(sorted(used + rest[: draft_vocab_size - len(used)]))
    with torch.no_grad():
        w1, w2 = drafter.markov_head.markov_w1.weight, drafter.markov_head.markov_w2.weight
        w1.zero_()
        w2.zero_()
        for j, (a, b) in enumerate(entries):
            w1[a, j] = 1.0
            w2[int(drafter.verifier_to_draft_ids(torch.tensor(b))), j] = scale
    return drafter


def greedy_references(verifier, prompts: list[torch.Tensor], max_new_tokens: int) -> list[list[int]]:
    """The verifier's own greedy continuations (from the last prompt token on)."""
    refs = []
    for ids in prompts:
        out = verifier.generate(ids, do_sample=False, max_new_tokens=max_new_tokens, temperature=None, top_p=None,
                                top_k=None, pad_token_id=0)
        refs.append(out[0, ids.shape[1] - 1:].tolist())
    return refs


def random_prompts(n: int) -> list[torch.Tensor]:
    return [torch.randint(3, VOCAB, (1, 5 + 2 * s), generator=torch.Generator().manual_seed(s)) for s in range(n)]


def chat_prompt_ids(tokenizer, prompts: list[str]) -> list[torch.Tensor]:
    """Token ids exactly as `evaluate_in_process` builds them."""
    return [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True,
                                          return_dict=True, return_tensors="pt")["input_ids"] for p in prompts]


def test_step_anchors_are_where_draft_is_called(qwen3_verifier, monkeypatch):
    """Anchor i = prompt length + committed tokens of steps 0..i-1: the index of the bonus token each `draft()`
    call of the generation actually drafted after (its draft cache holds exactly the tokens before it)."""
    assert step_anchors(10, [1, 3, 5, 2]) == [10, 11, 14, 19] and step_anchors(7, []) == []
    prompts = random_prompts(3)
    drafter = bigram_drafter(qwen3_verifier, greedy_references(qwen3_verifier, prompts, 20))
    real = drafter.draft
    seen = []

    def spy(aux, bonus, cache=None, **kw):
        proposal = real(aux, bonus, cache=cache, **kw)
        seen.append((cache.length, int(bonus)))  # context tokens before the bonus token = its index
        return proposal

    monkeypatch.setattr(drafter, "draft", spy)
    for ids in prompts:
        seen.clear()
        out = speculative_generate(drafter, qwen3_verifier, ids, max_new_tokens=20, temperature=0, eos_token_id=[])
        anchors = step_anchors(ids.shape[1], out.committed_per_step)
        assert seen == [(a, int(out.sequences[0, a])) for a in anchors]


@pytest.mark.parametrize("make", [tiny_gemma4_verifier, tiny_qwen3_verifier], ids=["gemma4", "qwen3"])
@pytest.mark.parametrize("kind", ["random", "bigram", "bigram-draft-vocab"])
def test_teacher_forced_acceptance_equals_the_measured_one(make, kind):
    """Greedy speculative generation on several prompts, then the training forward on each generated sequence:
    every compared step's teacher-forced acceptance equals its committed count (so the means agree too), and
    only a last, cut step can go uncompared."""
    verifier = make()
    prompts = random_prompts(5)
    if kind == "random":
        drafter = tiny_drafter(verifier)  # draft vocabulary of 100 random ids: almost every step commits 1
    else:
        refs = greedy_references(verifier, prompts, 24)
        drafter = bigram_drafter(verifier, refs, draft_vocab_size=200 if kind == "bigram-draft-vocab" else None)
    measured, teacher_forced = [], []
    for ids in prompts:
        out = speculative_generate(drafter, verifier, ids, max_new_tokens=24, temperature=0, eos_token_id=[])
        check = teacher_forced_acceptance(drafter, verifier, out.sequences, ids.shape[1], out.committed_per_step)
        assert check.measured == out.committed_per_step and check.differing == [], check
        uncompared = [i for i, t in enumerate(check.teacher_forced) if t is None]
        assert uncompared in ([], [len(check.measured) - 1]), check
        measured += [check.measured[i] for i in check.compared]
        teacher_forced += [check.teacher_forced[i] for i in check.compared]
    assert teacher_forced == measured  # per step, hence also the teacher-forced acceptance length
    if kind != "random":  # long accepted runs and full blocks occurred, so the Markov chain was exercised
        assert max(measured) == drafter.block_size + 1 and len(set(measured)) >= 3, measured


def test_the_check_fails_when_the_anchors_are_off_by_one(gemma4_verifier):
    """Teacher-forcing blocks one token later than where they were drafted disagrees with the measurement."""
    prompts = random_prompts(3)
    drafter = bigram_drafter(gemma4_verifier, greedy_references(gemma4_verifier, prompts, 24))
    differing = 0
    for ids in prompts:
        out = speculative_generate(drafter, gemma4_verifier, ids, max_new_tokens=24, temperature=0, eos_token_id=[])
        shifted = [a + 1 for a in step_anchors(ids.shape[1], out.committed_per_step)]
        shifted[-1] = min(shifted[-1], out.sequences.shape[1] - 1)
        check = teacher_forced_acceptance(drafter, gemma4_verifier, out.sequences, ids.shape[1],
                                          out.committed_per_step, anchors=shifted)
        differing += len(check.differing)
    assert differing > 0


def shift_anchors_by_one(module, args, kwargs):
    """Forward pre-hook: the training forward's blocks move one token right (drafting does not go through
    `drafter(...)`, so speculative generation is untouched)."""
    ids, anchors = kwargs["input_ids"], kwargs["anchor_positions"]
    return args, {**kwargs, "anchor_positions": (anchors + 1).clamp(max=ids.shape[1] - 1)}


def test_results_record_the_check_and_warn_when_it_fails(chat_verifier_dir):
    """Through `evaluate_in_process` on a chat verifier with its real tokenizer: the fields are recorded and agree;
    with the training layout broken (anchors shifted by a hook on the drafter's forward) the subset is warned
    about and counts differing steps; `fidelity_check=False` and sampling record null."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    verifier = AutoModelForCausalLM.from_pretrained(chat_verifier_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(chat_verifier_dir)
    prompts = {"qa": ["What is 2+2?", "Name a colour."], "writing": ["Write a haiku about rain."]}
    ids = chat_prompt_ids(tokenizer, [p for v in prompts.values() for p in v])
    drafter = bigram_drafter(verifier, greedy_references(verifier, ids, 16), mask_token_id=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FidelityWarning)  # an agreeing check warns about nothing
        results = evaluate_in_process(drafter, verifier, tokenizer, prompts, max_new_tokens=16, temperature=0,
                                      progress=False)
    for name in prompts:
        sub = results["subsets"][name]
        assert sub["fidelity_steps_differing"] == 0 and 1 <= sub["fidelity_steps"] <= sub["steps"], sub
        if sub["fidelity_steps"] == sub["steps"]:
            assert sub["teacher_forced_acceptance_length"] == pytest.approx(sub["acceptance_length"], abs=1e-12)
    assert any(v["pos"][0] > 0 for v in results["subsets"].values())  # drafts were accepted

    handle = drafter.register_forward_pre_hook(shift_anchors_by_one, with_kwargs=True)
    try:
        with pytest.warns(FidelityWarning) as caught:
            broken = evaluate_in_process(drafter, verifier, tokenizer, prompts, max_new_tokens=16, temperature=0,
                                         progress=False)
    finally:
        handle.remove()
    warned = [str(w.message) for w in caught]
    for name, sub in broken["subsets"].items():
        n, compared = sub["fidelity_steps_differing"], sub["fidelity_steps"]
        mine = [m for m in warned if f"on subset {name}:" in m]  # one warning per failing subset, with its count
        assert len(mine) == (n > 0) and all(m.startswith(f"fidelity check failed on subset {name}: on {n} of "
                                                         f"{compared} compared verification steps") for m in mine)
    assert broken["subsets"]["qa"]["fidelity_steps_differing"] > 0
    # the measurement itself is untouched by the broken check
    assert broken["subsets"]["qa"]["acceptance_length"] == results["subsets"]["qa"]["acceptance_length"]

    small = {"qa": ["What is 2+2?"]}
    off = evaluate_in_process(drafter, verifier, tokenizer, small, max_new_tokens=6, temperature=0, progress=False,
                              fidelity_check=False)
    sampled = evaluate_in_process(drafter, verifier, tokenizer, small, max_new_tokens=6, temperature=1.0,
                                  progress=False)
    for r in (off, sampled):
        sub = r["subsets"]["qa"]
        assert sub["teacher_forced_acceptance_length"] is None and sub["fidelity_steps"] is None
        assert sub["fidelity_steps_differing"] is None and sub["steps"] >= 1


def test_fidelity_on_a_real_small_model(smollm2_dir, smollm2_tokenizer):
    """SmolLM2-135M-Instruct (real weights, tokenizer and chat template) through `evaluate_in_process`: no step
    differs, and where every step was compared the teacher-forced acceptance length is the measured one."""
    from transformers import AutoModelForCausalLM

    verifier = AutoModelForCausalLM.from_pretrained(smollm2_dir).eval().requires_grad_(False)
    prompts = {"qa": ["What is the capital of France?", "List three colours."],
               "HumanEval": ["Write a Python function that reverses a string."]}
    ids = chat_prompt_ids(smollm2_tokenizer, [p for v in prompts.values() for p in v])
    drafter = bigram_drafter(verifier, greedy_references(verifier, ids, 24), keep=0.6,
                             aux_hidden_state_layer_ids=[2, 15, 27], num_attention_heads=9, num_key_value_heads=3,
                             head_dim=64)
    results = evaluate_in_process(drafter, verifier, smollm2_tokenizer, prompts, max_new_tokens=24, temperature=0,
                                  progress=False)
    for name, sub in results["subsets"].items():
        assert sub["fidelity_steps_differing"] == 0 and sub["fidelity_steps"] >= sub["steps"] - len(prompts[name])
        if sub["fidelity_steps"] == sub["steps"]:
            assert sub["teacher_forced_acceptance_length"] == pytest.approx(sub["acceptance_length"], abs=1e-12)
    assert max(v["acceptance_length"] for v in results["subsets"].values()) > 1.5


def test_measured_and_teacher_forced_acceptance_cover_the_same_steps(chat_verifier_dir, tmp_path):
    """The fidelity columns compare like with like: each prompt's last step may go uncompared (its block runs past
    the sequence), so beside the teacher-forced acceptance the results carry the measured one over exactly the
    compared steps. With no differing step the two are equal to the last bit, in the results, the printed table
    and the card, while `acceptance_length` stays the mean over all steps."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trainer.evaluation.results import read_results, write_results
    from trainer.export.card_sections import _results_section

    verifier = AutoModelForCausalLM.from_pretrained(chat_verifier_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(chat_verifier_dir)
    prompts = {"qa": ["What is 2+2?", "Name a colour.", "Why is the sky blue?"],
               "writing": ["Write a haiku about rain.", "Describe a cat in five words."]}
    ids = chat_prompt_ids(tokenizer, [p for v in prompts.values() for p in v])
    drafter = bigram_drafter(verifier, greedy_references(verifier, ids, 16), mask_token_id=0)
    results = evaluate_in_process(drafter, verifier, tokenizer, prompts, max_new_tokens=16, temperature=0,
                                  progress=False)
    subsets = results["subsets"]
    for name, sub in subsets.items():
        assert sub["fidelity_steps_differing"] == 0, (name, sub)
        assert sub["measured_acceptance_length_compared"] == sub["teacher_forced_acceptance_length"], (name, sub)
    # some last steps went uncompared, and there the all-step mean is not the compared one: the case this is about
    cut = [n for n, s in subsets.items() if s["fidelity_steps"] < s["steps"]]
    assert cut and any(subsets[n]["acceptance_length"] != subsets[n]["measured_acceptance_length_compared"]
                       for n in cut), subsets
    assert results["weighted_acceptance_length"] == pytest.approx(
        sum(s["acceptance_length"] * s["steps"] for s in subsets.values()) / sum(s["steps"] for s in subsets.values()))

    table = write_results(results, str(tmp_path / "r.json"))
    assert ("| measured_acceptance_length_compared | teacher_forced_acceptance_length | fidelity_steps_differing |"
            in table.splitlines()[0])
    read = read_results(tmp_path / "r.json", block_size=drafter.config.block_size)
    card = _results_section(read, drafter.config.block_size)
    assert "| subset | steps compared | measured acceptance_length | teacher-forced acceptance_length | " \
           "steps differing |" in card
    for s in read.subsets:
        value = f"{s.teacher_forced_acceptance_length:.3f}"
        assert s.measured_acceptance_length_compared == s.teacher_forced_acceptance_length
        assert f"| {value} | {value} | 0 of {s.fidelity_steps} |" in table
        assert f"| {s.name} | {s.fidelity_steps} of {s.steps} | {value} | {value} | 0 |" in card
