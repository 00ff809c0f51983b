"""Layout validation, rank arithmetic, presets and the dropout random streams (single process)."""

import pytest
import torch

from lightning_megatron.models import GPT, GPTConfig
from lightning_megatron.parallel import ParallelConfig, TensorParallelRNG


def test_rank_layout_puts_tensor_parallel_innermost():
    config = ParallelConfig(tensor_parallel_size=2, data_parallel_size=4)
    seen = set()
    for rank in range(config.world_size):
        pp, dp, cp, tp = config.coordinates_of(rank)
        assert cp == 0
        assert rank == (pp * 4 + dp) * 2 + tp == config.rank_of(pipeline_rank=pp, data_rank=dp, tensor_rank=tp)
        seen.add((pp, dp, tp))
    assert len(seen) == 8


def test_context_parallel_sits_between_data_and_tensor_parallel():
    config = ParallelConfig(tensor_parallel_size=2, context_parallel_size=2, data_parallel_size=2,
                            pipeline_parallel_size=2)
    assert config.world_size == 16 and config.replica_size == 4
    coordinates = [config.coordinates_of(rank) for rank in range(16)]
    assert len(set(coordinates)) == 16
    for rank, (pp, dp, cp, tp) in enumerate(coordinates):
        assert rank == ((pp * 2 + dp) * 2 + cp) * 2 + tp
        assert config.rank_of(pipeline_rank=pp, data_rank=dp, context_rank=cp, tensor_rank=tp) == rank


def test_data_parallel_size_auto_takes_the_rest():
    assert ParallelConfig.for_world(8, tensor_parallel_size=2).data_parallel_size == 4


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(world_size=6, tensor_parallel_size=4), r"world size \(6 processes\) is not a multiple of .* = 4"),
        (dict(world_size=8, tensor_parallel_size=2, data_parallel_size=2), r"= 4, but 8 processes were launched"),
        (dict(world_size=2, tensor_parallel_size=0), r"tensor_parallel_size must be a positive integer, got 0"),
        (dict(world_size=2, pipeline_parallel_size=2, virtual_pipeline_size=0), r"virtual_pipeline_size must be a positive integer, got 0"),
        (dict(world_size=2, zero_stage=5), r"zero_stage must be 0 \(no sharding\), 1 .* got 5"),
        (dict(world_size=2, data_parallel_size=2, sequence_parallel=True), r"sequence_parallel=True needs tensor_parallel_size > 1"),
        (dict(world_size=6, context_parallel_size=4), r"not a multiple of .* context_parallel_size = 1 \* 1 \* 4 = 4"),
        (dict(world_size=4, context_parallel_size=2, expert_parallel_size=2),
         r"context_parallel_size=2 with expert_parallel_size=2 is not supported"),
        (dict(world_size=2, context_parallel_size=0), r"context_parallel_size must be a positive integer, got 0"),
    ],
)
def test_bad_layouts_name_the_numbers(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ParallelConfig.for_world(kwargs.pop("world_size"), **kwargs)


def test_model_split_errors_name_heads_and_fix():
    config = GPTConfig(hidden_size=96, num_heads=6)
    config.validate_tensor_parallel_size(3)
    with pytest.raises(ValueError, match=r"does not divide num_heads=6.*tensor_parallel_size in \[1, 2, 3, 6\]"):
        config.validate_tensor_parallel_size(4)


def test_presets_and_unknown_preset():
    config = GPTConfig.from_name("gpt-8.3b")
    assert (config.hidden_size, config.num_heads, config.num_layers, config.vocab_size) == (3072, 32, 72, 51200)
    assert 8.2e9 < config.num_parameters() < 8.4e9
    assert GPTConfig.from_name("gpt-1.2b").num_parameters() == pytest.approx(1.2e9, rel=0.05)
    with pytest.raises(ValueError, match=r"Unknown GPT preset 'gpt-9b'. Available presets: .*gpt-tiny"):
        GPTConfig.from_name("gpt-9b")
    with pytest.raises(ValueError, match="hidden_size=100 is not divisible by num_heads=3"):
        GPTConfig(hidden_size=100, num_heads=3)


def test_constructing_a_big_gpt_on_meta_is_cheap():
    with torch.device("meta"):
        gpt = GPT("gpt-8.3b")
        gpt.configure_model()
    assert all(p.is_meta for p in gpt.parameters())
    assert sum(p.numel() for p in gpt.parameters()) == GPTConfig.from_name("gpt-8.3b").num_parameters()


def test_sharded_stream_is_independent_reentrant_and_leaves_default_alone():
    torch.manual_seed(0)
    expected_default = torch.rand(4)
    torch.manual_seed(0)
    rank0, rank1 = TensorParallelRNG(0, 0, torch.device("cpu")), TensorParallelRNG(0, 1, torch.device("cpu"))
    with rank0.fork():
        a = torch.rand(4)
        with rank0.fork():
            b = torch.rand(4)
    with rank1.fork():
        c = torch.rand(4)
    with rank0.fork():
        d = torch.rand(4)
    assert torch.equal(torch.rand(4), expected_default), "the default stream must not move inside a fork"
    assert not torch.equal(a, c), "tp ranks must draw different masks"
    assert not torch.equal(a, b) and not torch.equal(b, d), "the sharded stream must advance, not restart"
