"""Segmented tensor-parallel shards (PackedColumn, QueryGroupColumn) against one process, on 4 real ranks.

Three toy modules, each built once as a plain single-process reference on every rank and once
parallelised by ``parallelize`` over several layouts of the same processes:

* ``Nano``: nanoGPT-style attention and a gated MLP, ``qkv(x).chunk(3, -1)`` and ``fc(x).chunk(2, -1)``;
* ``Grouped``: attention with the ``qkv`` fused by query group (4 heads, 2 groups; 8 heads, 1 group),
  read from the local weight as the library's ``SelfAttention`` does, SDPA with ``enable_gqa``.

Each case runs one step (forward, backward of the token-summed loss, the gradient path, the global
grad norm, one SGD step) and records the worst deviation from the reference; then sharded
checkpoints saved at one layout are read at others. Results go to rank{r}.json: ``errors``
(name -> max abs deviation), ``guard`` (deviations that must be large), ``checkpoint`` facts.
"""

import copy
import json
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lightning_megatron.checkpoint import gather_full_state_dict, read_full_tensors
from lightning_megatron.checkpoint.entries import (
    allocate_optimizer_state,
    model_entries,
    optimizer_entries,
    parameter_placements,
)
from lightning_megatron.checkpoint.sharded import open_sharded, read_tensors, save_sharded
from lightning_megatron.optim import GradientSynchronizer, global_grad_norm
from lightning_megatron.optim.grad_sync import LocalGradients
from lightning_megatron.optim.partial_grads import partial_grad_groups
from lightning_megatron.optim.step import build_step_gradients
from lightning_megatron.strategy.options import StrategyOptions
from lightning_megatron.optim.zero3 import apply_zero3
from lightning_megatron.parallel import ParallelConfig, ParallelState
from lightning_megatron.parallel.initialize import initialize_parameters
from lightning_megatron.parallel.shards import shard_of
from lightning_megatron.tensor_parallel import PackedColumn, QueryGroupColumn, parallelize
from entry import run_script


