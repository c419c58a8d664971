"""Muon for the drafter's hidden matrices, AdamW for everything else, as one optimizer for the Trainer.

Muon (`torch.optim.Muon`, torch >= 2.9) orthogonalises the update of 2-D hidden weight matrices; it is the
wrong tool for vectors (norm gains, biases), for embedding-like or output-like tables (the Markov factors
`markov_w1` [V, r] and `markov_w2` [Vd, r]) and for the degenerate `[1, H+r]` confidence projection, which go
to AdamW. LoRA adapter matrices also go to AdamW. The split is `muon_parameter_names` below and is tested
exactly.

Newton-Schulz precision. `torch.optim.Muon` always runs its Newton-Schulz orthogonalisation (15 matmuls per
matrix per step) in bfloat16, which pays off on CUDA tensor cores. On a CPU without native bf16 matmuls
(e.g. AVX2 only) those matmuls fall back to a slow generic kernel: one step on three 1536x576 matrices took
~16 s instead of ~0.1 s in float32, and a 0.55B drafter's optimizer step 127 s instead of 1.4 s. Even on a CPU
that has bf16 instructions, float32 is only a few times slower, and it is more precise. So `DtypeMuon` runs
Newton-Schulz in `newton_schulz_dtype`; the default `"auto"` means bfloat16 for CUDA parameters (torch's own
behaviour) and float32 for every other device (CPU, MPS, ...), where fast bf16 matmuls cannot be assumed. The
choice is not detected from CPU flags, so the same run gives the same updates on every CPU. Apart from the
precision of the matmuls the update is torch's, line for line (coefficients, steps, normalisation, momentum,
Nesterov, decoupled weight decay, `adjust_lr_fn`); with `newton_schulz_dtype="bfloat16"` it is bit-identical
to `torch.optim.Muon` (bar one torch quirk: for bf16 parameters without Nesterov, torch's in-place
normalisation also rescales the momentum buffer; here it does not). `DtypeMuon` is a subclass that overrides only `step`: torch itself is not patched, and
other `torch.optim.Muon` instances in the process are unaffected. Its state dict is `torch.optim.Muon`'s.

Cost. In float32 (and wider), matrices of one shape are orthogonalised in stacks of up to 8 MiB (the step's
only transient memory besides the gradients), and where it needs fewer multiply-adds (`n > 1.5 m` for a wide
`m x n` matrix: the MLP's and `fc`) the iteration runs on the `m x m` Gram matrix instead of on X
(`orthogonalize_batch`): the same update in exact arithmetic, ~1.6x faster on the MLP
matrices; against torch's iteration in float64 it differs by ~2e-5 relative (up to 2e-4 on ill-conditioned
inputs), where torch's own bf16 Muon differs by ~1e-2. The AdamW half uses torch's fused kernel on CPU and
CUDA: the same update, one pass over each tensor instead of ~7 (0.43 s -> 0.05 s for a [262144, 256] Markov
table on two CPU cores).

The Trainer accepts a factory through `optimizer_cls_and_kwargs=(MuonAdamWFactory, kwargs)`: it calls the
factory with the model and gets one `torch.optim.Optimizer` whose `param_groups` are the union of both inner
optimizers' groups (the same dicts), so the LR scheduler drives both, and whose state dict holds both.
"""

import math

import torch
from torch import Tensor, nn

NewtonSchulzDtype = str | torch.dtype  # "auto", "float32", "bfloat16", ... or a floating torch.dtype


def newton_schulz_dtype_for(setting: NewtonSchulzDtype, device: torch.device | str) -> torch.dtype:
    """The dtype Newton-Schulz runs in for a parameter on `device`: `"auto"` is bfloat16 on CUDA, float32
    elsewhere; anything else names (or is) a floating dtype used everywhere."""
    if isinstance(setting, str) and setting == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    dtype = getattr(torch, setting, None) if isinstance(setting, str) else setting
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"newton_schulz_dtype must be 'auto' or a floating dtype such as 'float32' or "
                         f"'bfloat16'; got {setting!r}.")
    return dtype


