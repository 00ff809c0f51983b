"""Train, validation and test splits as contiguous document ranges, from Megatron-LM's ``"969,30,1"`` string.

Megatron-LM splits an indexed dataset by document: the first ~96.9% of its documents are
for training, the next ~3% for validation, the last ~0.1% for test. The ranges never
overlap, so validation and test never see a document that training saw, and they depend
only on the split string and the number of documents, never on the layout or the seed.
"""

from __future__ import annotations

from collections.abc import Sequence

SPLIT_NAMES = ("train", "validation", "test")


def _weights(split: str | Sequence[float]) -> list[float]:
    """The three weights as written (not normalised; missing trailing ones 0), checked."""
    text = split if isinstance(split, str) else ",".join(str(part) for part in split)
    parts = [part.strip() for part in text.replace("/", ",").split(",")]
    try:
        weights = [float(part) for part in parts if part]
    except ValueError:
        raise ValueError(
            f"split={split!r} is not a list of numbers; give train, validation and test weights as Megatron-LM "
            f"does, e.g. split='969,30,1'."
        ) from None
    if not 1 <= len(weights) <= 3 or any(w < 0 for w in weights) or sum(weights) <= 0 or weights[0] <= 0:
        raise ValueError(
            f"split={split!r} must give 1 to 3 non-negative weights (train, validation, test) with a positive train "
            f"weight, e.g. split='969,30,1'."
        )
    return weights + [0.0] * (3 - len(weights))


def parse_split(split: str | Sequence[float]) -> tuple[float, float, float]:
    """``"969,30,1"`` (or ``[969, 30, 1]``, ``"98,2"``) -> normalised weights of (train, validation, test).

    Missing trailing parts are 0; the weights need not sum to anything in particular.
    """
    weights = _weights(split)
    total = sum(weights)
    return tuple(w / total for w in weights)  # type: ignore[return-value]


def enlarged_split(split: str | Sequence[float], name: str, factor: float) -> str:
    """``split`` with the weight of split ``name`` multiplied by ``factor``, the others as written: a split to
    suggest when ``name`` gets too few documents. A weight of 0 is first taken as the other held-out split's, or
    as 5% of the documents when neither has any.

    Example::

        >>> enlarged_split("969,30,1", "validation", 4), enlarged_split("95,5,0", "test", 1)
        ('969,120,1', '95,5,5')
        >>> enlarged_split("1", "validation", 2)
        '1,0.11,0'
    """
    weights = _weights(split)
    index = SPLIT_NAMES.index(name)
    held_out = [w for w in weights[1:] if w > 0]
    weights[index] = (weights[index] or (min(held_out) if held_out else weights[0] / 19)) * factor

    def written(weight: float) -> str:
        return str(round(weight)) if float(weight).is_integer() or weight >= 10 else f"{weight:.2g}"

    return ",".join(map(written, weights))


def split_document_ranges(split: str | Sequence[float], num_documents: int) -> dict[str, range]:
    """The document range of each split, as Megatron-LM computes it: the boundaries are the cumulative shares
    times ``num_documents``, rounded (half to even).

    Example::

        >>> {name: (r.start, r.stop) for name, r in split_document_ranges("969,30,1", 1000).items()}
        {'train': (0, 969), 'validation': (969, 999), 'test': (999, 1000)}
    """
    weights = parse_split(split)
    shares = [0.0, weights[0], weights[0] + weights[1], 1.0]
    bounds = [int(round(share * num_documents)) for share in shares]
    return {name: range(bounds[i], bounds[i + 1]) for i, name in enumerate(SPLIT_NAMES)}
