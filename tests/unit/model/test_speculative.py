"""Lossless speculative generation: token-identical to greedy `generate` at T=0, the verifier's distribution at
T>0 (a statistical test with a fixed seed and a stated tolerance), with each draft method (vLLM's greedy and
probabilistic drafting, and top-k/top-p-filtered drafts); the acceptance rule against its closed forms."""

import math

import pytest
import torch
from transformers import GenerationConfig

from generation_dspark import sampling_defaults, speculative_accept, speculative_generate
from modeling_dspark import DRAFT_METHODS, DSparkProposal
from tiny import VOCAB, tiny_drafter, tiny_gemma4_verifier, tiny_qwen3_verifier
from trainer.states.in_process import verifier_hidden_states


def processed(logits: torch.Tensor, temperature: float, top_k: int | None = None, top_p: float | None = None):
    """Reference sampling distribution of one logits row, by the definition and not by `filter_logits`: softmax at
    the temperature; keep the top_k most likely tokens and renormalise; keep the most likely tokens while the mass
    before them is below top_p (so the one crossing it stays) and renormalise. float64."""
    probs = torch.softmax(logits.double() / temperature, -1)
    order = sorted(range(probs.numel()), key=lambda i: -float(probs[i]))[: top_k or None]
    mass, kept, before = float(probs[order].sum()), [], 0.0
    for i in order:
        if top_p is not None and before >= top_p:
            break
        kept.append(i)
        before += float(probs[i]) / mass
    out = torch.zeros_like(probs)
    out[kept] = probs[kept]
    return out / out.sum()


def chi_square_bound(df: int) -> float:
    """The chi-square 0.999 quantile (Wilson-Hilferty approximation, within 1% for df >= 3)."""
    z = 3.090
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


class Oracle:
    """Drafts from a known reference continuation with deliberate corruptions, so steps accept 0..B drafts
    (a random drafter almost never gets past the first slot)."""

    def __init__(self, drafter, reference: list[int], prompt_len: int, seed: int):
        self.drafter, self.reference, self.prompt_len = drafter, reference, prompt_len
        self.g = torch.Generator().manual_seed(seed)
        self.real_draft = drafter.draft

    def __call__(self, aux, bonus, cache=None, **kw):
        real = self.real_draft(aux, bonus, cache=cache, **kw)  # keeps the draft cache in step
        position = cache.length  # index of the bonus token in the sequence
        B = self.drafter.block_size
        truth = self.reference[position + 1: position + 1 + B]
        truth = truth + [3] * (B - len(truth))
        tokens = torch.tensor(truth)
        cut = int(torch.randint(0, B + 2, (1,), generator=self.g))
        if cut < B:
            tokens[cut] = (tokens[cut] + 1 + int(torch.randint(0, 50, (1,), generator=self.g))) % VOCAB
        probs = torch.nn.functional.one_hot(tokens, self.drafter.config.draft_vocab_size).float()
        return DSparkProposal(token_ids=tokens, draft_token_ids=tokens, probs=probs, confidence=real.confidence,
                              logits=probs)


@pytest.mark.parametrize("make", [tiny_gemma4_verifier, tiny_qwen3_verifier])
@pytest.mark.parametrize("oracle", [False, True])
def test_greedy_output_is_token_identical_to_generate(make, oracle, monkeypatch):
    verifier = make()
    drafter = tiny_drafter(verifier, draft_vocab_size=None if oracle else 100)
    committed = []
    for seed in range(8):
        ids = torch.randint(3, VOCAB, (1, 4 + 3 * seed), generator=torch.Generator().manual_seed(seed))
        ref = verifier.generate(ids, do_sample=False, max_new_tokens=30, min_new_tokens=30, pad_token_id=0)
        if oracle:
            monkeypatch.setattr(drafter, "draft", Oracle(drafter, ref[0].tolist(), ids.shape[1], seed))
        out = speculative_generate(drafter, verifier, ids, max_new_tokens=30, temperature=0, eos_token_id=[])
        assert torch.equal(out.sequences, ref), seed
        committed += out.committed_per_step
    assert all(1 <= c <= drafter.block_size + 1 for c in committed)
    if oracle:  # every acceptance length occurred, including full blocks (bonus token path)
        assert set(committed) == set(range(1, drafter.block_size + 2))


