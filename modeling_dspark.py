"""DSpark draft model (remote code: imports only torch, transformers and the stdlib).

A DSpark drafter proposes a block of B tokens in one forward pass. It reads the frozen verifier's
hidden states of every token verified so far (the *context*), and a block of query slots
`[anchor, MASK x (B-1)]` placed right after the context:

    ctx    = hidden_norm(fc(concat(verifier aux states)))           shared by every draft layer
    block  = verifier input-embedding rows of [anchor, MASK, ...]    raw rows: no Gemma sqrt(H) scale
    layer  : queries from the block; keys/values = k/v_proj([ctx ; block]) with k_norm and RoPE
             context visible strictly before the anchor (same document); own block causal on sliding
             layers, bidirectional on full layers; sliding layers also window every query, as vLLM does:
             the query at position i sees keys (context and block) at positions >= i - sliding_window + 1
    logits = lm_head(norm(h)) + markov_w2 . markov_w1[previous token]   over the draft vocabulary, no softcap
    conf   = sigmoid(w . [h ; markov_w1[previous token]] + b)           P(slot accepted | earlier slots accepted)

Slot k of the block anchored at position p predicts token p+k+1; its Markov bias is conditioned on the token
before it (x[p+k] in training, the previously proposed token when drafting).

The file reads top to bottom like a transformers modeling file: helpers (the attention-mask predicate,
document positions, the draft's sampling distributions, the capture of the verifier's states), the building blocks,
the outputs and the draft cache, the pretrained base, and the model itself (draft vocabulary, verifier weights,
heads, backbone, training `forward`, and `draft()`, one serving-time proposal). The speculative decoding loop that
drives `draft()` against a verifier is not the model: it is `generation_dspark.py`, shipped in exported repos as
`custom_generate/generate.py` for `verifier.generate(..., custom_generate=<repo>, drafter=...)`. Parameter names
and saved tensors follow the speculators checkpoint format that vLLM serves, so an exported drafter loads there
unchanged.
"""

import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import create_block_mask
from transformers import AutoModelForCausalLM, PreTrainedModel
from transformers import initialization as init
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.qwen3.modeling_qwen3 import (
    Qwen3MLP,
    Qwen3RMSNorm,
    Qwen3RotaryEmbedding,
    eager_attention_forward,
    rotate_half,
)
from transformers.utils import ModelOutput

try:
    from .configuration_dspark import SLIDING, DSparkConfig, check_aux_layer_ids, verifier_snapshot
except ImportError:  # imported as a top-level module (the package layout) rather than as remote code
    from configuration_dspark import SLIDING, DSparkConfig, check_aux_layer_ids, verifier_snapshot


# ================================================================================================
# 1. The attention mask: one predicate, evaluated densely (sdpa/eager) or by flex attention.
# ================================================================================================
def dspark_mask_mod(
    context_document_ids: torch.Tensor,
    anchor_positions: torch.Tensor,
    anchor_document_ids: torch.Tensor,
    block_size: int,
    sliding_window: int | None,
    causal_block: bool,
) -> Callable:
    """Return `mask_mod(b, h, q_idx, kv_idx) -> bool` for keys `[context (T) ; blocks (N*B)]`.

    Query `q` belongs to block `j = q // B`, slot `k = q % B`, anchored at context index `p =
    anchor_positions[b, j]` in document `anchor_document_ids[b, j]` (-1: padding block). It sees

    * context index `c` iff `c` is in the same document and `c < p` (the anchor's own verifier state does not
      exist yet at serving time);
    * its own block: every slot (full layers / non-causal) or slots `<= k` (sliding layers, causal);
    * nothing else (no other block, so packed blocks train exactly as they are drafted, one at a time).
      Padding blocks see only their own block, so no row is ever fully masked.

    Sliding layers (`sliding_window` W set) window each *query*, as vLLM's DSpark runtime does: the query at
    position `i` sees keys at positions `>= i - W + 1`, context and block keys alike. Slot `k` sits at
    position `pos[p] + k` and, within a document, positions are consecutive, so in index terms slot `k` sees
    context index `c` iff `c >= p + k - W + 1` and own-block slot `j` iff `j >= k - W + 1`.

    The same function builds the dense sdpa/eager mask (broadcast indices) and flex's `BlockMask`, so the
    backends cannot disagree on what is visible.
    """
    context_len = context_document_ids.shape[-1]

    def mask_mod(b, h, q_idx, kv_idx):
        block, slot = q_idx // block_size, q_idx % block_size
        anchor = anchor_positions[b, block]
        document = anchor_document_ids[b, block]
        in_context = kv_idx < context_len
        c = kv_idx.clamp(max=max(context_len - 1, 0))
        visible = in_context & (document >= 0) & (c < anchor)
        if context_len > 0:
            visible = visible & (context_document_ids[b, c] == document)
        key_slot = kv_idx - context_len
        own_block = ~in_context & (key_slot // block_size == block)
        if causal_block:
            own_block = own_block & (key_slot % block_size <= slot)
        if sliding_window is not None:  # per query: keys at positions >= (query position) - W + 1
            visible = visible & (c >= anchor + slot - (sliding_window - 1))
            own_block = own_block & (key_slot % block_size >= slot - (sliding_window - 1))
        return visible | own_block

    return mask_mod


def build_attention_mask(
    mask_mod: Callable,
    batch: int,
    q_len: int,
    kv_len: int,
    device: torch.device,
    attn_implementation: str,
    dtype: torch.dtype,
    compiled: bool = False,
):
    """Materialise `mask_mod` for the attention backend: flex `BlockMask`, sdpa bool, eager additive float.

    `compiled` builds the flex `BlockMask` through `torch.compile(create_block_mask)`: eagerly, the predicate is
    evaluated over every (query, key) pair by many small kernels, compiled it is one fused kernel (on an H200 at the
    seed recipe's 4,096 x 8,192 it took the training forward from 38 to 12 ms, decoder layers compiled in both). GPU training asks for it: its shapes repeat every step, so one compile
    serves the whole run; drafting does not (its context grows by a few tokens per call). If the compiler fails
    (inductor's CPU code generation does at some small shapes under torch 2.13), `CompiledOrEager` warns once and
    builds masks eagerly from then on: the same masks."""
    if attn_implementation == "flex_attention":
        if compiled:
            return _COMPILED_CREATE_BLOCK_MASK(mask_mod, batch, None, q_len, kv_len, device=device)
        return create_block_mask(mask_mod, batch, None, q_len, kv_len, device=device)
    b = torch.arange(batch, device=device).view(batch, 1, 1)
    q = torch.arange(q_len, device=device).view(1, q_len, 1)
    kv = torch.arange(kv_len, device=device).view(1, 1, kv_len)
    dense = mask_mod(b, None, q, kv).expand(batch, q_len, kv_len).unsqueeze(1)  # [R, 1, Q, KV]
    if attn_implementation == "sdpa" or attn_implementation.startswith("paged"):
        return dense
    return torch.zeros(dense.shape, dtype=dtype, device=device).masked_fill_(~dense, torch.finfo(dtype).min)


class CompiledOrEager:
    """`fn` under `torch.compile` (built on the first call), for speed paths whose eager version computes the same
    result: if compiling or running the compiled version fails, one warning names the cause and `fn` itself runs
    from then on in this process. A training run is not lost to a compiler bug, and never pays for a failing
    compile twice."""

    def __init__(self, fn: Callable, what: str):
        self.fn, self.what = fn, what
        self.compiled: Callable | None = None
        self.failed = False

    def __call__(self, *args, **kwargs):
        if not self.failed:
            try:
                if self.compiled is None:
                    self.compiled = torch.compile(self.fn)
                return self.compiled(*args, **kwargs)
            except Exception as e:  # noqa: BLE001 - any compiler failure; the eager call below is exact
                self.failed = True
                first_line = (str(e).splitlines() or [""])[0][:160]
                warnings.warn(f"compiling {self.what} failed ({type(e).__name__}: {first_line}); it runs eagerly from "
                              f"now on (same results, slower); set TORCHDYNAMO_VERBOSE=1 for the compiler's trace.",
                              stacklevel=2)
        return self.fn(*args, **kwargs)


_COMPILED_CREATE_BLOCK_MASK = CompiledOrEager(create_block_mask, "the flex attention mask")


def _attention_backend(config) -> str:
    """The attention backend named by `config._attn_implementation` (sdpa when unset).

    Read at call time by both the mask builder and the layers, so setting
    `drafter.config._attn_implementation` after construction switches both together.
    """
    return config._attn_implementation or "sdpa"


# ================================================================================================
# 2. Document positions of packed rows (runs of equal document ids).
# ================================================================================================
def index_within_runs(values: torch.Tensor) -> torch.Tensor:
    """`[R, T]` -> `[R, T]`: the index of each element within its run of equal consecutive values.

    `[[7, 7, 7, 2, 2, 7]]` -> `[[0, 1, 2, 0, 1, 0]]`. A run restarts wherever the value changes, so a value
    that reappears later starts a new run (packed documents are contiguous, so this is "position within the
    document"). Vectorised: the start index of the current run is a running max over the run starts.
    """
    rows, length = values.shape
    index = torch.arange(length, device=values.device).expand(rows, length)
    starts = torch.ones_like(values, dtype=torch.bool)
    starts[:, 1:] = values[:, 1:] != values[:, :-1]
    start_index = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=1).values
    return index - start_index


