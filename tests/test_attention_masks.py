"""The attention back ends' mask logic (``context_parallel/masks.py``, ``kernels.py``) against a dense reference
written out here: softmax over an explicit ``[S, S]`` boolean mask, in fp64, outputs, log-sum-exp and gradients.

The CUDA back end (FlexAttention) runs here eagerly: the same block masks, ``mask_mod`` and backward operator
(with the whole attention's output and log-sum-exp) as the compiled kernels, so its masks and arithmetic are
checked on CPU; ``benchmarks/gpu_check.py`` runs it compiled. Cases: causal, packed documents, sliding windows
(alone and with documents), bidirectional with key padding, grouped-query heads, and the context-parallel blocks
of every (rank, source) pair of 2- and 4-rank rings, the ring run on one process block by block (the all-gather
attention computes the very same ``Block`` objects over its gathered keys). And the host transfers of a packed
model's training step do not grow with its layers."""

import math

import pytest
import torch

from lightning_megatron.context_parallel import DocumentMask, chunk_indices, document_attention, ring_order
from lightning_megatron.context_parallel.blocks import Block, start
from lightning_megatron.context_parallel.kernels import CPU_FLASH, FLEX_EAGER, block_mask
from lightning_megatron.context_parallel.masks import BlockPattern
from lightning_megatron.models import GPTConfig, GPTModel

BACKENDS = {"cpu": CPU_FLASH, "flex": FLEX_EAGER}


def reference_keep(seq: int, *, causal: bool, ids=None, padding=None, window=None) -> torch.Tensor:
    """``[B, 1, S, S]`` booleans of the whole attention, written out position by position."""
    i, j = torch.arange(seq)[:, None], torch.arange(seq)[None, :]
    keep = torch.ones(1, 1, seq, seq, dtype=torch.bool)
    if causal:
        keep = keep & (i >= j)
    if window is not None:
        keep = keep & ((i - j).abs() < window)
    if ids is not None:
        keep = keep & (ids[:, None, :, None] == ids[:, None, None, :])
    if padding is not None:
        keep = keep & padding[:, None, None, :]
    return keep


