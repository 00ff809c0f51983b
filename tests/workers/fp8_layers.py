"""FP8 tensor-parallel layers against the single-process FP8 layer (2 ranks; ``tests/test_fp8.py``).

Every rank computes the single-process FP8 layer on the full tensors itself and compares its shard of each
tensor-parallel layer's output and gradients with the matching part: the column layer (with and without sequence
parallelism), the packed and query-group columns (the latter with key/value rows replicated on both ranks), the
row layer (with and without), and the experts' column and row layers inside an MoE region, for both recipes.
Negative controls remove the tensor-parallel group from the amaxes of a row layer whose input rows have their amax
in rank 0's shard, and of a column layer whose output gradient rows have. Then two steps of 1 and of 4 micro-batches
through a column + row MLP, counting the amax all-reduces per step. Results (max |error| / max |reference| per
tensor) go to rank{r}.json.
"""

import json
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from lightning_megatron.parallel import ParallelConfig, ParallelState
from lightning_megatron.tensor_parallel import ColumnParallelLinear, PackedColumn, QueryGroupColumn, RowParallelLinear
from lightning_megatron.tensor_parallel import parallelize
from lightning_megatron.tensor_parallel.fp8 import Fp8Gemms, Fp8Recipe
from lightning_megatron.tensor_parallel.fp8_plan import convert_to_fp8
from entry import run_script


