"""Tensor-parallel layers, vocab-parallel cross-entropy and the communication count, on 2 real ranks."""

import pytest
import torch

from launch import run_job
from lightning_megatron.parallel import ParallelConfig
from lightning_megatron.tensor_parallel.overlap import OverlappedSequenceParallelLinear, overlapped_linear_for


@pytest.fixture(scope="module")
def layer_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("tp_layers")


@pytest.fixture(scope="module")
def layer_results(layer_dir):
    results, _ = run_job("tp_layers", 2, layer_dir)
    assert len(results) == 2
    return results


@pytest.mark.slow
def test_layers_match_plain_pytorch_forward_and_backward(layer_results):
    for rank, result in enumerate(layer_results):
        errors = result["errors"]
        assert len(errors) >= 20
        worst = {name: value for name, value in errors.items() if value > 1e-5}
        assert not worst, f"rank {rank}: parallel layers deviate from plain PyTorch: {worst}"


@pytest.mark.slow
def test_chunked_loss_matches_the_unchunked_single_process_model_at_tp2_and_sp(layer_results):
    """``loss_chunk_tokens``: loss and every gradient (head, tied embedding, the layers below) as the unchunked
    model's on the whole batch, to 1e-6, with vocabulary padding, ignored labels and a chunk dividing nothing."""
    for rank, result in enumerate(layer_results):
        chunked = result["chunked_loss"]
        assert len(chunked) == 12, chunked
        deviations = {name: value for name, value in chunked.items() if not name.endswith("_head_grad_norm")}
        assert max(deviations.values()) < 1e-6, f"rank {rank}: {deviations}"
        assert min(value for name, value in chunked.items() if name.endswith("_head_grad_norm")) > 0, chunked


def _by_kind(counts):
    kinds = {"all_gather_single": "all_gather", "all_gather_into_tensor": "all_gather",
             "reduce_scatter_single": "reduce_scatter", "reduce_scatter_tensor": "reduce_scatter"}
    merged = {}
    for name, n in counts.items():
        merged[kinds.get(name, name)] = merged.get(kinds.get(name, name), 0) + n
    return merged


@pytest.mark.slow
@pytest.mark.parametrize("model", ["gpt2", "llama", "mqa"])
def test_transformer_layer_issues_exactly_the_papers_collectives(layer_results, model):
    """GPT-2's layer; a Llama layer (RMSNorm, rotary, SwiGLU, 2 key/value groups split over tp=2); a multi-query
    one whose single key/value head is replicated on both ranks: rotary positions, the gated MLP and replicated
    key/value heads add no collective to the layer (the replicas' weight gradients are summed once per step).
    Under sequence parallelism the column layers keep only their input's sequence chunk and gather it again in
    backward (Korthikanti et al. 2022, 4.2.2): one more all-gather per column layer in backward."""
    for result in layer_results:
        plain, sequence_parallel = result["counts"][f"{model}_tp"], result["counts"][f"{model}_tp_sp"]
        assert _by_kind(plain["forward"]) == {"all_reduce": 2}
        assert _by_kind(plain["backward"]) == {"all_reduce": 2}
        assert _by_kind(sequence_parallel["forward"]) == {"all_gather": 2, "reduce_scatter": 2}
        assert _by_kind(sequence_parallel["backward"]) == {"all_gather": 4, "reduce_scatter": 2}


@pytest.mark.slow
@pytest.mark.parametrize("model", ["gpt2", "llama", "mqa"])
def test_overlapped_sequence_parallelism_issues_the_same_collectives_its_row_pieces_more(layer_results, model):
    """tp_comm_overlap: the same collectives as the default (the column layer's forward gather overlapped with its
    own chunk's GEMM); its row layers cut in 2 pieces: 2 reduce-scatters per row layer forward."""
    for result in layer_results:
        overlapped, pieces = result["counts"][f"{model}_tp_sp_tpo"], result["counts"][f"{model}_tp_sp_tpo2"]
        assert _by_kind(overlapped["forward"]) == {"all_gather": 2, "reduce_scatter": 2}
        assert _by_kind(overlapped["backward"]) == {"all_gather": 4, "reduce_scatter": 2}
        assert _by_kind(pieces["forward"]) == {"all_gather": 2, "reduce_scatter": 4}
        assert _by_kind(pieces["backward"]) == {"all_gather": 4, "reduce_scatter": 2}


