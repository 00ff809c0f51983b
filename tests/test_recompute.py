"""Activation recomputation: the same losses and gradients as none, fewer saved activations, clear errors."""

import pytest
import torch

from launch import run_job
from workers.recompute_setup import CONFIG, LAYERS, SEED, batches, max_deviation, two_steps, without_tracker_replay
from lightning_megatron.models import GPT, GPTModel
from lightning_megatron.parallel import ParallelConfig, ParallelState, TensorParallelRNG
from lightning_megatron.parallel.initialize import initialize_parameters
from lightning_megatron.tensor_parallel import parallelize
from lightning_megatron.transforms.recompute import apply_activation_checkpointing


def lightning_gpt(mode: str) -> GPTModel:
    """The LightningModule, patterned from its root; every dropout draws from the default generator."""
    torch.manual_seed(SEED)
    module = GPT(CONFIG)
    module.configure_model()
    apply_activation_checkpointing(module, mode=mode, layer_pattern=f"model.{LAYERS}")
    return module.model


def tracked_gpt(mode: str) -> GPTModel:
    """Built as the strategy builds it, at tp=1: attention dropout draws from TensorParallelRNG."""
    with torch.device("meta"):
        model = GPTModel(CONFIG)
    rng = TensorParallelRNG(SEED, 0, torch.device("cpu"))
    parallelize(model, model.tensor_parallel_plan(), ParallelState.create(ParallelConfig(), "cpu"), rng=rng)
    apply_activation_checkpointing(model, mode=mode, layer_pattern=LAYERS, rng=rng)
    initialize_parameters(model, SEED, device="cpu", only_meta=True)
    return model


@pytest.mark.parametrize("build", [lightning_gpt, tracked_gpt])
@pytest.mark.parametrize("mode", ["full", "selective"])
def test_recomputation_gives_bit_identical_losses_and_gradients(build, mode):
    assert max_deviation(two_steps(build(mode)), two_steps(build("none"))) == 0.0


def test_without_the_tracker_replay_recomputed_dropout_differs():
    """The control for the test above: it does see wrong per-rank masks."""
    with without_tracker_replay():
        broken = tracked_gpt("full")
    assert max_deviation(two_steps(broken), two_steps(tracked_gpt("none"))) > 0.0


@pytest.mark.slow
def test_recomputation_under_tensor_and_sequence_parallelism(tmp_path):
    results, _ = run_job("recompute_tp", 2, tmp_path)
    assert len(results) == 2
    for rank, result in enumerate(results):
        for layout in ("tp2", "tp2-sp"):
            deviation = result[layout]
            assert deviation["full"] == 0.0 and deviation["selective"] == 0.0, f"rank {rank}, {layout}: {deviation}"
            assert deviation["full_without_tracker_replay"] > 0.0, f"rank {rank}, {layout}: the control saw no change"


def saved_activation_bytes(model: GPTModel) -> int:
    """Bytes of the distinct storages autograd keeps for backward after one training forward, parameters excluded."""
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameters:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    model.train()
    input_ids, labels = batches()[0]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model.loss(input_ids, labels)
    return sum(saved.values())


def test_recomputation_saves_fewer_activations():
    saved = {mode: saved_activation_bytes(lightning_gpt(mode)) for mode in ("none", "selective", "full")}
    print(f"saved activation bytes: {saved}")
    assert saved["full"] < saved["selective"] < saved["none"]


def test_unknown_mode_names_the_valid_ones():
    with pytest.raises(ValueError, match=r"Unknown activation checkpointing mode 'partial'.*'none', 'full', 'selective'"):
        apply_activation_checkpointing(GPTModel(CONFIG), mode="partial", layer_pattern=LAYERS)


def test_pattern_that_matches_nothing_is_rejected():
    with pytest.raises(ValueError, match=r"layer_pattern 'model.blocks.\*' matches no submodule of GPTModel"):
        apply_activation_checkpointing(GPTModel(CONFIG), mode="full", layer_pattern="model.blocks.*")


def test_selective_needs_core_attention_in_every_layer():
    with pytest.raises(ValueError, match=r"blocks.0.mlp \(MLP\) has none.*use mode='full'"):
        apply_activation_checkpointing(GPTModel(CONFIG), mode="selective", layer_pattern="blocks.*.mlp")


def recomputed(model) -> set[str]:
    """The modules whose forward the recomputation wrapped."""
    return {name for name, module in model.named_modules() if "forward" in vars(module)}


def test_selective_recomputes_what_the_model_declares():
    """The model says what (``recompute_plan()``), the transform only matches names: by default attention's core,
    and whatever else a model declares instead."""
    model = apply_activation_checkpointing(GPTModel(CONFIG), mode="selective", layer_pattern=LAYERS)
    assert recomputed(model) == {f"blocks.{i}.attn.core_attention" for i in range(CONFIG.num_layers)}
    model = GPTModel(CONFIG)
    model.recompute_plan = lambda: {"blocks.*.mlp": "selective"}
    apply_activation_checkpointing(model, mode="selective", layer_pattern=LAYERS)
    assert recomputed(model) == {f"blocks.{i}.mlp" for i in range(CONFIG.num_layers)}


def test_selective_without_a_declaration_asks_for_one():
    model = GPTModel(CONFIG)
    model.recompute_plan = lambda: {}
    with pytest.raises(ValueError, match=r"it declares none.*Declare recompute_plan\(\)"):
        apply_activation_checkpointing(model, mode="selective", layer_pattern=LAYERS)
    model.recompute_plan = lambda: {"blocks.*.mlp": "partial"}
    with pytest.raises(ValueError, match=r"maps \{'blocks.\*.mlp': 'partial'\}"):
        apply_activation_checkpointing(model, mode="selective", layer_pattern=LAYERS)


def test_applying_twice_is_rejected():
    model = apply_activation_checkpointing(GPTModel(CONFIG), mode="full", layer_pattern=LAYERS)
    with pytest.raises(ValueError, match=r"blocks.0 \(TransformerLayer\) already has its own `forward`"):
        apply_activation_checkpointing(model, mode="full", layer_pattern=LAYERS)
