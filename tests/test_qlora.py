"""QLoRA (``LoRAConfig(quantize_base="nf4")``, ``peft.nf4``): the frozen base in torchao's NF4, the same at every
layout. Each rank's dequantised shard is its part of torchao's round trip of the whole weight (column, row, packed
and grouped-query splits, replicated key/value rows included); the quantised model computes what a plain model
with torchao's round-tripped weights and the same adapters computes, forward and backward; training at tp2 x pp2
at tp4 (replicated key/value heads, sequence parallel, recomputation) and at dp2 x pp2 under ZeRO-3 (the base stays whole on each replica) gives one process's losses, and the adapter-only checkpoint resumes in one
process (the base quantised again from ``pretrained``); the planner counts the base at its 4-bit bytes, as the
strategy reports them on every rank."""

import json

import pytest
import torch

from launch import run_job  # noqa: E402
from test_lora_export import fit, saved_base  # noqa: E402
from workers.trainer_setup import model  # noqa: E402
from lightning_megatron.models import GPT  # noqa: E402
from lightning_megatron.parallel.shards import TensorShard  # noqa: E402
from lightning_megatron.peft.nf4 import NF4Settings, require_torchao, shard_nf4  # noqa: E402
from lightning_megatron.plan import GPUS, Planner, Workload  # noqa: E402
from lightning_megatron.tensor_parallel.styles import PackedColumn, QueryGroupColumn  # noqa: E402

