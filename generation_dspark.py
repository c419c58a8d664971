"""Lossless speculative decoding with a DSpark drafter and its Hugging Face verifier (batch size 1).

Remote code: imports only torch, transformers and the stdlib. Exported repos carry this file as
`custom_generate/generate.py`, transformers' convention for a decoding loop shipped with a model repo, so a user
of the Hub drafter decodes in-process with no package installed:

    drafter = AutoModel.from_pretrained(repo, trust_remote_code=True, revision=REVISION)
    verifier = drafter.load_verifier()                       # or drafter.attach_verifier(verifier_model)
    ids = verifier.generate(input_ids, custom_generate=repo, trust_remote_code=True, revision=REVISION,
                            drafter=drafter, max_new_tokens=256)

`generate` is that entry: transformers calls it with the verifier as `model` and every `generate()` argument. It
reads the sampling settings as `generate` does (the verifier's `generation_config`, overridden by the call) and
runs `speculative_generate`, the loop itself, which this package's evaluator calls directly.

Everything the loop needs from the drafter's architecture (its state capture of the verifier, its draft cache,
its sampling distributions) is read from the module that defines the drafter's class, so the loop always runs
with the helpers of the drafter it drives: the repo's remote code when the drafter was loaded with `AutoModel`,
the package's `modeling_dspark` in training and evaluation. Nothing is imported from either by name.
"""

import copy
import sys
from dataclasses import dataclass

import torch
from torch import nn
from transformers.utils import ModelOutput


