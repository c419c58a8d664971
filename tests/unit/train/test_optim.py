"""Muon for the draft layers' projection matrices and fc, AdamW for everything else, as one optimizer."""

import copy
import math

import pytest
import torch
from transformers import get_cosine_schedule_with_warmup

from tiny import tiny_drafter
from trainer.train.optim import (
    DtypeMuon,
    MuonAdamWFactory,
    MuonWithAdamW,
    muon_parameter_names,
    newton_schulz_dtype_for,
    zeropower_via_newton_schulz,
)


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
    assert isinstance(muon_opt, DtypeMuon) and muon_opt.newton_schulz_dtype == "auto"  # the Trainer path's default
    ids = {id(p) for g in muon_opt.param_groups for p in g["params"]}
    assert ids == {id(drafter.get_parameter(n)) for n in expected_muon}
    assert all(p.ndim == 2 for g in muon_opt.param_groups for p in g["params"])
    decayed, plain = adamw_opt.param_groups
    assert all(p.ndim >= 2 for p in decayed["params"]) and decayed["weight_decay"] == 0.01
    assert all(p.ndim == 1 for p in plain["params"]) and plain["weight_decay"] == 0.0


def test_lora_matrices_go_to_adamw(gemma4_verifier):
    from trainer.train.adapters import add_lora

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


# --- Newton-Schulz precision: float32 off CUDA, torch's bfloat16 on CUDA ------------------------------------

SHAPES = [(48, 48), (96, 40), (40, 96)]  # square, tall, wide


def _reference_muon_f64(params, grad_steps, *, lr, weight_decay, momentum, nesterov, a, b, c, ns_steps, eps):
    """torch.optim.Muon's update (torch/optim/_muon.py) written out in float64, one matrix at a time."""
    params = [p.detach().double().clone() for p in params]
    bufs = [torch.zeros_like(p) for p in params]
    for grads in grad_steps:
        for i, (p, g) in enumerate(zip(params, grads)):
            g = g.double()
            bufs[i] = momentum * bufs[i] + (1 - momentum) * g  # buf.lerp_(grad, 1 - momentum)
            u = (1 - momentum) * g + momentum * bufs[i] if nesterov else bufs[i]  # grad.lerp(buf, momentum)
            rows, cols = u.shape
            x = u.T if rows > cols else u
            x = x / max(torch.linalg.matrix_norm(x).item(), eps)  # Frobenius norm
            for _ in range(ns_steps):
                gram = x @ x.T
                x = a * x + (b * gram + c * gram @ gram) @ x
            ortho = x.T if rows > cols else x
            adjusted = lr * 0.2 * math.sqrt(max(rows, cols))  # adjust_lr_fn="match_rms_adamw"
            params[i] = p * (1 - lr * weight_decay) - adjusted * ortho
    return params


def _run(make_opt, params, grad_steps):
    params = [torch.nn.Parameter(p.clone()) for p in params]
    opt = make_opt(params)
    for grads in grad_steps:
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opt.step()
    return [p.detach() for p in params], opt


def _problem(seed=0, steps=3):
    gen = torch.Generator().manual_seed(seed)
    params = [torch.randn(*s, generator=gen) * 0.05 for s in SHAPES]
    grad_steps = [[torch.randn(*s, generator=gen) for s in SHAPES] for _ in range(steps)]
    return params, grad_steps


def _rel(x, ref, start):
    """Relative error of the total update x - start against the reference update ref - start."""
    return ((x.double() - ref).norm() / (ref - start.double()).norm()).item()


@pytest.mark.parametrize("nesterov", [True, False])
def test_float32_newton_schulz_is_torchs_update_only_more_precise(nesterov):
    params, grad_steps = _problem()
    hp = dict(lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=nesterov, adjust_lr_fn="match_rms_adamw")
    ours, opt = _run(lambda ps: DtypeMuon(ps, **hp), params, grad_steps)  # "auto": float32 on CPU
    assert opt.newton_schulz_dtype == "auto" and newton_schulz_dtype_for("auto", ours[0].device) == torch.float32
    theirs, _ = _run(lambda ps: torch.optim.Muon(ps, **hp), params, grad_steps)  # torch's bf16, still in force
    reference = _reference_muon_f64(params, grad_steps, lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=nesterov,
                                    a=3.4445, b=-4.7750, c=2.0315, ns_steps=5, eps=1e-7)
    for mine, torchs, ref, start in zip(ours, theirs, reference, params):
        assert _rel(mine, ref, start) < 1e-5  # float32 round-off only
        assert 1e-3 < _rel(torchs, ref, start) < 3e-2  # torch.optim.Muon is bf16-accurate, and unpatched
        assert _rel(mine, torchs.double(), start) < 3e-2  # the same update as torch's, to bf16 precision


