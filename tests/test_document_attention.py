"""Document masks in O(S) memory (``context_parallel/documents.py``, ``local.py``): equal to SDPA over the dense
``[B, 1, S, S]`` mask, forward and gradients, on random packings (one-token documents, documents across tiles,
grouped-query and multi-query heads); a packed model equal to its documents run alone, with selective
recomputation; and what backward keeps linear in the sequence length, where the dense mask's grows with its
square. The context-parallel ring and all-gather are checked against the same reference in
``tests/workers/cp_layouts.py`` (``kernels-``)."""

import pytest
import torch
import torch.nn.functional as F

from lightning_megatron.context_parallel.documents import DocumentMask
from lightning_megatron.context_parallel.kernels import CPU_FLASH, FLEX_EAGER
from lightning_megatron.context_parallel.local import document_attention
from lightning_megatron.context_parallel.masks import BlockPattern
from lightning_megatron.models import GPTConfig, GPTModel
from lightning_megatron.models.attention import CoreAttention
from lightning_megatron.transforms.recompute import apply_activation_checkpointing


def packing(batch: int, seq: int, generator: torch.Generator) -> torch.Tensor:
    """Document ids of random packed samples: documents of 1 to ~10 tokens; the second sample all one-token ones."""
    starts = torch.rand(batch, seq, generator=generator) < 0.25
    starts[:, 0] = True
    ids = starts.long().cumsum(1)
    ids[1 % batch] = torch.arange(seq)
    return ids


def dense_reference(q, k, v, ids, causal, grad):
    """SDPA over the dense mask written out here (same document, and causal): output and q/k/v gradients."""
    keep = ids[:, None, :, None] == ids[:, None, None, :]
    if causal:
        keep = keep & torch.ones(ids.shape[1], ids.shape[1], dtype=torch.bool).tril()
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    out = F.scaled_dot_product_attention(*full, attn_mask=keep, enable_gqa=q.shape[1] != k.shape[1])
    (out * grad).sum().backward()
    return out.detach(), *(t.grad for t in full)


@pytest.mark.slow
@pytest.mark.parametrize("dtype, out_tol, grad_tol, heads, groups", [
    (torch.float32, 1e-6, 1e-5, 4, 4), (torch.float32, 1e-6, 1e-5, 4, 2), (torch.float32, 1e-6, 1e-5, 4, 1),
    (torch.float64, 1e-12, 1e-12, 4, 2)])
def test_document_attention_equals_sdpa_over_the_dense_mask(dtype, out_tol, grad_tol, heads, groups):
    generator = torch.Generator().manual_seed(0)
    batch, seq, dim = 3, 23, 8
    for tile in (4, 7, 512):  # tiles cut across documents (the last one short), one tile for all
        for causal in (True, False):
            q, k, v, grad = (torch.randn(batch, h, seq, dim, generator=generator, dtype=dtype)
                             for h in (heads, groups, groups, heads))
            ids = packing(batch, seq, generator)
            expected = dense_reference(q, k, v, ids, causal, grad)
            mine = [t.clone().requires_grad_() for t in (q, k, v)]
            out = document_attention(*mine, DocumentMask(ids, tile), causal=causal)
            (out * grad).sum().backward()
            assert (out - expected[0]).abs().max() < out_tol, (tile, causal)
            for name, got, want in zip("qkv", (t.grad for t in mine), expected[1:]):
                assert (got - want).abs().max() < grad_tol, (tile, causal, name, (got - want).abs().max())


def test_a_tile_of_documents_on_the_cuda_back_end_equals_the_cpu_kernel():
    """The CUDA back end (FlexAttention, run eagerly here) and torch's CPU flash kernel give one tile's output,
    log-sum-exp and gradients alike, with queries whose keys are all in other documents (output 0, log-sum-exp
    -inf, no NaN)."""
    generator = torch.Generator().manual_seed(1)
    q, k, v, grad = (torch.randn(2, 4, 6, 8, generator=generator, dtype=torch.float64) for _ in range(4))
    queries, keys = torch.tensor([[0, 0, 1, 1, 2, 2]] * 2), torch.tensor([[0, 1, 1, 1, 1, 1]] * 2)
    pattern = BlockPattern(q_pos=torch.arange(6), k_pos=torch.arange(6), causal=False, q_ids=queries, k_ids=keys)
    results = {}
    for name, backend in (("cpu", CPU_FLASH), ("flex", FLEX_EAGER)):
        (_, out, lse), = backend.forward(q, k, v, pattern)
        (_, _, *grads), = backend.backward(grad, q, k, v, out, lse, pattern)
        results[name] = (out, lse, *grads)
    for a, b in zip(results["cpu"], results["flex"]):
        assert torch.allclose(a, b, atol=1e-12)
    out, lse = results["flex"][:2]
    assert torch.isfinite(out).all() and torch.isinf(lse[..., 4:]).all() and (out[..., 4:, :] == 0).all()


