"""FP8 weights cast once per optimizer step (``tensor_parallel.fp8_weights``), in one process.

How often a weight is cast is counted without asking the code under test: a dispatch mode counts the operations
that read the weight's memory (views aside): an amax and a scaled cast read it, the FP8 GEMMs do not. The numbers
are checked against the same layers with ``cache_weights=False`` (every GEMM casts afresh, as before the cache):
bit for bit, over steps of several micro-batches and every way a weight changes that the cache must see. The
multi-rank side (amax all-reduces per step at tp2) is in ``test_fp8.py``.
"""

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import checkpoint

import lightning_megatron.tensor_parallel.fp8 as fp8
from lightning_megatron.parallel import ParallelConfig, ParallelState
from lightning_megatron.tensor_parallel import ColumnParallelLinear, RowParallelLinear, parallelize
from lightning_megatron.tensor_parallel.fp8 import Fp8Gemms, Fp8Recipe
from lightning_megatron.tensor_parallel.fp8_plan import convert_to_fp8
from lightning_megatron.tensor_parallel.fp8_weights import Fp8WeightCache, clear_fp8_weight_caches

RECIPES = ("tensorwise", "rowwise")
HIDDEN, FFN = 32, 64


class WeightReads(TorchDispatchMode):
    """Counts the operations (but views) that take one of ``weights``' memory as an input."""

    def __init__(self, weights):
        super().__init__()
        self.storages = {w.untyped_storage().data_ptr() for w in weights}
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [leaf for leaf in tree_leaves((args, kwargs)) if isinstance(leaf, torch.Tensor)]
        if not func.is_view and any(t.untyped_storage().data_ptr() in self.storages for t in tensors):
            self.count += 1
        return func(*args, **kwargs)


class Mlp(torch.nn.Module):
    def __init__(self, recipe, cache=True, seed=0):
        super().__init__()
        self.fc, self.proj = ColumnParallelLinear(HIDDEN, FFN), RowParallelLinear(FFN, HIDDEN)
        generator = torch.Generator().manual_seed(seed)
        for param in self.parameters():
            param.data.copy_(torch.randn(param.shape, generator=generator) * 0.2)
        self.fc.gemms = Fp8Gemms(Fp8Recipe.named(recipe), None, "output", cache_weights=cache)
        self.proj.gemms = Fp8Gemms(Fp8Recipe.named(recipe), None, "input", cache_weights=cache)

    def forward(self, x):
        return self.proj(F.gelu(self.fc(x)))

    def weights(self):
        return [self.fc.weight, self.proj.weight]


def micro_batches(count, seed=1, tokens=7):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(2, tokens, HIDDEN, generator=generator) * 3 for _ in range(count)]


def accumulate(model, batches, autocast=False, recompute=False):
    """Forward and backward of each micro-batch, gradients accumulated; the losses."""
    losses = []
    for x in batches:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            y = checkpoint(model, x, use_reentrant=False) if recompute else model(x)
        loss = (y.float() ** 2).mean()
        loss.backward()
        losses.append(loss.item())
    return losses


@pytest.mark.slow
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("recompute", [False, True])
def test_a_weight_is_read_once_per_step_whatever_the_micro_batches_and_recomputation(recipe, recompute):
    """The operations reading the weights during a step of 4 micro-batches are as many as during a step of 1 (the
    casts of the first, kept), with activation recomputation too (each forward runs twice), and again as many in the
    next step (the optimizer step made the weights new); without the cache they grow with the micro-batches."""
    reads = {}
    for cache in (True, False):
        for count in (1, 4):
            model = Mlp(recipe, cache)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            steps = []
            for step in range(2):
                with WeightReads(model.weights()) as counter:
                    accumulate(model, micro_batches(count, seed=step), recompute=recompute)
                steps.append(counter.count)
                optimizer.step()
                optimizer.zero_grad()
            reads[cache, count] = steps
    once = reads[True, 1][0]
    assert once > 0 and reads[True, 1] == reads[True, 4] == [once, once], reads
    assert reads[False, 4][0] >= 4 * reads[False, 1][0] > 0, reads  # (recomputed: the weight casts again)


def _train(recipe, cache, update, *, autocast=False, steps=2, tokens=7):
    """Steps of 4 micro-batches, the weights changed between steps by ``update``; the losses and final parameters."""
    model = Mlp(recipe, cache)
    params = list(model.parameters())
    main = [p.detach().clone() for p in params]  # fp32 main copies, for the "through .data" update
    optimizer = torch.optim.AdamW(params if update != "main copies" else main, lr=0.05)
    losses = []
    for step in range(steps):
        losses += accumulate(model, micro_batches(4, seed=step, tokens=tokens), autocast=autocast)
        if update == "main copies":  # stepped apart, written back where no version counter sees it
            for m, p in zip(main, params):
                m.grad = p.grad
            optimizer.step()
            for m, p in zip(main, params):
                p.data.copy_(m)
        elif update == "in place, no optimizer":
            with torch.no_grad():
                for p in params:
                    p.sub_(0.05 * p.grad)
        elif update == "new tensors":
            for p in params:
                p.data = p.detach() - 0.05 * p.grad
        else:
            optimizer.step()
        for p in params:
            p.grad = None
    return losses, [p.detach().clone() for p in params]


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("update", ["optimizer", "main copies", "in place, no optimizer", "new tensors"])
def test_cached_weights_train_bit_for_bit_as_fresh_casts(recipe, update):
    """2 steps of 4 micro-batches (14 tokens each: the weight gradient's padding), losses and weights equal to the
    last bit with and without the cache, however the weights change between steps: an optimizer stepping them in
    place, an optimizer stepping fp32 copies written back through ``.data`` (no version counter sees that: the
    optimizer's pre-step hook does), an in-place update without an optimizer (the version counter) and new tensors
    (``param.data = ...``: a new address)."""
    cached, fresh = _train(recipe, True, update), _train(recipe, False, update)
    assert cached[0] == fresh[0]
    assert all(torch.equal(a, b) for a, b in zip(cached[1], fresh[1]))
    assert len(set(cached[0])) == len(cached[0])  # the weights did change between steps