def zeropower_via_newton_schulz(grad: Tensor, ns_coefficients: tuple[float, float, float], ns_steps: int,
                                eps: float, dtype: torch.dtype) -> Tensor:
    """torch's quintic Newton-Schulz orthogonalisation (`torch.optim._muon._zeropower_via_newtonschulz`),
    computed in `dtype` instead of always bfloat16. Never writes into `grad` (torch's in-place normalisation
    can write into the momentum buffer when the parameter is already bf16 and Nesterov is off)."""
    if ns_steps >= 100:
        raise ValueError("Number of steps must be less than 100 for computational efficiency")
    if grad.ndim != 2:
        raise ValueError("Input tensor gradient must be a 2D matrix")
    if len(ns_coefficients) != 3:
        raise ValueError("Coefficients must be a tuple of exactly 3 values")
    a, b, c = ns_coefficients
    tall = grad.size(0) > grad.size(1)
    x = grad.to(dtype)
    if tall:
        x = x.T  # iterate on the wide orientation, so the Gram matrix is the small one
    x = x / x.norm().clamp(min=eps)  # Frobenius norm >= spectral norm, so the spectral norm is at most 1
    for _ in range(ns_steps):
        gram = x @ x.T
        poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)  # b*A + c*A@A
        x = torch.addmm(x, poly, x, beta=a)  # a*X + (b*A + c*A@A) @ X
    return x.T if tall else x


# Elements per stack of same-shape matrices (8 MiB in float32): the stack, its result and the Gram-space
# temporaries are the optimizer step's only transient memory, so they stay small next to the gradients.
STACK_ELEMENTS = 1 << 21


def _newton_schulz_flops(rows: int, cols: int, ns_steps: int) -> tuple[int, int]:
    """Multiply-add counts of the two equal-in-exact-arithmetic forms for a wide `rows <= cols` matrix: the
    iteration on X (`X @ X^T`, the polynomial, `poly @ X` per step) and the iteration on the Gram matrix
    (`A = X X^T` once, then only `rows x rows` products, one final `M @ X`)."""
    m, n = rows, cols
    on_x = ns_steps * (2 * m * m * n + m**3)
    on_gram = 2 * m * m * n + max(0, 4 * ns_steps - 3) * m**3
    return on_x, on_gram


def orthogonalize_batch(updates: Tensor, ns_coefficients: tuple[float, float, float], ns_steps: int,
                        eps: float) -> Tensor:
    """torch's quintic Newton-Schulz for a `[b, m, n]` stack of wide (`m <= n`) matrices, in their dtype (float32
    or float64: the Gram form below is not for half precision, whose rounding it amplifies).

    Every iterate is `X_k = M_k X_0` with `M_k` a polynomial in `A_0 = X_0 X_0^T`, so the iteration can run on
    `m x m` matrices: `Q = aI + bA + cA^2`, `M <- Q M`, `A <- Q A Q`, and `X_5 = M_5 X_0` at the end. That is
    the same update in exact arithmetic; it costs `2 m^2 n + 17 m^3` multiply-adds per matrix at 5 steps
    instead of `5 (2 m^2 n + m^3)`, fewer whenever `n > 1.5 m` (the draft MLP's 4:1 matrices and `fc`). The
    form with fewer multiply-adds is used per stack. One batched matmul per product serves every matrix of a
    shape (the layers' q/o, k/v and gate/up/down matrices share shapes). Overwrites `updates` (normalised in
    place, to hold one fewer stack)."""
    a, b, c = ns_coefficients
    x = updates.div_(updates.norm(dim=(1, 2), keepdim=True).clamp(min=eps))
    m, n = x.shape[-2:]
    on_x, on_gram = _newton_schulz_flops(m, n, ns_steps)
    if on_x <= on_gram:
        for _ in range(ns_steps):
            gram = x @ x.mT
            poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
            x = torch.baddbmm(x, poly, x, beta=a)
        return x
    eye = torch.eye(m, dtype=x.dtype, device=x.device).expand_as(x[:, :, :m])
    gram = x @ x.mT
    product = None
    for step in range(ns_steps):
        poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c).add_(eye, alpha=a)  # aI + bA + cA^2
        product = poly if product is None else poly @ product
        if step + 1 < ns_steps:
            gram = poly @ gram @ poly
            gram = (gram + gram.mT).mul_(0.5)  # symmetric in exact arithmetic; keep it so in floating point
    return product @ x


