"""CPU AdamW step time: DeepSpeed's ``DeepSpeedCPUAdam`` against this package's kernel and torch's, side by side.

With ``offload_optimizer="cpu"`` the optimizer steps every fp32 main parameter in host memory, so this step is the
one to compare with ZeRO-Offload's. On the same ``--params`` fp32 parameters (default 1e8), laid out as a GPT-2's
tensors (``list``: a 50,257 x 768 embedding, positions, then 12 tensors per layer, a few large and many small,
layers added until there are ``--params``) and as one flat tensor (``flat``), with the same fixed gradients and
AdamW hyper-parameters (lr 1e-3, betas (0.9, 0.95), eps 1e-8, weight decay 0.1, decoupled), it times
``optimizer.step()`` of:

- ``deepspeed``: ``deepspeed.ops.adam.DeepSpeedCPUAdam(adamw_mode=True)`` (AVX-512/AVX2 + OpenMP, JIT-built);
- ``cpu_kernel``: ``lightning_megatron.optim.cpu_adam.CPUAdamW``: one OpenMP-parallel vectorised pass over the
  elements of all tensors at once (one fork/join of the threads per step);
- ``fused``: ``torch.optim.AdamW(fused=True)``, torch's one-pass CPU kernel (vectorised, one parallel loop per
  tensor);
- ``for_loop``: ``torch.optim.AdamW(foreach=False)``, torch's per-tensor Python loop (the reference);
- ``foreach``: ``torch.optim.AdamW(foreach=True)``, the multi-tensor kernels (several passes over memory).

The row marked ``*`` is what the offloaded step runs: the optimizer the GPT/BERT recipe's
``adam_implementation="auto"`` builds (``models.optim_recipe.adamw_optimizer``), which
``optim.main_params.MainParamOptimizer`` rebinds to fp32 pieces in host memory, stepping them as it steps these.

Every implementation steps once per round, in an order reversed every other round, so drift on a shared machine
falls on all alike; ``--warmup`` rounds (state allocation, JIT compiles) are not timed; each cell is the median
of ``--steps`` timed steps. All run on ``--threads`` threads (default: every core this process may use), set
before torch or DeepSpeed start OpenMP (``OMP_NUM_THREADS``; both use the same ``libgomp``). After the last round
each implementation's parameters are compared with the for-loop's (``max |dp|``: float32 rounding is ~1e-6).

DeepSpeed is not a dependency of the project; the ``deepspeed`` row appears where it imports (else a note says
how to get it). On a CPU-only torch, in a separate environment::

    python -m venv --system-site-packages /tmp/ds-venv
    /tmp/ds-venv/bin/pip install deepspeed          # pulls ninja, py-cpuinfo, hjson, ...; needs g++ on the PATH
    DS_ACCELERATOR=cpu /tmp/ds-venv/bin/python -m benchmarks.cpu_adam

(deepspeed 0.19.8 here, with torch 2.13.0+cpu.) ``DS_ACCELERATOR=cpu`` names DeepSpeed's CPU accelerator (this
script sets it when unset; without it DeepSpeed falls back to CPU with a warning when it finds no GPU). The first
step JIT-builds the ``cpu_adam`` op with ninja and g++ (``-O3 -march=native -fopenmp``, AVX-512 here) into
``~/.cache/torch_extensions`` (about a minute on 2 cores); later runs load it. ``DS_BUILD_OPS`` is not needed:
it pre-builds ops at install time instead.

Example::

    python -m benchmarks.cpu_adam                     # 1e8 parameters: ~2 minutes on 2 idle cores, ~8 GB RAM
    python -m benchmarks.cpu_adam --smoke             # tiny sizes, seconds: the test's run
    python -m benchmarks.cpu_adam --params 3e8 --layouts flat --steps 20
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Optional

from benchmarks.harness.rounds import abba
from benchmarks.harness.tables import format_rows

IMPLEMENTATIONS = ("deepspeed", "cpu_kernel", "fused", "for_loop", "foreach")
HYPER = {"lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", type=float, default=1e8, help="fp32 parameters stepped (at least this many)")
    parser.add_argument("--layouts", nargs="+", choices=("list", "flat"), default=["list", "flat"])
    parser.add_argument("--implementations", nargs="+", choices=IMPLEMENTATIONS, default=list(IMPLEMENTATIONS))
    parser.add_argument("--steps", type=int, default=7, help="timed steps (rounds) per implementation")
    parser.add_argument("--warmup", type=int, default=2, help="untimed rounds first")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--smoke", action="store_true", help="tiny sizes (2e5 parameters, hidden 64), 2 steps")
    args = parser.parse_args(argv)
    if "for_loop" not in args.implementations:
        parser.error("the for_loop row is the numerics reference and the second ratio's baseline; keep it")
    args.hidden, args.vocab, args.positions = (64, 257, 64) if args.smoke else (768, 50257, 1024)
    if args.smoke:
        args.params, args.steps, args.warmup = min(args.params, 2e5), 2, 1
    return args


def gpt2_shapes(params: int, hidden: int, vocab: int, positions: int) -> list[tuple[int, ...]]:
    """A GPT-2's parameter shapes (embedding, positions, 12 per layer, final norm), layers added until ``params``."""
    shapes = [(vocab, hidden), (positions, hidden)]
    layer = [(hidden,), (hidden,), (3 * hidden, hidden), (3 * hidden,), (hidden, hidden), (hidden,),
             (hidden,), (hidden,), (4 * hidden, hidden), (4 * hidden,), (hidden, 4 * hidden), (hidden,)]
    while sum(_numel(s) for s in shapes) + 2 * hidden < params:
        shapes += layer
    return shapes + [(hidden,), (hidden,)]


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for size in shape:
        n *= size
    return n


