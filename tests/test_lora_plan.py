"""LoRA's tensor-parallel plan (``peft.plan``) and what the single-process parts of the step do with a frozen base.
The multi-rank comparisons with one process are ``tests/test_layout_invariance.py``'s ``-lora`` layouts; the bytes,
``tests/test_plan.py``'s ``lora-`` layouts."""

import copy

import pytest
import torch
from torch import nn

from lightning_megatron.models import GPT, GPTConfig, GPTModel
from lightning_megatron.parallel import ParallelConfig, ParallelState
from lightning_megatron.parallel.shards import shard_of
from lightning_megatron.parallel.names import is_adapter_name
from lightning_megatron.peft.lora import LoRAConfig, apply_lora, fused_layers
from lightning_megatron.peft.merge import adapter_weight_names, layer_adapters, merged_projections_weight
from lightning_megatron.peft.plan import adapter_plan
from lightning_megatron.plan.inventory import fake_world
from lightning_megatron.peft.plan import tensor_parallel_plan_of
from lightning_megatron.tensor_parallel import ColumnParallelLinear, RowParallelLinear, parallelize
from lightning_megatron.tensor_parallel.fp8 import Fp8Recipe
from lightning_megatron.tensor_parallel.fp8_plan import convert_to_fp8, describe_fp8
from lightning_megatron.tensor_parallel.region import InsideRegion
from lightning_megatron.tensor_parallel.styles import KeyValueHeads, PackedColumn, QueryGroupColumn

LLAMA = GPTConfig.from_name("llama-tiny", vocab_size=64, max_seq_length=16, hidden_size=32, num_layers=2, num_heads=4,
                            num_query_groups=2, ffn_hidden_size=48)
LORA = LoRAConfig(rank=4, alpha=8.0)


def _lora_model(lora=LORA, config=LLAMA, device="meta"):
    with torch.device(device):
        model = GPTModel(config)
        apply_lora(model, lora, seed=0)
    return model


def test_adapters_follow_the_style_of_their_layer():
    model = _lora_model()
    plan = model.tensor_parallel_plan()
    extended = adapter_plan(model, plan, ParallelConfig(tensor_parallel_size=2))
    assert {k: v for k, v in extended.items() if k in plan} == plan  # the model's own entries untouched
    added = {k: v for k, v in extended.items() if k not in plan}
    expected, parts = {}, {"q": "column", "k": KeyValueHeads(2), "v": KeyValueHeads(2), "gate": "column",
                           "up": "column"}
    for layer in range(2):
        prefix = f"blocks.{layer}"
        expected.update({f"{prefix}.{fused}.lora_{ab}.{part}": "sequence_parallel" if ab == "a" else parts[part]
                         for fused, names in (("attn.qkv", "qkv"), ("mlp.fc", ("gate", "up")))
                         for part in names for ab in "ab"})
        expected.update({f"{prefix}.attn.proj.lora_a": "row", f"{prefix}.attn.proj.lora_b": "sequence_parallel",
                         f"{prefix}.mlp.proj.lora_a": "row", f"{prefix}.mlp.proj.lora_b": "sequence_parallel"})
    assert added == expected
    # The fused variant: one adapter over each fused layer, B split exactly as the layer.
    fused = _lora_model(LoRAConfig(rank=4, variant="fused"))
    added = {k: v for k, v in adapter_plan(fused, plan, ParallelConfig(tensor_parallel_size=2)).items()
             if k not in plan and ".lora_b" in k}
    assert added["blocks.1.attn.qkv.lora_b"] == QueryGroupColumn(4, 2) and \
        added["blocks.1.mlp.fc.lora_b"] == PackedColumn(2)
    # A model without adapters keeps its plan; GPT-2's plain "column" fc gives B the same string.
    assert adapter_plan(GPTModel(LLAMA), plan, ParallelConfig()) == plan
    gpt = _lora_model(LoRAConfig(targets=["*.mlp.fc"]), GPTConfig(vocab_size=64, hidden_size=32, num_layers=1,
                                                                 num_heads=4, max_seq_length=16))
    added = {k: v for k, v in adapter_plan(gpt, gpt.tensor_parallel_plan(), ParallelConfig()).items()
             if k.endswith(("lora_a", "lora_b"))}
    assert added == {"blocks.0.mlp.fc.lora_a": "sequence_parallel", "blocks.0.mlp.fc.lora_b": "column"}