# ================================================================================================
# 1. Drawing, and sampling settings from a generation config.
# ================================================================================================
def sample_from(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One token id from a probability vector (argmax when it is one-hot, i.e. greedy)."""
    if bool((probs.max() == 1.0) & (probs.sum() == 1.0)):
        return probs.argmax()
    return torch.multinomial(probs.cpu(), 1, generator=generator).view(()).to(probs.device)


def sampling_defaults(
    generation_config, temperature: float | None = None, top_k: int | None = None, top_p: float | None = None
) -> dict:
    """`{"temperature", "top_k", "top_p"}` to decode with: explicit arguments win, the verifier's
    `generation_config` (may be None) fills in the rest.

    * `temperature=None` -> the config's temperature (1.0 when it has none) if the config samples
      (`do_sample`), else 0.0 (greedy). An explicit 0 forces greedy.
    * `top_k` / `top_p` -> the argument, else the config's value, but only when sampling (temperature > 0);
      greedy decoding ignores them, so they are None then.
    """
    if temperature is None:
        sampling = bool(getattr(generation_config, "do_sample", False))
        temperature = float(getattr(generation_config, "temperature", 1.0) or 1.0) if sampling else 0.0
    temperature = float(temperature)
    if temperature <= 0:
        return {"temperature": temperature, "top_k": None, "top_p": None}
    return {
        "temperature": temperature,
        "top_k": top_k if top_k is not None else getattr(generation_config, "top_k", None),
        "top_p": top_p if top_p is not None else getattr(generation_config, "top_p", None),
    }


# ================================================================================================
# 2. Speculative sampling over one block.
# ================================================================================================
def speculative_accept(
    target_probs: torch.Tensor, draft_probs: torch.Tensor, drafts: torch.Tensor, generator: torch.Generator | None = None
) -> tuple[int, torch.Tensor]:
    """Standard speculative sampling over one block (Leviathan et al.; Chen et al.).

    `target_probs` `[B+1, V]` are the verifier's (processed) distributions after the last committed token and
    after each draft; `draft_probs` `[B, V]` the distributions the drafts were drawn from. Draft i is accepted
    with probability `min(1, p_i(d)/q_i(d))`; at the first rejection the next token is drawn from the residual
    `max(0, p_i - q_i)` (normalised); if all B pass, a bonus token is drawn from `p_B`. Greedy drafts (vLLM's
    default) are the case of a one-hot q: d is accepted with probability p(d) and the replacement is drawn from p
    without d, renormalised, which is how vLLM verifies them; greedy decoding is the case of one-hot p and q
    (exact-match acceptance). Returns `(number accepted, next token)`.
    """
    for i, d in enumerate(drafts.tolist()):
        p, q = target_probs[i, d], draft_probs[i, d]
        if p >= q:
            continue  # min(1, p/q) = 1: accept without drawing
        u = torch.rand((), generator=generator).item()
        if q > 0 and u < (p / q).item():
            continue
        residual = (target_probs[i] - draft_probs[i]).clamp(min=0)
        if residual.sum() <= 0:
            residual = target_probs[i]
        return i, sample_from(residual / residual.sum(), generator)
    return len(drafts), sample_from(target_probs[len(drafts)], generator)


# ================================================================================================
# 3. The loop.
# ================================================================================================
@dataclass
class SpeculativeGenerationOutput(ModelOutput):
    """`sequences` `[1, prompt + new]`; `committed_per_step` the tokens committed by each verification step
    (accepted drafts + the corrected or bonus token, so 1..B+1; its mean is the acceptance length)."""

    sequences: torch.LongTensor | None = None
    committed_per_step: list[int] | None = None


def drafter_code(drafter: nn.Module):
    """The module that defines the drafter's class (the first class of its MRO whose module has the DSpark
    drafting helpers): the repo's remote code for a drafter loaded with `AutoModel`, `modeling_dspark` for one
    built by this package."""
    for cls in type(drafter).__mro__:
        module = sys.modules.get(cls.__module__)
        if all(hasattr(module, name) for name in ("VerifierStateCapture", "DSparkDraftCache", "sampling_distribution",
                                                  "draft_sampling")):
            return module
    raise TypeError(f"{type(drafter).__name__} is not a DSpark drafter; pass drafter=AutoModel.from_pretrained(<the "
                    f"DSpark repo>, trust_remote_code=True).")


@torch.no_grad()
def speculative_generate(
    drafter: nn.Module,
    verifier: nn.Module,
    input_ids: torch.LongTensor,
    max_new_tokens: int = 256,
    temperature: float | None = None,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_token_id: int | list[int] | None = None,
    generator: torch.Generator | None = None,
    draft_method: str = "greedy",
) -> SpeculativeGenerationOutput:
    """Generate with the verifier, drafting B tokens per step with `drafter` (batch size 1; the drafter must have
    the verifier attached).

    Each step drafts `[d_1..d_B]` after the last committed token (`drafter.draft`), scores `[last, d_1..d_B]` with
    one cached verifier forward, and accepts the longest prefix by standard speculative sampling
    (`speculative_accept`: `min(1, p/q)`, residual resampling from `max(0, p - q)`, then a bonus token from the
    verifier when all drafts pass). The output is the verifier's own: token-identical to greedy `generate` at
    temperature 0, identically distributed above, whichever `draft_method` drafts ("greedy", vLLM's default,
    argmax drafts checked as one-hot; "probabilistic", vLLM's, drafts sampled at the temperature only;
    "filtered", drafts sampled with the verifier's top-k/top-p too). The draft method changes only how many drafts
    are accepted.

    Sampling settings default to the verifier's `generation_config` (`sampling_defaults`: greedy when it does not
    sample); `temperature=0` forces greedy. `eos_token_id=None` is the config's. Returns the sequences and the
    tokens committed per verification step.
    """
    code = drafter_code(drafter)
    gen = getattr(verifier, "generation_config", None)
    sampling = sampling_defaults(gen, temperature, top_k, top_p)
    temperature, top_k, top_p = sampling["temperature"], sampling["top_k"], sampling["top_p"]
    code.draft_sampling(draft_method, temperature, top_k, top_p)  # an unknown method is refused before any forward
    if eos_token_id is None:
        eos_token_id = getattr(gen, "eos_token_id", None)
    eos = set([eos_token_id] if isinstance(eos_token_id, int) else (eos_token_id or []))
    if input_ids.dim() == 1:
        input_ids = input_ids.unsqueeze(0)
    if input_ids.shape[0] != 1:
        raise ValueError("speculative generation drafts for one sequence at a time; pass input_ids of shape [1, n].")
    device = next(verifier.parameters()).device
    input_ids = input_ids.to(device)
    vocab = verifier.config.get_text_config().vocab_size
    draft_ids = drafter.draft_vocab_ids.to(device)
    block = drafter.block_size

    def distribution(logits: torch.Tensor) -> torch.Tensor:  # the verifier's processed distribution
        return code.sampling_distribution(logits[..., :vocab], temperature, top_k, top_p)

    capture = code.VerifierStateCapture(verifier, drafter.config.aux_hidden_state_layer_ids)
    with capture:
        out = verifier(input_ids=input_ids, use_cache=True, logits_to_keep=1)
    cache = out.past_key_values
    cache.activate_past_recording()  # sliding-window layers keep what a rejected draft must roll back
    context = capture.aux_hidden_states[0]
    token = sample_from(distribution(out.logits[0, -1]), generator)
    generated = [int(token)]
    committed: list[int] = []
    draft_cache = code.DSparkDraftCache()
    while len(generated) < max_new_tokens and generated[-1] not in eos:
        proposal = drafter.draft(context, token, cache=draft_cache, temperature=temperature, top_k=top_k,
                                 top_p=top_p, generator=generator, draft_method=draft_method)
        drafts = proposal.token_ids.to(device)
        step_ids = torch.cat([token.view(1).to(device), drafts]).unsqueeze(0)
        with capture:
            out = verifier(input_ids=step_ids, past_key_values=cache, use_cache=True)
        if temperature <= 0:  # one-hot p and q: speculative sampling is the longest run of exact matches
            targets = out.logits[0, :, :vocab].argmax(-1)
            accepted = int((drafts == targets[:block]).long().cumprod(0).sum())
            token = targets[accepted]
        else:
            q = torch.zeros(block, vocab, device=device).index_copy_(1, draft_ids, proposal.probs.to(device))
            accepted, token = speculative_accept(distribution(out.logits[0]), q, drafts, generator)
        cache.crop(-(block - accepted))  # forget the rejected drafts' keys and values
        context = capture.aux_hidden_states[0, : accepted + 1]  # states of `token`'s predecessors, now verified
        committed.append(accepted + 1)
        for t in [*drafts[:accepted].tolist(), int(token)]:
            generated.append(t)
            if t in eos or len(generated) >= max_new_tokens:
                break
    new = torch.tensor(generated[:max_new_tokens], device=device).unsqueeze(0)
    return SpeculativeGenerationOutput(sequences=torch.cat([input_ids, new], dim=1), committed_per_step=committed)


# ================================================================================================
# 4. transformers' `custom_generate` entry: `verifier.generate(..., custom_generate=<repo>, drafter=...)`.
# ================================================================================================
# `generate()` arguments this loop honours when passed explicitly; any other is refused rather than ignored.
GENERATE_SETTINGS = ("max_new_tokens", "max_length", "do_sample", "temperature", "top_k", "top_p", "eos_token_id",
                     "pad_token_id", "return_dict_in_generate", "use_cache")
# What transformers forwards from `generate(..., revision=...)` to load this file: not decoding settings.
_LOADING_KWARGS = ("revision", "token", "cache_dir", "force_download", "proxies", "local_files_only", "subfolder",
                   "repo_type")
_UNSUPPORTED = ("logits_processor", "stopping_criteria", "prefix_allowed_tokens_fn", "assistant_model", "streamer",
                "negative_prompt_ids", "negative_prompt_attention_mask")


def generate(model, inputs: torch.LongTensor | None = None, generation_config=None, *, drafter=None,
             draft_method: str = "greedy", generator: torch.Generator | None = None, **kwargs):
    """`model.generate(inputs, custom_generate=<DSpark repo>, trust_remote_code=True, drafter=drafter, ...)`:
    lossless speculative decoding of `model` (the verifier) with `drafter` (`AutoModel.from_pretrained(<repo>,
    trust_remote_code=True)`; attached to `model` here when it is not already).

    The settings are `generate`'s: `generation_config` (default: the verifier's own), overridden by
    `max_new_tokens`, `max_length`, `do_sample`, `temperature`, `top_k`, `top_p`, `eos_token_id`; greedy unless
    the resulting config samples. `draft_method` ("greedy", vLLM's default; "probabilistic"; "filtered") and a
    seeded `generator` are this loop's own. Batch size 1, an all-ones `attention_mask` if any. Returns the
    sequences `[1, prompt + new]`, or with `return_dict_in_generate=True` a `SpeculativeGenerationOutput` that also
    holds the tokens committed per verification step.
    """
    refused = [name for name in _UNSUPPORTED if kwargs.pop(name, None) is not None]
    kwargs.pop("synced_gpus", None)
    for name in _LOADING_KWARGS:
        kwargs.pop(name, None)
    input_ids = kwargs.pop("input_ids", None)
    input_ids = inputs if inputs is not None else input_ids
    attention_mask = kwargs.pop("attention_mask", None)
    settings = {name: kwargs.pop(name) for name in GENERATE_SETTINGS if name in kwargs}
    refused += sorted(kwargs)
    if refused:
        raise ValueError(f"DSpark speculative generation does not support {', '.join(refused)}; pass only "
                         f"{', '.join(GENERATE_SETTINGS)}, draft_method and generator (or call the verifier's own "
                         f"generate without custom_generate).")
    if drafter is None or not isinstance(drafter, nn.Module):
        raise ValueError("custom_generate=<DSpark repo> needs the drafter; pass drafter=AutoModel.from_pretrained("
                         "<the same repo>, trust_remote_code=True).")
    if input_ids is None:
        raise ValueError("pass the prompt's input_ids (shape [1, n]) to generate.")
    if attention_mask is not None and not bool(attention_mask.bool().all()):
        raise ValueError("DSpark speculative generation decodes one unpadded sequence; pass input_ids [1, n] "
                         "without padding.")
    attached = getattr(drafter, "_verifier_embedding", None)
    if attached is None or attached.data_ptr() != model.get_input_embeddings().weight.data_ptr():
        drafter.attach_verifier(model)
    gen = copy.deepcopy(generation_config if generation_config is not None else model.generation_config)
    gen.update(**settings)
    prompt_length = input_ids.shape[-1]
    max_new_tokens = gen.max_new_tokens if gen.max_new_tokens is not None else max(gen.max_length - prompt_length, 0)
    eos = gen.eos_token_id if gen.eos_token_id is not None else []
    out = speculative_generate(drafter, model, input_ids, max_new_tokens=max_new_tokens,
                               **sampling_defaults(gen), eos_token_id=eos, generator=generator,
                               draft_method=draft_method)
    return out if gen.return_dict_in_generate else out.sequences


__all__ = ["generate", "speculative_generate", "SpeculativeGenerationOutput", "speculative_accept", "sample_from",
           "sampling_defaults", "drafter_code"]
