"""Lossless speculative generation: token-identical to greedy `generate` at T=0, the verifier's distribution at
T>0 (a statistical test with a fixed seed and a stated tolerance)."""

import itertools
import math

import pytest
import torch
from transformers import GenerationConfig

from modeling_dspark import DSparkProposal, sampling_defaults, speculative_accept
from tiny import VOCAB, tiny_drafter, tiny_gemma4_verifier, tiny_qwen3_verifier


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
        out = drafter.speculative_generate(verifier, ids, max_new_tokens=30, temperature=0, eos_token_id=[])
        assert torch.equal(out.sequences, ref), seed
        committed += out.committed_per_step
    assert all(1 <= c <= drafter.block_size + 1 for c in committed)
    if oracle:  # every acceptance length occurred, including full blocks (bonus token path)
        assert set(committed) == set(range(1, drafter.block_size + 2))


def test_generation_stops_at_eos_and_max_new_tokens(gemma4_verifier):
    drafter = tiny_drafter(gemma4_verifier)
    ids = torch.randint(3, VOCAB, (1, 6), generator=torch.Generator().manual_seed(0))
    ref = gemma4_verifier.generate(ids, do_sample=False, max_new_tokens=12, min_new_tokens=12, pad_token_id=0)
    eos = int(ref[0, 6 + 4])  # pretend the 5th generated token is the end of sequence
    out = drafter.speculative_generate(gemma4_verifier, ids, max_new_tokens=12, temperature=0, eos_token_id=eos)
    first = ref[0, 6:].tolist().index(eos)
    assert out.sequences[0, 6:].tolist() == ref[0, 6: 6 + first + 1].tolist()
    out = drafter.speculative_generate(gemma4_verifier, ids, max_new_tokens=7, temperature=0, eos_token_id=[])
    assert out.sequences.shape[1] == 6 + 7


def test_acceptance_rule_preserves_the_target_distribution():
    """Pure rule, many draws: the first emitted token is distributed as p_0 whatever q is, and given an accepted
    first draft the second follows p_1 (chi-square style bound: |empirical - exact| < 5 standard errors)."""
    torch.manual_seed(0)
    V, B, n = 6, 2, 40000
    p = torch.softmax(torch.randn(B + 1, V) * 1.5, -1)
    q = torch.softmax(torch.randn(B, V) * 1.5, -1)
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


def exact_two_token_distribution(verifier, prompt, temperature):
    probs = {}
    with torch.no_grad():
        first = torch.softmax(verifier(prompt).logits[0, -1].float() / temperature, -1)
        for a in range(VOCAB_SMALL):
            seq = torch.cat([prompt, torch.tensor([[a]])], 1)
            second = torch.softmax(verifier(seq).logits[0, -1].float() / temperature, -1)
            for b in range(VOCAB_SMALL):
                probs[(a, b)] = float(first[a] * second[b])
    return probs


@pytest.mark.slow
def test_sampled_output_follows_the_verifier_distribution():
    """End to end at T=1 on an 8-token vocabulary: the first two generated tokens of 2,500 seeded speculative
    generations match the verifier's exact two-token distribution (64 outcomes, enumerated). Tolerance: total
    variation below 0.09, about 1.6x what sampling noise alone gives at this size (expected TV ~ 0.055)."""
    verifier = tiny_qwen3_verifier(seed=3, vocab_size=VOCAB_SMALL)
    drafter = tiny_drafter(verifier, draft_vocab_size=None, block_size=3, mask_token_id=0)
    prompt = torch.tensor([[1, 5, 2, 7]])
    exact = exact_two_token_distribution(verifier, prompt, 1.0)
    g = torch.Generator().manual_seed(0)
    counts = dict.fromkeys(itertools.product(range(VOCAB_SMALL), repeat=2), 0)
    n = 2500
    committed = []
    for _ in range(n):
        out = drafter.speculative_generate(verifier, prompt, max_new_tokens=2, temperature=1.0, eos_token_id=[],
                                           generator=g)
        counts[tuple(out.sequences[0, 4:6].tolist())] += 1
        committed += out.committed_per_step
    tv = 0.5 * sum(abs(counts[k] / n - exact[k]) for k in exact)
    noise = 0.5 * sum(math.sqrt(2 * exact[k] * (1 - exact[k]) / (math.pi * n)) for k in exact)
    assert tv < 0.09, (tv, noise)
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
        out = drafter.speculative_generate(verifier, ids, max_new_tokens=24, temperature=0)
        monkeypatch.undo()
        assert torch.equal(out.sequences, ref), prompt
        committed += out.committed_per_step
    assert max(committed) == drafter.block_size + 1