def test_dropout_draws_from_the_stream_its_input_needs():
    model = _lora_model(LoRAConfig(rank=4, dropout=0.1, targets=["*.mlp.fc", "*.mlp.proj", "*.attn.proj"]))
    extended = adapter_plan(model, model.tensor_parallel_plan(), ParallelConfig(tensor_parallel_size=2))
    assert extended["blocks.0.mlp.fc.lora_dropout"] == "sequence_parallel"  # replicated input, a chunk under SP
    assert extended["blocks.0.mlp.proj.lora_dropout"] == "sharded_dropout"  # input split by features
    assert extended["blocks.0.attn.proj.lora_dropout"] == "sharded_dropout"
    # qkv runs inside attention, whose dropout draws from the per-rank stream: its replicated input cannot.
    qkv = _lora_model(LoRAConfig(rank=4, dropout=0.1, targets=["*.attn.qkv"]))
    with pytest.raises(ValueError, match=r"LoRA dropout on blocks\.0\.attn\.qkv at tensor_parallel_size=2 without "
                                         r"sequence parallelism.*sequence_parallel=True"):
        adapter_plan(qkv, qkv.tensor_parallel_plan(), ParallelConfig(tensor_parallel_size=2))
    for config in (ParallelConfig(tensor_parallel_size=2, sequence_parallel=True), ParallelConfig()):
        assert adapter_plan(qkv, qkv.tensor_parallel_plan(), config)["blocks.1.attn.qkv.lora_dropout"] == \
            "sequence_parallel"


def test_a_layer_split_another_way_is_refused_with_the_fix():
    model = _lora_model(LoRAConfig(targets=["lm_head", "*.attn.qkv"]))
    with pytest.raises(ValueError, match=r"LoRA cannot adapt lm_head: the tensor-parallel plan splits it as 'vocab'"
                                         r".*Narrow the LoRA targets"):
        adapter_plan(model, model.tensor_parallel_plan(), ParallelConfig())
    experts = nn.Module()
    experts.fc = nn.Linear(8, 8)
    apply_lora(experts, LoRAConfig(targets=["fc"]))
    with pytest.raises(ValueError, match=r"LoRA cannot adapt fc: .*InsideRegion"):
        adapter_plan(experts, {"fc": InsideRegion("column")}, ParallelConfig())
    # A layer the plan leaves whole keeps a whole adapter: nothing to add.
    assert adapter_plan(experts, {}, ParallelConfig(tensor_parallel_size=2)) == {}


def test_swapped_layers_keep_the_adapter_and_its_update():
    """One process (the swap to tp=1 parallel layers): the adapted model computes the same logits after the swap, with
    its adapters, their hook and scale carried over, and its base still frozen."""
    torch.manual_seed(0)
    model = _lora_model(device="cpu")
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_b." in name:
                param.normal_(0.0, 0.1)  # B away from zero, so the update shows
    ids = torch.randint(0, 64, (2, 16))
    expected = model(ids)
    swapped = copy.deepcopy(model)
    state = ParallelState(ParallelConfig(), torch.device("cpu"))
    parallelize(swapped, tensor_parallel_plan_of(swapped, state.config), state, pad_vocab_to_multiple_of=1)
    qkv = swapped.blocks["0"].attn.qkv
    assert isinstance(qkv, ColumnParallelLinear) and isinstance(qkv.lora_b["k"], ColumnParallelLinear)
    assert isinstance(swapped.blocks["0"].mlp.proj.lora_a, RowParallelLinear) and qkv.lora_scale == LORA.scale
    assert dict(swapped.named_parameters()).keys() == dict(model.named_parameters()).keys()
    assert [n for n, p in swapped.named_parameters() if p.requires_grad] == \
        [n for n, p in model.named_parameters() if p.requires_grad]
    torch.testing.assert_close(swapped(ids), expected, rtol=0, atol=1e-6)
    assert (expected - GPTModel.forward(_without_adapters(model), ids)).abs().max() > 1e-3  # the update is there


def test_a_swap_keeps_what_was_attached_and_only_that():
    model = nn.Module()
    model.emb, model.fc = nn.Embedding(10, 4), nn.Linear(4, 6)
    model.fc.requires_grad_(False)
    model.fc.extra, model.fc.tag = nn.Linear(4, 6), "kept"
    handle = model.fc.register_forward_hook(lambda layer, args, out: out + layer.extra(args[0]))
    parallelize(model, {"emb": "vocab", "fc": "column"}, ParallelState(ParallelConfig(), torch.device("cpu")))
    assert isinstance(model.fc, ColumnParallelLinear) and model.fc.tag == "kept"
    assert "extra" in dict(model.fc.named_children())
    assert not model.fc.weight.requires_grad and model.fc.extra.weight.requires_grad
    assert not hasattr(model.emb, "padding_idx")  # nn.Embedding's own settings are not attachments
    x = torch.randn(3, 4)
    with_hook = model.fc(x)
    handle.remove()  # the handle still reaches the hook it registered
    torch.testing.assert_close(with_hook - model.fc(x), model.fc.extra(x))