def test_every_draft_method_is_greedy_at_temperature_0(qwen3_verifier):
    """At T=0 the three draft methods propose the same argmax tokens with one-hot `probs` (whatever top-k/top-p
    are passed), and speculative generation with each is token-identical to greedy `generate`."""
    drafter = tiny_drafter(qwen3_verifier)
    ids = torch.randint(3, VOCAB, (1, 12), generator=torch.Generator().manual_seed(4))
    aux, _ = verifier_hidden_states(qwen3_verifier, drafter.config.aux_hidden_state_layer_ids, ids)
    proposals = {m: drafter.draft(aux[0, :10], ids[0, 10], temperature=0, top_k=3, top_p=0.5, draft_method=m)
                 for m in DRAFT_METHODS}
    for method, proposal in proposals.items():
        argmax = proposal.logits.argmax(-1)
        assert torch.equal(proposal.draft_token_ids, argmax), method
        assert torch.equal(proposal.probs, torch.nn.functional.one_hot(argmax, proposal.logits.shape[-1]).float())
        assert torch.equal(proposal.token_ids, proposals["greedy"].token_ids), method
    for seed in range(2):
        ids = torch.randint(3, VOCAB, (1, 5 + 4 * seed), generator=torch.Generator().manual_seed(seed))
        ref = qwen3_verifier.generate(ids, do_sample=False, max_new_tokens=16, min_new_tokens=16, pad_token_id=0)
        for method in DRAFT_METHODS:
            out = speculative_generate(drafter, qwen3_verifier, ids, max_new_tokens=16, temperature=0, eos_token_id=[],
                                               draft_method=method)
            assert torch.equal(out.sequences, ref), (seed, method)


def test_draft_methods_draw_from_the_distribution_vllm_uses(qwen3_verifier):
    """At T>0, per slot, from the proposal's own logits: greedy drafts are the argmax with one-hot `probs` (vLLM's
    default: the verifier's temperature does not reach the drafts); probabilistic `probs` are softmax(logits / T)
    over the whole draft vocabulary (vLLM ignores top-k/top-p when drafting); filtered `probs` are the reference
    top-k/top-p distribution; every sampled draft lies in its `probs`' support. An unknown method is refused."""
    drafter = tiny_drafter(qwen3_verifier)
    ids = torch.randint(3, VOCAB, (1, 12), generator=torch.Generator().manual_seed(5))
    aux, _ = verifier_hidden_states(qwen3_verifier, drafter.config.aux_hidden_state_layer_ids, ids)
    T, k, p = 0.7, 5, 0.8
    for method in DRAFT_METHODS:
        proposal = drafter.draft(aux[0, :10], ids[0, 10], temperature=T, top_k=k, top_p=p, draft_method=method,
                                 generator=torch.Generator().manual_seed(0))
        for slot, logits in enumerate(proposal.logits):
            if method == "greedy":
                expected = torch.nn.functional.one_hot(logits.argmax(), logits.numel()).double()
                assert int(proposal.draft_token_ids[slot]) == int(logits.argmax())
            else:
                expected = processed(logits, T, *((k, p) if method == "filtered" else (None, None)))
            assert torch.allclose(proposal.probs[slot].double(), expected, atol=1e-6), (method, slot)
            assert proposal.probs[slot, proposal.draft_token_ids[slot]] > 0, (method, slot)
        support = (proposal.probs > 0).sum(-1)
        assert bool((support == 1).all() if method == "greedy" else (support > 1).all()), method
        if method == "probabilistic":  # the whole draft vocabulary, not the verifier's top-k
            assert bool((support == drafter.config.draft_vocab_size).all())
    with pytest.raises(ValueError, match=r"draft_method 'sampled' is not one of 'greedy', 'probabilistic', "
                                         r"'filtered'; pass one of them"):
        drafter.draft(aux[0, :10], ids[0, 10], temperature=T, draft_method="sampled")
    with pytest.raises(ValueError, match="draft_method 'Greedy' is not one of"):
        speculative_generate(drafter, qwen3_verifier, ids, max_new_tokens=4, temperature=0, draft_method="Greedy")


def test_generation_stops_at_eos_and_max_new_tokens(gemma4_verifier):
    drafter = tiny_drafter(gemma4_verifier)
    ids = torch.randint(3, VOCAB, (1, 6), generator=torch.Generator().manual_seed(0))
    ref = gemma4_verifier.generate(ids, do_sample=False, max_new_tokens=12, min_new_tokens=12, pad_token_id=0)
    eos = int(ref[0, 6 + 4])  # pretend the 5th generated token is the end of sequence
    out = speculative_generate(drafter, gemma4_verifier, ids, max_new_tokens=12, temperature=0, eos_token_id=eos)
    first = ref[0, 6:].tolist().index(eos)
    assert out.sequences[0, 6:].tolist() == ref[0, 6: 6 + first + 1].tolist()
    out = speculative_generate(drafter, gemma4_verifier, ids, max_new_tokens=7, temperature=0, eos_token_id=[])
    assert out.sequences.shape[1] == 6 + 7


