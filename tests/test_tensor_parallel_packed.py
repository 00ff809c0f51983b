"""Segmented tensor-parallel shards: PackedColumn and QueryGroupColumn, their gradients, norms and checkpoints.

One 4-rank launch (``workers/tp_packed.py``) compares toy modules under several layouts with the
single-process module; the geometry and the bad-input errors are checked here in one process.
"""

import math

import pytest
import torch
from torch import nn

from launch import run_job
from lightning_megatron.checkpoint.pieces import Placement
from lightning_megatron.parallel import ParallelConfig, ParallelState
from lightning_megatron.parallel.shards import TensorShard
from lightning_megatron.tensor_parallel import PackedColumn, QueryGroupColumn, parallelize


def shards(style, out_features, world, inner=3):
    ranges = style.rank_ranges(out_features, world)
    return [TensorShard(0, (out_features, inner), out_features, r, world, ranges) for r in range(world)]


# ---------------------------------------------------------------- geometry, one process
def test_packed_column_gives_each_rank_its_part_of_every_chunk():
    full = torch.arange(12.0 * 2).view(12, 2)
    q, k, v = full.chunk(3)
    for rank, shard in enumerate(shards(PackedColumn(3), 12, 2, inner=2)):
        local = shard.local_slice(full)
        parts = (q.chunk(2)[rank], k.chunk(2)[rank], v.chunk(2)[rank])
        assert all(torch.equal(a, b) for a, b in zip(local.chunk(3), parts))  # what the model's chunk(3) reads
    sizes = PackedColumn((8, 4)).rank_ranges(12, 4)
    assert sizes[1] == ((2, 2), (9, 1))


def test_query_group_column_replicates_each_groups_key_and_value_on_its_ranks():
    # 4 heads, 2 groups, head_dim 1: rows [q0 q1 k0 v0 | q2 q3 k1 v1]; tp4: rank r has q head r and k, v of group r // 2.
    rows = shards(QueryGroupColumn(4, 2), 8, 4, inner=1)
    assert [s.ranges_of(s.rank) for s in rows] == [((0, 1), (2, 2)), ((1, 1), (2, 2)),
                                                    ((4, 1), (6, 2)), ((5, 1), (6, 2))]
    assert [seg.holders for seg in rows[1].segments()] == [(1,), (0, 1)]
    assert rows[0].counted_flat_ranges() is None  # the primary of its k, v rows counts everything
    assert rows[1].counted_flat_ranges() == [(0, 1)]  # only its query head
    # tp dividing the groups is the plain split ("column"), and so is MHA (groups == heads) at any tp dividing it.
    assert QueryGroupColumn(4, 2).rank_ranges(8, 2) is None
    assert QueryGroupColumn(4, 4).rank_ranges(12, 4) is None
    assert QueryGroupColumn(8, 2).valid_sizes() == [1, 2, 4, 8]


@pytest.mark.parametrize("style, out, world", [(PackedColumn(3), 12, 2), (PackedColumn(2), 8, 4),
                                              (QueryGroupColumn(4, 2), 16, 4), (QueryGroupColumn(8, 1), 20, 2)])
def test_slices_assemble_back_and_checkpoint_boxes_cover_the_tensor_once(style, out, world):
    full = torch.randn(out, 3)
    per_rank = shards(style, out, world)
    locals_ = [shard.local_slice(full) for shard in per_rank]
    assert torch.equal(per_rank[0].assemble(locals_), full)
    # Whole shards and ZeRO-like flat pieces (halves of the shard): every box sits where its values belong; boxes
    # of replicated rows are identical on every replica (DCP writes one of them), and together they cover each
    # element exactly once.
    for pieces in (1, 2):
        written: dict = {}
        for shard, local in zip(per_rank, locals_):
            numel = local.numel()
            for p in range(pieces):
                start, stop = p * numel // pieces, (p + 1) * numel // pieces
                views = Placement(full.shape, shard, start, stop).views(local.reshape(-1)[start:stop].contiguous())
                for offsets, view in views.items():
                    region = tuple(slice(o, o + s) for o, s in zip(offsets, view.shape))
                    assert torch.equal(view, full[region]), (shard.rank, offsets)
                    assert written.setdefault(offsets, view.shape) == view.shape
        hits = torch.zeros(out, 3)
        for offsets, shape in written.items():
            hits[tuple(slice(o, o + s) for o, s in zip(offsets, shape))] += 1
        assert torch.equal(hits, torch.ones(out, 3))


def test_counted_ranges_count_each_element_once_over_the_ranks():
    for style, out, world in ((QueryGroupColumn(4, 2), 16, 4), (QueryGroupColumn(8, 1), 20, 4),
                              (PackedColumn(2), 8, 2)):
        full = torch.randn(out, 3)
        total = 0.0
        for shard in shards(style, out, world):
            local, ranges = shard.local_slice(full).reshape(-1), shard.counted_flat_ranges()
            total += local.pow(2).sum() if ranges is None else sum(local[a:b].pow(2).sum() for a, b in ranges)
        assert math.isclose(float(total), float(full.pow(2).sum()), rel_tol=1e-6)


