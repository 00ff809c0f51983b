"""The GPT sample index: the same arrays as a plain walk over the token stream, built in ~12 bytes a sample."""

import tracemalloc

import numpy as np
import pytest

from lightning_megatron.data import sample_index
from lightning_megatron.data.sample_index import build_sample_index, index_bytes, samples_starting_before


def _reference_index(lengths, *, seq_length, epochs, seed):
    """The index written out as its definition, one sample at a time: each data epoch's documents in the order of
    ``default_rng([seed, epoch, 0]).permutation`` (one epoch more than the samples start in), sample ``j`` starting
    at stream position ``j * seq_length``, and each epoch's block of samples in the order of
    ``default_rng([seed, epoch, 1]).permutation`` (the order of every index cached so far)."""
    lengths = [int(length) for length in lengths]
    tokens = sum(lengths)
    order = [int(document) for epoch in range(epochs + 1)
             for document in np.random.default_rng([seed, epoch, 0]).permutation(len(lengths))]
    sample_document, sample_offset = [], []
    position, document_start = 0, 0  # the document of the stream being walked, and the position it starts at
    for sample in range(-(-epochs * tokens // seq_length)):
        start = sample * seq_length
        while document_start + lengths[order[position]] <= start:
            document_start += lengths[order[position]]
            position += 1
        sample_document.append(position)
        sample_offset.append(start - document_start)
    shuffle = []
    for epoch in range(epochs):
        first, end = -(-epoch * tokens // seq_length), -(-(epoch + 1) * tokens // seq_length)
        shuffle += [first + int(i) for i in np.random.default_rng([seed, epoch, 1]).permutation(end - first)]
    return order, sample_document, sample_offset, shuffle


@pytest.mark.parametrize("num_documents, seq_length, epochs, mean_length, chunk", [
    (1, 4, 3, 10, None),  # one document: every epoch the same, samples span epochs
    (7, 3, 4, 5, None),  # documents shorter than a sample: samples span several documents
    (40, 16, 3, 40, None),
    (300, 8, 2, 300, None),  # documents spanning many samples
    (300, 8, 2, 30, 7),  # many chunks of documents and samples per epoch, boundaries anywhere
])
def test_build_gives_the_arrays_of_the_plain_walk_and_int32(num_documents, seq_length, epochs, mean_length, chunk,
                                                            monkeypatch):
    if chunk is not None:
        monkeypatch.setattr(sample_index, "_CHUNK", chunk)
    rng = np.random.default_rng(num_documents)
    lengths = (1 + rng.geometric(1 / mean_length, size=num_documents)).astype(np.int32)
    lengths[0] += seq_length  # at least one sample
    index = build_sample_index(lengths, seq_length=seq_length, epochs=epochs, seed=11)
    order, sample_document, sample_offset, shuffle = _reference_index(lengths, seq_length=seq_length,
                                                                      epochs=epochs, seed=11)
    np.testing.assert_array_equal(index.document_order, order)
    np.testing.assert_array_equal(index.sample_document, sample_document)
    np.testing.assert_array_equal(index.sample_offset, sample_offset)
    np.testing.assert_array_equal(index.shuffle, shuffle)
    assert {array.dtype for array in (index.document_order, index.sample_document, index.sample_offset,
                                      index.shuffle)} == {np.dtype(np.int32)}


def test_build_holds_about_12_bytes_a_sample_at_its_peak():
    """Megatron-Core keeps 12 bytes a sample (int32 document and offset, uint32 shuffle); the build must not hold
    int64 temporaries per sample (the first version peaked at ~50 bytes a sample)."""
    rng = np.random.default_rng(0)
    lengths = (1 + rng.geometric(1 / 999, size=32_000)).astype(np.int32)  # ~32M tokens in ~1,000-token documents
    seq_length, epochs = 32, 2
    samples = samples_starting_before(epochs * int(lengths.sum()), seq_length)
    assert samples > 1_900_000
    tracemalloc.start()
    try:
        index = build_sample_index(lengths, seq_length=seq_length, epochs=epochs, seed=0)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    per_sample = sum(a.nbytes for a in (index.sample_document, index.sample_offset, index.shuffle))
    assert per_sample == 12 * samples
    assert peak / samples < 14, f"the build peaked at {peak / samples:.1f} bytes a sample"
    # beyond the arrays it returns (the document order too), a fixed few MiB of chunks
    kept = per_sample + index.document_order.nbytes
    assert kept == index_bytes(len(lengths), tokens_per_epoch=int(lengths.sum()), seq_length=seq_length, epochs=epochs)
    assert peak < kept + 4 * 2**20, peak
