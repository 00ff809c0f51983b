"""Corpora bigger than a rank should hold: 4 ranks train on memory-mapped data whose size does not show in their
memory, the index is built by one rank and read by the others, and a blend logs the tokens each dataset gave."""

import json

import numpy as np
import pytest

from launch import run_job
from lightning_megatron.data.indexed import IndexedDatasetWriter
from lightning_megatron.data.preprocess import metadata_file

SMALL_TOKENS, BIG_TOKENS = 2_000_000, 60_000_000  # 4 MB and 120 MB of uint16 tokens


def _write_corpus(prefix, num_tokens, seed):
    """Documents of 200-2000 random byte tokens, written a thousand at a time (never the whole corpus in memory)."""
    rng = np.random.default_rng(seed)
    written = 0
    with IndexedDatasetWriter(prefix, dtype=np.uint16) as writer:
        while written < num_tokens:
            lengths = rng.integers(200, 2000, 1000)
            block = rng.integers(0, 256, int(lengths.sum()), dtype=np.uint16)
            for document in np.split(block, np.cumsum(lengths)[:-1]):
                writer.add_document(document)
            written += int(lengths.sum())
    metadata_file(prefix).write_text(json.dumps({"tokenizer": "byte", "vocab_size": 257, "eos_id": 256}))
    return str(prefix), written


@pytest.fixture(scope="module")
def scale_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("scale")
    small, small_tokens = _write_corpus(root / "small", SMALL_TOKENS, seed=0)
    big, big_tokens = _write_corpus(root / "big", BIG_TOKENS, seed=1)
    # the small corpus twice: the first run warms the processes up, so the second and the big one compare alike
    corpora = [small, small, big, [0.25, small, 0.75, big]]
    results, _ = run_job("data_scale", 4, root / "out", json.dumps({"corpora": corpora, "tp": 2, "steps": 3}))
    assert len(results) == 4
    return results, (big_tokens - small_tokens) * 2


@pytest.mark.slow
def test_resident_memory_does_not_grow_with_the_corpus(scale_run):
    results, corpus_growth_bytes = scale_run
    for rank, result in enumerate(results):
        small, big = result["runs"][1]["resident_kib"], result["runs"][2]["resident_kib"]
        private, mapped = ((big[field] - small[field]) * 1024 for field in ("RssAnon", "RssFile"))
        # Reading the corpus into memory, as before, grew every rank's private memory by at least the corpus
        # (116 MB here); memory-mapping it grew the mapped pages by a page-cache folio per random read.
        assert private < 0.05 * corpus_growth_bytes, (rank, small, big, corpus_growth_bytes)
        assert mapped < 0.05 * corpus_growth_bytes, (rank, small, big, corpus_growth_bytes)


@pytest.mark.slow
def test_each_index_is_built_by_one_rank_and_read_by_the_others(scale_run):
    results, _ = scale_run
    for run in (0, 2):  # fresh indices: exactly one build per split, on rank 0
        for split in ("train", "val"):
            builds = [result["runs"][run]["built"][split] for result in results]
            assert builds == [[True], [False], [False], [False]], (run, split, builds)
    for split in ("train", "val"):  # the same corpus again: read from the cache by every rank
        assert [result["runs"][1]["built"][split] for result in results] == [[False]] * 4
    # the blend's training datasets are prefixes of the indices the single runs built (same data epochs)
    assert [result["runs"][3]["built"]["train"] for result in results] == [[False, False]] * 4


@pytest.mark.slow
def test_blend_logs_the_tokens_each_dataset_gave_and_dp_ranks_share_every_batch(scale_run):
    results, _ = scale_run
    blend = [result["runs"][3] for result in results]
    samples_so_far = [8 * step for step in (1, 2, 3)]
    for run in blend:  # 25% / 75% of 8 samples of 32 tokens per step, the same numbers on every rank
        logged = [(entry["consumed_tokens/small"], entry["consumed_tokens/big"]) for entry in run["logged"]]
        assert logged == [(n * 0.25 * 32, n * 0.75 * 32) for n in samples_so_far]
    # tp ranks (0, 1) and (2, 3) of a dp replica load the same samples; the two dp replicas different ones
    for run in range(4):
        steps = [result["runs"][run]["samples"] for result in results]
        assert steps[0] == steps[1] and steps[2] == steps[3]
        assert all(not set(a) & set(b) for a, b in zip(steps[0], steps[2]))
