"""LoRA adaptation of an existing drafter (peft): adapters on the draft layers during training, merged into
plain weights whenever a checkpoint is written, so exported drafters never need peft."""

import torch
from torch import nn

from trainer.errors import UsageError


def add_lora(drafter: nn.Module, rank: int, alpha: float, dropout: float, target_modules: list[str]) -> nn.Module:
    """Wrap the drafter's draft-layer projections with LoRA adapters; everything else is frozen."""
    from peft import LoraConfig, get_peft_model

    modules = sorted({name for name, module in drafter.named_modules()
                      if name.startswith("layers.") and isinstance(module, nn.Linear)
                      and name.rsplit(".", 1)[-1] in target_modules})
    if not modules:
        raise UsageError(f"no draft-layer module matches lora_target_modules {target_modules}; use names such as "
                         f"q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj.")
    config = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=modules, bias="none")
    return get_peft_model(drafter, config)


@torch.no_grad()
def merged_state_dict(peft_model) -> dict[str, torch.Tensor]:
    """The drafter's state dict with every LoRA delta folded into its base weight, under the plain names,
    computed without modifying the training model."""
    base = peft_model.get_base_model()
    merged = {}
    lora_layers = {}
    for name, module in base.named_modules():
        if hasattr(module, "get_delta_weight") and hasattr(module, "base_layer"):
            lora_layers[name] = module
    for key, value in base.state_dict().items():
        if ".lora_" in key:
            continue
        clean = key.replace(".base_layer", "")
        owner = key.rsplit(".", 2)[0] if ".base_layer." in key else None
        if owner in lora_layers and key.endswith("base_layer.weight"):
            module = lora_layers[owner]
            delta = sum(module.get_delta_weight(a) for a in module.active_adapters if a in module.lora_A)
            value = value + delta.to(value.dtype)
        merged[clean] = value.detach().clone()
    return merged