def reference(q, k, v, keep, grad):
    """Softmax attention over ``keep`` in fp64: output, log-sum-exp (-inf and output 0 where a query keeps no key)
    and the gradients of ``(out * grad).sum()``."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    q_, k_, v_ = leaves
    groups = q.shape[1] // k.shape[1]
    k_, v_ = (t.repeat_interleave(groups, dim=1) for t in (k_, v_))
    scores = (q_ @ k_.transpose(-1, -2) / math.sqrt(q.shape[-1])).masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)[..., None])
    out = probs @ v_
    (out * grad).sum().backward()
    return out.detach(), lse.detach(), *(t.grad for t in leaves)


def inputs(batch, heads, groups, seq, generator, dim=8):
    return [torch.randn(batch, h, seq, dim, generator=generator, dtype=torch.float64)
            for h in (heads, groups, groups, heads)]


def packed_ids(batch: int, seq: int, generator) -> torch.Tensor:
    """Contiguous documents of 1 to ~8 tokens (the last sample: all one-token documents)."""
    starts = torch.rand(batch, seq, generator=generator) < 0.3
    starts[:, 0] = True
    starts[-1] = True
    return starts.long().cumsum(1)


CASES = {  # name: (causal, documents, padding, window)
    "causal": (True, False, False, None),
    "documents": (True, True, False, None),
    "window": (True, False, False, 5),
    "documents-window": (True, True, False, 4),
    "padded": (False, False, True, None),
    "padded-documents-window": (False, True, True, 6),
}


def case_masks(case, batch, seq, generator):
    causal, documents, padded, window = CASES[case]
    ids = packed_ids(batch, seq, generator) if documents else None
    padding = None
    if padded:
        padding = torch.ones(batch, seq, dtype=torch.bool)
        padding[0, -7:] = False
        padding[-1] = False  # a sample whose keys are all padding: its queries keep nothing
    return causal, ids, padding, window


def within_tolerance(got, want, tol=1e-10):
    both_inf = torch.isinf(got) & torch.isinf(want) & (got.sign() == want.sign())
    return bool(((got - want).abs().le(tol) | both_inf).all())


@pytest.mark.slow
@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize("case", sorted(CASES))
def test_one_block_over_the_whole_sequence_equals_the_dense_mask(backend, case):
    """A whole sequence as one block (no context parallelism), tiles of 7 cutting across documents and windows;
    multi-head, grouped-query and multi-query heads."""
    generator = torch.Generator().manual_seed(0)
    batch, seq = 3, 29
    causal, ids, padding, window = case_masks(case, batch, seq, generator)
    documents = DocumentMask(ids if ids is not None else torch.zeros(batch, seq, dtype=torch.long), tile=7)
    keep = reference_keep(seq, causal=causal, ids=ids, padding=padding, window=window)
    for heads, groups in ((4, 4), (4, 2), (4, 1)):
        q, k, v, grad = inputs(batch, heads, groups, seq, generator)
        want = reference(q, k, v, keep, grad)
        block = Block(step=0, rank=0, size=1, causal=causal, length=seq)
        out, lse = start(q)
        block.forward(q, k, v, padding, documents, out, lse, window=window, backend=BACKENDS[backend])
        dq, dk, dv = (torch.zeros_like(t) for t in (q, k, v))
        block.backward(grad, q, k, v, out.to(q.dtype), lse, padding, documents, dq, dk, dv, window=window,
                       backend=BACKENDS[backend])
        for name, got, expected in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, dq, dk, dv), want):
            assert within_tolerance(got, expected), (case, heads, groups, name, (got - expected).abs().max())


def ring_on_one_process(q, k, v, grad, size, causal, ids, padding, window, backend):
    """Every rank's blocks of a ring of ``size``, computed in one process: the outputs, log-sum-exps and gradients
    of the whole sequence (positions in their natural order)."""
    seq = q.shape[2]
    length, order = seq // size, ring_order(seq, size)
    documents = None if ids is None else DocumentMask(ids[:, order], tile=3)
    key_mask = None if padding is None else padding[:, order]
    out_all, lse_all = torch.zeros_like(q), torch.zeros(q.shape[:-1], dtype=q.dtype)
    dq_all, dk_all, dv_all = (torch.zeros_like(t) for t in (q, k, v))
    for rank in range(size):
        mine = chunk_indices(seq, size, rank)
        out, lse = start(q[:, :, mine])
        blocks = [Block(step=step, rank=rank, size=size, causal=causal, length=length) for step in range(size)]
        for block in blocks:
            source = chunk_indices(seq, size, block.source)
            block.forward(q[:, :, mine], k[:, :, source], v[:, :, source], key_mask, documents, out, lse,
                          window=window, backend=backend)
        out_all[:, :, mine], lse_all[:, :, mine] = out, lse
        dq = torch.zeros_like(q[:, :, mine])
        for block in blocks:
            source = chunk_indices(seq, size, block.source)
            dk, dv = torch.zeros_like(k[:, :, source]), torch.zeros_like(v[:, :, source])
            block.backward(grad[:, :, mine], q[:, :, mine], k[:, :, source], v[:, :, source], out.to(q.dtype), lse,
                           key_mask, documents, dq, dk, dv, window=window, backend=backend)
            dk_all[:, :, source] += dk
            dv_all[:, :, source] += dv
        dq_all[:, :, mine] = dq
    return out_all, lse_all, dq_all, dk_all, dv_all


@pytest.mark.slow
@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize("case", sorted(CASES))
def test_the_rings_blocks_of_every_rank_and_source_equal_the_dense_mask(backend, case):
    """Rings of 2 and 4 ranks (chunks of 4 and 2 tokens, so documents and windows cross chunks and ranks), every
    (rank, source) block merged by the online softmax, and the gradients of every block summed per source."""
    generator = torch.Generator().manual_seed(1)
    batch, seq = 2, 16
    causal, ids, padding, window = case_masks(case, batch, seq, generator)
    keep = reference_keep(seq, causal=causal, ids=ids, padding=padding, window=window)
    for size in (2, 4):
        q, k, v, grad = inputs(batch, 4, 2, seq, generator)
        want = reference(q, k, v, keep, grad)
        got = ring_on_one_process(q, k, v, grad, size, causal, ids, padding, window, BACKENDS[backend])
        for name, mine, expected in zip(("out", "lse", "dq", "dk", "dv"), got, want):
            assert within_tolerance(mine, expected), (case, size, name, (mine - expected).abs().max())


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_blocks_pattern_and_tiles_are_the_dense_mask_of_its_queries_and_keys(case):
    """For every (rank, source) of rings of 1, 2 and 4: the block's mask equals the dense one at its queries' and
    keys' global positions, the half a causal block skips keeps nothing, and the tile test is sound (a skipped
    tile keeps nothing, a tile marked whole keeps everything) for the CPU's tiles and Flex's blocks; the
    ``mask_mod`` evaluated on every pair gives the same mask, and the ``BlockMask`` Flex reads holds the tiles."""
    generator = torch.Generator().manual_seed(2)
    batch, seq = 2, 48
    causal, ids, padding, window = case_masks(case, batch, seq, generator)
    keep = reference_keep(seq, causal=causal, ids=ids, padding=padding, window=window).expand(batch, 1, seq, seq)
    for size in (1, 2, 4):
        order, length = ring_order(seq, size), seq // size
        documents = None if ids is None else DocumentMask(ids[:, order])
        key_mask = None if padding is None else padding[:, order]
        for rank in range(size):
            for step in range(size):
                block = Block(step=step, rank=rank, size=size, causal=causal, length=length)
                rows = chunk_indices(seq, size, rank) if size > 1 else torch.arange(seq)
                cols = chunk_indices(seq, size, block.source) if size > 1 else torch.arange(seq)
                whole = keep[:, :, rows][:, :, :, cols]
                inside = torch.zeros_like(whole)
                inside[:, :, block.rows, block.cols] = True
                assert not (whole & ~inside).any(), (case, size, rank, step)  # the skipped half keeps nothing
                expected = whole[:, :, block.rows, block.cols]
                pattern = block.pattern(key_mask, documents, torch.device("cpu"), window)
                assert torch.equal(pattern.keep().expand_as(expected), expected)
                lq, lk = pattern.shape
                b, qi, ki = torch.arange(batch)[:, None, None], torch.arange(lq)[None, :, None], torch.arange(lk)
                modded = pattern.mask_mod(16)(b, 0, qi, ki[None, None, :])
                assert torch.equal(modded.expand(batch, lq, lk), expected[:, 0])
                for tile in (5, 16):
                    some, every = pattern.tiles(tile)
                    expand = lambda t: t.repeat_interleave(tile, 1).repeat_interleave(tile, 2)[:, :lq, :lk]
                    assert not (expected[:, 0] & ~expand(some)).any(), (case, size, rank, step, tile)
                    assert not (expand(every) & ~expected[:, 0]).any(), (case, size, rank, step, tile)
                flex_mask = block_mask(pattern)
                some, _ = pattern.tiles(128)
                dense_blocks = flex_mask.to_dense()[:, 0].bool()
                assert torch.equal(dense_blocks, some.expand(dense_blocks.shape[0], -1, -1))


def test_tiles_of_contiguous_documents_are_skipped_exactly():
    """For documents that are contiguous runs (causal, no window) a tile is computed iff some pair in it is kept;
    which tiles, in a case worked by hand."""
    ids = torch.tensor([[0] * 8 + [1] * 8, [0] * 4 + [1] * 12])
    positions = torch.arange(16)
    pattern = BlockPattern(q_pos=positions, k_pos=positions, causal=True, q_ids=ids, k_ids=ids)
    # Rows 8-15 (document 1 in both samples) never meet keys 0-3 (document 0 in both); keys after queries never.
    assert {(r.start, c.start) for r, c in pattern.tile_plan(4)} == {
        (0, 0), (4, 0), (4, 4), (8, 4), (8, 8), (12, 4), (12, 8), (12, 12)}
    generator = torch.Generator().manual_seed(3)
    ids = packed_ids(3, 40, generator)
    pattern = BlockPattern(q_pos=torch.arange(40), k_pos=torch.arange(40), causal=True, q_ids=ids, k_ids=ids)
    some, _ = pattern.tiles(6)
    kept = reference_keep(40, causal=True, ids=ids)[:, 0]
    kept = torch.nn.functional.pad(kept, (0, 2, 0, 2)).view(3, 7, 6, 7, 6).any(4).any(2)
    assert torch.equal(some, kept)


def test_a_window_with_nothing_to_see_is_refused():
    with pytest.raises(ValueError, match=r"sliding window of 0 keys .* at least 1"):
        BlockPattern(q_pos=torch.arange(4), k_pos=torch.arange(4), causal=True, window=0)


def test_document_attention_takes_a_window():
    """The public entry point (``CoreAttention``'s, packed SFT) with a sliding window, forward and backward through
    autograd, against the dense reference."""
    generator = torch.Generator().manual_seed(4)
    q, k, v, grad = inputs(2, 4, 2, 30, generator)
    ids = packed_ids(2, 30, generator)
    want = reference(q, k, v, reference_keep(30, causal=True, ids=ids, window=3), grad)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = document_attention(*leaves, DocumentMask(ids, tile=8), causal=True, window=3)
    (out * grad).sum().backward()
    for got, expected in zip((out, *(t.grad for t in leaves)), (want[0], *want[2:])):
        assert (got - expected).abs().max() < 1e-12


class HostTransfers:
    """Counts the calls that bring a tensor's values to the host (a device sync on an accelerator), forward and
    backward alike: the ``Tensor`` methods wrapped while the context is open (a ``TorchFunctionMode`` would not
    see the autograd engine's backward calls)."""

    NAMES = ("tolist", "item", "__bool__", "cpu", "numpy", "__int__", "__float__", "__index__")

    def __init__(self):
        self.count, self.saved = 0, {}

    def __enter__(self):
        for name in self.NAMES:
            original = self.saved[name] = getattr(torch.Tensor, name)
            setattr(torch.Tensor, name, self._counting(original))
        return self

    def __exit__(self, *exc):
        for name, original in self.saved.items():
            setattr(torch.Tensor, name, original)

    def _counting(self, original):
        def counted(*args, **kwargs):
            self.count += 1
            return original(*args, **kwargs)
        return counted


@pytest.mark.slow
def test_host_transfers_of_a_packed_step_do_not_grow_with_the_layers():
    """A packed Llama-shaped model's forward and backward: the same number of host transfers with 2 and 4 layers
    (the tile plans are made once per DocumentMask and reused by every layer and by backward), and building the
    CUDA back end's block masks transfers nothing."""
    counts = {}
    generator = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, 97, (2, 65), generator=generator)
    ids = packed_ids(2, 64, generator)
    for layers in (2, 4):
        torch.manual_seed(0)
        config = GPTConfig.from_name("llama-tiny", vocab_size=97, max_seq_length=64, hidden_size=32, num_heads=4,
                                     num_query_groups=2, ffn_hidden_size=48, num_layers=layers)
        model = GPTModel(config)
        with HostTransfers() as counter:
            loss, _ = model.loss(tokens[:, :-1], tokens[:, 1:], document_ids=ids)
            loss.backward()
        counts[layers] = counter.count
    assert counts[2] == counts[4] >= 1, counts  # at least the one tile plan
    block = Block(step=0, rank=0, size=1, causal=True, length=64)
    pattern = block.pattern(None, DocumentMask(ids), torch.device("cpu"), 8)
    with HostTransfers() as counter:
        block_mask(pattern)
    assert counter.count == 0
