"""The MoE layer on the device: its experts as grouped GEMMs against their loop, and no host sync in the layer.

One function, :func:`moe_device_check`, for ``gpu_check.py`` to run as a row on the GPU; on the CPU (fp32, tiny
sizes) it is its own self-test (``tests/test_moe_experts.py``), so its first GPU run cannot fail in its plumbing.
What it checks, where the CPU cannot (``models/experts.py`` chose the grouped GEMMs for CUDA bf16 on compute
capability 9.x/10.x from torch's source, not from a run):

* the choice: :func:`grouped_gemm_supported` says grouped for the experts in the compute dtype (bf16 on CUDA);
* the numbers: forward and backward of the grouped GEMMs against the loop of the experts' own modules, with ragged
  per-expert counts (odd sizes, an empty expert) and rows past the counted ones, as a capacity leaves them;
* no fallback and no host sync: the profiler sees no device-to-host copy in the grouped experts' forward and
  backward (torch's fallback for unsupported devices reads the offsets on the host), nor in a whole MoE layer's
  (router, capacity, losses, experts) forward and backward; on the CPU the host syncs are counted instead;
* the speed: grouped against loop, forward and backward, in ms.
"""

from __future__ import annotations

import time
from typing import Callable

import torch
from torch.profiler import ProfilerActivity, profile

from lightning_megatron.models.experts import grouped_experts, grouped_gemm_supported, looped_experts
from lightning_megatron.models.mlp import build_mlp
from lightning_megatron.models.moe import MoE, MoEConfig
from lightning_megatron.parallel.guards import count_host_syncs

# (experts, hidden, expert width, assignments): Mixtral-like widths on the GPU, tiny on the CPU.
GPU_SHAPE, CPU_SHAPE = (8, 2048, 1408, 16384), (4, 32, 48, 64)
TAIL_ROWS = 5  # rows past the counted ones (a capacity's dropped assignments)


def moe_device_check(device: torch.device) -> dict:
    """``{"status": "pass" | "fail", "detail": str, "numbers": {...}}`` for ``device`` (module docstring)."""
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    num_experts, hidden, width, assignments = GPU_SHAPE if cuda else CPU_SHAPE
    generator = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    experts = [build_mlp("swiglu", hidden, width, bias=False).to(device, dtype) for _ in range(num_experts)]
    weights = torch.rand(num_experts, generator=generator)
    weights[1] = 0  # an expert without tokens
    counts = torch.bincount(torch.multinomial(weights, assignments, replacement=True, generator=generator),
                            minlength=num_experts)
    rows = assignments + TAIL_ROWS
    tokens = torch.randn(rows, hidden, generator=generator).to(device, dtype)
    upstream = torch.randn(rows, hidden, generator=generator).to(device, dtype)
    upstream[assignments:] = 0  # the layer masks the rows past the counted ones
    counts = counts.to(device)
    failures = []
    if not grouped_gemm_supported(experts, tokens):
        failures.append(f"grouped GEMMs not chosen for {dtype} on {device}: the loop would run")

    def run(fn: Callable) -> list[torch.Tensor]:
        x = tokens.detach().clone().requires_grad_()
        out = fn(experts, x, counts)
        grads = torch.autograd.grad(out, [x, *[p for e in experts for p in e.parameters()]], upstream)
        return [out[:assignments], grads[0][:assignments], *grads[1:]]

    grouped, loop = run(grouped_experts), run(looped_experts)
    tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-6  # bf16: two GEMM orders, 8 bits of mantissa
    errors = [_relative_error(g, l) for g, l in zip(grouped, loop)]
    if max(errors) > tolerance:
        failures.append(f"grouped vs loop: worst relative error {max(errors):.2e} > {tolerance:.0e}")
    syncs = {"grouped experts": _host_syncs(lambda: run(grouped_experts), device),
             "moe layer": _host_syncs(_moe_layer_step(hidden, width, num_experts, device, dtype, rows), device)}
    failures += [f"{what}: {n} host syncs ({how})" for what, (n, how) in syncs.items() if n]
    numbers = {"worst relative error": max(errors), "grouped ms": _timed(lambda: run(grouped_experts), device),
               "loop ms": _timed(lambda: run(looped_experts), device),
               **{f"{what} host syncs": n for what, (n, _) in syncs.items()}}
    numbers["grouped vs loop"] = numbers["loop ms"] / max(numbers["grouped ms"], 1e-9)
    detail = "; ".join(failures) or (f"{num_experts} experts {hidden}->{width}, {assignments} assignments, {dtype}: "
                                     f"grouped {numbers['grouped ms']:.2f} ms vs loop {numbers['loop ms']:.2f} ms")
    return {"status": "fail" if failures else "pass", "detail": detail, "numbers": numbers}


def _moe_layer_step(hidden: int, width: int, num_experts: int, device, dtype, tokens: int) -> Callable[[], None]:
    """One training forward and backward of a whole MoE layer: softmax top-2, capacity 1.25, both losses."""
    config = MoEConfig(num_experts=num_experts, top_k=2, ffn_hidden_size=width, aux_loss_coeff=1e-2,
                       z_loss_coeff=1e-3, capacity_factor=1.25)
    layer = MoE(hidden, config, default_ffn_size=width, activation="swiglu").to(device, dtype).train()
    x = torch.randn(2, max(tokens // 4, 8), hidden, device=device, dtype=dtype, requires_grad=True)

    def step() -> None:
        out = layer(x)
        (out.float().square().sum() + layer.aux_losses.drain()).backward()
    return step


def _host_syncs(step: Callable[[], object], device: torch.device) -> tuple[int, str]:
    """How many times ``step`` makes the host wait: device-to-host copies the profiler sees on a GPU (they include
    torch's own, which no Python-level counter sees), the counted calls on the CPU."""
    step()  # warm: first calls allocate and pick kernels
    if device.type != "cuda":
        with count_host_syncs() as syncs:
            step()
        return syncs.total, syncs.report() or "none"
    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize(device)
    copies = [e.name for e in prof.events() if "Memcpy DtoH" in e.name or "cudaStreamSynchronize" in e.name]
    return len(copies), ", ".join(sorted(set(copies))) or "none"


def _timed(step: Callable[[], object], device: torch.device, repeats: int = 5) -> float:
    """Milliseconds per call after one warm-up (CUDA events on a GPU: wall clock measures only the launches)."""
    step()
    if device.type != "cuda":
        start = time.perf_counter()
        for _ in range(repeats):
            step()
        return (time.perf_counter() - start) * 1e3 / repeats
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(repeats):
        step()
    end.record()
    end.synchronize()
    return begin.elapsed_time(end) / repeats


def _relative_error(value: torch.Tensor, reference: torch.Tensor) -> float:
    reference = reference.double()
    return ((value.double() - reference).norm() / reference.norm().clamp(min=1e-30)).item()


if __name__ == "__main__":
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    print(moe_device_check(device))