def _without_adapters(model):
    plain = copy.deepcopy(model)
    for module in plain.modules():
        module._forward_hooks.clear()
    return plain


def test_adapters_are_split_with_their_layers_at_tp4(no_process_group):
    """tp4 over the fake process group: 2 key/value groups, so each group's k/v rows (of qkv and of its B) are
    replicated on 2 ranks; A of a column layer and B of a row layer are whole, and under SP sum their gradients."""
    with fake_world(4, rank=1):
        state = ParallelState.create(ParallelConfig(tensor_parallel_size=4, sequence_parallel=True), "cpu")
        model = _lora_model()
        parallelize(model, tensor_parallel_plan_of(model, state.config), state)
        qkv, proj, fc = model.blocks["0"].attn.qkv, model.blocks["0"].attn.proj, model.blocks["0"].mlp.fc
        # head_dim 8: rank 1 holds query heads 1 (of group 0) and group 0's key/value head, held by ranks 0 and 1.
        assert shard_of(qkv.lora_b["k"].weight).rank_ranges == (((0, 8),),) * 2 + (((8, 8),),) * 2
        assert qkv.lora_b["q"].weight.shape == (8, 4) and shard_of(qkv.lora_b["q"].weight).rank_ranges is None
        assert qkv.lora_b["v"].weight.shape == (8, 4) and qkv.lora_a["v"].weight.shape == (4, 32)
        assert fc.lora_b["up"].weight.shape == (48 // 4, 4)
        assert proj.lora_a.weight.shape == (4, 32 // 4) and proj.lora_b.weight.shape == (32, 4)
        for whole in (qkv.lora_a["q"].weight, fc.lora_a["gate"].weight, proj.lora_b.weight):
            assert shard_of(whole) is None and whole.sequence_parallel_grad and whole.requires_grad
        assert not qkv.weight.requires_grad and not proj.weight.requires_grad


def test_the_recipe_steps_only_the_adapters():
    gpt = GPT(LLAMA, lora={"rank": 4, "targets": ["*.attn.qkv"]})
    gpt.configure_model()
    optimizer = gpt.configure_optimizers()["optimizer"]
    stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
    adapters = {id(p) for n, p in gpt.named_parameters() if ".lora_" in n}
    assert stepped == adapters and len(adapters) == 2 * 3 * LLAMA.num_layers  # A and B of q, k and v


def test_fp8_leaves_the_adapters_in_high_precision():
    """The base layers' GEMMs in FP8, the adapters' in fp32: the adapted layer's output is its FP8 GEMM plus exactly the
    fp32 update; the log line counts the base layers only."""
    pytest.importorskip("torchao")
    torch.manual_seed(0)
    model = _lora_model(device="cpu")
    state = ParallelState(ParallelConfig(), torch.device("cpu"))
    parallelize(model, tensor_parallel_plan_of(model, state.config), state)
    recipe = Fp8Recipe.named("tensorwise")
    converted = convert_to_fp8(model, recipe, state)
    layers = ("attn.qkv", "attn.proj", "mlp.fc", "mlp.proj")
    assert converted == [f"blocks.{i}.{layer}" for i in range(2) for layer in layers]
    fc = model.blocks["1"].mlp.fc
    assert fc.gemms.fp8 and not fc.lora_b["up"].gemms.fp8 and not model.blocks["1"].mlp.proj.lora_a.gemms.fp8
    with torch.no_grad():
        for part in ("gate", "up"):
            fc.lora_b[part].weight.normal_(0.0, 0.1)
    x = torch.randn(2, 16, 32)
    update = fc(x) - fc.gemms.linear(x, fc.weight, fc.bias)
    exact = LORA.scale * torch.cat([(x @ fc.lora_a[part].weight.T) @ fc.lora_b[part].weight.T
                                    for part in ("gate", "up")], dim=-1)
    torch.testing.assert_close(update, exact, rtol=0, atol=1e-5)
    assert (fc.gemms.linear(x, fc.weight, fc.bias) - x @ fc.weight.T).abs().max() > 1e-3  # the base is in FP8
    line = describe_fp8(model, recipe)  # 8 base linears and the head; not the 28 adapter layers
    assert "8 of this rank's 9 parallel linears" in line and "LoRA adapters" in line


@pytest.mark.parametrize("heads, groups", [(4, 4), (4, 2), (4, 1), (6, 2)])
def test_the_projections_split_and_join_as_the_fused_layer_at_every_layout(heads, groups):
    """Each rank's q, k and v rows (their own styles) joined are exactly the rows QueryGroupColumn gives it of the
    fused qkv (replicated key/value heads included); PackedColumn's chunks alike."""
    head_dim, style = 3, QueryGroupColumn(heads, groups)
    out = (heads + 2 * groups) * head_dim
    fused = torch.arange(out, dtype=torch.float32)
    parts = [fused[None, torch.tensor(index)] for index in _hf_order(heads, groups, head_dim)]  # global q, k, v
    assert tuple(part.shape[-1] for part in parts) == style.part_sizes(out)
    torch.testing.assert_close(style.join(parts, out), fused[None], rtol=0, atol=0)
    for world in style.valid_sizes():
        for rank in range(world):
            rows = _rows(style.rank_ranges(out, world), rank, out, world)
            local = [part[:, _rows(_ranges_of(part_style, part.shape[-1], world), rank, part.shape[-1], world)]
                     for part, part_style in zip(parts, style.part_styles())]
            assert tuple(p.shape[-1] for p in local) == style.local_part_sizes(len(rows), out)
            torch.testing.assert_close(style.join(local, out), fused[None, rows], rtol=0, atol=0)
    packed = PackedColumn(2)
    for world in (1, 2, 4):
        for rank in range(world):
            rows = _rows(packed.rank_ranges(16, world), rank, 16, world)
            local = [torch.arange(8.0)[None, _rows(None, rank, 8, world)] + 8 * i for i in range(2)]
            torch.testing.assert_close(packed.join(local, 16), fused.new_tensor(rows)[None], rtol=0, atol=0)


def _hf_order(heads, groups, head_dim):
    """The fused rows of q, k and v, each in its own (Hugging Face) order: heads h, kv heads g."""
    per_group = heads // groups
    row = lambda group, slot: [(group * (per_group + 2) + slot) * head_dim + d for d in range(head_dim)]  # noqa: E731
    q = [r for h in range(heads) for r in row(h // per_group, h % per_group)]
    return q, [r for g in range(groups) for r in row(g, per_group)], [r for g in range(groups) for r in row(g, per_group + 1)]


def _ranges_of(style, size, world):
    return None if style == "column" else style.rank_ranges(size, world)


def _rows(ranges, rank, size, world):
    if ranges is None:
        return list(range(rank * size // world, (rank + 1) * size // world))
    return [row for start, length in ranges[rank] for row in range(start, start + length)]


def test_merging_projection_adapters_gives_the_weights_the_adapted_model_computes_with():
    """``peft.merge``: each projection's ``scale B A`` laid out in the fused weight's rows (a projection left out
    adds nothing) computes what the adapted model computes."""
    torch.manual_seed(0)
    lora = LoRAConfig(rank=4, targets=["*.attn.qkv.q", "*.attn.qkv.v", "*.mlp.fc.up"])
    model = _lora_model(lora, device="cpu")
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_b." in name:
                param.normal_(0.0, 0.1)
    state = model.state_dict()
    merged = {name: value for name, value in state.items() if not is_adapter_name(name)}
    for layer, (layout, parts) in fused_layers(model).items():
        adapted = layer_adapters(state)[layer]
        pairs = {part: tuple(state[name] for name in adapter_weight_names(layer, part)) for part in adapted}
        merged[f"{layer}.weight"] = merged_projections_weight(state[f"{layer}.weight"], pairs, layout, parts, lora.scale)
    assert layer_adapters(state)["blocks.0.attn.qkv"] == ("q", "v")
    plain = _lora_model(LoRAConfig(rank=4, targets=["lm_head"]), device="cpu")  # adapters on the head only, B zero
    plain.load_state_dict(merged, strict=False)
    ids = torch.randint(0, 64, (2, 16))
    torch.testing.assert_close(plain(ids), model(ids), atol=1e-5, rtol=0)
    assert (plain(ids) - GPTModel.forward(_without_adapters(model), ids)).abs().max() > 1e-3