def test_one_chunk_shards_are_unchanged():
    # The vocabulary's padded chunks: no segments beyond the chunk, padding left out, nothing replicated.
    shard = TensorShard(dim=0, global_shape=(5, 2), padded_size=8, rank=1, world=2)
    assert shard.rank_ranges is None and shard.local_shape == (4, 2) and shard.real_local_size() == 1
    assert shard.segments() == [(0, 4, 1, (1,))] and shard.counted_flat_ranges() is None
    full = torch.arange(10.0).view(5, 2)
    assert torch.equal(shard.local_slice(full), torch.tensor([[8.0, 9.0], [0, 0], [0, 0], [0, 0]]))


# ---------------------------------------------------------------- bad inputs
def _state(tp):
    return ParallelState(ParallelConfig(tensor_parallel_size=tp), torch.device("cpu"))  # no processes needed to fail


def test_packed_column_refuses_chunks_that_do_not_split():
    layer = nn.Module()
    layer.qkv = nn.Linear(4, 30)
    with pytest.raises(ValueError, match=r"qkv: PackedColumn chunks of sizes \(10, 10, 10\) do not split over "
                                         r"tensor_parallel_size=4.*divides 10"):
        parallelize(layer, {"qkv": PackedColumn(3)}, _state(4))
    with pytest.raises(ValueError, match="add up to 12, but the layer has 30"):
        parallelize(layer, {"qkv": PackedColumn((6, 6))}, _state(2))
    with pytest.raises(ValueError, match="positive"):
        PackedColumn(0)


def test_query_group_column_refuses_layouts_it_cannot_split():
    layer = nn.Module()
    layer.qkv = nn.Linear(4, (8 + 2 * 2) * 2)  # 8 heads, 2 groups, head_dim 2
    with pytest.raises(ValueError, match=r"tensor_parallel_size=3 neither divides num_query_groups=2.*"
                                         r"Valid tensor_parallel_size values: \[1, 2, 4, 8\]"):
        parallelize(layer, {"qkv": QueryGroupColumn(8, 2)}, _state(3))
    layer.qkv = nn.Linear(4, (4 + 2 * 2) * 2)  # 4 heads, 2 groups: tp8 would need 4 ranks per group of 2 heads
    with pytest.raises(ValueError, match=r"tensor_parallel_size=8 .* the 2 query heads .* \[1, 2, 4\]"):
        parallelize(layer, {"qkv": QueryGroupColumn(4, 2)}, _state(8))
    with pytest.raises(ValueError, match="num_heads=6 must be a positive multiple of num_query_groups=4"):
        QueryGroupColumn(6, 4)
    with pytest.raises(ValueError, match="not .* = 12 heads"):
        QueryGroupColumn(8, 2).rank_ranges(30, 4)


# ---------------------------------------------------------------- 4 ranks
@pytest.fixture(scope="module")
def results(tmp_path_factory):
    results, _ = run_job("tp_packed", 4, tmp_path_factory.mktemp("tp_packed"))
    assert len(results) == 4
    return results


@pytest.mark.slow
def test_segmented_layouts_match_one_process(results):
    for rank, result in enumerate(results):
        errors = result["errors"]
        kinds = {name.rsplit("/", 1)[-1] for name in errors}
        assert {"forward", "input_grad", "grad", "norm", "weights", "local_weights", "momentum"} <= kinds
        for case in ("nano/tp2-dp2-z1", "nano/tp4", "gqa/tp1-dp4", "gqa/tp2-dp2", "gqa/tp4-sync", "gqa/tp4-local",
                     "gqa/tp4-z1", "mqa/tp2-dp2-z1", "mqa/tp4-sync", "mqa/tp2-dp2-z3"):
            assert f"{case}/norm" in errors and f"{case}/weights" in errors, case
        worst = {name: value for name, value in errors.items() if value > 1e-5}
        assert not worst, f"rank {rank}: segmented shards deviate from one process: {worst}"


@pytest.mark.slow
def test_plain_column_split_of_a_packed_layer_is_wrong(results):
    # The guard that the comparisons above can fail: "column" on [q | k | v] and [gate | up] trains another model.
    for result in results:
        assert min(result["guard"].values()) > 0.1, result["guard"]


@pytest.mark.slow
def test_replicated_rows_are_written_once(results):
    # tp4 over 2 groups: 4 query-head boxes and 2 key/value boxes (not 4) of qkv, covering it exactly once.
    chunks = results[0]["facts"]["gqa_tp4_chunks"]
    assert chunks["attn.qkv.weight"] == [6, 64 * 32] and chunks["attn.qkv.bias"] == [6, 64]
    assert chunks["attn.proj.weight"] == [4, 32 * 32] and chunks["attn.proj.bias"] == [1, 32]