pytest.importorskip("transformers")
NF4Tensor, to_nf4 = require_torchao()
# The tiny Llama's layers (in 32 or 48 features, 1,024 to 3,072 elements) need blocks smaller than QLoRA's 64 / 256.
QLORA = {"rank": 4, "alpha": 8.0, "quantize_base": {"format": "nf4", "block_size": 4, "scaler_block_size": 64}}


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return saved_base(tmp_path_factory.mktemp("llama"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_ranks_dequantised_shard_is_its_part_of_torchaos_round_trip_of_the_whole_weight(dtype):
    settings = NF4Settings(block_size=4, scaler_block_size=64)
    weight = torch.randn(64, 32, generator=torch.Generator().manual_seed(0)).to(dtype)
    whole = to_nf4(weight, 4, 64).get_original_weight()
    assert torch.equal(shard_nf4("w", weight, None, settings).get_original_weight(), whole)
    splits = [(0, None), (1, None), (0, PackedColumn(2)), (0, QueryGroupColumn(4, 2))]  # tp4: replicated k/v rows
    runs = set()
    for world in (2, 4):
        for dim, style in splits:
            ranges = None if style is None else style.rank_ranges(64, world)
            for rank in range(world):
                shard = TensorShard(dim=dim, global_shape=(64, 32), padded_size=(64, 32)[dim], rank=rank,
                                    world=world, rank_ranges=ranges)
                local = shard_nf4("w", weight, shard, settings)
                assert torch.equal(local.get_original_weight(), shard.local_slice(whole)), (dim, style, world, rank)
                runs.add(local.scaler_block_size)
    assert runs == {64, 4, 2}  # row splits cut the 8-block rows into runs of 4 (tp2) and 2 (tp4): a factor per run
    # A shape torchao cannot block is refused by name, with sizes that fit.
    with pytest.raises(ValueError, match=r"w: its weight of shape \(64, 30\).*'block_size': 2"):
        shard_nf4("w", torch.randn(64, 30), None, settings)


def test_the_quantised_model_computes_the_plain_model_with_torchaos_round_tripped_base(llama_dir):
    quantised = GPT.from_hf(str(llama_dir), lora=QLORA)
    plain = GPT.from_hf(str(llama_dir), lora={k: v for k, v in QLORA.items() if k != "quantize_base"})
    plain.load_state_dict(quantised.state_dict(), strict=False)  # the same adapters
    torch.manual_seed(3)
    with torch.no_grad():
        for name, param in quantised.named_parameters():  # B != 0, so that the adapters show in the output
            if "lora_b" in name:
                param.normal_(std=0.1)
                plain.get_parameter(name).copy_(param)
        layers = [name for name, layer in plain.named_modules() if hasattr(layer, "lora_a")]
        assert len(layers) == 8
        for name in layers:
            layer = plain.get_submodule(name)
            layer.weight.copy_(to_nf4(layer.weight.detach(), 4, 64).get_original_weight())
            assert isinstance(quantised.get_submodule(name).weight, NF4Tensor)
    names = {name for name, _ in quantised.named_parameters()}
    assert not any(f"{layer}.weight" in names for layer in layers)  # the 4-bit base is no parameter
    tokens = torch.randint(0, 257, (2, 12), generator=torch.Generator().manual_seed(5))
    out_q, out_p = quantised(tokens), plain(tokens)
    torch.testing.assert_close(out_q, out_p, atol=1e-5, rtol=0)
    out_q.square().mean().backward()
    out_p.square().mean().backward()
    for name, param in quantised.named_parameters():
        if param.requires_grad:
            torch.testing.assert_close(param.grad, plain.get_parameter(name).grad, atol=1e-6, rtol=1e-5, msg=name)
    # A and B of each adapted projection: q, k, v, o, gate, up, down in each of the 2 layers (PEFT's adapters)
    assert sum(p.requires_grad for p in quantised.parameters()) == 2 * 7 * 2


@pytest.mark.slow
def test_qlora_at_tp2_pp2_tp4_and_dp2_pp2_equals_one_process_resumes_in_one_and_the_planner_counts_its_bytes(
        llama_dir, tmp_path, no_process_group):
    common = {"steps": 4, "micro_batch_size": 2, "lora": QLORA, "pretrained": str(llama_dir)}
    layouts = {"tp2pp2": {"tp": 2, "pp": 2, "save_at_step": 2}, "tp4": {"tp": 4, "sp": True, "recompute": "full"},
               "dp2pp2": {"tp": 1, "pp": 2, "zero_stage": 3}}
    predicted = {}  # the planner's bytes of each pipeline rank (over the fake process group: before any Trainer)
    for key, layout in layouts.items():
        planner = Planner(lambda: model({**common, **layout}), Workload(
            global_batch_size=4, seq_length=32, precision="32-true", bucket_size_mb=0.01), GPUS["a100"], world_size=4)
        plan = planner.with_layout(tensor_parallel_size=layout["tp"], pipeline_parallel_size=layout.get("pp", 1),
                                   sequence_parallel=layout.get("sp", False), zero_stage=layout.get("zero_stage", 0))
        predicted[key] = [planner.model_state_bytes(plan, pipeline_rank=p) for p in range(plan.pipeline_parallel_size)]
    trainer, one = fit(model(common), tmp_path / "one", 4)
    adapters = {name: value for name, value in trainer.lightning_module.state_dict().items() if ".lora_" in name}
    assert len(adapters) == 2 * 7 * 2  # A and B of q, k, v, o, gate, up, down in each of the 2 layers
    for key, layout in layouts.items():
        results, _ = run_job("trainer_fit", 4, tmp_path / key, json.dumps({**common, **layout}))
        per_rank = torch.tensor([result["losses"] for result in results])
        dp = 4 // (layout["tp"] * layout.get("pp", 1))
        # ranks (pp, dp, tp), tp innermost: each data-parallel replica logs its own micro-batches' mean
        replicas = per_rank.view(-1, dp, layout["tp"], per_rank.shape[-1]).transpose(0, 1).flatten(1, 2)
        assert (replicas == replicas[:, :1]).all(), key
        torch.testing.assert_close(replicas[:, 0].mean(0), torch.tensor(one), atol=1e-5, rtol=0, msg=key)
        gathered = torch.load(tmp_path / key / "weights.pt", weights_only=True)
        for name, value in adapters.items():
            torch.testing.assert_close(gathered[name], value, atol=1e-5, rtol=0, msg=f"{key} {name}")
        for rank, result in enumerate(results):  # ranks: (pp, dp, tp), tp innermost
            pipeline_rank = rank // (4 // layout.get("pp", 1))
            assert predicted[key][pipeline_rank] == result["model_state_bytes"], (key, rank)
    _, resumed = fit(model(common), tmp_path / "resumed", 4, ckpt_path=tmp_path / "tp2pp2" / "step2.ckpt")
    torch.testing.assert_close(torch.tensor(resumed), torch.tensor(one[2:]), atol=1e-5, rtol=0)


def test_one_gpu_fine_tuning_plans_qlora_with_the_base_at_its_nf4_bytes(no_process_group):
    """``plan --fine-tuning-fit``'s function: the same layout with LoRA and with QLoRA differs by the adapted
    weights' 16-bit bytes less their NF4 bytes (codes, an int8 scaler per 64, an fp32 factor per 256 scalers, the
    mean and 16 levels), computed here from Llama-3.2-1B's shapes."""
    from lightning_megatron.models import GPTConfig
    from lightning_megatron.plan.fine_tuning import fine_tuning_fits

    (fit,) = fine_tuning_fits(GPUS["rtx-4090"], presets=("llama-3.2-1b",), seq_length=512, global_batch_size=1)
    assert fit.lora.layout == fit.qlora.layout and fit.lora.fits and fit.qlora.fits
    config = GPTConfig.from_name("llama-3.2-1b")
    h, f, d = config.hidden_size, config.ffn_hidden_size, config.head_dim
    shapes = [((config.num_heads + 2 * config.num_query_groups) * d, h), (h, h), (2 * f, h), (h, f)]
    nf4 = sum(n // 2 + n // 64 + (n // 64 // 256 + 17) * 4 for n in (a * b for a, b in shapes))
    saved = config.num_layers * (sum(2 * a * b for a, b in shapes) - nf4)
    assert fit.lora.memory_per_gpu_bytes - fit.qlora.memory_per_gpu_bytes == saved


def test_what_a_quantised_base_cannot_run_with_is_refused_by_name(llama_dir):
    """A base the strategy would draw shard by shard (no ``pretrained``), FP8 GEMMs and overlapped sequence-parallel
    GEMMs are refused before anything runs, each with its fix."""
    from lightning_megatron.peft.nf4 import check_nf4_options, hold_global_weights

    module = GPT(GPT(pretrained=str(llama_dir)).config, lora=QLORA)
    with torch.device("meta"):
        module.configure_model()
    with pytest.raises(ValueError, match=r"model\.blocks\.0\.attn\.qkv: quantize_base='nf4' quantises a pretrained base"):
        hold_global_weights(module)
    with pytest.raises(ValueError, match="set fp8=None"):
        check_nf4_options(fp8=True, tp_comm_overlap=False)
    with pytest.raises(ValueError, match="set tp_comm_overlap=False"):
        check_nf4_options(fp8=False, tp_comm_overlap=True)
    with pytest.raises(ValueError, match="quantize_base must be 'nf4'"):
        GPT(pretrained=str(llama_dir), lora={**QLORA, "quantize_base": "int4"})
    quantised = GPT(pretrained=str(llama_dir), lora=QLORA)  # to_hf: the 4-bit base is no weight to merge into
    quantised.configure_model()
    with pytest.raises(ValueError, match=r"to_hf of a QLoRA module.*lightning-megatron checkpoint convert"):
        quantised.to_hf(llama_dir.parent / "never_written")
    assert not (llama_dir.parent / "never_written").exists()