def positions_from_document_ids(document_ids: torch.Tensor) -> torch.Tensor:
    """Positions that restart at 0 at every document boundary of a packed row (`[R, T]`)."""
    return index_within_runs(document_ids)


# ================================================================================================
# 3. Sampling distributions: filtering, the distribution a draft (or the verifier) draws from, draft methods.
# ================================================================================================
def filter_logits(logits: torch.Tensor, top_k: int | None = None, top_p: float | None = None) -> torch.Tensor:
    """Top-k then top-p (nucleus) filtering on the last dim; removed entries become -inf."""
    if top_k is not None and 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and 0.0 < top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
        remove = cumulative - torch.softmax(sorted_logits, dim=-1) >= top_p  # keep the token that crosses top_p
        sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    return logits


def sampling_distribution(
    logits: torch.Tensor, temperature: float, top_k: int | None = None, top_p: float | None = None
) -> torch.Tensor:
    """The probabilities a sampler with these settings draws from, over the last dim (float32): one-hot on the
    argmax at temperature 0, else the softmax of the tempered logits after top-k then top-p filtering. This is
    the verifier's processed distribution (the target of acceptance) and, with a draft method's settings
    (`draft_sampling`), the distribution a draft is drawn from."""
    logits = logits.float()
    if temperature <= 0:
        return F.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    return torch.softmax(filter_logits(logits / temperature, top_k, top_p), dim=-1)


# How `draft()` draws its tokens. vLLM's `draft_sample_method` has the first two (its default is "greedy");
# "filtered" is this package's earlier behaviour, kept so results measured with it can be compared.
DRAFT_METHODS = ("greedy", "probabilistic", "filtered")


def draft_sampling(
    draft_method: str, temperature: float, top_k: int | None = None, top_p: float | None = None
) -> dict:
    """`{"temperature", "top_k", "top_p"}` the drafts of `draft_method` are drawn with, for `sampling_distribution`,
    given the verifier's (request's) settings.

    * "greedy" (vLLM's default, `draft_sample_method: greedy`): the argmax of the draft logits whatever the
      verifier's temperature, so temperature 0 here. vLLM then treats the draft distribution as one-hot in
      rejection sampling: draft d is accepted with the verifier's probability p(d), and on rejection the token is
      drawn from p with d removed, renormalised (`generation_dspark.speculative_accept` with a one-hot q is that).
    * "probabilistic" (vLLM's `draft_sample_method: probabilistic`): the softmax of the draft logits at the
      verifier's temperature only. vLLM ignores the request's top-k/top-p when drafting (they shape only the
      verifier's distribution): that costs acceptance, never correctness.
    * "filtered": the verifier's temperature, top-k and top-p applied to the draft logits too; vLLM never drafts
      this way.

    At temperature 0 every method is greedy. (vLLM reference, section 2.8 "Markov head and confidence head at
    inference" and section 6's caveats; in vLLM's source `SpeculativeConfig.draft_sample_method`, the DSpark
    speculator's `_sample_logits`, and the temperature-only note in the GPU speculator's `_copy_request_inputs`.)
    """
    if draft_method not in DRAFT_METHODS:
        raise ValueError(f"draft_method {draft_method!r} is not one of {', '.join(map(repr, DRAFT_METHODS))}; pass "
                         f"one of them ('greedy' is what vLLM serves by default).")
    temperature = float(temperature or 0.0)
    if draft_method == "greedy" or temperature <= 0:
        return {"temperature": 0.0, "top_k": None, "top_p": None}
    if draft_method == "probabilistic":
        return {"temperature": temperature, "top_k": None, "top_p": None}
    return {"temperature": temperature, "top_k": top_k, "top_p": top_p}