def test_bfloat16_setting_is_bit_identical_to_torch_muon_and_state_dicts_interchange():
    params, grad_steps = _problem(seed=1, steps=2)
    hp = dict(lr=0.02, weight_decay=0.1, momentum=0.9, adjust_lr_fn="match_rms_adamw")
    ours, opt = _run(lambda ps: DtypeMuon(ps, newton_schulz_dtype="bfloat16", **hp), params, grad_steps)
    theirs, torch_opt = _run(lambda ps: torch.optim.Muon(ps, **hp), params, grad_steps)
    assert all(torch.equal(x, y) for x, y in zip(ours, theirs))
    ours_sd, theirs_sd = opt.state_dict(), torch_opt.state_dict()
    assert ours_sd["param_groups"] == theirs_sd["param_groups"]  # no extra keys: torch's state-dict format
    assert all(torch.equal(ours_sd["state"][i]["momentum_buffer"], theirs_sd["state"][i]["momentum_buffer"])
               for i in range(len(SHAPES)))
    DtypeMuon([torch.nn.Parameter(p.clone()) for p in params], **hp).load_state_dict(theirs_sd)
    torch.optim.Muon([torch.nn.Parameter(p.clone()) for p in params], **hp).load_state_dict(ours_sd)


def test_newton_schulz_dtype_choice():
    assert newton_schulz_dtype_for("auto", "cpu") == torch.float32
    assert newton_schulz_dtype_for("auto", torch.device("cuda", 1)) == torch.bfloat16
    assert newton_schulz_dtype_for("auto", "mps") == torch.float32 and newton_schulz_dtype_for("auto", "meta") == torch.float32
    assert newton_schulz_dtype_for("bfloat16", "cpu") == torch.bfloat16
    assert newton_schulz_dtype_for(torch.float32, "cuda") == torch.float32
    for bad in ("fp32", "int8", torch.int64, "Tensor"):
        with pytest.raises(ValueError, match="newton_schulz_dtype"):
            newton_schulz_dtype_for(bad, "cpu")
    with pytest.raises(ValueError, match="newton_schulz_dtype"):
        MuonWithAdamW([("w", torch.nn.Parameter(torch.zeros(4, 4)))], lr=1e-3, muon_names={"w"},
                      newton_schulz_dtype="float23")
    opt = MuonWithAdamW([("w", torch.nn.Parameter(torch.zeros(4, 4)))], lr=1e-3, muon_names={"w"},
                        newton_schulz_dtype="bfloat16")
    assert opt.optimizers[0].newton_schulz_dtype == "bfloat16"


def test_newton_schulz_never_writes_into_its_input():
    for dtype in (torch.float32, torch.bfloat16):
        grad = torch.randn(40, 96, dtype=dtype)
        before = grad.clone()
        zeropower_via_newton_schulz(grad, (3.4445, -4.7750, 2.0315), 5, 1e-7, torch.float32)
        zeropower_via_newton_schulz(grad, (3.4445, -4.7750, 2.0315), 5, 1e-7, dtype)
        assert torch.equal(grad, before)


def test_resumed_optimizer_continues_bit_identically():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(24, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    names = {"0.weight", "2.weight"}
    x, y = torch.randn(64, 24), torch.randn(64, 1)

    def train(model, opt, steps):
        for _ in range(steps):
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()

    opt = MuonWithAdamW(model.named_parameters(), lr=0.01, muon_names=names)
    train(model, opt, 3)
    resumed_model = copy.deepcopy(model)
    resumed = MuonWithAdamW(resumed_model.named_parameters(), lr=0.01, muon_names=names)
    resumed.load_state_dict(copy.deepcopy(opt.state_dict()))
    assert resumed.param_groups[0] is resumed.optimizers[0].param_groups[0]  # still the shared dicts
    train(model, opt, 2)
    train(resumed_model, resumed, 2)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), resumed_model.parameters()))