@pytest.mark.parametrize("drafts_from", ["sampled", "greedy"])
def test_acceptance_rule_preserves_the_target_distribution(drafts_from):
    """Pure rule, many draws: the first emitted token is distributed as p_0 whatever q is, with sampled drafts
    (a dense q) and with greedy drafts (q one-hot on each slot's argmax, as vLLM verifies them)
    (|empirical - exact| < 5 standard errors)."""
    torch.manual_seed(0)
    V, B, n = 6, 2, 20000
    p = torch.softmax(torch.randn(B + 1, V) * 1.5, -1)
    q = torch.softmax(torch.randn(B, V) * 1.5, -1)
    if drafts_from == "greedy":
        q = torch.nn.functional.one_hot(q.argmax(-1), V).float()
    g = torch.Generator().manual_seed(1)
    first = torch.zeros(V)
    for _ in range(n):
        drafts = torch.stack([torch.multinomial(q[i], 1, generator=g)[0] for i in range(B)])
        accepted, nxt = speculative_accept(p, q, drafts, generator=g)
        token = int(drafts[0]) if accepted >= 1 else int(nxt)
        first[token] += 1
    freq = first / n
    stderr = (p[0] * (1 - p[0]) / n).sqrt()
    assert bool(((freq - p[0]).abs() < 5 * stderr).all()), (freq, p[0])


def test_greedy_drafts_are_accepted_with_p_of_the_draft_and_replaced_from_p_without_it():
    """vLLM's rule for greedy drafts, against its closed forms: with a one-hot q on d, d is accepted with probability
    p(d), and a rejected d is replaced by a draw from p restricted to the tokens != d, renormalised
    (|empirical - exact| < 5 standard errors); p(d) = 1 always accepts, p(d) = 0 never does."""
    V, n, d = 6, 20000, 2
    p = torch.softmax(torch.tensor([[0.3, -1.0, 0.8, 1.1, -0.4, 0.0], [0.0] * V]), -1)
    q = torch.nn.functional.one_hot(torch.tensor([d]), V).float()
    g = torch.Generator().manual_seed(2)
    accepted, replaced = 0, torch.zeros(V)
    for _ in range(n):
        count, token = speculative_accept(p, q, torch.tensor([d]), generator=g)
        accepted += count
        if not count:
            replaced[int(token)] += 1
    rate, exact = accepted / n, float(p[0, d])
    assert abs(rate - exact) < 5 * math.sqrt(exact * (1 - exact) / n), (rate, exact)
    residual = p[0].clone()
    residual[d] = 0
    residual /= residual.sum()
    rejected = n - accepted
    freq = replaced / rejected
    assert replaced[d] == 0 and bool(((freq - residual).abs() <= 5 * (residual * (1 - residual) / rejected).sqrt()).all())
    certain = torch.nn.functional.one_hot(torch.tensor([d, 0]), V).float()
    assert all(speculative_accept(certain, q, torch.tensor([d]), generator=g)[0] == 1 for _ in range(50))
    impossible = p.clone()
    impossible[0, d] = 0
    impossible[0] /= impossible[0].sum()
    outcomes = [speculative_accept(impossible, q, torch.tensor([d]), generator=g) for _ in range(200)]
    assert all(count == 0 and int(token) != d for count, token in outcomes)