def test_a_packed_model_equals_its_documents_alone_with_selective_recomputation():
    """Loss and every gradient of a packed Llama-shaped sample (rotary, grouped-query) with the document ids and
    restarting positions, attention recomputed in backward, equal the sums over each document run on its own."""
    torch.manual_seed(0)
    config = GPTConfig.from_name("llama-tiny", vocab_size=97, max_seq_length=32, hidden_size=32, num_heads=4,
                                 num_query_groups=2, ffn_hidden_size=48)
    packed_model, alone_model = GPTModel(config), GPTModel(config)
    alone_model.load_state_dict(packed_model.state_dict())
    apply_activation_checkpointing(packed_model, mode="selective", layer_pattern="blocks.*")
    lengths = [7, 1, 12, 1, 11]
    tokens = torch.randint(0, 97, (1, sum(lengths) + 1))
    ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[None]
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    packed, _ = packed_model.loss(inputs, labels, position_ids=positions, document_ids=ids)
    packed.backward()
    alone = sum(alone_model.loss(inputs[:, s:s + n], labels[:, s:s + n])[0]
                for s, n in zip(torch.tensor([0, *lengths]).cumsum(0).tolist(), lengths))
    alone.backward()
    assert abs(packed.item() - alone.item()) < 1e-4 * alone.item()
    for (name, a), b in zip(packed_model.named_parameters(), alone_model.parameters()):
        assert (a.grad - b.grad).abs().max() < 1e-5, name


def test_attention_dropout_draws_over_the_dense_mask():
    """Dropout is SDPA's: with it on in training, the same draws as SDPA over the dense mask; off in eval."""
    generator = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, 4, 10, 8, generator=generator) for _ in range(3))
    ids = packing(2, 10, generator)
    core = CoreAttention(attention_dropout=0.5, causal=True)
    torch.manual_seed(5)
    got = core(q, k, v, DocumentMask(ids))
    torch.manual_seed(5)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=DocumentMask(ids).dense(True), dropout_p=0.5)
    assert torch.equal(got, want)
    core.eval()
    assert (core(q, k, v, DocumentMask(ids)) - F.scaled_dot_product_attention(
        q, k, v, attn_mask=DocumentMask(ids).dense(True))).abs().max() < 1e-6


def test_bad_document_ids_are_refused_with_the_shapes():
    q = torch.zeros(2, 4, 10, 8)
    with pytest.raises(ValueError, match=r"\[2, 9\] do not match the 2 sequences of 10 queries"):
        document_attention(q, q, q, DocumentMask(torch.zeros(2, 9, dtype=torch.long)), causal=True)
    with pytest.raises(ValueError, match=r"shape \[batch, sequence\]; got \[20\]"):
        DocumentMask(torch.zeros(20, dtype=torch.long))


def saved_bytes(attention, seq: int) -> int:
    """Bytes of the storages autograd saves for backward in one call (each storage once, by data_ptr)."""
    generator = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, h, seq, 16, generator=generator, requires_grad=True) for h in (4, 2, 2))
    ids = torch.arange(seq).repeat(2, 1) // 37  # documents of 37 tokens
    storages = {}

    def pack(tensor):
        storages.setdefault(tensor.untyped_storage().data_ptr(), tensor.untyped_storage().nbytes())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = attention(q, k, v, ids)
    del out
    return sum(storages.values())


def test_what_backward_keeps_grows_linearly_and_the_dense_masks_quadratically():
    documents = lambda q, k, v, ids: document_attention(q, k, v, DocumentMask(ids, tile=128), causal=True)
    dense = lambda q, k, v, ids: F.scaled_dot_product_attention(q, k, v, attn_mask=DocumentMask(ids).dense(True),
                                                                enable_gqa=True)
    seq = 512
    tiled = [saved_bytes(documents, s) for s in (seq, 2 * seq)]
    masked = [saved_bytes(dense, s) for s in (seq, 2 * seq)]
    print(f"saved bytes at S={seq}, {2 * seq}: tiled {tiled}, dense mask {masked}")
    assert tiled[1] == 2 * tiled[0]  # q, k, v, output, log-sum-exp, ids: all per token
    # SDPA keeps the same per-token tensors and the [B, 1, S, S] mask on top: that excess quadruples when S doubles.
    excess = [m - t for m, t in zip(masked, tiled)]
    assert excess[0] > 2 * tiled[0] and 3.9 < excess[1] / excess[0] < 4.1, excess
