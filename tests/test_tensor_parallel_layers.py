"""Tensor-parallel layers, vocab-parallel cross-entropy and the communication count, on 2 real ranks."""

import pytest

from launch import launch


@pytest.fixture(scope="module")
def layer_results(tmp_path_factory):
    results, _ = launch("tp_layers.py", 2, tmp_path_factory.mktemp("tp_layers"))
    assert len(results) == 2
    return results


def test_layers_match_plain_pytorch_forward_and_backward(layer_results):
    for rank, result in enumerate(layer_results):
        errors = result["errors"]
        assert len(errors) >= 20
        worst = {name: value for name, value in errors.items() if value > 1e-5}
        assert not worst, f"rank {rank}: parallel layers deviate from plain PyTorch: {worst}"


def _by_kind(counts):
    kinds = {"all_gather_single": "all_gather", "all_gather_into_tensor": "all_gather",
             "reduce_scatter_single": "reduce_scatter", "reduce_scatter_tensor": "reduce_scatter"}
    merged = {}
    for name, n in counts.items():
        merged[kinds.get(name, name)] = merged.get(kinds.get(name, name), 0) + n
    return merged


def test_transformer_layer_issues_exactly_the_papers_collectives(layer_results):
    for result in layer_results:
        plain, sequence_parallel = result["counts"]["tp"], result["counts"]["tp_sp"]
        assert _by_kind(plain["forward"]) == {"all_reduce": 2}
        assert _by_kind(plain["backward"]) == {"all_reduce": 2}
        assert _by_kind(sequence_parallel["forward"]) == {"all_gather": 2, "reduce_scatter": 2}
        assert _by_kind(sequence_parallel["backward"]) == {"all_gather": 2, "reduce_scatter": 2}


def test_dropout_masks_agree_in_replicated_regions_and_differ_in_sharded_ones(layer_results):
    for result in layer_results:
        assert result["same_dropout_mask"] == {"replicated": True, "heads": False, "chunks": False}
