"""Muon for the draft layers' projection matrices and fc, AdamW for everything else, as one optimizer."""

import pytest
import torch
from transformers import get_cosine_schedule_with_warmup

from tiny import tiny_drafter
from trainer.optim import MuonAdamWFactory, MuonWithAdamW, muon_parameter_names


def test_parameter_split_is_exactly_right(gemma4_verifier):
    drafter = tiny_drafter(gemma4_verifier)
    muon = set(muon_parameter_names(drafter))
    expected_muon = {"fc.weight"} | {
        f"layers.{i}.{m}.weight" for i in range(drafter.config.num_hidden_layers)
        for m in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                  "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}
    assert muon == expected_muon
    trainable = {n for n, p in drafter.named_parameters() if p.requires_grad}
    adamw = trainable - muon
    assert adamw == {"hidden_norm.weight", "norm.weight", "markov_head.markov_w1.weight",
                     "markov_head.markov_w2.weight", "confidence_head.proj.weight", "confidence_head.proj.bias"} | {
        f"layers.{i}.{n}.weight" for i in range(drafter.config.num_hidden_layers)
        for n in ("input_layernorm", "post_attention_layernorm", "self_attn.q_norm", "self_attn.k_norm")}
    assert "lm_head.weight" not in trainable  # frozen verifier rows are never optimized

    opt = MuonAdamWFactory()(drafter, lr=1e-3)
    muon_opt, adamw_opt = opt.optimizers
    assert isinstance(muon_opt, torch.optim.Muon) and isinstance(adamw_opt, torch.optim.AdamW)
    ids = {id(p) for g in muon_opt.param_groups for p in g["params"]}
    assert ids == {id(drafter.get_parameter(n)) for n in expected_muon}
    assert all(p.ndim == 2 for g in muon_opt.param_groups for p in g["params"])
    decayed, plain = adamw_opt.param_groups
    assert all(p.ndim >= 2 for p in decayed["params"]) and decayed["weight_decay"] == 0.01
    assert all(p.ndim == 1 for p in plain["params"]) and plain["weight_decay"] == 0.0


def test_lora_matrices_go_to_adamw(gemma4_verifier):
    from trainer.adapters import add_lora

    model = add_lora(tiny_drafter(gemma4_verifier), rank=4, alpha=8, dropout=0.0, target_modules=["q_proj", "o_proj"])
    assert muon_parameter_names(model) == []  # base weights are frozen; A/B adapters are AdamW's
    opt = MuonAdamWFactory()(model, lr=1e-3)
    assert len(opt.optimizers) == 1 and isinstance(opt.optimizers[0], torch.optim.AdamW)


def test_one_optimizer_driven_by_one_scheduler_and_checkpointable():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    named = list(model.named_parameters())
    opt = MuonWithAdamW(named, lr=0.02, muon_names={"0.weight", "2.weight"})
    sched = get_cosine_schedule_with_warmup(opt, num_warmup_steps=2, num_training_steps=20)
    x, y = torch.randn(64, 8), torch.randn(64, 1)
    losses = []
    for _ in range(10):
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    lrs = {g["lr"] for o in opt.optimizers for g in o.param_groups}
    assert len(lrs) == 1 and 0 < lrs.pop() < 0.02  # the scheduler moved both inner optimizers together
    state = opt.state_dict()
    assert "momentum_buffer" in str(state["optimizers"][0]["state"]) and "exp_avg" in str(state["optimizers"][1])
    clone = MuonWithAdamW(named, lr=0.02, muon_names={"0.weight", "2.weight"})
    clone.load_state_dict(state)
    assert torch.equal(clone.optimizers[1].state_dict()["state"][0]["exp_avg"],
                       opt.optimizers[1].state_dict()["state"][0]["exp_avg"])
    with pytest.raises(ValueError, match="different Muon/AdamW split"):
        MuonWithAdamW(named, lr=0.02).load_state_dict(state)
