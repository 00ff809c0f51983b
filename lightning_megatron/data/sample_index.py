"""The three small index arrays of a GPT dataset, built vectorised with numpy.

A split's documents are read as one token stream: data epoch ``e`` is the documents in an
order shuffled by ``(seed, e)``, each followed by the end-of-document id (unless it already
ends with one). Sample ``j`` is the ``seq_length + 1`` tokens starting at stream position
``j * seq_length``: consecutive samples share one token (the last label of one is the first
input of the next), every token is a label once, and a sample may span documents and
epochs, as in Megatron-LM.

* ``document_order``: positions of the split's documents, epoch after epoch;
* ``sample_starts``: for each sample, the index into ``document_order`` of its first
  document and the token offset into it (Megatron's "sample index");
* ``shuffle``: the order in which the dataset hands out the samples.

Samples are grouped into *blocks* by the epoch in which they start, and each block is
shuffled by ``(seed, e)`` on its own. A run that needs more samples (a larger ``max_steps``)
therefore sees the same samples in the same order first: the arrays for ``E`` epochs are a
prefix of those for ``E + 1``. For that, the stream is built one epoch longer than the
samples need (the last samples of an epoch end in the next one).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

_DOCUMENT_ORDER, _SAMPLE_ORDER = 0, 1  # the streams of randomness, per epoch
_CHUNK = 1 << 16  # samples (or documents) per numpy pass: the temporaries stay ~1.5 MiB whatever the corpus


def samples_starting_before(tokens: int, seq_length: int) -> int:
    """How many sample starts (multiples of ``seq_length``) lie in ``[0, tokens)``."""
    return -(-tokens // seq_length)


def epochs_for(num_samples: int, *, tokens_per_epoch: int, seq_length: int) -> int:
    """The fewest data epochs whose tokens hold the starts of ``num_samples`` samples."""
    epochs = max(1, -(-(num_samples * seq_length) // tokens_per_epoch))
    while samples_starting_before(epochs * tokens_per_epoch, seq_length) < num_samples:
        epochs += 1
    while epochs > 1 and samples_starting_before((epochs - 1) * tokens_per_epoch, seq_length) >= num_samples:
        epochs -= 1
    return epochs


def _smallest_int(limit: int) -> type:
    return np.int32 if limit < 2**31 else np.int64


def _dtypes(num_documents: int, epochs: int, num_samples: int) -> dict[str, type]:
    """The dtype of each array of the index: int32 wherever the values fit."""
    return {"document_order": _smallest_int(num_documents),
            "sample_document": _smallest_int((epochs + 1) * num_documents),
            "sample_offset": np.int32,  # documents are shorter than 2**31 tokens
            "shuffle": _smallest_int(num_samples)}


def index_bytes(num_documents: int, *, tokens_per_epoch: int, seq_length: int, epochs: int) -> int:
    """The bytes of the arrays :func:`build_sample_index` returns, known without building them: what its cache
    entry holds on disk and, within ~2 MiB, what the build peaks at (12 bytes a sample and 4 a document and epoch
    while they fit int32; Megatron-Core keeps the same per sample)."""
    num_samples = samples_starting_before(epochs * tokens_per_epoch, seq_length)
    itemsize = {name: np.dtype(dtype).itemsize for name, dtype in _dtypes(num_documents, epochs, num_samples).items()}
    per_sample = itemsize["sample_document"] + itemsize["sample_offset"] + itemsize["shuffle"]
    return (epochs + 1) * num_documents * itemsize["document_order"] + num_samples * per_sample


def _epoch_rng(seed: int, epoch: int, stream: int) -> np.random.Generator:
    return np.random.default_rng([seed, epoch, stream])


@dataclass(frozen=True)
class SampleIndex:
    # int32 wherever the values fit (12 bytes per sample in all), else int64
    document_order: np.ndarray  # positions into the split's documents
    sample_document: np.ndarray  # index into document_order of each sample's first token
    sample_offset: np.ndarray  # token offset into that document (documents are shorter than 2**31 tokens)
    shuffle: np.ndarray  # the dataset's order of the samples

    @property
    def num_samples(self) -> int:
        return len(self.shuffle)


def build_sample_index(document_lengths: np.ndarray, *, seq_length: int, epochs: int, seed: int) -> SampleIndex:
    """The index of ``epochs`` data epochs over documents of ``document_lengths`` tokens (eos included).

    The arrays are allocated once, at their final dtype, and filled with numpy ``_CHUNK``
    documents and samples at a time, in stream order (the samples that start in a chunk of
    documents are found among those documents alone). The build therefore holds the index
    itself, 12 bytes per sample and 4 per document and epoch (as much as Megatron-Core's
    helpers keep), plus a fixed ~2 MiB, never an int64 array per sample or per document; its
    cost is a pass over the documents of each epoch and over the samples, never the tokens.
    """
    num_documents = len(document_lengths)
    tokens_per_epoch = int(document_lengths.sum(dtype=np.int64))
    if tokens_per_epoch < seq_length + 1:
        raise ValueError(f"{tokens_per_epoch} tokens cannot make one sample of seq_length + 1 = {seq_length + 1}.")
    blocks = [samples_starting_before(epoch * tokens_per_epoch, seq_length) for epoch in range(epochs + 1)]
    dtypes = _dtypes(num_documents, epochs, blocks[-1])
    document_order = np.empty((epochs + 1) * num_documents, dtype=dtypes["document_order"])
    for epoch in range(epochs + 1):  # one more epoch: the last samples run into it
        _shuffle_range(document_order[epoch * num_documents:(epoch + 1) * num_documents], 0,
                       _epoch_rng(seed, epoch, _DOCUMENT_ORDER))

    sample_document, sample_offset, shuffle = (np.empty(blocks[-1], dtype=dtypes[name])
                                               for name in ("sample_document", "sample_offset", "shuffle"))
    bounds = np.empty(_CHUNK + 1, dtype=np.int64)  # where each document of a chunk starts, and where the last ends
    for epoch in range(epochs):
        order = document_order[epoch * num_documents:(epoch + 1) * num_documents]
        bounds[0] = epoch * tokens_per_epoch
        for first_document in range(0, num_documents, _CHUNK):
            chunk = order[first_document:first_document + _CHUNK]
            ends = bounds[1:len(chunk) + 1]
            np.cumsum(document_lengths[chunk], dtype=np.int64, out=ends)
            ends += bounds[0]
            # the samples that start in these documents
            first = samples_starting_before(int(bounds[0]), seq_length)
            end = samples_starting_before(int(ends[-1]), seq_length)
            for at in range(first, end, _CHUNK):
                stop = min(at + _CHUNK, end)
                starts = np.arange(at, stop, dtype=np.int64)
                starts *= seq_length
                document = np.searchsorted(bounds[:len(chunk) + 1], starts, side="right")
                document -= 1
                starts -= bounds[document]
                sample_offset[at:stop] = starts
                document += epoch * num_documents + first_document
                sample_document[at:stop] = document
            bounds[0] = ends[-1]
        _shuffle_range(shuffle[blocks[epoch]:blocks[epoch + 1]], blocks[epoch], _epoch_rng(seed, epoch, _SAMPLE_ORDER))
    return SampleIndex(document_order, sample_document, sample_offset, shuffle)


def _shuffle_range(out: np.ndarray, first: int, rng: np.random.Generator) -> None:
    """Fill ``out`` with ``first, first + 1, ...`` in the order of ``first + rng.permutation(len(out))``, in place
    (``Generator.shuffle`` moves the same positions whatever the dtype: the int64 permutation is never made)."""
    for at in range(0, len(out), _CHUNK):
        stop = min(at + _CHUNK, len(out))
        out[at:stop] = np.arange(first + at, first + stop, dtype=out.dtype)
    rng.shuffle(out)
