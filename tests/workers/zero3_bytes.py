"""Per-rank model-state bytes under ZeRO stage 3 (AdamW), fp32 and bf16 mixed precision.

Run by ``zero3_training.py`` (layout ``bytes``), or alone (argv: OUT_DIR). For tp1-dp4 and
tp2-dp2 over 4 ranks, with and without ``MixedPrecisionPolicy(param_dtype=bfloat16,
reduce_dtype=float32)``, the latter also with ``offload_parameters="cpu"`` (``bf16-mixed-cpu``), each
rank runs one step and reports: the measured bytes of its parameter, gradient and optimizer-state shards;
Psi (its tp-local parameter count) and dp; the bytes FSDP's dim-0 chunking predicts for this dp rank; and
what a layer's forward saw (type and dtype of the gathered weight) and the gradients' dtype.
"""

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor

from gpt_setup import CONFIG, SEED, batches
from lightning_megatron.models import GPTModel
from lightning_megatron.offload.settings import OffloadSettings
from lightning_megatron.optim.zero3 import apply_zero3
from lightning_megatron.parallel import ParallelConfig, ParallelState
from lightning_megatron.tensor_parallel import parallelize


def measure_bytes() -> dict:
    results = {}
    for tp, dp in ((1, 4), (2, 2)):
        for precision in ("fp32", "bf16-mixed", "bf16-mixed-cpu"):
            results[f"tp{tp}-dp{dp}-{precision}"] = _one_step(tp, dp, precision)
    return results


def _one_step(tp: int, dp: int, precision: str) -> dict:
    state = ParallelState.create(ParallelConfig(tensor_parallel_size=tp, data_parallel_size=dp), "cpu")
    with torch.device("meta"):
        model = GPTModel(CONFIG)
    parallelize(model, model.tensor_parallel_plan(), state)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if precision != "fp32" else None
    zero3 = apply_zero3(model, state, layers_pattern="blocks.*", mixed_precision=policy,
                        offload=OffloadSettings(parameters="cpu" if precision.endswith("-cpu") else "none"))
    zero3.initialize(SEED, device="cpu")
    seen = []
    qkv = model.get_submodule("blocks.0.attn.qkv")
    hook = qkv.register_forward_pre_hook(lambda m, a: seen.append(
        ("DTensor" if isinstance(m.weight, DTensor) else "Tensor", str(m.weight.dtype))))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    input_ids, labels = batches()[0]
    rows = slice(state.data_parallel_rank * 2, state.data_parallel_rank * 2 + 2)
    zero3.start_micro_batch(sync=True)
    loss_sum, tokens = model.loss(input_ids[rows], labels[rows])
    loss_sum.backward()
    zero3.finish(tokens)
    grad_dtypes = sorted({str(p.grad.dtype) for p in model.parameters()})
    optimizer.step()
    measured = zero3.model_state_bytes(optimizer)  # gradients still held, as between backward and zero_grad
    optimizer.zero_grad()
    hook.remove()
    # FSDP2 shards dim 0 as torch.chunk: ceil(rows / N) rows per rank, empty past the end.
    chunked = 0
    for p in model.parameters():
        rows_total, row_numel = p.shape[0], p.numel() // max(p.shape[0], 1)
        per_rank = -(-rows_total // dp)
        chunked += max(0, min(per_rank, rows_total - state.data_parallel_rank * per_rank)) * row_numel
    return {
        "bytes": measured,
        "psi": sum(p.numel() for p in model.parameters()),  # a DTensor's shape is the tp-local shape
        "chunked_numel": chunked,
        "dp": dp,
        "forward_weight": seen[0],
        "grad_dtypes": grad_dtypes,
    }


if __name__ == "__main__":
    out_dir = Path(sys.argv[1])
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    (out_dir / f"rank{dist.get_rank()}.json").write_text(json.dumps(measure_bytes()))
    dist.barrier()
    os._exit(0)  # skip gloo's C++ teardown: with several meshes alive it aborts at random (torch 2.13)