def test_sampling_defaults_follow_the_generation_config():
    """Explicit arguments win; an unset temperature is the config's when it samples, else greedy; top-k/top-p
    come from the config only when sampling, and are None for greedy decoding."""
    sampler = GenerationConfig(do_sample=True, temperature=0.7, top_k=20, top_p=0.8)
    greedy = GenerationConfig(do_sample=False, temperature=0.7, top_k=20, top_p=0.8)
    unset = GenerationConfig(do_sample=True, temperature=None, top_k=None, top_p=None)
    cases = [
        ((sampler,), {"temperature": 0.7, "top_k": 20, "top_p": 0.8}),
        ((sampler, 1.5), {"temperature": 1.5, "top_k": 20, "top_p": 0.8}),
        ((sampler, None, 5, 0.5), {"temperature": 0.7, "top_k": 5, "top_p": 0.5}),
        ((sampler, 0), {"temperature": 0.0, "top_k": None, "top_p": None}),
        ((sampler, 0, 5, 0.5), {"temperature": 0.0, "top_k": None, "top_p": None}),
        ((greedy,), {"temperature": 0.0, "top_k": None, "top_p": None}),
        ((greedy, 1.0), {"temperature": 1.0, "top_k": 20, "top_p": 0.8}),
        ((unset,), {"temperature": 1.0, "top_k": None, "top_p": None}),
        ((None,), {"temperature": 0.0, "top_k": None, "top_p": None}),
        ((None, 0.9, 3), {"temperature": 0.9, "top_k": 3, "top_p": None}),
    ]
    for args, expected in cases:
        got = sampling_defaults(*args)
        assert got == expected and isinstance(got["temperature"], float), (args, got)


VOCAB_SMALL = 8


def exact_sequence_distribution(verifier, prompt, length, temperature, top_k, top_p) -> dict[tuple, float]:
    """The verifier's exact distribution of its next `length` tokens after `prompt`, enumerated: the product of the
    reference processed distributions (`processed`) along every continuation with non-zero probability."""
    out = {(): 1.0}
    for _ in range(length):
        grown = {}
        for prefix, mass in out.items():
            seq = torch.cat([prompt, torch.tensor([list(prefix)], dtype=torch.long)], 1)
            with torch.no_grad():
                probs = processed(verifier(seq).logits[0, -1], temperature, top_k, top_p)
            for token in probs.nonzero().flatten().tolist():
                grown[(*prefix, token)] = mass * float(probs[token])
        out = grown
    return out


