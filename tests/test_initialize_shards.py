"""Layout-invariant initialisation that draws only a shard's own values (``parallel.initialize``): bit-identical to
drawing the full parameter and cutting the shard out of it, for every kind of shard (rows, columns, padded
vocabulary, fused projections' segments, sizes that are not multiples of torch's block of 16), while allocating
about the shard instead of the full tensor."""

import gc
import math

import pytest
import torch

from workers.allocation_meter import AllocationMeter
from workers.gpt_setup import CONFIG
from lightning_megatron.models import BERTConfig, BERTModel, GPTModel
from lightning_megatron.parallel.initialize import (default_initializer, initialize_parameters, local_initial_values,
                                                    uninitialised_build)
from lightning_megatron.parallel.shards import TensorShard

SEED = 11


def sharded(shard: TensorShard) -> torch.Tensor:
    """A meta parameter of ``shard``'s local shape carrying it, as the tensor-parallel plan leaves one."""
    param = torch.nn.Parameter(torch.empty(shard.local_shape, device="meta"))
    param.tensor_shard = shard
    return param


def full_then_sliced(shard: TensorShard, name: str, rule) -> torch.Tensor:
    """The rule as it reads: the full tensor drawn with the parameter's generator, this rank's part cut out."""
    from lightning_megatron.parallel.initialize import parameter_seed

    full = torch.empty(shard.global_shape)
    rule(name, full, torch.Generator().manual_seed(parameter_seed(SEED, name)))
    return shard.local_slice(full)


with torch.device("meta"):
    GPT = GPTModel(CONFIG)  # its initialize_parameter: N(0, 0.02), residual projections scaled by 1/sqrt(2 layers)

SHARDS = [  # (dim, global shape, padded size, world, rank ranges)
    (0, (64, 32), 64, 4, None),  # column-parallel rows
    (1, (32, 96), 96, 4, None),  # row-parallel columns
    (0, (257, 32), 384, 2, None),  # a padded vocabulary
    (0, (33, 7), 33, 3, None),  # sizes that are not multiples of 16
    (1, (37, 1000), 1000, 8, None),
    (2, (5, 3, 40), 40, 4, None),
    # a fused [q | k | v] of 48 rows at tp2: each rank holds a part of every block (styles.PackedColumn)
    (0, (48, 32), 48, 2, (((0, 8), (16, 8), (32, 8)), ((8, 8), (24, 8), (40, 8)))),
    # key/value rows replicated on two ranks (styles.QueryGroupColumn)
    (0, (24, 16), 24, 2, (((0, 8), (16, 8)), ((8, 8), (16, 8)))),
]


@pytest.mark.parametrize("dim, shape, padded, world, ranges", SHARDS)
@pytest.mark.parametrize("name, rule", [("blocks.0.mlp.fc.weight", default_initializer),
                                        ("blocks.0.attn.proj.weight", GPT.initialize_parameter),
                                        ("blocks.0.ln_1.weight", default_initializer),
                                        ("blocks.0.mlp.fc.bias", default_initializer)])
def test_a_shard_drawn_alone_equals_the_full_draw_cut(dim, shape, padded, world, ranges, name, rule):
    for rank in range(world):
        shard = TensorShard(dim, shape, padded, rank, world, ranges)
        assert torch.equal(local_initial_values(sharded(shard), name, SEED, rule), full_then_sliced(shard, name, rule))


def test_other_initialisers_still_get_the_full_tensor():
    """An initialiser that is not one normal_/zero_/fill_ of the tensor (here a truncated normal) draws the full
    tensor as it always did: same values."""
    def truncated(name, tensor, generator):
        torch.nn.init.trunc_normal_(tensor, std=0.02, generator=generator)

    shard = TensorShard(0, (64, 16), 64, 4, 2)
    assert torch.equal(local_initial_values(sharded(shard), "w", SEED, truncated),
                       full_then_sliced(shard, "w", truncated))


@pytest.mark.parametrize("dim, rank", [(0, 0), (0, 7), (1, 7)])
def test_a_shard_of_a_large_layer_allocates_about_the_shard(dim, rank):
    """A 4096 x 4096 weight at tp8: the full draw allocated the full 64 MiB on every rank; the shard's own draw
    allocates its 8 MiB (twice: drawn, then placed) and a bounded scratch for skipping or streaming."""
    shape = (4096, 4096)
    shard = TensorShard(dim, shape, 4096, rank, 8)
    with AllocationMeter() as meter:
        local_initial_values(sharded(shard), "blocks.0.mlp.fc.weight", SEED, default_initializer)
    full_bytes, shard_bytes = 4 * math.prod(shape), 4 * math.prod(shape) // 8
    assert meter.bytes <= 2 * shard_bytes + 4 * 2**20 + 1024, (meter.bytes, shard_bytes)
    assert meter.bytes < full_bytes / 2


def test_models_are_built_without_torchs_default_draws_and_start_at_the_seeded_values():
    """GPTModel and BERTModel build their layers ``uninitialised_build`` (``initialize_parameters`` sets every
    parameter right after): torch's global generator is left where it was (``nn.Linear``'s kaiming draws would move
    it), and every parameter holds the value the seed gives it, as a model built on the meta device and initialised
    there does. Python's cyclic garbage collector waits until the model is built. Outside the context a layer
    draws as torch's does."""
    for build in (lambda: GPTModel(CONFIG), lambda: BERTModel(BERTConfig(num_layers=2))):
        torch.manual_seed(SEED)
        state = torch.get_rng_state()
        model = build()
        assert torch.equal(torch.get_rng_state(), state)
        with torch.device("meta"):
            expected = build()
        initialize_parameters(expected, SEED, device="cpu", only_meta=True)
        for (name, value), (_, seeded) in zip(model.state_dict().items(), expected.state_dict().items()):
            assert torch.equal(value, seeded), name
    with uninitialised_build():
        torch.nn.Linear(4, 4)
        assert not gc.isenabled()  # every object made is kept: a collection would find nothing
    assert gc.isenabled() and torch.equal(torch.get_rng_state(), state)
    torch.nn.Linear(4, 4)
    assert not torch.equal(torch.get_rng_state(), state)