# ================================================================================================
# 4. The verifier's hidden states (layer-id convention and pre-norm capture).
# ================================================================================================
def verifier_decoder(verifier: nn.Module) -> nn.Module:
    """The verifier's text decoder stack (the module holding `.layers` and the final `.norm`).

    Works for plain causal LMs (`LlamaForCausalLM.model`) and composite models
    (`Gemma4ForConditionalGeneration.model.language_model`).
    """
    decoder = verifier.get_decoder() if hasattr(verifier, "get_decoder") else verifier
    if not hasattr(decoder, "layers") and hasattr(decoder, "get_decoder"):
        decoder = decoder.get_decoder()
    if not hasattr(decoder, "layers") or not hasattr(decoder, "norm"):
        raise ValueError(
            f"cannot find the decoder layers of {type(verifier).__name__}; pass a causal LM whose decoder exposes "
            f"`.layers` and `.norm` (Llama, Qwen, Gemma families)."
        )
    return decoder


class VerifierStateCapture:
    """Context manager that records, during any forward of the verifier, the states a drafter reads.

    * aux id `L` = the residual stream after `L` decoder layers = the output of decoder layer `L-1`
      (equal to HF `output_hidden_states=True` index `L`; index 0 is the embedding output, which is
      never an aux id);
    * `last_hidden_state` = the output of the *last* decoder layer **before** the final norm (HF's own
      `hidden_states[-1]` is after the norm, so it cannot be used for the teacher).

    Both are captured with forward hooks on the decoder layers, so they work for a plain forward,
    a decoder-only forward (no full-vocabulary logits) and cached generation steps alike.
    """

    def __init__(self, verifier: nn.Module, aux_layer_ids: Sequence[int]):
        self.layers = verifier_decoder(verifier).layers
        n = len(self.layers)
        check_aux_layer_ids(list(aux_layer_ids), n)
        self.aux_layer_ids = list(aux_layer_ids)
        self._states: dict[int, torch.Tensor] = {}
        self._handles: list = []

    def _hook(self, layer_number: int):
        def hook(module, args, output):
            self._states[layer_number] = output[0] if isinstance(output, tuple) else output

        return hook

    def __enter__(self) -> "VerifierStateCapture":
        self._states.clear()
        for number in sorted(set(self.aux_layer_ids) | {len(self.layers)}):
            self._handles.append(self.layers[number - 1].register_forward_hook(self._hook(number)))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    @property
    def aux_hidden_states(self) -> torch.Tensor:
        """`[batch, seq, k*H]`: the aux states concatenated along features in ascending id order."""
        return torch.cat([self._states[i] for i in self.aux_layer_ids], dim=-1)

    @property
    def last_hidden_state(self) -> torch.Tensor:
        """`[batch, seq, H]`: the last decoder layer's output before the verifier's final norm."""
        return self._states[len(self.layers)]


# ================================================================================================
# 5. Building blocks.
# ================================================================================================
def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos.unsqueeze(1) + rotate_half(x) * sin.unsqueeze(1)