@pytest.mark.slow
@pytest.mark.parametrize("draft_method", DRAFT_METHODS)
def test_sampled_output_follows_the_verifier_distribution(draft_method):
    """End to end at T=0.8 with top-k 4 and top-p 0.9 on an 8-token vocabulary (a 6-token draft vocabulary, block
    2): the first three generated tokens of 1,000 seeded speculative generations follow the verifier's exact
    three-token distribution, enumerated from its logits with the reference processing, whichever way the drafts
    are drawn. Three tokens span a full block (both slots, the Markov chain over a sampled draft) and the next
    step. Test: no token outside the support, and Pearson's chi-square over the outcomes (those expected fewer
    than 5 times pooled) below its 0.999 quantile (105 at the 63 degrees of freedom here). A drafter whose `probs`
    are not what it drew from fails it: dense probs for greedy drafts gave 3,142, dense probs for filtered drafts
    193, filtered probs for probabilistic drafts tokens outside the support."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models on a shared CPU: a second thread only adds contention
    try:
        verifier = tiny_qwen3_verifier(seed=3, vocab_size=VOCAB_SMALL)
        drafter = tiny_drafter(verifier, draft_vocab_size=6, block_size=2, mask_token_id=0, num_hidden_layers=1)
        prompt = torch.tensor([[1, 5, 2, 7]])
        T, top_k, top_p, n = 0.8, 4, 0.9, 1000
        exact = exact_sequence_distribution(verifier, prompt, 3, T, top_k, top_p)
        g = torch.Generator().manual_seed(0)
        counts = dict.fromkeys(exact, 0)
        committed = []
        for _ in range(n):
            out = speculative_generate(drafter, verifier, prompt, max_new_tokens=3, temperature=T, top_k=top_k,
                                               top_p=top_p, eos_token_id=[], generator=g, draft_method=draft_method)
            outcome = tuple(out.sequences[0, 4:7].tolist())
            assert outcome in exact, outcome  # zero probability under the verifier
            counts[outcome] += 1
            committed += out.committed_per_step
    finally:
        torch.set_num_threads(threads)
    bins = [(counts[k], n * exact[k]) for k in exact if n * exact[k] >= 5]
    rest = [(counts[k], n * exact[k]) for k in exact if n * exact[k] < 5]
    bins.append((sum(c for c, _ in rest), sum(e for _, e in rest)))
    chi2 = sum((c - e) ** 2 / e for c, e in bins if e > 0)
    assert chi2 < chi_square_bound(len(bins) - 1), (chi2, len(bins))
    assert any(c > 1 for c in committed)  # drafts were accepted, so both rule branches ran


@pytest.mark.slow
def test_greedy_identity_on_a_real_small_model(smollm2_dir, smollm2_tokenizer, monkeypatch):
    """SmolLM2-135M-Instruct (real weights, real chat prompts): token-identical to greedy `generate`, with a random
    drafter (mostly rejections) and with an oracle drafter (long accepted runs, full blocks)."""
    from transformers import AutoModelForCausalLM

    verifier = AutoModelForCausalLM.from_pretrained(smollm2_dir).eval().requires_grad_(False)
    drafter = tiny_drafter(verifier, draft_vocab_size=None, aux_hidden_state_layer_ids=[2, 15, 27],
                           num_attention_heads=9, num_key_value_heads=3, head_dim=64)
    prompts = ["What is the capital of France?", "Write a Python function that reverses a string.",
               "Translate into French: good morning", "List three colours.", "Explain what a CPU does."]
    committed = []
    for i, prompt in enumerate(prompts):
        ids = smollm2_tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                                    return_tensors="pt", return_dict=True)["input_ids"]
        ref = verifier.generate(ids, do_sample=False, max_new_tokens=24, temperature=None, top_p=None, top_k=None)
        if i % 2:
            monkeypatch.setattr(drafter, "draft", Oracle(drafter, ref[0].tolist(), ids.shape[1], i))
        out = speculative_generate(drafter, verifier, ids, max_new_tokens=24, temperature=0)
        monkeypatch.undo()
        assert torch.equal(out.sequences, ref), prompt
        committed += out.committed_per_step
    assert max(committed) == drafter.block_size + 1


# ------------------------------------------------------------------ transformers' custom_generate entry
def test_custom_generate_entry_is_the_loop_with_generate_settings(qwen3_verifier):
    """`generation_dspark.generate` (what `verifier.generate(..., custom_generate=<repo>)` calls) reads the settings
    as `generate` does and runs the loop: greedy output equals plain greedy `generate`; with sampling settings it
    draws exactly what `speculative_generate` draws with the same seed; `return_dict_in_generate` adds the steps."""
    from generation_dspark import generate

    drafter = tiny_drafter(qwen3_verifier)
    ids = torch.randint(3, VOCAB, (1, 9), generator=torch.Generator().manual_seed(3))
    ref = qwen3_verifier.generate(ids, do_sample=False, max_new_tokens=16, min_new_tokens=16, pad_token_id=0)
    got = generate(qwen3_verifier, ids, drafter=drafter, do_sample=False, max_new_tokens=16, eos_token_id=[])
    assert torch.equal(got, ref)
    out = generate(qwen3_verifier, input_ids=ids, attention_mask=torch.ones_like(ids), drafter=drafter, do_sample=True,
                   temperature=0.7, top_k=5, max_new_tokens=12, eos_token_id=[], return_dict_in_generate=True,
                   generator=torch.Generator().manual_seed(0), draft_method="probabilistic", revision="abc")
    direct = speculative_generate(drafter, qwen3_verifier, ids, max_new_tokens=12, temperature=0.7, top_k=5, top_p=1.0,
                                  eos_token_id=[], generator=torch.Generator().manual_seed(0),
                                  draft_method="probabilistic")
    assert torch.equal(out.sequences, direct.sequences) and out.committed_per_step == direct.committed_per_step
    assert sum(out.committed_per_step) >= 11  # every token after the prefill's is committed by a step


def test_custom_generate_entry_refuses_what_it_cannot_honour(qwen3_verifier):
    from generation_dspark import generate

    drafter = tiny_drafter(qwen3_verifier)
    ids = torch.randint(3, VOCAB, (1, 6), generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match=r"needs the drafter; pass drafter=AutoModel.from_pretrained\("):
        generate(qwen3_verifier, ids, max_new_tokens=4)
    with pytest.raises(ValueError, match=r"does not support num_beams, repetition_penalty; pass only max_new_tokens"):
        generate(qwen3_verifier, ids, drafter=drafter, num_beams=2, repetition_penalty=1.2)
    with pytest.raises(ValueError, match="does not support streamer"):
        generate(qwen3_verifier, ids, drafter=drafter, streamer=object())
    with pytest.raises(ValueError, match="one unpadded sequence"):
        generate(qwen3_verifier, ids, drafter=drafter, attention_mask=torch.tensor([[0, 1, 1, 1, 1, 1]]))
    with pytest.raises(ValueError, match="one sequence at a time"):
        generate(qwen3_verifier, ids.repeat(2, 1), drafter=drafter, max_new_tokens=4)
    with pytest.raises(TypeError, match="is not a DSpark drafter"):
        speculative_generate(torch.nn.Linear(2, 2), qwen3_verifier, ids)