@pytest.mark.slow
@pytest.mark.parametrize("recipe", RECIPES)
def test_cached_weights_under_bf16_autocast_and_aligned_tokens_train_as_fresh_casts(recipe):
    for tokens in (8, 7):
        cached = _train(recipe, True, "optimizer", autocast=True, steps=2, tokens=tokens)
        fresh = _train(recipe, False, "optimizer", autocast=True, steps=2, tokens=tokens)
        assert cached[0] == fresh[0]
        assert all(torch.equal(a, b) for a, b in zip(cached[1], fresh[1]))


def test_a_write_through_data_is_seen_after_clear_fp8_weight_caches_and_never_under_inference_mode():
    """``param.data.copy_`` outside an optimizer step bypasses what the cache watches: the documented remedy is
    :func:`clear_fp8_weight_caches`. Under ``torch.inference_mode`` (evaluation, generation) nothing is kept."""
    model, x = Mlp("tensorwise"), micro_batches(1)[0]
    new_weights = [w.detach() * 0.5 for w in model.weights()]
    fresh = Mlp("tensorwise", cache=False)
    for w, new in zip(fresh.weights(), new_weights):
        w.data.copy_(new)
    with torch.no_grad():
        expected = fresh(x)
        model(x)  # cast and kept
        for w, new in zip(model.weights(), new_weights):
            w.data.copy_(new)
        stale = model(x)
        clear_fp8_weight_caches()
        assert not torch.equal(stale, expected) and torch.equal(model(x), expected)
    evaluated = Mlp("tensorwise")
    with torch.inference_mode():
        evaluated(x)
        for w, new in zip(evaluated.weights(), new_weights):
            w.data.copy_(new)
        assert torch.equal(evaluated(x), expected)


@pytest.mark.parametrize("recipe", RECIPES)
def test_the_forward_gemm_accumulates_fast_and_the_backward_gemms_do_not(recipe, monkeypatch):
    flags = []
    scaled_mm = torch._scaled_mm

    def recording(*args, use_fast_accum=False, **kwargs):
        flags.append(use_fast_accum)
        return scaled_mm(*args, use_fast_accum=use_fast_accum, **kwargs)

    monkeypatch.setattr(torch, "_scaled_mm", recording)
    layer = Mlp(recipe).fc
    x = micro_batches(1)[0].requires_grad_()
    y = layer(x)
    assert flags == [True]
    y.backward(torch.ones_like(y))
    assert flags == [True, False, False]


def test_convert_to_fp8_caches_weights_but_under_zero3():
    for zero_stage, cached in ((0, True), (1, True), (2, True), (3, False)):
        block = torch.nn.ModuleDict({"fc": torch.nn.Linear(32, 48), "proj": torch.nn.Linear(48, 32)})
        state = ParallelState.create(ParallelConfig(zero_stage=zero_stage), "cpu")
        parallelize(block, {"fc": "column", "proj": "row"}, state)
        convert_to_fp8(block, Fp8Recipe.named("tensorwise"), state)
        assert [block[name].gemms.cache_weights for name in ("fc", "proj")] == [cached, cached]


def test_scale_and_cast_reads_16_bit_inputs_without_rounding_the_product_to_16_bits():
    """A bf16 tensor times a scalar fp32 scale: the product in fp32 (what a cast of ``t.float() * scale`` gives),
    not in bf16, where type promotion would leave it for a 0-dim scale."""
    t = torch.randn(16, 32).to(torch.bfloat16)
    scale = torch.tensor(448 / 3.1)
    expected = (t.float() * scale).clamp(-448, 448).to(torch.float8_e4m3fn)
    assert torch.equal(fp8.scale_and_cast(t, scale, torch.float8_e4m3fn).view(torch.uint8),
                       expected.view(torch.uint8))
    rounded = (t * scale).float().clamp(-448, 448).to(torch.float8_e4m3fn)
    assert not torch.equal(rounded.view(torch.uint8), expected.view(torch.uint8))


def test_a_weight_gathered_again_into_its_storage_at_another_address_is_still_cached():
    """FSDP2 frees a gathered weight's memory after use and gathers it into the same storage again, at whatever
    address the allocator gives: one rank's may match the old address and another's not. The cache must decide by
    the storage, alike on every rank (a hit on some ranks and a miss on others issue different amax all-reduces:
    the ZeRO-3 FP8 layouts hung on it), and a new storage must still miss."""
    cache = Fp8WeightCache()
    weight = torch.nn.Parameter(torch.randn(64, 32))
    values = weight.detach().clone()
    cache.store(weight, "forward", "cast")
    storage, address = weight.untyped_storage(), weight.data_ptr()
    storage.resize_(0)  # FSDP's free after use
    blocker = torch.empty(64 * 32)  # takes the freed memory, so the gather lands elsewhere
    storage.resize_(values.numel() * values.element_size())
    with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(weight):
        weight.detach().copy_(values)  # the all-gather's write, its version counter preserved as FSDP2 preserves it
    assert weight.data_ptr() != address and blocker.numel()  # the precondition: the address moved
    assert cache.lookup(weight, "forward") == "cast"
    weight.data = values.clone()  # a new storage: a miss
    assert cache.lookup(weight, "forward") is None