class DSparkAttention(nn.Module):
    """Qwen3 attention whose keys/values cover `[context ; block]` and whose queries are the block only.

    Parameter names (`q_proj`, `k_proj`, `v_proj`, `o_proj`, `q_norm`, `k_norm`) are Qwen3's, so vLLM
    loads them into its own DSpark layer. The context K/V do not depend on the block, so they are
    computed by `project_context` (once per layer per forward, or incrementally by a draft cache).

    `config` is the drafter's own (live) `DSparkConfig`: the attention backend is read from it on every
    call, so `drafter.config._attn_implementation = ...` after construction takes effect. `layer_config`
    is its Qwen3 view (`DSparkConfig.layer_config()`, a copy), read only for sizes at construction.
    """

    def __init__(self, config: DSparkConfig, layer_config, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = layer_config.head_dim
        self.num_key_value_groups = layer_config.num_attention_heads // layer_config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.attention_dropout = layer_config.attention_dropout
        self.is_causal = False  # the mask is always explicit
        is_sliding = layer_config.layer_types[layer_idx] == SLIDING
        self.sliding_window = layer_config.sliding_window if is_sliding else None
        bias = layer_config.attention_bias
        hidden, heads = layer_config.hidden_size, layer_config.num_attention_heads
        kv_heads = layer_config.num_key_value_heads
        self.q_proj = nn.Linear(hidden, heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(heads * self.head_dim, hidden, bias=bias)
        self.q_norm = Qwen3RMSNorm(self.head_dim, eps=layer_config.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(self.head_dim, eps=layer_config.rms_norm_eps)

    def _keys_values(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        shape = (*x.shape[:-1], -1, self.head_dim)
        key = _rotate(self.k_norm(self.k_proj(x).view(shape)).transpose(1, 2), cos, sin)
        value = self.v_proj(x).view(shape).transpose(1, 2)
        return key, value

    def project_context(self, context: torch.Tensor, position_embeddings) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of the fused verifier context `[R, T, H]` (no input norm: the context is not a residual stream)."""
        return self._keys_values(context, *position_embeddings)

    def forward(
        self,
        hidden_states: torch.Tensor,
        context_kv: tuple[torch.Tensor, torch.Tensor],
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask,
    ) -> torch.Tensor:
        cos, sin = position_embeddings
        shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        query = _rotate(self.q_norm(self.q_proj(hidden_states).view(shape)).transpose(1, 2), cos, sin)
        block_key, block_value = self._keys_values(hidden_states, cos, sin)
        key = torch.cat([context_kv[0].to(block_key.dtype), block_key], dim=2)
        value = torch.cat([context_kv[1].to(block_value.dtype), block_value], dim=2)
        if torch.is_autocast_enabled(query.device.type):
            # Under autocast the projections come out in the low precision but the q/k norms' fp32 weights upcast
            # query and key again; sdpa re-casts its inputs itself, flex and eager do not: one dtype for every backend.
            dtype = torch.get_autocast_dtype(query.device.type)
            query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
        backend = _attention_backend(self.config)  # the live value, not the layer-config copy's
        attention = ALL_ATTENTION_FUNCTIONS.get_interface(backend, eager_attention_forward)
        output, _ = attention(
            self,
            query,
            key,
            value,
            attention_mask,
            dropout=self.attention_dropout if self.training else 0.0,
            scaling=self.scaling,
        )
        return self.o_proj(output.reshape(*hidden_states.shape[:-1], -1).contiguous())


class DSparkDecoderLayer(GradientCheckpointingLayer):
    """Pre-norm Qwen3 decoder layer over the block; the context enters only through attention K/V.

    Arguments are passed positionally so gradient checkpointing (`GradientCheckpointingLayer`) replays them.
    """

    def __init__(self, config: DSparkConfig, layer_config, layer_idx: int):
        super().__init__()
        self.layer_type = layer_config.layer_types[layer_idx]
        self.self_attn = DSparkAttention(config, layer_config, layer_idx)
        self.mlp = Qwen3MLP(layer_config)
        self.input_layernorm = Qwen3RMSNorm(layer_config.hidden_size, eps=layer_config.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(layer_config.hidden_size, eps=layer_config.rms_norm_eps)

    def forward(self, hidden_states, context_kv, position_embeddings, attention_mask):
        residual = hidden_states
        hidden_states = self.self_attn(
            self.input_layernorm(hidden_states), context_kv, position_embeddings, attention_mask
        )
        hidden_states = residual + hidden_states
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class DSparkLMHead(nn.Module):
    """The verifier's output-embedding rows of the draft vocabulary (frozen, copied in by `attach_verifier`).

    Not an `nn.Linear` on purpose: it is initialised to NaN, so a drafter used without its verifier
    weights fails loudly instead of drafting from random rows.

    Frozen by construction: every parameter registered here is set to `requires_grad=False`, whoever
    installs it. `from_pretrained` and `load_state_dict(assign=True)` replace parameters with fresh,
    trainable ones, and `attach_verifier` may install the verifier's own head; none of these may make the
    verifier's rows train.
    """

    def __init__(self, hidden_size: int, draft_vocab_size: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(draft_vocab_size, hidden_size), requires_grad=False)

    def register_parameter(self, name: str, param: nn.Parameter | None) -> None:
        if param is not None:
            param.requires_grad_(False)
        super().register_parameter(name, param)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        # Compute in the head's dtype: casting a shared full-vocabulary verifier head per call would copy it.
        return F.linear(hidden_states.to(self.weight.dtype), self.weight)


class DSparkMarkovHead(nn.Module):
    """Vanilla rank-r Markov logit bias: `bias = markov_w2(markov_w1[previous verifier token])`.

    Two named parts because the rank-r features of the previous token are read twice: by the logit bias
    and by the confidence head (`[h ; features]`).
    """

    def __init__(self, vocab_size: int, draft_vocab_size: int, rank: int):
        super().__init__()
        # Both parts take the standard normal(initializer_range) init. speculators starts markov_w1 at std 0.01 and
        # markov_w2 at nn.Linear's default; on the demo recipe each measured below this (benchmarks/RESULTS.md).
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, draft_vocab_size, bias=False)

    def previous_features(self, previous_token_ids: torch.Tensor) -> torch.Tensor:
        """`[..., r]` rank-r features of the previous token (verifier ids): `markov_w1[prev]`."""
        return self.markov_w1(previous_token_ids)

    def logit_bias(self, features: torch.Tensor) -> torch.Tensor:
        """`[..., Vd]` draft-vocabulary logit bias from the previous-token features: `markov_w2(features)`."""
        return self.markov_w2(features)

    def forward(self, previous_token_ids: torch.Tensor) -> torch.Tensor:
        return self.logit_bias(self.previous_features(previous_token_ids))


class DSparkConfidenceHead(nn.Module):
    """Logit of P(slot accepted | earlier slots accepted) from `[h ; markov_w1[previous token]]`."""

    def __init__(self, input_size: int):
        super().__init__()
        self.proj = nn.Linear(input_size, 1)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.proj(features).squeeze(-1)


# ================================================================================================
# 6. Outputs and the serving-time draft cache.
# ================================================================================================
@dataclass
class DSparkDraftOutput(ModelOutput):
    """Training forward output. Block dims are `[rows R, anchors N, slots B]`.

    Attributes:
        logits: `[R, N, B, Vd]` Markov-corrected draft logits (None with `return_logits=False`).
        last_hidden_state: `[R, N, B, H]` post-norm draft states (the input of lm_head and the heads).
        confidence_logits: `[R, N, B]` confidence-head logits (None when the head is disabled).
        previous_token_ids: `[R, N, B]` verifier ids conditioning each slot (teacher forcing: `x[p+k]`).
        anchor_mask: `[R, N]` True for real anchors (False for padding blocks).
        previous_features: `[R, N, B, r]` Markov features `markov_w1[previous_token_ids]` (None without a Markov
            head), looked up once and read by the logits and the confidence head, so their gradients reach the
            `[V, r]` table through one lookup (one dense `[V, r]` gradient in the backward, not one per reader).
    """

    logits: torch.Tensor | None = None
    last_hidden_state: torch.Tensor | None = None
    confidence_logits: torch.Tensor | None = None
    previous_token_ids: torch.Tensor | None = None
    anchor_mask: torch.Tensor | None = None
    previous_features: torch.Tensor | None = None


@dataclass
class DSparkProposal(ModelOutput):
    """One serving-time proposal of B tokens (`draft()`).

    Attributes:
        token_ids: `[B]` proposed tokens in verifier ids.
        draft_token_ids: `[B]` the same tokens in draft-vocabulary ids.
        probs: `[B, Vd]` the distribution each token was drawn from (one-hot for greedy drafts, and for every
            draft method at temperature 0), the q of speculative-sampling acceptance.
        confidence: `[B]` sigmoid of the confidence head (None when disabled).
        logits: `[B, Vd]` the raw Markov-corrected logits.
    """

    token_ids: torch.Tensor | None = None
    draft_token_ids: torch.Tensor | None = None
    probs: torch.Tensor | None = None
    confidence: torch.Tensor | None = None
    logits: torch.Tensor | None = None


class DSparkDraftCache:
    """Per-layer context K/V of the verified tokens so far, extended incrementally between proposals
    (the same precomputation vLLM does): each `draft()` call then costs one block pass, not a re-read of
    the whole history. Positions are token indices of a single sequence starting at 0."""

    def __init__(self):
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.length = 0

    def update(self, new_kv_per_layer: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Append each layer's `(keys, values)` `[1, kv_heads, n, head_dim]` of `n` newly verified tokens
        along the sequence dim and advance `length` by `n`."""
        new_kv_per_layer = list(new_kv_per_layer)
        if not new_kv_per_layer:
            return
        if self.keys and len(new_kv_per_layer) != len(self.keys):
            raise ValueError(
                f"the draft cache holds {len(self.keys)} layers but the update has {len(new_kv_per_layer)}; "
                f"use one DSparkDraftCache per drafter and sequence."
            )
        if self.keys:
            self.keys = [torch.cat([old, k], dim=2) for old, (k, _) in zip(self.keys, new_kv_per_layer)]
            self.values = [torch.cat([old, v], dim=2) for old, (_, v) in zip(self.values, new_kv_per_layer)]
        else:
            self.keys = [k for k, _ in new_kv_per_layer]
            self.values = [v for _, v in new_kv_per_layer]
        self.length += new_kv_per_layer[0][0].shape[2]


# ================================================================================================
# 7. The pretrained base.
# ================================================================================================
class DSparkPreTrainedModel(PreTrainedModel):
    config: DSparkConfig
    base_model_prefix = "dspark"
    supports_gradient_checkpointing = True
    _no_split_modules = ["DSparkDecoderLayer"]
    _supports_sdpa = True
    _supports_flex_attn = True

    def _init_weights(self, module):
        super()._init_weights(module)
        if isinstance(module, DSparkLMHead):
            init.constant_(module.weight, float("nan"))  # filled from the verifier by attach_verifier
        elif isinstance(module, DSparkDraftModel) and module.config.uses_draft_vocab:
            init.zeros_(module.d2t)
            init.zeros_(module.t2d)


# ================================================================================================
# 8. The model.
# ================================================================================================
class DSparkDraftModel(DSparkPreTrainedModel):
    """The DSpark drafter. See the module docstring for the computation.

    Weights owned by the verifier are not part of this model's state: the input embedding is shared
    with the verifier (`attach_verifier`, no copy), and `lm_head` holds the verifier's output rows of the
    draft vocabulary (saved only when the draft vocabulary is a strict subset, always frozen). Use:

        drafter = DSparkDraftModel(DSparkConfig.from_verifier(verifier_model, ...))
        drafter.set_draft_vocab(token_ids)        # sorted verifier ids, len == draft_vocab_size
        drafter.attach_verifier(verifier_model)
        out = drafter(input_ids, aux_hidden_states, anchor_positions, document_ids=..., position_ids=...)
        proposal = drafter.draft(context_aux_states, bonus_token_id)
    """

    def __init__(self, config: DSparkConfig):
        super().__init__(config)
        if config.mask_token_id is None:
            raise ValueError("config.mask_token_id is not set; build the config with DSparkConfig.from_verifier(...).")
        if not config.aux_hidden_state_layer_ids:
            raise ValueError("config.aux_hidden_state_layer_ids is empty; build the config with from_verifier(...).")
        config = self.config  # the live config: layers read its attention backend at call time
        layer_config = config.layer_config()
        hidden, vocab, draft_vocab = config.hidden_size, config.vocab_size, config.draft_vocab_size
        self.block_size = config.block_size
        self.fc = nn.Linear(config.aux_input_size, hidden, bias=False)
        self.hidden_norm = Qwen3RMSNorm(hidden, eps=layer_config.rms_norm_eps)
        self.layers = nn.ModuleList(
            DSparkDecoderLayer(config, layer_config, i) for i in range(config.num_hidden_layers)
        )
        self.norm = Qwen3RMSNorm(hidden, eps=layer_config.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(layer_config)
        self.lm_head = DSparkLMHead(hidden, draft_vocab)
        rank = config.markov_rank
        self.markov_head = DSparkMarkovHead(vocab, draft_vocab, rank) if rank > 0 else None
        self.confidence_head = None
        if config.enable_confidence_head:
            with_markov = config.confidence_head_with_markov
            self.confidence_head = DSparkConfidenceHead(hidden + (rank if with_markov else 0))
        if config.uses_draft_vocab:
            self.register_buffer("d2t", torch.zeros(draft_vocab, dtype=torch.long))
            self.register_buffer("t2d", torch.zeros(vocab, dtype=torch.bool))
        # Shared verifier tensors (no copy); deliberately plain attributes, so they are never saved or optimized.
        self._verifier_embedding: torch.Tensor | None = None
        self._verifier_output: torch.Tensor | None = None
        self.post_init()
        if not config.uses_draft_vocab:  # a full-vocabulary head *is* the verifier's: never saved
            self._keys_to_ignore_on_save = set(self._keys_to_ignore_on_save or ()) | {"lm_head.weight"}
            self._keys_to_ignore_on_load_missing = ["lm_head.weight"]

    # ------------------------------------------------------------------ draft vocabulary
    def set_draft_vocab(self, token_ids) -> None:
        """Set the draft vocabulary from its sorted verifier ids (`d2t[i] = id_i - i`, `t2d[id] = True`).

        Refreshes `lm_head` from the attached verifier, if any.
        """
        ids = torch.as_tensor(token_ids, dtype=torch.long).flatten().cpu()
        cfg = self.config
        if ids.numel() != cfg.draft_vocab_size:
            raise ValueError(
                f"the draft vocabulary has {ids.numel()} ids but config.draft_vocab_size is {cfg.draft_vocab_size}; "
                f"pass exactly {cfg.draft_vocab_size} verifier ids."
            )
        if ids.numel() and (ids.min() < 0 or ids.max() >= cfg.vocab_size):
            raise ValueError(f"draft vocabulary ids must lie in 0..{cfg.vocab_size - 1}; got {ids.min()}..{ids.max()}.")
        if (ids[1:] <= ids[:-1]).any():
            raise ValueError("draft vocabulary ids must be sorted ascending without duplicates; pass sorted(set(ids)).")
        if not cfg.uses_draft_vocab:
            return  # the only sorted, unique list of V ids is 0..V-1: the identity mapping, nothing to store
        with torch.no_grad():
            self.d2t.copy_(ids - torch.arange(ids.numel()))
            self.t2d.zero_()
            self.t2d[ids.to(self.t2d.device)] = True
        if self._verifier_embedding is not None:
            self._fill_lm_head()

    @property
    def draft_vocab_ids(self) -> torch.Tensor:
        """`[Vd]` verifier ids of the draft vocabulary, ascending."""
        draft = torch.arange(self.config.draft_vocab_size, device=self.lm_head.weight.device)
        return self.draft_to_verifier_ids(draft)

    def draft_to_verifier_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Map draft-vocabulary ids to verifier ids (`id + d2t[id]`; identity for a full vocabulary)."""
        if not self.config.uses_draft_vocab:
            return draft_ids
        return draft_ids + self.d2t[draft_ids]

    def verifier_to_draft_ids(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Map verifier ids to draft ids, `-1` for tokens outside the draft vocabulary."""
        if not self.config.uses_draft_vocab:
            return token_ids
        index = torch.cumsum(self.t2d.long(), 0) - 1
        return torch.where(self.t2d[token_ids], index[token_ids], torch.full_like(token_ids, -1))

    # ------------------------------------------------------------------ verifier weights
    def attach_verifier(self, verifier: nn.Module) -> None:
        """Share the verifier's input embedding (raw rows, no copy) and fill `lm_head` with its output rows.

        Checks the pairing first: hidden size, vocabulary, layer count (aux ids must exist) and, when the
        config carries a verifier snapshot, the softcap. A drafter saved by speculators carries no snapshot; it
        gets this verifier's, so training, evaluation and export know the softcap and family from here on.
        """
        cfg = self.config
        text = verifier.config.get_text_config()
        v_hidden = text.hidden_size
        v_vocab = text.vocab_size
        v_layers = len(verifier_decoder(verifier).layers)
        expected = cfg.verifier_text_config or {}
        problems = []
        if (cfg.target_hidden_size or cfg.hidden_size) != v_hidden:
            problems.append(f"hidden size {v_hidden} (drafter expects {cfg.target_hidden_size or cfg.hidden_size})")
        if v_vocab != cfg.vocab_size:
            problems.append(f"vocabulary {v_vocab} (drafter expects {cfg.vocab_size})")
        if max(cfg.aux_hidden_state_layer_ids) > v_layers - 1:
            problems.append(f"{v_layers} layers (aux ids {cfg.aux_hidden_state_layer_ids} need more)")
        elif expected.get("num_hidden_layers") not in (None, v_layers):
            problems.append(f"{v_layers} layers (drafter was built for {expected['num_hidden_layers']})")
        softcap = getattr(text, "final_logit_softcapping", None)
        if "final_logit_softcapping" in expected and expected["final_logit_softcapping"] != softcap:
            problems.append(f"softcap {softcap} (drafter was built for {expected['final_logit_softcapping']})")
        if problems:
            raise ValueError(
                f"this drafter does not fit the given verifier ({'; '.join(problems)}); attach the verifier it was "
                f"trained for ({cfg.verifier_name_or_path or cfg.verifier_local_path or 'see config.json'})."
            )
        embedding = verifier.get_input_embeddings()
        head = verifier.get_output_embeddings()
        if embedding is None or head is None:
            raise ValueError(f"{type(verifier).__name__} exposes no input/output embeddings; pass the causal-LM model.")
        if not cfg.verifier_text_config:
            cfg.verifier_text_config = verifier_snapshot(verifier.config, type(verifier).__name__)
        self._verifier_embedding = embedding.weight.detach()
        self._verifier_output = head.weight.detach()
        self._fill_lm_head()

    @torch.no_grad()
    def _fill_lm_head(self) -> None:
        rows = self._verifier_output
        if self.config.uses_draft_vocab:
            if int(self.t2d.sum()) != self.config.draft_vocab_size:
                raise RuntimeError("the draft vocabulary is not set; call set_draft_vocab(token_ids) first.")
            rows = rows[self.draft_vocab_ids.to(rows.device)]
            self.lm_head.weight.data = rows.to(device=self.lm_head.weight.device, dtype=self.lm_head.weight.dtype)
        else:  # full vocabulary: use the verifier's head itself (no copy)
            self.lm_head.weight = nn.Parameter(rows, requires_grad=False)

    def load_verifier(self, verifier_name_or_path: str | None = None, **from_pretrained_kwargs) -> nn.Module:
        """Load the verifier named in the config (local path first, then the Hub id), attach it, return it."""
        name = verifier_name_or_path or self.config.verifier_local_path or self.config.verifier_name_or_path
        if not name:
            raise ValueError("the config names no verifier; pass load_verifier('org/name') or attach_verifier(model).")
        verifier = AutoModelForCausalLM.from_pretrained(name, **from_pretrained_kwargs)
        verifier.eval().requires_grad_(False)
        self.attach_verifier(verifier)
        return verifier

    def _require_verifier(self) -> torch.Tensor:
        if self._verifier_embedding is None:
            raise RuntimeError(
                "this DSpark drafter has no verifier weights attached (its input embeddings and output rows come "
                "from the verifier); call drafter.attach_verifier(verifier_model) or drafter.load_verifier() first."
            )
        return self._verifier_embedding

    def embed_tokens(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Raw verifier input-embedding rows (no Gemma sqrt(H) scale, as vLLM's shared embedding)."""
        table = self._require_verifier()
        rows = F.embedding(token_ids.to(table.device), table)
        return rows.to(device=self.fc.weight.device, dtype=self.fc.weight.dtype)

    def get_input_embeddings(self):
        return None  # shared with the verifier at run time, never part of this model

    # ------------------------------------------------------------------ heads (shared by training and drafting)
    def logit_terms(self, hidden_states: torch.Tensor, previous_token_ids: torch.Tensor,
                    previous_features: torch.Tensor | None = None):
        """The draft logits as a sum of linear maps, `sum_i x_i @ W_i^T`: `(h, lm_head.weight)` and, with a
        Markov head, `(markov_w1[prev], markov_w2.weight)`. Each `x_i` is cast to its `W_i`'s dtype. The training
        loss reads this form to write the gradients of its logits straight into `x_i` and `W_i`
        (trainer/train/loss.py), so it never keeps or recomputes a `[slots, Vd]` tensor for the backward.
        `previous_features` are `markov_w1[previous_token_ids]` when the caller already looked them up."""
        head = self.lm_head.weight
        terms = [(hidden_states.to(head.dtype), head)]
        if self.markov_head is not None:
            w2 = self.markov_head.markov_w2.weight
            if previous_features is None:
                previous_features = self.markov_head.previous_features(previous_token_ids)
            terms.append((previous_features.to(w2.dtype), w2))
        return terms

    def compute_logits(self, hidden_states: torch.Tensor, previous_token_ids: torch.Tensor,
                       previous_features: torch.Tensor | None = None) -> torch.Tensor:
        """Markov-corrected draft logits `lm_head(h) + markov_w2(markov_w1[prev])` (prev in verifier ids): the sum
        of `logit_terms`."""
        (x, head), *rest = self.logit_terms(hidden_states, previous_token_ids, previous_features)
        logits = F.linear(x, head)
        for features, weight in rest:
            logits = logits + F.linear(features, weight).to(logits.dtype)
        return logits

    def compute_confidence(self, hidden_states: torch.Tensor, previous_token_ids: torch.Tensor,
                           previous_features: torch.Tensor | None = None) -> torch.Tensor | None:
        """Confidence logits from `[h ; markov_w1[prev]]` (or `h` alone), None when the head is disabled;
        `previous_features` are `markov_w1[prev]` when the caller already looked them up."""
        if self.confidence_head is None:
            return None
        features = hidden_states
        if self.config.confidence_head_with_markov:
            if previous_features is None:
                previous_features = self.markov_head.previous_features(previous_token_ids)
            features = torch.cat([hidden_states, previous_features.to(hidden_states.dtype)], dim=-1)
        return self.confidence_head(features)

    # ------------------------------------------------------------------ backbone
    def _position_embeddings(self, reference: torch.Tensor, position_ids: torch.Tensor):
        return self.rotary_emb(reference, position_ids)

    def _masks(self, context_document_ids, anchor_positions, anchor_document_ids, q_len, kv_len, dtype,
               compiled: bool = False):
        """One mask per layer type in use, shared by all layers of that type, for the configured backend
        (`compiled`: see `build_attention_mask`)."""
        impl = _attention_backend(self.config)
        masks = {}
        for layer in self.layers:
            kind = layer.layer_type
            if kind in masks:
                continue
            window = self.config.transformer_layer_config["sliding_window"] if kind == SLIDING else None
            causal = kind == SLIDING and not self.config.sliding_window_non_causal
            mask_mod = dspark_mask_mod(
                context_document_ids, anchor_positions, anchor_document_ids, self.block_size, window, causal
            )
            masks[kind] = build_attention_mask(
                mask_mod, anchor_positions.shape[0], q_len, kv_len, anchor_positions.device, impl, dtype,
                compiled=compiled,
            )
        return masks

    def _run_layers(self, block_embeds, block_positions, context_kv_per_layer, masks):
        block_rope = self._position_embeddings(block_embeds, block_positions)
        hidden = block_embeds
        for layer, context_kv in zip(self.layers, context_kv_per_layer):
            hidden = layer(hidden, context_kv, block_rope, masks[layer.layer_type])
        return self.norm(hidden)

    def fuse_context(self, aux_hidden_states: torch.Tensor) -> torch.Tensor:
        """`hidden_norm(fc(aux))`: the context every draft layer attends to."""
        if aux_hidden_states.shape[-1] != self.fc.in_features:
            raise ValueError(
                f"aux hidden states have width {aux_hidden_states.shape[-1]} but the drafter expects "
                f"{self.fc.in_features} ({len(self.config.aux_hidden_state_layer_ids)} verifier layers "
                f"{self.config.aux_hidden_state_layer_ids} x hidden size); extract exactly those layers."
            )
        return self.hidden_norm(self.fc(aux_hidden_states.to(self.fc.weight.dtype)))

    # ------------------------------------------------------------------ training forward
    def forward(
        self,
        input_ids: torch.LongTensor,
        aux_hidden_states: torch.Tensor,
        anchor_positions: torch.LongTensor,
        document_ids: torch.LongTensor | None = None,
        position_ids: torch.LongTensor | None = None,
        return_logits: bool = True,
    ) -> DSparkDraftOutput:
        """Teacher-forced training forward over packed rows.

        Args:
            input_ids: `[R, T]` verifier token ids of the packed rows.
            aux_hidden_states: `[R, T, k*H]` verifier aux states (`VerifierStateCapture`).
            anchor_positions: `[R, N]` anchor indices into each row, `-1` for padding. Sampling anchors
                is the trainer's job; the model uses exactly these.
            document_ids: `[R, T]` document index per token, `-1` on padding (default: one document).
            position_ids: `[R, T]` positions restarting at 0 per document (default: from `document_ids`).
            return_logits: set False to skip the `[R, N, B, Vd]` logits (the trainer recomputes them in chunks
                from `last_hidden_state` with `compute_logits`, bounding memory).

        Block j at anchor p holds `[x_p, MASK, ...]` at positions `pos[p] + k`; slot k predicts `x_{p+k+1}`
        and its Markov bias is conditioned on `x_{p+k}`. All blocks of a row are one query sequence; the mask
        keeps them independent, so each trains exactly as `draft` computes it.
        """
        rows, length = input_ids.shape
        device = input_ids.device
        block = self.block_size
        anchor_positions = anchor_positions.to(device=device, dtype=torch.long)
        if document_ids is None:
            document_ids = torch.zeros_like(input_ids)
        if position_ids is None:
            position_ids = positions_from_document_ids(document_ids)
        valid = anchor_positions >= 0
        if bool((anchor_positions >= length).any()):
            raise ValueError(f"anchor positions must be < the row length {length} (or -1 for padding).")
        anchors = anchor_positions.clamp(min=0)
        n_anchors = anchors.shape[1]
        anchor_documents = document_ids.gather(1, anchors).masked_fill(~valid, -1)

        offsets = torch.arange(block, device=device)
        block_tokens = torch.full((rows, n_anchors, block), self.config.mask_token_id, dtype=torch.long, device=device)
        block_tokens[..., 0] = input_ids.gather(1, anchors)
        block_positions = position_ids.gather(1, anchors).unsqueeze(-1) + offsets  # [R, N, B]
        follow = (anchors.unsqueeze(-1) + offsets).clamp(max=length - 1).view(rows, -1)
        previous = input_ids.gather(1, follow).view(rows, n_anchors, block)  # teacher forcing: x[p+k]

        context = self.fuse_context(aux_hidden_states)
        context_rope = self._position_embeddings(context, position_ids)
        context_kv = [layer.self_attn.project_context(context, context_rope) for layer in self.layers]
        block_embeds = self.embed_tokens(block_tokens.view(rows, -1))
        masks = self._masks(
            document_ids, anchors.masked_fill(~valid, 0), anchor_documents, n_anchors * block,
            length + n_anchors * block, block_embeds.dtype, compiled=self.training and device.type == "cuda",
        )
        hidden = self._run_layers(block_embeds, block_positions.view(rows, -1), context_kv, masks)
        hidden = hidden.view(rows, n_anchors, block, -1)
        features = self.markov_head.previous_features(previous) if self.markov_head is not None else None
        return DSparkDraftOutput(
            logits=self.compute_logits(hidden, previous, features) if return_logits else None,
            last_hidden_state=hidden,
            confidence_logits=self.compute_confidence(hidden, previous, features),
            previous_token_ids=previous,
            anchor_mask=valid,
            previous_features=features,
        )

    # ------------------------------------------------------------------ drafting (serving time)
    @torch.no_grad()
    def draft(
        self,
        aux_hidden_states: torch.Tensor,
        bonus_token_id: int | torch.Tensor,
        cache: DSparkDraftCache | None = None,
        temperature: float = 0.0,
        top_k: int | None = None,
        top_p: float | None = None,
        generator: torch.Generator | None = None,
        draft_method: str = "greedy",
    ) -> DSparkProposal:
        """Propose B tokens after the verified context, computed as vLLM serves the drafter.

        Args:
            aux_hidden_states: `[n, k*H]` (or `[1, n, k*H]`) verifier aux states of the context tokens not yet
                in `cache` (all of them when `cache` is None). Context tokens sit at positions 0..len-1.
            bonus_token_id: the last token the verifier produced (the anchor), at position `len(context)`.
            cache: a `DSparkDraftCache` reused across calls of one sequence (extended in place).
            temperature / top_k / top_p: the verifier's sampling settings (0: greedy decoding).
            draft_method: how each slot's token is drawn from its logits, as vLLM's `draft_sample_method`
                (`draft_sampling`): "greedy" (the default, vLLM's) takes the argmax even when the verifier
                samples; "probabilistic" samples at `temperature` only (no top-k/top-p, as vLLM does);
                "filtered" samples from the tempered, top-k/top-p-filtered distribution (not what vLLM serves).
                At temperature 0 every method is greedy. `probs` is the distribution each draft was drawn from.

        The context's K/V per layer are projected once and appended to the cache. Then one backbone pass over
        the block `[bonus, MASK x (B-1)]` at positions `len .. len+B-1`, which sees the context (a single
        document; the anchor is the bonus token, whose own verifier state does not exist yet; on sliding layers
        only the keys within each query's window) and its own block, with the training mask. Then B sequential
        Markov steps: slot k's bias is conditioned on the previously proposed token (the bonus for slot 0),
        mapped to verifier ids, exactly the teacher-forced chain of training when the proposals are correct.
        """
        drawing = draft_sampling(draft_method, temperature, top_k, top_p)  # refuses an unknown method first
        cache = cache if cache is not None else DSparkDraftCache()
        aux = aux_hidden_states.reshape(1, -1, aux_hidden_states.shape[-1])
        device = self.fc.weight.device
        if aux.shape[1]:
            new_positions = torch.arange(cache.length, cache.length + aux.shape[1], device=device).unsqueeze(0)
            context = self.fuse_context(aux.to(device))
            rope = self._position_embeddings(context, new_positions)
            cache.update([layer.self_attn.project_context(context, rope) for layer in self.layers])
        if cache.length == 0:
            raise ValueError("draft() needs the verifier states of at least one context token.")
        block = self.block_size
        n = cache.length
        bonus = torch.as_tensor(bonus_token_id, device=device).reshape(1)
        tokens = torch.full((1, block), self.config.mask_token_id, dtype=torch.long, device=device)
        tokens[0, 0] = bonus[0]
        positions = (n + torch.arange(block, device=device)).unsqueeze(0)
        embeds = self.embed_tokens(tokens)
        masks = self._masks(
            torch.zeros(1, n, dtype=torch.long, device=device),
            torch.full((1, 1), n, dtype=torch.long, device=device),
            torch.zeros(1, 1, dtype=torch.long, device=device),
            block, n + block, embeds.dtype,
        )
        hidden = self._run_layers(embeds, positions, list(zip(cache.keys, cache.values)), masks)[0]  # [B, H]
        base = self.lm_head(hidden).float()

        previous = bonus.long()
        out_draft, out_tokens, out_probs, out_logits, out_conf = [], [], [], [], []
        for k in range(block):
            h = hidden[k : k + 1]
            logits = base[k : k + 1]
            if self.markov_head is not None:
                logits = logits + self.markov_head(previous).float()
            confidence = self.compute_confidence(h, previous)
            probs = sampling_distribution(logits, **drawing)
            if drawing["temperature"] > 0:
                draft_id = torch.multinomial(probs.cpu(), 1, generator=generator).view(1).to(device)
            else:  # one-hot on the argmax
                draft_id = logits.argmax(dim=-1)
            token = self.draft_to_verifier_ids(draft_id)
            out_draft.append(draft_id)
            out_tokens.append(token)
            out_probs.append(probs)
            out_logits.append(logits)
            if confidence is not None:
                out_conf.append(torch.sigmoid(confidence.float()))
            previous = token
        return DSparkProposal(
            token_ids=torch.cat(out_tokens),
            draft_token_ids=torch.cat(out_draft),
            probs=torch.cat(out_probs),
            confidence=torch.cat(out_conf) if out_conf else None,
            logits=torch.cat(out_logits),
        )


__all__ = [
    "DSparkDraftModel",
    "DSparkPreTrainedModel",
    "DSparkDraftOutput",
    "DSparkProposal",
    "DSparkDraftCache",
    "VerifierStateCapture",
    "verifier_decoder",
    "dspark_mask_mod",
    "build_attention_mask",
    "index_within_runs",
    "positions_from_document_ids",
    "DRAFT_METHODS",
    "draft_sampling",
    "filter_logits",
    "sampling_distribution",
]

DSparkConfig.register_for_auto_class()
DSparkDraftModel.register_for_auto_class("AutoModel")
