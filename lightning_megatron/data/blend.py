"""Weighted blends of datasets, with Megatron-LM's rule and its ``[w1, prefix1, w2, prefix2, ...]`` syntax.

Sample ``i`` of a blend comes from the dataset that is furthest behind its share: the ``d``
with the largest ``weights[d] * (i + 1) - taken[d]``, where ``taken[d]`` counts the samples
drawn from it so far (the first of those on ties). So after any number ``n`` of samples,
every dataset has given about ``weights[d] * n`` of them (for a few datasets the difference
stays within about one sample), whatever the global batch size or the data-parallel size,
and the blend's ``k``-th sample from dataset ``d`` is that dataset's own ``k``-th sample.
The rule is deterministic: the order within each dataset is that dataset's own shuffle.

The blend index depends only on the weights and the number of samples, so it is cached
like the datasets' own indices (``data/index_cache.py``).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any, Union

import numpy as np
from torch.utils.data import Dataset

from lightning_megatron.data.index_cache import Ranks, load_or_build

DataPrefix = Union[str, Sequence[Union[str, float, int]]]


def parse_data_prefix(data_prefix: DataPrefix) -> tuple[list[str], list[float]]:
    """``"path"`` or ``["path"]`` -> one dataset of weight 1; ``[0.3, "a", 0.7, "b"]`` -> ``(["a", "b"], [0.3, 0.7])``.

    Weights need not sum to 1 (they are normalised) and must be positive. A string holding a
    space-separated Megatron-LM list (``"0.3 a 0.7 b"``, as in its shell scripts) works too.
    """
    if isinstance(data_prefix, (str, os.PathLike)):
        parts = os.fspath(data_prefix).split()
        items: list = parts if len(parts) > 1 else [os.fspath(data_prefix)]
    else:
        items = list(data_prefix)
    if len(items) == 1:
        return [os.fspath(items[0])], [1.0]
    if len(items) % 2:
        raise ValueError(
            f"data_prefix={data_prefix!r} must be one path or pairs of weight and path, e.g. "
            f"[0.3, 'data/a_text_document', 0.7, 'data/b_text_document']; it has {len(items)} items."
        )
    weights, prefixes = [], []
    for weight, prefix in zip(items[0::2], items[1::2]):
        try:
            weights.append(float(weight))
        except (TypeError, ValueError):
            raise ValueError(
                f"data_prefix={data_prefix!r}: {weight!r} stands where a weight belongs; a blend alternates weights "
                f"and paths: [0.3, 'data/a', 0.7, 'data/b']."
            ) from None
        prefixes.append(os.fspath(prefix))
    if any(w <= 0 for w in weights):
        raise ValueError(f"data_prefix={data_prefix!r}: every blend weight must be positive, got {weights}.")
    duplicates = sorted({p for p in prefixes if prefixes.count(p) > 1})
    if duplicates:
        raise ValueError(f"data_prefix={data_prefix!r} names {duplicates} more than once; give each dataset one "
                         f"weight (their sum).")
    return prefixes, weights


def normalized(weights: Sequence[float]) -> np.ndarray:
    weights = np.asarray(weights, dtype=np.float64)
    return weights / weights.sum()


def blend_index(weights: Sequence[float], num_samples: int) -> tuple[np.ndarray, np.ndarray]:
    """``(dataset, sample within it)`` of each of the blend's ``num_samples`` samples (see the module docstring).

    A plain loop (about 0.25 s per million samples and dataset on one core; cached), since each
    choice depends on all the earlier ones.
    """
    shares = [float(w) for w in normalized(weights)]
    taken = [0] * len(shares)
    dataset = np.empty(num_samples, dtype=np.int16)
    sample = np.empty(num_samples, dtype=np.int64)
    datasets = range(len(shares))
    for i in range(num_samples):
        t = i + 1
        best, lag = 0, shares[0] * t - taken[0]
        for d in datasets:
            behind = shares[d] * t - taken[d]
            if behind > lag:
                best, lag = d, behind
        dataset[i], sample[i] = best, taken[best]
        taken[best] += 1
    return dataset, sample


def samples_per_dataset(dataset_index: Any, num_datasets: int) -> list[int]:
    """How many of a blend's samples come from each dataset (``dataset_index``: the blend's dataset array)."""
    return np.bincount(np.asarray(dataset_index), minlength=num_datasets).tolist()


class BlendedDataset(Dataset):
    """``num_samples`` samples drawn from ``datasets`` by ``weights`` (see the module docstring).

    The index comes first (:meth:`index`): the number of samples each dataset must provide
    follows from it (:func:`samples_per_dataset`). ``sample_counts(n)`` says how many of the first
    ``n`` samples each dataset gave (the consumed-data log). Its order is always the blend's
    (``shuffles_samples``): a sampler's shuffle would break the running shares; each dataset's
    own order is shuffled.
    """

    shuffles_samples = True

    def __init__(self, datasets: Sequence[Dataset], names: Sequence[str], dataset_index: np.ndarray,
                 dataset_sample: np.ndarray) -> None:
        self.datasets, self.names = list(datasets), list(names)
        self.dataset_index, self.dataset_sample = dataset_index, dataset_sample
        #: samples the whole blend takes from each dataset
        self.totals = dict(zip(self.names, samples_per_dataset(dataset_index, len(self.datasets))))
        self._counted = (0, np.zeros(len(self.datasets), dtype=np.int64))  # sample_counts' last position and counts
        for dataset, name in zip(self.datasets, self.names):
            if len(dataset) < self.totals[name]:
                raise ValueError(f"Blend dataset {name} has {len(dataset)} samples; the blend needs {self.totals[name]}.")

    @staticmethod
    def index(weights: Sequence[float], num_samples: int, *, cache_dir: str | os.PathLike,
              ranks: Ranks = Ranks()) -> tuple[np.ndarray, np.ndarray]:
        """The cached ``(dataset, sample within it)`` arrays of a blend."""
        key = {"kind": "blend", "version": 1, "weights": [float(w) for w in normalized(weights)],
               "num_samples": int(num_samples)}

        def build() -> dict[str, np.ndarray]:
            dataset, sample = blend_index(weights, num_samples)
            return {"dataset": dataset, "sample": sample}

        arrays = load_or_build(cache_dir, key, build, ranks=ranks, what=f"blend of {len(weights)} datasets").arrays
        return arrays["dataset"], arrays["sample"]

    def __len__(self) -> int:
        return len(self.dataset_index)

    def __getitem__(self, index: int) -> Any:
        if not 0 <= index < len(self):
            raise IndexError(f"sample {index} out of range for a blend of {len(self)} samples")
        return self.datasets[int(self.dataset_index[index])][int(self.dataset_sample[index])]

    def sample_counts(self, num_samples: int) -> dict[str, int]:
        """Samples each dataset gave among the blend's first ``num_samples`` (read from the index: exact on every
        rank, with no communication). Counted on from the previous call's position when it is not past this one,
        so a call per training step costs a batch, not the whole prefix."""
        num_samples = min(num_samples, len(self))
        start, counts = self._counted
        if start > num_samples:
            start, counts = 0, np.zeros(len(self.datasets), dtype=np.int64)
        counts = counts + np.bincount(np.asarray(self.dataset_index[start:num_samples]), minlength=len(self.datasets))
        self._counted = (num_samples, counts)
        return {name: int(count) for name, count in zip(self.names, counts)}