def _adjust_lr(lr: float, adjust_lr_fn: str | None, shape: torch.Size) -> float:
    """torch's Muon learning-rate adjustment for an [A, B] matrix."""
    rows, cols = shape[:2]
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return lr * math.sqrt(max(1, rows / cols))
    if adjust_lr_fn == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(rows, cols))
    return lr


def _evaluate_closure(closure):
    """The optimizer-step closure protocol: re-evaluate the loss with gradients enabled, when given."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


class DtypeMuon(torch.optim.Muon):
    """`torch.optim.Muon` with Newton-Schulz in `newton_schulz_dtype` (see the module docstring) instead of
    always bfloat16. Same hyperparameters, param groups and state dict as `torch.optim.Muon`."""

    def __init__(self, params, *args, newton_schulz_dtype: NewtonSchulzDtype = "auto", **kwargs):
        newton_schulz_dtype_for(newton_schulz_dtype, "cpu")  # validate now, not at the first step
        super().__init__(params, *args, **kwargs)
        # Not a param-group entry, so the state dict stays exactly torch.optim.Muon's (loadable both ways).
        self.newton_schulz_dtype = newton_schulz_dtype

    @torch.no_grad()
    def step(self, closure=None):
        loss = _evaluate_closure(closure)
        for group in self.param_groups:
            params: list[Tensor] = []
            grads: list[Tensor] = []
            bufs: list[Tensor] = []
            self._init_group(group, params, grads, bufs)  # torch's: checks, lazily creates momentum buffers
            lr = group["lr"]
            lr = lr.item() if isinstance(lr, Tensor) else lr
            weight_decay, momentum = group["weight_decay"], group["momentum"]
            # Half precision: torch's own per-matrix iteration (bit-identical to torch.optim.Muon). float32 and
            # wider: matrices of one shape are stacked and orthogonalised together (`orthogonalize_batch`); each
            # update is written straight into its stack, so the step holds one stack at a time, not every update.
            stacks: dict[tuple, list[tuple[Tensor, Tensor, Tensor]]] = {}
            for param, grad, buf in zip(params, grads, bufs):
                if grad.ndim != 2:
                    raise ValueError("Param gradient must be a 2D matrix")
                dtype = newton_schulz_dtype_for(self.newton_schulz_dtype, param.device)
                if torch.finfo(dtype).bits < 32:
                    buf.lerp_(grad, 1 - momentum)
                    update = grad.lerp(buf, momentum) if group["nesterov"] else buf
                    update = zeropower_via_newton_schulz(update, group["ns_coefficients"], group["ns_steps"],
                                                         group["eps"], dtype)
                    self._apply(param, update, lr, weight_decay, group["adjust_lr_fn"])
                    continue
                wide = tuple(reversed(grad.shape)) if grad.shape[0] > grad.shape[1] else tuple(grad.shape)
                stacks.setdefault((wide, dtype, param.device), []).append((param, grad, buf))
            pieces = []
            for (wide, dtype, device), members in stacks.items():
                per_stack = max(1, STACK_ELEMENTS // (wide[0] * wide[1]))
                pieces += [(wide, dtype, device, members[i : i + per_stack]) for i in range(0, len(members), per_stack)]
            for wide, dtype, device, members in pieces:
                stack = torch.empty(len(members), *wide, dtype=dtype, device=device)
                for i, (_, grad, buf) in enumerate(members):
                    buf.lerp_(grad, 1 - momentum)
                    update = grad.lerp(buf, momentum) if group["nesterov"] else buf
                    stack[i].copy_(update.mT if update.shape[0] > update.shape[1] else update)
                    del update
                ortho = orthogonalize_batch(stack, group["ns_coefficients"], group["ns_steps"], group["eps"])
                del stack
                for (param, _, _), o in zip(members, ortho):
                    self._apply(param, o.mT if param.shape[0] > param.shape[1] else o, lr, weight_decay,
                                group["adjust_lr_fn"])
                del ortho
        return loss

    @staticmethod
    def _apply(param: Tensor, ortho: Tensor, lr: float, weight_decay: float, adjust_lr_fn) -> None:
        """Decoupled weight decay, then the orthogonalised step scaled by torch's learning-rate adjustment."""
        param.mul_(1 - lr * weight_decay)
        param.add_(ortho, alpha=-_adjust_lr(lr, adjust_lr_fn, param.shape))


