"""Muon for the drafter's hidden matrices, AdamW for everything else, as one optimizer for the Trainer.

Muon (`torch.optim.Muon`, torch >= 2.9) orthogonalises the update of 2-D hidden weight matrices; it is the
wrong tool for vectors (norm gains, biases), for embedding-like or output-like tables (the Markov factors
`markov_w1` [V, r] and `markov_w2` [Vd, r]) and for the degenerate `[1, H+r]` confidence projection, which go
to AdamW. LoRA adapter matrices also go to AdamW. The split is `muon_parameter_names` below and is tested
exactly.

The Trainer accepts a factory through `optimizer_cls_and_kwargs=(MuonAdamWFactory, kwargs)`: it calls the
factory with the model and gets one `torch.optim.Optimizer` whose `param_groups` are the union of both inner
optimizers' groups (the same dicts), so the LR scheduler drives both, and whose state dict holds both.
"""

import torch
from torch import nn


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
    """One optimizer stepping a `torch.optim.Muon` and a `torch.optim.AdamW` together."""

    def __init__(self, named_parameters, lr: float, muon_lr: float | None = None, weight_decay: float = 0.01,
                 muon_weight_decay: float = 0.1, betas=(0.9, 0.95), eps: float = 1e-8, momentum: float = 0.95,
                 muon_names: set[str] | None = None):
        named = [(n, p) for n, p in named_parameters if p.requires_grad]
        if not named:
            raise ValueError("the model has no trainable parameters to optimize.")
        muon_names = set(muon_names or ())
        muon_params = [p for n, p in named if n in muon_names]
        adamw_params = [p for n, p in named if n not in muon_names]
        self.optimizers: list[torch.optim.Optimizer] = []
        if muon_params:
            # "match_rms_adamw" scales Muon's update to AdamW's RMS, so AdamW's lr and decay carry over.
            self.optimizers.append(torch.optim.Muon(
                muon_params, lr=muon_lr or lr, weight_decay=muon_weight_decay, momentum=momentum,
                adjust_lr_fn="match_rms_adamw"))
        if adamw_params:
            # Norm gains and biases (1-D) are not decayed; the Markov factors and the confidence projection are.
            groups = [{"params": [p for p in adamw_params if p.ndim >= 2], "weight_decay": weight_decay},
                      {"params": [p for p in adamw_params if p.ndim < 2], "weight_decay": 0.0}]
            self.optimizers.append(torch.optim.AdamW([g for g in groups if g["params"]], lr=lr, betas=betas, eps=eps))
        super().__init__([p for _, p in named], {"lr": lr})
        # Share the inner optimizers' group dicts, so schedulers and the Trainer see and set real values.
        self.param_groups = [group for opt in self.optimizers for group in opt.param_groups]

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
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