@pytest.mark.slow
def test_sequence_parallel_column_layer_saves_only_its_sequence_chunk(layer_results):
    """Counted with saved_tensors_hooks against the same layer without sequence parallelism: the input saved for
    the weight gradient is this rank's 1/tp of the sequence (default and overlapped; in bf16 under autocast); a
    frozen layer saves none.
    The sequence scatter copies a one-sample chunk rather than keeping a view of the whole input."""
    for result in layer_results:
        saved = result["saved_bytes"]
        assert saved["tp"] > 0 and saved["sp"] * 2 == saved["tp"] and saved["sp_tpo"] == saved["sp"], saved
        assert saved["sp_frozen"] == 0, saved
        # Under bf16 autocast: the chunk in bf16, and the values of the layer without sequence parallelism (bf16 GEMMs).
        assert saved["sp_autocast"] == saved["sp"] // 2 + saved["weight_bf16"], saved
        assert saved["sp_autocast_dtype"] == "torch.bfloat16", saved
        assert saved["sp_autocast_error"] < 1e-2, saved  # relative to the largest value: bf16 rounding
        assert saved["scatter_chunk_storage"] * 2 == saved["scatter_input_storage"], saved


@pytest.mark.slow
def test_replicated_key_value_heads_add_one_bucketed_reduction_per_step(layer_results):
    """3 multi-query layers at tp=2: the replicas' key/value weight rows of all layers are summed in one all-reduce
    after backward; with the 2 groups split (no replicas) nothing is added."""
    for result in layer_results:
        assert result["step_counts"]["mqa"] == {"collectives": {"all_reduce": 1}, "parts": 3}
        assert result["step_counts"]["llama"] == {"collectives": {}, "parts": 0}


@pytest.mark.slow
def test_dropout_masks_agree_in_replicated_regions_and_differ_in_sharded_ones(layer_results):
    for result in layer_results:
        assert result["same_dropout_mask"] == {"replicated": True, "heads": False, "chunks": False}


@pytest.mark.slow
def test_pad_vocab_to_multiple_of_1_pads_an_indivisible_vocabulary_and_saves_it_unpadded(layer_results, layer_dir):
    # tp=2, vocabulary 257, pad_vocab_to_multiple_of=1 through parallelize: 258 rows (a multiple of tp * 1), one of
    # them padding on the last rank. It used to fail: make_shard padded only for multiples > 1.
    for rank, result in enumerate(layer_results):
        pad1 = result["pad1"]
        assert "error" not in pad1, f"rank {rank}: {pad1.get('error')}"
        assert pad1["padded_rows"] == 258 and pad1["local_rows"] == 129 and pad1["tied"]
        assert pad1["padding_logits"] == rank  # rank 0 holds ids 0..128, rank 1 ids 129..256 and the padding row
        assert pad1["padding_logits_not_minus_inf"] == 0
        assert pad1["gathered_logit_columns"] == 258
        assert pad1["logits_error"] < 1e-5 and pad1["weight_grad_error"] < 1e-5 and pad1["padding_rows_grad"] == 0
        assert abs(pad1["loss"] - pad1["loss_ref"]) < 1e-4 * abs(pad1["loss_ref"])
        assert pad1["full_state_shapes"] == {"emb.weight": [257, 16], "head.weight": [257, 16]}
        assert pad1["full_state_error"] == 0
    from lightning_megatron.checkpoint import consolidated_state_dict

    reference = torch.load(layer_dir / "pad1_reference.pt", weights_only=True)
    saved = consolidated_state_dict(layer_dir / "pad1_checkpoint")
    assert {name: tuple(t.shape) for name, t in saved.items()} == {name: (257, 16) for name in reference}
    for name, tensor in reference.items():
        assert torch.equal(saved[name], tensor), name


@pytest.mark.slow
def test_overlapped_layers_fall_back_to_plain_tensor_parallelism_on_whole_sequences(layer_results):
    """Generation (``full_sequences``): the overlapped layers take whole sequences, as the default ones do."""
    for result in layer_results:
        assert result["whole_sequences"] == {"column": True, "row": True}


@pytest.mark.parametrize("config", [ParallelConfig(tensor_parallel_size=2), ParallelConfig(data_parallel_size=2)])
def test_tp_comm_overlap_is_refused_without_sequence_parallel_communication(config):
    tp, sp = config.tensor_parallel_size, config.sequence_parallel
    with pytest.raises(ValueError, match=rf"tensor_parallel_size={tp} and sequence_parallel={sp}\. Set "
                                         rf"sequence_parallel=True with tensor_parallel_size > 1"):
        overlapped_linear_for(config, True)
    assert overlapped_linear_for(config, False) is None
    assert overlapped_linear_for(ParallelConfig(tensor_parallel_size=2, sequence_parallel=True), True) == \
        OverlappedSequenceParallelLinear()
    with pytest.raises(ValueError, match="row_chunks must be >= 1, got 0"):
        OverlappedSequenceParallelLinear(row_chunks=0)