def main(out_dir: Path, args: list[str]) -> None:
    rank = dist.get_rank()
    assert dist.get_world_size() == 4
    B, S, LR = 4, 6, 0.1
    errors: dict[str, float] = {}
    guard: dict[str, float] = {}
    facts: dict[str, object] = {}

    def err(name, a, b):
        errors[name] = max(errors.get(name, 0.0), (a.detach().float() - b.detach().float()).abs().max().item())

    class Nano(nn.Module):
        def __init__(self, hidden=16, heads=4, ffn=24):
            super().__init__()
            self.head_dim = hidden // heads
            self.qkv, self.proj = nn.Linear(hidden, 3 * hidden), nn.Linear(hidden, hidden)
            self.fc, self.out = nn.Linear(hidden, 2 * ffn), nn.Linear(ffn, hidden)

        def forward(self, x):
            b, s, _ = x.shape
            q, k, v = (t.reshape(b, s, -1, self.head_dim).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
            x = x + self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, -1))
            gate, up = self.fc(x).chunk(2, -1)
            return x + self.out(F.silu(gate) * up)

    class Attention(nn.Module):
        """Reads its local layout from its weight: local_groups = max(1, rows // ((qpg + 2) * head_dim))."""

        def __init__(self, heads, groups, head_dim):
            super().__init__()
            self.head_dim, self.per_group = head_dim, heads // groups
            self.qkv = nn.Linear(heads * head_dim, (heads + 2 * groups) * head_dim)
            self.proj = nn.Linear(heads * head_dim, heads * head_dim)

        def forward(self, x):
            b, s, _ = x.shape
            rows = self.qkv.weight.shape[0] // self.head_dim
            groups = max(1, rows // (self.per_group + 2))
            per_group = rows // groups - 2
            q, k, v = self.qkv(x).view(b, s, groups, per_group + 2, self.head_dim).split([per_group, 1, 1], dim=3)
            q = q.reshape(b, s, groups * per_group, self.head_dim).transpose(1, 2)
            k, v = k.squeeze(3).transpose(1, 2), v.squeeze(3).transpose(1, 2)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])
            return self.proj(y.transpose(1, 2).reshape(b, s, -1))

    class Grouped(nn.Module):
        def __init__(self, heads, groups, head_dim):
            super().__init__()
            self.attn = Attention(heads, groups, head_dim)

        def forward(self, x):
            return x + self.attn(x)

    NANO_PLAN = {"qkv": PackedColumn(3), "proj": "row", "fc": PackedColumn((24, 24)), "out": "row"}
    COLUMN_PLAN = {"qkv": "column", "proj": "row", "fc": "column", "out": "row"}
    GQA, MQA = (4, 2, 8), (8, 1, 4)  # heads, groups, head_dim

    def grouped_plan(shape):
        return {"attn.qkv": QueryGroupColumn(shape[0], shape[1]), "attn.proj": "row"}

    def layout(tp, dp, zero_stage=0):
        return ParallelState.create(ParallelConfig(tensor_parallel_size=tp, data_parallel_size=dp, zero_stage=zero_stage),
                                    "cpu")

    STATES = {"tp1-dp4": layout(1, 4), "tp2-dp2": layout(2, 2), "tp2-dp2-z1": layout(2, 2, 1), "tp4": layout(4, 1),
              "tp4-z1": layout(4, 1, 1)}

    def reference(make, momentum):
        """The plain module after one SGD step on the mean loss; its input, output, gradients and grad norm."""
        torch.manual_seed(0)
        ref = make()
        start = copy.deepcopy(ref)
        gen = torch.Generator().manual_seed(1)
        width = ref.qkv.in_features if hasattr(ref, "qkv") else ref.attn.qkv.in_features
        x, target = torch.randn(B, S, width, generator=gen), torch.randn(B, S, width, generator=gen)
        x_ref = x.clone().requires_grad_()
        y_ref = ref(x_ref)
        ((y_ref - target).pow(2).sum() / (B * S)).backward()
        grads = {name: p.grad.clone() for name, p in ref.named_parameters()}
        norm = torch.sqrt(sum(g.double().pow(2).sum() for g in grads.values())).item()
        opt = torch.optim.SGD(ref.parameters(), lr=LR, momentum=momentum)
        opt.step()
        momenta = {name: opt.state[p]["momentum_buffer"].clone() for name, p in ref.named_parameters()} if momentum else {}
        return dict(start=start, x=x, target=target, y=y_ref.detach(), x_grad=x_ref.grad, grads=grads, norm=norm,
                    weights={k: v.clone() for k, v in ref.state_dict().items()}, momenta=momenta)

    def step(tag, make, plan, state_name, *, path="sync", momentum=0.0, guard_only=False):
        """One training step of ``make()`` parallelised by ``plan``; ``path``: the gradient path (``local``:
        LocalGradients, ``sync``: GradientSynchronizer at zero_stage 0, ``main``: build_step_gradients with the
        layout's zero_stage and fp32 main pieces, ``zero3``: FSDP2 over dp)."""
        state, ref = STATES[state_name], reference(make, momentum)
        model = copy.deepcopy(ref["start"])
        parallelize(model, plan, state)
        dp, dp_rank = state.config.data_parallel_size, state.data_parallel_rank
        rows = slice(dp_rank * B // dp, (dp_rank + 1) * B // dp)
        zero3 = apply_zero3(model, state, layers_pattern="attn.qkv") if path == "zero3" else None
        params = list(model.parameters())
        opt = torch.optim.SGD(params, lr=LR, momentum=momentum)
        main = None
        if path == "zero3":
            sync = zero3
        elif path == "main":
            built = build_step_gradients(model, state, [opt], StrategyOptions(zero_stage=state.config.zero_stage,
                                         bucket_size_mb=25.0), loss_scaler=None, nonfinite=None,
                                         device=torch.device("cpu"))
            sync, main = built.sync, built.main_params
            assert main is not None and isinstance(sync, GradientSynchronizer)
        elif path == "local":
            sync = LocalGradients(params, partial_grad_groups=partial_grad_groups(params, state))
        else:
            sync = GradientSynchronizer(params, data_parallel_group=state.data_parallel_group,
                                        partial_grad_groups=partial_grad_groups(params, state))
        sync.start_micro_batch(sync=True)
        x = ref["x"][rows].clone().requires_grad_()
        y = model(x)
        if guard_only:
            guard[tag] = (y.detach() - ref["y"][rows]).abs().max().item()
            sync.remove()
            return None
        err(f"{tag}/forward", y, ref["y"][rows])
        (y - ref["target"][rows]).pow(2).sum().backward()
        sync.finish(torch.tensor(float((rows.stop - rows.start) * S)))
        err(f"{tag}/input_grad", x.grad / (B * S), ref["x_grad"][rows])
        if main is not None:
            main.prepare_step()
        if path in ("local", "sync"):  # whole gradients in param.grad: every replica holds the summed rows
            for name, param in model.named_parameters():
                shard = shard_of(param)
                expected = ref["grads"][name] if shard is None else shard.local_slice(ref["grads"][name])
                err(f"{tag}/grad", param.grad, expected)
        if zero3 is not None:
            norm = zero3.grad_norm()
        else:
            stepped = [p for group in opt.param_groups for p in group["params"]]
            norm = global_grad_norm(stepped, model_parallel_group=state.model_parallel_group,
                                    is_first_tensor_rank=state.tensor_parallel_rank == 0,
                                    data_parallel_group=state.data_parallel_group if sync.zero_stage else None)
        errors[f"{tag}/norm"] = abs(float(norm) - ref["norm"]) / ref["norm"]
        opt.step()
        if main is not None:
            main.finish_step()
        full = gather_full_state_dict(model, state.tensor_parallel_group)
        for name, value in ref["weights"].items():
            err(f"{tag}/weights", full[name], value)
        return dict(model=model, opt=opt, main=main, state=state, ref=ref, sync=sync)

    def fresh(make, plan, state_name, *, main_params=False):
        """A parallelised copy of ``make()`` with other values (zeros), to load a checkpoint into."""
        state = STATES[state_name]
        with torch.device("meta"):
            model = make()
        parallelize(model, plan, state)
        initialize_parameters(model, seed=7, device="cpu")
        with torch.no_grad():
            for param in model.parameters():
                param.zero_()
        opt, main = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9), None
        if main_params:
            main = build_step_gradients(model, state, [opt], StrategyOptions(zero_stage=state.config.zero_stage,
                                        bucket_size_mb=25.0), loss_scaler=None, nonfinite=None,
                                        device=torch.device("cpu")).main_params
        return model, opt, main, state

    def save(case, name, *, with_optimizer=False):
        state, model = case["state"], case["model"]
        entries = model_entries(model)
        if with_optimizer:
            placements = parameter_placements(model, case["main"])
            entries.update(optimizer_entries(case["opt"], 0, placements))
        save_sharded(out_dir / name, entries, {}, {})
        return out_dir / name

    def load(tag, path, make, plan, state_name, weights, *, momenta=None):
        """Read ``path`` into a fresh model (and with ``momenta``, its fp32 main pieces' SGD momentum) at another
        layout; compare the gathered weights and every local piece of optimizer state with the reference."""
        model, opt, main, state = fresh(make, plan, state_name, main_params=momenta is not None)
        saved = open_sharded(path)
        entries = model_entries(model)
        if momenta is not None:
            placements = parameter_placements(model, main)
            allocate_optimizer_state(opt, 0, placements, saved.tensors())
            entries.update(optimizer_entries(opt, 0, placements))
        read_tensors(saved, entries)
        full = gather_full_state_dict(model, state.tensor_parallel_group)  # the primaries' copies of replicated rows
        for name, value in weights.items():
            err(f"{tag}/weights", full[name], value)
        for name, param in model.named_parameters():  # every replica's own
            shard = shard_of(param)
            err(f"{tag}/local_weights", param, weights[name] if shard is None else shard.local_slice(weights[name]))
        if momenta is not None:
            main.copy_from_model()
            names = {id(p): n for n, p in model.named_parameters()}
            for piece, main_param in main.pieces:
                shard, momentum = shard_of(piece.param), momenta[names[id(piece.param)]]
                expected = momentum if shard is None else shard.local_slice(momentum)
                err(f"{tag}/momentum", opt.state[main_param]["momentum_buffer"],
                    expected.reshape(-1)[piece.start : piece.stop])

    def expected_layouts():
        """Local rows by an independent formula: PackedColumn takes each chunk's r-th 1/tp; QueryGroupColumn at tp4
        over 2 groups takes group r // 2's query head r % 2, then that group's k and v."""
        full = torch.arange(64.0 * 32).view(64, 32)
        state = STATES["tp4"]
        r = state.tensor_parallel_rank
        grouped = Grouped(*GQA)
        grouped.attn.qkv.weight.data.copy_(full)
        parallelize(grouped, grouped_plan(GQA), state)
        by_head = full.view(2, 4, 8, 32)  # group, (q0, q1, k, v), head_dim, input
        err("layout/query_group", grouped.attn.qkv.weight,
            torch.cat([by_head[r // 2, r % 2], by_head[r // 2, 2], by_head[r // 2, 3]]))
        nano = Nano()
        nano.qkv.weight.data.copy_(torch.arange(48.0 * 16).view(48, 16))
        expected = torch.cat([chunk.chunk(4)[r] for chunk in nano.qkv.weight.data.chunk(3)])
        parallelize(nano, NANO_PLAN, state)
        err("layout/packed", nano.qkv.weight, expected)

    expected_layouts()

    # (a) nanoGPT qkv.chunk(3) and [gate | up]: PackedColumn at tp2 (ZeRO-1 over dp2, fp32 main pieces) and tp4;
    # plain "column" gives other outputs (the guard that these comparisons can fail).
    step("nano/tp2-dp2-z1", Nano, NANO_PLAN, "tp2-dp2-z1", path="main")
    step("nano/tp4", Nano, NANO_PLAN, "tp4", path="local")
    step("nano-column/tp2", Nano, COLUMN_PLAN, "tp2-dp2", guard_only=True)
    step("nano-column/tp4", Nano, COLUMN_PLAN, "tp4", guard_only=True)

    # (b) grouped-query attention: whole groups (tp1, tp2), replicated k/v (tp4: pairs of ranks) on every gradient path.
    gqa = lambda: Grouped(*GQA)  # noqa: E731
    mqa = lambda: Grouped(*MQA)  # noqa: E731
    gqa_tp1 = step("gqa/tp1-dp4", gqa, grouped_plan(GQA), "tp1-dp4")
    step("gqa/tp2-dp2", gqa, grouped_plan(GQA), "tp2-dp2")
    gqa_tp4 = step("gqa/tp4-sync", gqa, grouped_plan(GQA), "tp4")
    step("gqa/tp4-local", gqa, grouped_plan(GQA), "tp4", path="local")
    step("gqa/tp4-z1", gqa, grouped_plan(GQA), "tp4-z1", path="main")
    # multi-query: k/v replicated on both tp ranks; ZeRO-1 pieces cut the qkv rows mid-way, and ZeRO-3 row blocks.
    mqa_z1 = step("mqa/tp2-dp2-z1", mqa, grouped_plan(MQA), "tp2-dp2-z1", path="main", momentum=0.9)
    step("mqa/tp4-sync", mqa, grouped_plan(MQA), "tp4")
    mqa_z3 = step("mqa/tp2-dp2-z3", mqa, grouped_plan(MQA), "tp2-dp2", path="zero3")

    # (c) sharded checkpoints across layouts: replicated k/v rows written once, read by every replica.
    path = save(gqa_tp4, "gqa_tp4")
    if rank == 0:
        saved = open_sharded(path).tensors()
        facts["gqa_tp4_chunks"] = {name.split("/", 1)[1]: [len(md.chunks), sum(c.sizes.numel() for c in md.chunks)]
                                   for name, md in saved.items()}
        consolidated = read_full_tensors(path)
        for name, value in gqa_tp4["ref"]["weights"].items():
            err("checkpoint/gqa_tp4_consolidated", consolidated[f"state_dict/{name}"], value)
    for state_name in ("tp2-dp2", "tp1-dp4"):
        load(f"checkpoint/gqa_tp4_to_{state_name}", path, gqa, grouped_plan(GQA), state_name, gqa_tp4["ref"]["weights"])
    load("checkpoint/gqa_tp1_to_tp4", save(gqa_tp1, "gqa_tp1"), gqa, grouped_plan(GQA), "tp4", gqa_tp1["ref"]["weights"])

    path = save(mqa_z1, "mqa_z1", with_optimizer=True)
    if rank == 0:
        consolidated = read_full_tensors(path)
        for name, value in mqa_z1["ref"]["momenta"].items():
            err("checkpoint/mqa_z1_momentum_consolidated", consolidated[f"optimizer/0/{name}/momentum_buffer"], value)
    for state_name in ("tp4-z1", "tp2-dp2-z1"):
        load(f"checkpoint/mqa_z1_to_{state_name}", path, mqa, grouped_plan(MQA), state_name, mqa_z1["ref"]["weights"],
             momenta=mqa_z1["ref"]["momenta"])
    load("checkpoint/mqa_z3_to_tp4", save(mqa_z3, "mqa_z3"), mqa, grouped_plan(MQA), "tp4", mqa_z3["ref"]["weights"])

    (out_dir / f"rank{rank}.json").write_text(json.dumps({"errors": errors, "guard": guard, "facts": facts}))
    dist.barrier()


if __name__ == "__main__":
    run_script(main)