def make_optimizer(name: str, params: list) -> Optional[object]:
    """``name``'s optimizer over ``params``, or None when it is not installed here (DeepSpeed)."""
    import torch

    if name == "deepspeed":
        try:
            from deepspeed.ops.adam import DeepSpeedCPUAdam
        except ImportError:
            return None
        return DeepSpeedCPUAdam(params, adamw_mode=True, **HYPER)
    if name == "cpu_kernel":
        from lightning_megatron.optim.cpu_adam import CPUAdamW

        return CPUAdamW(params, fused=True, **HYPER)
    return torch.optim.AdamW(params, **HYPER, **{"fused": {"fused": True}, "for_loop": {"foreach": False},
                                                 "foreach": {"foreach": True}}[name])


def offloaded_implementation() -> str:
    """The row of the optimizer that the recipe's ``adam_implementation="auto"`` builds, stepping host tensors."""
    import torch
    from lightning_megatron.models.optim_recipe import adamw_optimizer
    from lightning_megatron.optim.cpu_adam import CPUAdamW

    optimizer = adamw_optimizer([{"params": [torch.nn.Parameter(torch.zeros(2))]}], "auto", **HYPER)
    if isinstance(optimizer, CPUAdamW):
        return "cpu_kernel"
    group = optimizer.param_groups[0]
    return "fused" if group["fused"] else "foreach" if group["foreach"] else "for_loop"


def run_layout(args: argparse.Namespace, shapes: list[tuple[int, ...]]) -> dict[str, dict]:
    """Steps every implementation on ``shapes`` in interleaved rounds: the median seconds of each, and its largest
    parameter difference from the for-loop's after the last round."""
    import torch

    generator = torch.Generator().manual_seed(0)
    initial = [torch.randn(shape, generator=generator) for shape in shapes]
    grads = [torch.randn(shape, generator=generator) * 1e-3 for shape in shapes]
    runs: dict[str, dict] = {}
    for name in args.implementations:
        params = [torch.nn.Parameter(tensor.clone()) for tensor in initial]
        for param, grad in zip(params, grads):
            param.grad = grad  # the same gradient tensors for everyone: no implementation writes them
        optimizer = make_optimizer(name, params)
        if optimizer is not None:
            runs[name] = {"params": params, "step": optimizer.step, "times": []}
    del initial
    for round_ in range(args.warmup + args.steps):
        for name in abba(list(runs), round_):
            start = time.perf_counter()
            runs[name]["step"]()
            if round_ >= args.warmup:
                runs[name]["times"].append(time.perf_counter() - start)
    reference = runs["for_loop"]["params"]
    # Only the numbers leave: the next layout must not share the machine's memory with this one's ~6 GB.
    return {name: {"seconds": statistics.median(run["times"]),
                   "max_diff": max(float((p.detach() - r.detach()).abs().max())
                                   for p, r in zip(run["params"], reference))} for name, run in runs.items()}


def table(layouts: dict[str, tuple[int, dict]], offloaded: str) -> str:
    header = ["layout", "implementation", "ms/step", "Gparams/s", "vs DeepSpeed", "vs torch for-loop",
              "max |dp| vs for-loop"]
    rows = [header]
    for layout, (numel, runs) in layouts.items():
        for name, run in runs.items():
            seconds = run["seconds"]
            deepspeed = runs.get("deepspeed")
            rows.append([layout, name + (" *" if name == offloaded else ""), f"{seconds * 1e3:.1f}",
                         f"{numel / seconds / 1e9:.3f}",
                         f"{deepspeed['seconds'] / seconds:.2f}" if deepspeed else "-",
                         f"{runs['for_loop']['seconds'] / seconds:.2f}", f"{run['max_diff']:.1e}"])
    return format_rows(rows, left=(0, 1))


def main(argv: Optional[list[str]] = None) -> None:
    args = parse_args(argv)
    # Before torch (and DeepSpeed) start OpenMP: one thread count for every implementation.
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import torch

    torch.set_num_threads(args.threads)
    shapes = gpt2_shapes(int(args.params), args.hidden, args.vocab, args.positions)
    numel = sum(_numel(shape) for shape in shapes)
    layouts = {}
    for layout in args.layouts:
        layout_shapes = shapes if layout == "list" else [(numel,)]
        layouts[f"{layout} ({len(layout_shapes)} tensors)"] = (numel, run_layout(args, layout_shapes))
    print(f"AdamW step on {numel / 1e6:.1f}M fp32 parameters (GPT-2 h={args.hidden} tensors, or one flat tensor), "
          f"{torch.get_num_threads()} threads, median of {args.steps} steps after {args.warmup} warm-up, load average "
          f"{os.getloadavg()[0]:.1f}; ratios: the baseline's time / the row's (> 1: faster); * = the offloaded step")
    print(table(layouts, offloaded_implementation()))
    if "deepspeed" in args.implementations and not any("deepspeed" in runs for _, runs in layouts.values()):
        print("deepspeed: not importable here, row skipped (install: see this script's docstring)")


if __name__ == "__main__":
    main()
