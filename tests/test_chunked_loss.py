"""The chunked loss (``GPTConfig.loss_chunk_tokens``) on one process: the unchunked model's loss and gradients,
the same logits from forward, a clear error for a bad chunk, and a peak that follows the chunk, not the sequence.
(tp2 and tp2 + SP: tests/test_tensor_parallel_layers.py; layouts: tests/test_layout_invariance.py.)"""

from dataclasses import replace

import pytest
import torch

from lightning_megatron.models import GPTConfig, GPTModel
from lightning_megatron.tensor_parallel import VocabParallelCrossEntropy

CONFIG = GPTConfig(vocab_size=257, max_seq_length=16, hidden_size=32, num_layers=2, num_heads=4)


def _pair(config, chunk_tokens, dtype=torch.float32):
    torch.manual_seed(0)
    unchunked = GPTModel(config).to(dtype)
    chunked = GPTModel(replace(config, loss_chunk_tokens=chunk_tokens)).to(dtype)
    chunked.load_state_dict(unchunked.state_dict())
    return unchunked, chunked


def _batch():
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 257, (3, 16), generator=generator)
    labels = torch.randint(0, 257, (3, 16), generator=generator)
    labels[0, :5], labels[2, -2:] = -100, -100
    return ids, labels


def _step(model, ids, labels):
    loss_sum, tokens = model.loss(ids, labels)
    loss = loss_sum / tokens  # the model's normalisation: a mean over the counted tokens
    loss.backward()
    return loss.detach(), {name: p.grad for name, p in model.named_parameters()}


@pytest.mark.slow
@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("chunk_tokens", [1, 7, 48, 4096])
def test_chunked_loss_gives_the_unchunked_loss_and_gradients(tied, chunk_tokens):
    unchunked, chunked = _pair(replace(CONFIG, tie_embeddings=tied), chunk_tokens)
    ids, labels = _batch()
    ref_loss, ref_grads = _step(unchunked, ids, labels)
    loss, grads = _step(chunked, ids, labels)
    assert abs(loss - ref_loss) / ref_loss < 1e-6
    assert grads.keys() == ref_grads.keys()
    for name, grad in grads.items():
        assert (grad - ref_grads[name]).abs().max() < 1e-6, name
    assert chunked.lm_head.weight.grad.abs().sum() > 0
    with torch.no_grad():  # forward (generation, prediction) still returns the logits
        assert torch.equal(chunked(ids), unchunked(ids))


@pytest.mark.slow
def test_chunked_loss_in_bf16_keeps_the_fp32_softmax_math():
    """bf16 weights and activations: the logits' GEMMs in bf16, the softmax in fp32, so the loss is the unchunked bf16
    model's. The head's weight gradient is summed chunk by chunk in bf16 (an fp32 sum would add twice the weight's
    size to the peak) rather than in one GEMM: measured against the same model in fp32, its error may grow, but
    stays within twice the unchunked bf16 model's; the gradients keep the parameters' dtype."""
    unchunked, chunked = _pair(CONFIG, 7, torch.bfloat16)
    # What the strategy's plan makes of the loss at any tp (nn.CrossEntropyLoss would do its math in bf16).
    unchunked.loss_fn = VocabParallelCrossEntropy(reduction="sum")
    exact = GPTModel(CONFIG)
    exact.load_state_dict({name: value.float() for name, value in unchunked.state_dict().items()})
    ids, labels = _batch()
    ref_loss, ref_grads = _step(unchunked, ids, labels)
    loss, grads = _step(chunked, ids, labels)
    _, exact_grads = _step(exact, ids, labels)
    assert loss.dtype == torch.float32 and abs(loss - ref_loss) / ref_loss < 1e-6
    for name, grad in grads.items():
        assert grad.dtype == torch.bfloat16, name
        error = (grad.float() - exact_grads[name]).abs().max()
        assert error <= 2 * (ref_grads[name].float() - exact_grads[name]).abs().max() + 1e-6, name


@pytest.mark.parametrize("bad", [0, -4096, 2.5, True, "4096"])
def test_a_bad_chunk_is_refused_with_the_value_and_the_fix(bad):
    with pytest.raises(ValueError, match=rf"loss_chunk_tokens={bad!r} must be a positive number of tokens"):
        GPTConfig(loss_chunk_tokens=bad)


def test_the_chunked_peak_follows_the_chunk_and_the_unchunked_peak_the_sequence():
    """Measured (``plan.probes.head_loss_peak``'s allocation log) in the same test: the unchunked head and loss hold
    three fp32 ``[tokens, V]`` buffers at their peak (logits, log-softmax, its gradient), the chunked one three
    ``[chunk, V]`` buffers (a chunk's logits, shifted, exponentiated) plus a few numbers per token."""
    from lightning_megatron.plan.probes import head_loss_peak

    tokens, vocab, chunk = 512, 8192, 64
    unchunked = head_loss_peak(tokens=tokens, hidden=16, vocab=vocab, chunk_tokens=None)
    chunked = head_loss_peak(tokens=tokens, hidden=16, vocab=vocab, chunk_tokens=chunk)
    assert abs(chunked["loss"] - unchunked["loss"]) / unchunked["loss"] < 1e-6
    per_token = 16 * 4  # losses, maxima, sums, targets and their masks: a few fp32/int64 numbers per token
    assert unchunked["peak_bytes"] >= 3 * tokens * vocab * 4, unchunked
    assert chunked["peak_bytes"] <= 3 * chunk * vocab * 4 + per_token * tokens, chunked


def test_chunked_loss_under_autocast_matches_the_unchunked_one():
    """bf16-mixed (fp32 weights, bf16 autocast): the GEMMs in autocast's dtype, the weight gradient in fp32."""
    unchunked, chunked = _pair(CONFIG, 7)
    unchunked.loss_fn = VocabParallelCrossEntropy(reduction="sum")
    ids, labels = _batch()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref_loss, ref_grads = _step(unchunked, ids, labels)
        loss, grads = _step(chunked, ids, labels)
    assert abs(loss - ref_loss) / ref_loss < 1e-6
    for name, grad in grads.items():
        assert grad.dtype == torch.float32, name
        scale = ref_grads[name].abs().max()
        assert (grad - ref_grads[name]).abs().max() <= 2 ** -7 * scale, name