def muon_parameter_names(model: nn.Module) -> list[str]:
    """Trainable 2-D matrices of the draft layers' projections and of `fc` (names without wrapper prefixes)."""
    names = []
    for name, param in model.named_parameters():
        if not param.requires_grad or param.ndim != 2 or "lora_" in name:
            continue
        short = name.split("base_model.model.")[-1].replace(".base_layer", "")
        if short == "fc.weight" or (short.startswith("layers.") and short.endswith("_proj.weight")):
            names.append(name)
    return names


class MuonWithAdamW(torch.optim.Optimizer):
    """One optimizer stepping a Muon (`DtypeMuon`, a `torch.optim.Muon`) and a `torch.optim.AdamW` together.

    `newton_schulz_dtype` is `DtypeMuon`'s: `"auto"` (the default, and what the Trainer path uses) runs
    Newton-Schulz in bfloat16 for CUDA parameters and in float32 elsewhere; `"float32"` or `"bfloat16"` force one.
    """

    def __init__(self, named_parameters, lr: float, muon_lr: float | None = None, weight_decay: float = 0.01,
                 muon_weight_decay: float = 0.1, betas=(0.9, 0.95), eps: float = 1e-8, momentum: float = 0.95,
                 muon_names: set[str] | None = None, newton_schulz_dtype: NewtonSchulzDtype = "auto"):
        named = [(n, p) for n, p in named_parameters if p.requires_grad]
        if not named:
            raise ValueError("the model has no trainable parameters to optimize.")
        muon_names = set(muon_names or ())
        muon_params = [p for n, p in named if n in muon_names]
        adamw_params = [p for n, p in named if n not in muon_names]
        self.optimizers: list[torch.optim.Optimizer] = []
        if muon_params:
            # "match_rms_adamw" scales Muon's update to AdamW's RMS, so AdamW's lr and decay carry over.
            self.optimizers.append(DtypeMuon(
                muon_params, lr=muon_lr or lr, weight_decay=muon_weight_decay, momentum=momentum,
                adjust_lr_fn="match_rms_adamw", newton_schulz_dtype=newton_schulz_dtype))
        if adamw_params:
            # Norm gains and biases (1-D) are not decayed; the Markov factors and the confidence projection are.
            groups = [{"params": [p for p in adamw_params if p.ndim >= 2], "weight_decay": weight_decay},
                      {"params": [p for p in adamw_params if p.ndim < 2], "weight_decay": 0.0}]
            # The fused kernel (one pass per tensor instead of ~7): the same update, ~9x faster on the [V, r]
            # Markov table on CPU; other devices keep torch's default implementation.
            fused = all(p.device.type in ("cpu", "cuda") for p in adamw_params) or None
            self.optimizers.append(torch.optim.AdamW([g for g in groups if g["params"]], lr=lr, betas=betas, eps=eps,
                                                     fused=fused))
        super().__init__([p for _, p in named], {"lr": lr})
        # Share the inner optimizers' group dicts, so schedulers and the Trainer see and set real values.
        self.param_groups = [group for opt in self.optimizers for group in opt.param_groups]

    @torch.no_grad()
    def step(self, closure=None):
        loss = _evaluate_closure(closure)
        for opt in self.optimizers:
            opt.step()
        return loss

    def zero_grad(self, set_to_none: bool = True):
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)

    def state_dict(self):
        return {"optimizers": [opt.state_dict() for opt in self.optimizers]}

    def load_state_dict(self, state_dict):
        inner = state_dict["optimizers"]
        if len(inner) != len(self.optimizers):
            raise ValueError("the saved optimizer state has a different Muon/AdamW split; resume with the same model.")
        for opt, sd in zip(self.optimizers, inner):
            opt.load_state_dict(sd)
        self.param_groups = [group for opt in self.optimizers for group in opt.param_groups]


class MuonAdamWFactory:
    """`Trainer(optimizer_cls_and_kwargs=(MuonAdamWFactory, kwargs))`: the Trainer instantiates the factory
    with no arguments and calls it with `(model, **kwargs)`."""

    def __call__(self, model: nn.Module, **kwargs) -> MuonWithAdamW:
        return MuonWithAdamW(model.named_parameters(), muon_names=set(muon_parameter_names(model)), **kwargs)
