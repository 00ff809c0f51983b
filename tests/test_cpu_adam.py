"""optim.cpu_adam.CPUAdamW: torch's AdamW to float32 rounding (bit for bit outside its kernel), with the same state,
and the recipe's choice of it."""

import pytest
import torch

from lightning_megatron.models.optim_recipe import adamw_optimizer
from lightning_megatron.optim.cpu_adam import CPUAdamW

# A few large and many small tensors, sizes that split unevenly over threads and cache lines, a 1-element one.
SHAPES = [(300, 77), (5,), (4097,), (64, 64), (1,), (3, 5, 7)]


def train(optimizer_class, steps=6, **kwargs):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape)) for shape in SHAPES]
    groups = [{"params": params[:3], "weight_decay": 0.1}, {"params": params[3:], "weight_decay": 0.0}]
    optimizer = optimizer_class(groups, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, **kwargs)
    generator = torch.Generator().manual_seed(1)
    for step in range(steps):
        for param in params:
            param.grad = torch.randn(param.shape, generator=generator) * (1e-3 if step % 2 else 1.0)
        optimizer.step()
        optimizer.param_groups[0]["lr"] *= 0.9  # a schedule: the hyper-parameters are read every step
    return params, optimizer


@pytest.mark.parametrize("threads", [1, 2])
def test_matches_torch_adamw_to_float32_rounding(threads):
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        ours, optimizer = train(CPUAdamW, fused=True, amsgrad=False)
    finally:
        torch.set_num_threads(previous)
    reference, torch_optimizer = train(torch.optim.AdamW, foreach=False, amsgrad=False)
    for mine, theirs in zip(ours, reference):
        torch.testing.assert_close(mine.detach(), theirs.detach(), rtol=2e-6, atol=2e-6)
    state, torch_state = optimizer.state_dict(), torch_optimizer.state_dict()
    # AdamW's state dict, entry for entry: either optimizer loads the other's checkpoints
    assert [set(group) for group in state["param_groups"]] == [set(group) for group in torch_state["param_groups"]]
    for index, entry in torch_state["state"].items():
        assert set(state["state"][index]) == set(entry) and state["state"][index]["step"] == entry["step"]
        torch.testing.assert_close(state["state"][index]["exp_avg_sq"], entry["exp_avg_sq"], rtol=2e-6, atol=1e-12)


@pytest.mark.parametrize("kernels", [{"foreach": False}, {"foreach": True}, {"fused": True}])
@pytest.mark.parametrize("outside", ["amsgrad", "float64"])
def test_tensors_outside_the_kernel_step_exactly_as_torch_adamw(outside, kernels):
    """What the kernel does not cover (here amsgrad groups, float64 tensors; on an accelerator: every tensor of a
    model that is not offloaded) steps bit for bit as torch's own AdamW, with the kernels the groups name."""
    options = {"amsgrad": True} if outside == "amsgrad" else {"amsgrad": False}
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64 if outside == "float64" else torch.float32)
    try:
        ours, _ = train(CPUAdamW, **options, **kernels)
        reference, _ = train(torch.optim.AdamW, **options, **kernels)
    finally:
        torch.set_default_dtype(default)
    assert all(torch.equal(a.detach(), b.detach()) for a, b in zip(ours, reference))


def test_recipe_auto_builds_it_wherever_the_parameters_are():
    """"auto" is the CPU kernel for whatever steps in host memory, wherever the model's parameters are; an explicit
    choice is kept. The kernels for accelerator tensors are the ones torch's AdamW would get from "auto"."""
    cpu = [{"params": [torch.nn.Parameter(torch.zeros(4))]}]
    assert type(adamw_optimizer(cpu, "auto", lr=1e-3)) is CPUAdamW
    assert type(adamw_optimizer(cpu, "fused", lr=1e-3)) is torch.optim.AdamW
    meta = [{"params": [torch.nn.Parameter(torch.zeros(4, device="meta"))]}]  # an accelerator's parameters
    optimizer = adamw_optimizer(meta, "auto", lr=1e-3)
    assert type(optimizer) is CPUAdamW
    assert (optimizer.defaults["fused"], optimizer.defaults["foreach"]) == (False, True)  # meta has no fused kernel
    assert type(adamw_optimizer(meta, "foreach", lr=1e-3)) is torch.optim.AdamW


@pytest.mark.parametrize("offload", [False, "cpu", "nvme"])
def test_recipe_builds_the_same_optimizer_under_every_offload_tier(offload, tmp_path):
    """The GPT recipe under a Trainer reads nothing of the strategy: with parameters on an accelerator (meta here),
    every tier gets the same CPUAdamW, whose kernel steps the fp32 pieces the tier puts in host memory."""
    import lightning as L

    from lightning_megatron import Megatron3DStrategy
    from lightning_megatron.models import GPT

    strategy = Megatron3DStrategy(offload_optimizer=offload, offload_path=str(tmp_path) if offload == "nvme" else None)
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=1, logger=False, max_steps=1)
    module = GPT("gpt-tiny")
    with torch.device("meta"):
        module.configure_model()
    module.trainer = trainer
    optimizer = module.configure_optimizers()["optimizer"]
    assert type(optimizer) is CPUAdamW
    assert [(group["fused"], group["foreach"]) for group in optimizer.param_groups] == [(False, True)] * 2