def main(out_dir: Path, args: list[str]) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    state = ParallelState.create(ParallelConfig(tensor_parallel_size=world), "cpu")
    group = state.tensor_parallel_group
    B, S, K = 2, 12, 64  # 24 tokens: the weight gradient's contraction is padded to 32; sequence chunks of 6
    errors: dict[str, float] = {}

    def relative(a, b):
        return ((a.detach().float() - b.detach().float()).abs().max() / b.detach().float().abs().max()).item()

    def data(out_features, seed=0):
        """Input rows and gradient columns over orders of magnitude (rowwise scales differ from the tensor's)."""
        generator = torch.Generator().manual_seed(seed)
        x = torch.randn(B, S, K, generator=generator) * torch.logspace(-2, 1, S).unsqueeze(1)
        weight = torch.randn(out_features, K, generator=generator) / K ** 0.5
        bias = torch.randn(out_features, generator=generator)
        grad = torch.randn(B, S, out_features, generator=generator) * torch.logspace(-2, 0, out_features)
        return x, weight, bias, grad

    def single_process(recipe, x, weight, bias, grad, autocast=False):
        """The FP8 layer on one process: output, input, weight and bias gradients."""
        layer = ColumnParallelLinear(K, weight.shape[0], bias=bias is not None)
        layer.weight.data.copy_(weight)
        if bias is not None:
            layer.bias.data.copy_(bias)
        layer.gemms = Fp8Gemms(recipe, None, "output")
        x = x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            y = layer(x)
        y.backward(grad.to(y.dtype))
        return y.detach(), x.grad, layer.weight.grad, None if bias is None else layer.bias.grad

    def sequence_chunk(t):
        return t.chunk(world, dim=1)[rank]

    def local_features(t, shard):
        """The last dimension of ``t`` cut as ``shard`` cuts its dimension 0 (a column layer's output features)."""
        moved = t.movedim(-1, 0)
        return replace(shard, global_shape=tuple(moved.shape)).local_slice(moved).movedim(0, -1)

    def primary(shard):
        """1 for the local output features this rank is the primary holder of, 0 for replicas of another rank's: the
        gradient a replica receives is a partial sum, here all of it on the primary, none on the replica."""
        mask = torch.zeros(shard.local_size)
        for segment in shard.segments():
            if segment.holders[0] == rank:
                mask[segment.local_start:segment.local_start + segment.size] = 1
        return mask

    def summed(t):
        t = t.clone()
        dist.all_reduce(t, group=group)
        return t

    def column_case(name, recipe, out_features, *, sequence_parallel=False, rank_ranges=None, communicates=True,
                    autocast=False, gemms=None, plant=False, into=errors):
        x, weight, bias, grad = data(out_features)
        if plant:  # every token's gradient amax in rank 0's shard (output feature 0, whose weights are zero)
            grad[..., 0] = 2 ** 16 * grad.abs().max()
            weight[0] = 0
        y_ref, dx_ref, dw_ref, db_ref = single_process(recipe, x, weight, bias, grad, autocast)
        layer = ColumnParallelLinear(K, out_features, group=group, sequence_parallel=sequence_parallel,
                                     rank_ranges=rank_ranges)
        layer.communicates = communicates
        shard = layer.weight.tensor_shard
        layer.weight.data.copy_(shard.local_slice(weight))
        layer.bias.data.copy_(layer.bias.tensor_shard.local_slice(bias))
        layer.gemms = gemms or Fp8Gemms(recipe, group, "output")
        mask = primary(shard)
        x_local = (sequence_chunk(x) if sequence_parallel else x).clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            y = layer(x_local)
        y.backward((local_features(grad, shard) * mask).to(y.dtype))
        dx = x_local.grad if communicates else summed(x_local.grad)  # inside a region: partial until it is left
        into[f"{name}_output"] = relative(y, local_features(y_ref, shard))
        into[f"{name}_input_grad"] = relative(dx, sequence_chunk(dx_ref) if sequence_parallel else dx_ref)
        into[f"{name}_weight_grad"] = relative(layer.weight.grad, shard.local_slice(dw_ref) * mask[:, None])
        into[f"{name}_bias_grad"] = relative(layer.bias.grad, local_features(db_ref, shard) * mask)
        return y.dtype, (x_local.grad.dtype, layer.weight.grad.dtype, layer.bias.grad.dtype)

    def row_case(name, recipe, *, sequence_parallel=False, communicates=True, gemms=None, plant=False, into=errors):
        x, weight, bias, grad = data(64)
        if plant:  # every token's amax in rank 0's shard (input feature 0, whose weights are zero), 2^16 times the rest:
            x[..., 0] = 2 ** 16 * x.abs().max()  # scaled by it, the other values are e4m3 subnormals (or zero)
            weight[:, 0] = 0
        bias = bias if communicates else None  # inside a region the row layer has no bias (its outputs are partial)
        y_ref, dx_ref, dw_ref, db_ref = single_process(recipe, x, weight, bias, grad)
        layer = RowParallelLinear(K, 64, bias=bias is not None, group=group, sequence_parallel=sequence_parallel)
        layer.communicates = communicates
        layer.weight.data.copy_(layer.weight.tensor_shard.local_slice(weight))
        if bias is not None:
            layer.bias.data.copy_(bias)
        layer.gemms = gemms or Fp8Gemms(recipe, group, "input")
        x_local = x.chunk(world, dim=-1)[rank].clone().requires_grad_()
        y = layer(x_local)
        y.backward(sequence_chunk(grad) if sequence_parallel else grad)
        y = y if communicates else summed(y)
        into[f"{name}_output"] = relative(y, sequence_chunk(y_ref) if sequence_parallel else y_ref)
        into[f"{name}_input_grad"] = relative(x_local.grad, dx_ref.chunk(world, dim=-1)[rank])
        into[f"{name}_weight_grad"] = relative(layer.weight.grad, layer.weight.tensor_shard.local_slice(dw_ref))
        if bias is not None:
            bias_grad = summed(layer.bias.grad) if sequence_parallel else layer.bias.grad  # partial sums under SP
            into[f"{name}_bias_grad"] = relative(bias_grad, db_ref)

    dtypes = {}
    controls = {}
    for recipe_name in ("tensorwise", "rowwise"):
        recipe = Fp8Recipe.named(recipe_name)
        column_case(f"column_{recipe_name}", recipe, 64)
        column_case(f"column_sp_{recipe_name}", recipe, 64, sequence_parallel=True)
        column_case(f"packed_{recipe_name}", recipe, 64, rank_ranges=PackedColumn(2).rank_ranges(64, world))
        # Multi-query attention's qkv (4 query heads of 16, 1 key/value head) at tp2: the key/value rows on both ranks, their
        # whole gradient on the primary (split between the replicas, as attention splits it, convert_to_fp8 refuses it).
        column_case(f"query_groups_{recipe_name}", recipe, 96, rank_ranges=QueryGroupColumn(4, 1).rank_ranges(96, world))
        column_case(f"experts_column_{recipe_name}", recipe, 64, communicates=False)
        row_case(f"row_{recipe_name}", recipe)
        row_case(f"row_sp_{recipe_name}", recipe, sequence_parallel=True)
        row_case(f"experts_row_{recipe_name}", recipe, communicates=False)
        # Under autocast the column layers (with and without sequence parallelism) write bf16, as the single-process
        # layer under autocast does; their gradients keep the fp32 dtypes.
        for tag, sequence_parallel in (("", False), ("_sp", True)):
            output_dtype, grad_dtypes = column_case(f"column{tag}_autocast_{recipe_name}", recipe, 64,
                                                    sequence_parallel=sequence_parallel, autocast=True)
            dtypes[f"{recipe_name}{tag}"] = [str(output_dtype), *map(str, grad_dtypes)]
        # Negative controls: the planted amaxes with and without the tensor-parallel reduction, where the row layer's
        # forward and the column layer's input gradient contract over a cut dimension.
        row_case(f"row_reduced_{recipe_name}", recipe, plant=True, into=controls)
        row_case(f"row_local_{recipe_name}", recipe, plant=True, gemms=Fp8Gemms(recipe, None, "input"), into=controls)
        column_case(f"column_reduced_{recipe_name}", recipe, 64, plant=True, into=controls)
        column_case(f"column_local_{recipe_name}", recipe, 64, plant=True, gemms=Fp8Gemms(recipe, None, "output"),
                    into=controls)

    # convert_to_fp8 at tp2: the layers get the tensor-parallel group and their cut; a local size not a multiple of 16
    # (48 output features, 24 per rank) is refused, naming the size at this tensor_parallel_size.
    converted = {}
    block = nn.ModuleDict({"fc": nn.Linear(64, 64), "proj": nn.Linear(64, 64)})
    parallelize(block, {"fc": "column", "proj": "row"}, state)
    converted["names"] = convert_to_fp8(block, Fp8Recipe.named("tensorwise"), state)
    converted["gemms"] = [block["fc"].gemms == Fp8Gemms(Fp8Recipe.named("tensorwise"), group, "output"),
                          block["proj"].gemms == Fp8Gemms(Fp8Recipe.named("tensorwise"), group, "input")]
    narrow = nn.ModuleDict({"fc": nn.Linear(64, 48)})
    parallelize(narrow, {"fc": "column"}, state)
    try:
        convert_to_fp8(narrow, Fp8Recipe.named("rowwise"), state)
    except ValueError as error:
        converted["refusal"] = str(error)

    # Multi-query qkv at tp2 (the key/value rows on both ranks, each with a part of their gradient): refused.
    shared = nn.ModuleDict({"qkv": nn.Linear(64, 96)})
    parallelize(shared, {"qkv": QueryGroupColumn(4, 1)}, state)
    try:
        convert_to_fp8(shared, Fp8Recipe.named("tensorwise"), state)
    except ValueError as error:
        converted["replicated_refusal"] = str(error)

    # Steps of 1 and of 4 micro-batches through a column + row MLP at tp2, SGD between steps: the amax all-reduces (MAX)
    # per step, counted by a wrapper around dist.all_reduce, and the losses and weights against the single-process FP8 MLP.
    def mlp(recipe, tp_group):
        fc = ColumnParallelLinear(K, 64, group=tp_group)
        proj = RowParallelLinear(64, K, group=tp_group)
        generator = torch.Generator().manual_seed(3)
        for layer in (fc, proj):
            for param in layer.parameters():
                full = torch.randn(param.tensor_shard.global_shape if hasattr(param, "tensor_shard") else param.shape,
                                   generator=generator) * 0.2
                param.data.copy_(param.tensor_shard.local_slice(full) if hasattr(param, "tensor_shard") else full)
        fc.gemms = Fp8Gemms(recipe, tp_group, "output")
        proj.gemms = Fp8Gemms(recipe, tp_group, "input")
        return fc, proj

    def train_mlp(recipe, tp_group, micro_batches, steps=2):
        fc, proj = mlp(recipe, tp_group)
        optimizer = torch.optim.SGD([*fc.parameters(), *proj.parameters()], lr=0.1)
        generator = torch.Generator().manual_seed(4)
        losses, amax_reduces = [], []
        for _ in range(steps):
            calls[0] = 0
            for _ in range(micro_batches):
                x = (torch.randn(B, S, K, generator=generator) * 2).requires_grad_()  # as a layer's input inside a model
                loss = (proj(torch.nn.functional.gelu(fc(x))) ** 2).mean()
                loss.backward()
                losses.append(loss.item())
            amax_reduces.append(calls[0])
            optimizer.step()
            optimizer.zero_grad()
        weights = [p.detach().clone() for p in (fc.weight, proj.weight)]
        return losses, weights, amax_reduces, (fc, proj)

    calls = [0]
    _all_reduce = dist.all_reduce

    def counting_all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        if op == dist.ReduceOp.MAX:
            calls[0] += 1
        return _all_reduce(tensor, op=op, group=group, async_op=async_op)

    dist.all_reduce = counting_all_reduce
    steps = {}
    for recipe_name in ("tensorwise", "rowwise"):
        recipe = Fp8Recipe.named(recipe_name)
        for micro_batches in (1, 4):
            losses, weights, amax_reduces, (fc, proj) = train_mlp(recipe, group, micro_batches)
            ref_losses, ref_weights, _, _ = train_mlp(recipe, None, micro_batches)
            steps[f"{recipe_name}_mb{micro_batches}"] = {
                "amax_all_reduces": amax_reduces,
                "loss_error": max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)),
                "weight_error": max(relative(weights[0], fc.weight.tensor_shard.local_slice(ref_weights[0])),
                                    relative(weights[1], proj.weight.tensor_shard.local_slice(ref_weights[1])))}
    dist.all_reduce = _all_reduce

    (out_dir / f"rank{rank}.json").write_text(json.dumps({"errors": errors, "controls": controls, "dtypes": dtypes,
                                                             "converted": converted, "steps": steps}))
    dist.barrier()


if __name__ == "__main__":
    run_script(main)