def test_cpu_muon_step_runs_every_matmul_in_float32():
    """On a CPU without native bf16 matmuls torch's bfloat16 Newton-Schulz is emulated and 5-100x slower, so the
    default Muon must never multiply in bfloat16 off CUDA. Checked op by op (the step's cost on each machine is
    the muon_step benchmark's job, not a timed test's)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    matmuls = {torch.ops.aten.mm.default, torch.ops.aten.bmm.default, torch.ops.aten.addmm.default,
               torch.ops.aten.baddbmm.default, torch.ops.aten.matmul.default}

    class MatmulDtypes(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in matmuls:
                self.seen.append(args[0].dtype)
            return func(*args, **(kwargs or {}))

    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(64, 48, generator=gen) * 0.02) for _ in range(3)]
    opt = MuonWithAdamW([(str(i), p) for i, p in enumerate(params)], lr=1e-3, muon_names={"0", "1"})
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)
    with MatmulDtypes() as spy:
        opt.step()
    assert spy.seen and set(spy.seen) == {torch.float32}, spy.seen  # Newton-Schulz ran, and only in float32


@pytest.mark.gpu
def test_cuda_parameters_keep_torchs_bfloat16_newton_schulz():
    params, grad_steps = _problem(seed=2, steps=2)
    params = [p.cuda() for p in params]
    grad_steps = [[g.cuda() for g in grads] for grads in grad_steps]
    hp = dict(lr=0.02, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
    ours, opt = _run(lambda ps: DtypeMuon(ps, **hp), params, grad_steps)
    theirs, _ = _run(lambda ps: torch.optim.Muon(ps, **hp), params, grad_steps)
    assert newton_schulz_dtype_for(opt.newton_schulz_dtype, params[0].device) == torch.bfloat16
    assert all(torch.equal(x, y) for x, y in zip(ours, theirs))


def _ill_conditioned(rows, cols, smallest, seed=0):
    gen = torch.Generator().manual_seed(seed)
    u, _, v = torch.linalg.svd(torch.randn(rows, cols, generator=gen, dtype=torch.float64), full_matrices=False)
    return (u @ torch.diag(torch.logspace(0, math.log10(smallest), min(rows, cols), dtype=torch.float64)) @ v).float()


@pytest.mark.parametrize("shape", [(640, 2048), (256, 640), (64, 512), (48, 64)])
def test_batched_newton_schulz_equals_torchs_iteration(shape):
    """The stacked float32 orthogonalisation (the Gram-matrix form where it has fewer multiply-adds, the plain form
    otherwise) against torch's iteration in float64, on Gaussian, ill-conditioned (singular values down to 1e-7)
    and rank-8 matrices. Measured worst cases: 2.2e-5 Gaussian, 2.0e-4 ill-conditioned for the Gram form, against
    ~2e-5 for the plain float32 iteration and ~1e-2 for torch.optim.Muon's bf16 one."""
    from trainer.train.optim import _newton_schulz_flops, orthogonalize_batch

    rows, cols = shape
    gen = torch.Generator().manual_seed(1)
    cases = {"gauss": torch.randn(rows, cols, generator=gen), "ill": _ill_conditioned(rows, cols, 1e-7),
             "rank8": torch.randn(rows, 8, generator=gen) @ torch.randn(8, cols, generator=gen)}
    coefficients = (3.4445, -4.7750, 2.0315)
    stack = torch.stack(list(cases.values()))
    batched = orthogonalize_batch(stack.clone(), coefficients, 5, 1e-7)
    on_x, on_gram = _newton_schulz_flops(rows, cols, 5)
    for (kind, g), got in zip(cases.items(), batched):
        reference = zeropower_via_newton_schulz(g.double(), coefficients, 5, 1e-7, torch.float64)
        error = ((got.double() - reference).norm() / reference.norm()).item()
        assert error < (5e-5 if kind == "gauss" else 5e-4), (kind, error)
        # one matrix alone gives the same result as in the stack (no cross-talk between batch entries)
        alone = orthogonalize_batch(g[None].clone(), coefficients, 5, 1e-7)[0]
        assert torch.allclose(alone, got, atol=1e-5), kind
    assert (on_gram < on_x) == (cols > 1.5 * rows)  # the Gram form is chosen exactly when it is cheaper


def test_float32_muon_step_batches_same_shape_matrices_and_matches_one_by_one():
    """Matrices sharing a shape (q/o, k/v, gate/up/down across layers, tall ones transposed) are stepped as one
    stack; the result is each matrix's own torch update to float32 round-off."""
    gen = torch.Generator().manual_seed(3)
    shapes = [(96, 40), (40, 96), (96, 40), (48, 48), (48, 48), (30, 20)]
    params = [torch.randn(*s, generator=gen) * 0.05 for s in shapes]
    grad_steps = [[torch.randn(*s, generator=gen) for s in shapes] for _ in range(2)]
    hp = dict(lr=0.02, weight_decay=0.1, momentum=0.95, adjust_lr_fn="match_rms_adamw")
    together, _ = _run(lambda ps: DtypeMuon(ps, newton_schulz_dtype="float32", **hp), params, grad_steps)
    reference = _reference_muon_f64(params, grad_steps, lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True,
                                    a=3.4445, b=-4.7750, c=2.0315, ns_steps=5, eps=1e-7)
    for mine, ref, start in zip(together, reference, params):
        assert _rel(mine, ref, start) < 1e-5


def test_adamw_half_is_the_fused_kernel_with_torchs_update():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(300, 16), torch.nn.Linear(16, 16))
    twin = copy.deepcopy(model)
    ours = MuonWithAdamW(model.named_parameters(), lr=0.01, muon_names=set())
    adamw = ours.optimizers[0]
    assert adamw.defaults["fused"] is True
    plain = torch.optim.AdamW([{"params": [p for p in twin.parameters() if p.ndim >= 2], "weight_decay": 0.01},
                               {"params": [p for p in twin.parameters() if p.ndim < 2], "weight_decay": 0.0}],
                              lr=0.01, betas=(0.9, 0.95), eps=1e-8)
    x = torch.randint(0, 300, (64,))
    for _ in range(3):
        for m, opt in ((model, ours), (twin, plain)):
            m(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.allclose(p, q, rtol=1e-5, atol=1e-7)
