"""Mixture-of-Experts checkpoints: the tiny MoE GPT trained by the Trainer at ep2 x tp2 (dp2, ZeRO-1, AdamW), a
sharded checkpoint of an interrupted run, resumed at ep1, at ep4, at ep2 x dp4 under ZeRO-3 and at ep4 over
tp2 x dp2 with whole experts (expert_tensor_parallel_size=1) with the uninterrupted run's losses; the Qwen3-MoE-shaped
one (q/k norms, no shared expert) saved mid-run at ep2 x tp2 and resumed at ep4 x tp1; GPT-OSS's likewise (sinks
split with the heads, expert biases); the DeepSeek-V3-shaped one (latent attention, grouped sigmoid routing, the
expert bias) saved at ep2 x tp2 x dp2 and resumed at pp2 x ep2 x dp2."""

import json

import pytest
import torch

from launch import run_job
from lightning_megatron.checkpoint import consolidated_state_dict, open_sharded, read_full_tensors
from workers.gpt_setup import MOE_CONFIGS

STEPS, STOP_AT = 4, 2
SAVED = "save/epoch=0-step=2.ckpt"
SHORT = "short/epoch=0-step=2.ckpt"
QWEN3_MOE_SAVED = "qwen3moe/epoch=0-step=2.ckpt"
MLA_SAVED = "mla/epoch=0-step=2.ckpt"
OSS_SAVED = "oss/epoch=0-step=2.ckpt"
RESUMED = {  # run name: (tp, ep, zero_stage, expert_tensor_parallel_size) on 4 ranks, dp = 4 / tp
    "ep2": (2, 2, 1, None),  # the saving layout: exact
    "ep1": (2, 1, 1, None),  # every rank holds all 4 experts, reduced and ZeRO-sharded over dp2
    "ep4": (1, 4, 1, None),  # one expert per rank, no tp
    "ep2-z3": (1, 2, 3, None),  # ZeRO-3: experts' rows over their expert-data-parallel pair, the rest over dp4
    "ep4-etp1": (2, 4, 1, 1),  # whole experts, one per rank of tp x dp, attention still split over tp
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One launch: the uninterrupted run, the interrupted one (checkpoint after step 2), then each resume."""
    out = tmp_path_factory.mktemp("moe")
    plan = [{"name": "straight", "tp": 2, "ep": 2, "steps": STEPS},
            {"name": "save", "tp": 2, "ep": 2, "steps": STEPS, "stop_at": STOP_AT, "save_every": STOP_AT}]
    plan += [{"name": name, "tp": tp, "ep": ep, "zero": zero, "etp": etp, "steps": STEPS, "ckpt_path": str(out / SAVED)}
             for name, (tp, ep, zero, etp) in RESUMED.items()]
    # A run that ended at max_steps=2, continued with max_steps=4: the data index is rebuilt for 4 steps.
    plan += [{"name": "short", "tp": 2, "ep": 2, "steps": STOP_AT, "save_every": STOP_AT},
             {"name": "extended", "tp": 2, "ep": 2, "steps": STEPS, "ckpt_path": str(out / SHORT)}]
    # Qwen3-MoE: a run that saves at step 2 and goes on, and its checkpoint resumed at another (tp, ep, dp)
    plan += [{"name": "qwen3moe", "variant": "qwen3moe", "tp": 2, "ep": 2, "steps": STEPS, "save_every": STOP_AT},
             {"name": "qwen3moe-ep4", "variant": "qwen3moe", "tp": 1, "ep": 4, "steps": STEPS,
              "ckpt_path": str(out / QWEN3_MOE_SAVED)}]
    # DeepSeek-V3-shaped: saved at tp2 x ep2 x dp2, resumed over two pipeline stages at tp1 x ep2 x dp2
    plan += [{"name": "mla", "variant": "mla", "tp": 2, "ep": 2, "steps": STEPS, "save_every": STOP_AT},
             {"name": "mla-pp2", "variant": "mla", "tp": 1, "pp": 2, "ep": 2, "steps": STEPS,
              "ckpt_path": str(out / MLA_SAVED)}]
    # GPT-OSS (sinks split with the heads, expert biases): saved at tp2 x ep2 x dp2, resumed at tp1 x ep4 x dp4
    plan += [{"name": "oss", "variant": "oss", "tp": 2, "ep": 2, "steps": STEPS, "save_every": STOP_AT},
             {"name": "oss-ep4", "variant": "oss", "tp": 1, "ep": 4, "steps": STEPS, "ckpt_path": str(out / OSS_SAVED)}]
    results, _ = run_job("moe_resume", 4, out, json.dumps({"variant": "moe", "runs": plan}))
    assert len(results) == 4 and all("error" not in run for result in results for run in result.values()), results
    return out, results[0]


@pytest.mark.slow
def test_the_checkpoint_holds_every_expert_under_its_global_name_and_shape(runs):
    out, result = runs
    assert result["save"]["losses"] == result["straight"]["losses"][:STOP_AT]
    saved = open_sharded(out / SAVED)
    assert saved.info["layout"]["expert_parallel_size"] == 2 and saved.info["global_step"] == STOP_AT
    tensors = saved.tensors()
    config = MOE_CONFIGS["moe"]
    width, hidden = config.moe.ffn_hidden_size, config.hidden_size
    expert_names = {name for name in tensors if ".mlp.experts." in name}
    expected = set()
    for layer in (0, 1, 3):  # layer 2 is dense
        for expert in range(config.moe.num_experts):
            for part, shape in (("fc", (2 * width, hidden)), ("proj", (hidden, width))):  # fc: gate | up
                parameter = f"model.blocks.{layer}.mlp.experts.{expert}.{part}.weight"
                expected |= {f"state_dict/{parameter}", f"optimizer/0/{parameter}/exp_avg",
                             f"optimizer/0/{parameter}/exp_avg_sq", f"optimizer/0/{parameter}/step"}
                for key in (f"state_dict/{parameter}", f"optimizer/0/{parameter}/exp_avg_sq"):
                    assert tuple(tensors[key].size) == shape, key
                    # written once, by the ranks of the one expert-parallel rank holding it (2 tp halves of the
                    # gate and of the up rows for fc): its boxes tile it exactly
                    chunks = tensors[key].chunks
                    assert sum(chunk.sizes.numel() for chunk in chunks) == torch.Size(shape).numel(), key
                    assert len(chunks) == (4 if part == "fc" else 2), (key, chunks)
    assert expert_names == expected
    weights = torch.load(out / "save.pt", weights_only=True)["weights"]  # the interrupted run's, gathered at step 2
    consolidated = consolidated_state_dict(out / SAVED)
    assert consolidated.keys() == weights.keys()
    assert all(torch.equal(consolidated[name], value) for name, value in weights.items())


def continued_weights(out, result, saving_run: str, resumed_run: str) -> dict:
    """Checks that ``resumed_run`` (resumed from ``saving_run``'s checkpoint at step ``STOP_AT``) sees the samples
    still due and gives the saving run's losses and weights (1e-5); returns its final weights."""
    saving, resumed = result[saving_run], result[resumed_run]
    assert resumed["samples"] == saving["samples"][STOP_AT:], "the resumed run sees the samples still due"
    assert resumed["losses"] == pytest.approx(saving["losses"][STOP_AT:], abs=1e-5)
    final = torch.load(out / f"{resumed_run}.pt", weights_only=True)["weights"]
    expected = torch.load(out / f"{saving_run}.pt", weights_only=True)["weights"]
    assert final.keys() == expected.keys()
    worst = max((final[key] - expected[key]).abs().max().item() for key in expected)
    assert worst < 1e-5, f"weights deviate by {worst:.2e}"
    return final


@pytest.mark.slow
@pytest.mark.parametrize("name", list(RESUMED))
def test_resume_at_another_expert_parallel_size_continues_the_uninterrupted_run(runs, name):
    out, result = runs
    final = continued_weights(out, result, "straight", name)
    if name == "ep2":  # the saving layout: exact
        assert result[name]["losses"] == result["straight"]["losses"][STOP_AT:]
        expected = torch.load(out / "straight.pt", weights_only=True)["weights"]
        assert all(torch.equal(final[key], expected[key]) for key in expected)

    saved_again = consolidated_state_dict(out / f"{name}_final.ckpt")  # this layout saves what it holds
    assert saved_again.keys() == final.keys() and all(torch.equal(saved_again[k], final[k]) for k in final)

    # What each rank holds right after the restore (weights, optimizer state of its experts and ZeRO pieces) is
    # the checkpoint's, box by box, and together the ranks hold all of it.
    saved = read_full_tensors(out / SAVED)
    covered = {key: torch.zeros(value.shape, dtype=torch.bool) for key, value in saved.items()}
    for rank in range(4):
        for key, offsets, piece in torch.load(out / f"{name}_pieces{rank}.pt", weights_only=True):
            region = tuple(slice(o, o + s) for o, s in zip(offsets, piece.shape))
            assert torch.equal(piece, saved[key][region]), (rank, key, offsets)
            covered[key][region] = True
    assert all(covered[key].all() for key in covered), [key for key in covered if not covered[key].all()]


@pytest.mark.slow
@pytest.mark.parametrize("saving_run, resumed_run, family_weight", [
    ("qwen3moe", "qwen3moe-ep4", "model.blocks.0.attn.q_norm.weight"),
    ("mla", "mla-pp2", "model.blocks.3.mlp.router.expert_bias")], ids=["qwen3moe", "deepseek"])
def test_a_qwen3_moe_checkpoint_resumes_at_another_layout(runs, saving_run, resumed_run, family_weight):
    """Qwen3-MoE: saved at ep2 x tp2 x dp2 (each rank a half of its q/k norms' heads, two experts a layer), resumed
    at ep4 x tp1 x dp4. DeepSeek-V3-shaped: saved at ep2 x tp2 x dp2 (latent attention split by heads), resumed at
    pp2 x ep2 x tp1 x dp2 (the dense layer and an MoE one per stage). The steps after it give the saving run's
    losses and weights (``family_weight``: one of the family's own weights, there in both)."""
    out, result = runs
    assert family_weight in continued_weights(out, result, saving_run, resumed_run)


@pytest.mark.slow
def test_a_gpt_oss_checkpoint_holds_the_global_sinks_and_resumes_at_another_layout(runs):
    """Saved at tp2 x ep2 x dp2 (each tp rank half of every layer's sinks, the experts' down-projection biases whole
    on both), the checkpoint holds each layer's sinks under their global name and shape, written in two halves, and
    each expert's biases once; resumed at tp1 x ep4 x dp4 the steps after it give the saving run's losses and
    weights."""
    out, result = runs
    config = MOE_CONFIGS["oss"]
    tensors = open_sharded(out / OSS_SAVED).tensors()
    for layer in range(config.num_layers):
        for key in (f"state_dict/model.blocks.{layer}.attn.sinks", f"optimizer/0/model.blocks.{layer}.attn.sinks/exp_avg"):
            assert tuple(tensors[key].size) == (config.num_heads,), key
            assert sorted(tuple(chunk.offsets) for chunk in tensors[key].chunks) == [(0,), (config.num_heads // 2,)]
    for layer in range(config.num_layers):  # every layer MoE
        for expert in range(config.moe.num_experts):
            bias = tensors[f"state_dict/model.blocks.{layer}.mlp.experts.{expert}.proj.bias"]
            assert tuple(bias.size) == (config.hidden_size,) and len(bias.chunks) == 1
    continued_weights(out, result, "oss", "oss-ep4")
    expected = torch.load(out / "oss.pt", weights_only=True)["weights"]
    assert expected["model.blocks.0.attn.sinks"].abs().min() > 0  # trained: the halves' order is checked too


@pytest.mark.slow
def test_a_finished_run_continued_with_more_steps_reads_the_samples_still_due(runs):
    """A checkpoint saved at the last batch of a max_steps=2 run, resumed with max_steps=4: Lightning starts its next
    epoch, and the sampler goes on from the samples already read (it used to start again at sample 0)."""
    _, result = runs
    assert result["short"]["losses"] == result["straight"]["losses"][:STOP_AT]
    assert result["extended"]["samples"] == result["straight"]["samples"][STOP_AT:]
    assert result["extended"]["losses"] == result["straight"]["losses"][STOP_AT:]


@pytest.mark.slow
def test_the_logged_moe_statistics_are_the_same_at_every_layout(runs):
    """``moe_load_balancing`` and ``moe_z_loss`` (per sequence and per token) are sums of each rank's share over the
    model-parallel ranks (a tp group routing the same tokens counts them once), averaged over dp: the same numbers
    at ep2 x tp2, ep1 x tp2 and ep4 x tp1. ``moe_max_load`` is that of each dp rank's micro-batch: only bounded."""
    _, result = runs
    straight = result["straight"]["statistics"][STOP_AT:]
    for name in RESUMED:
        for got, want in zip(result[name]["statistics"], straight, strict=True):
            assert got[:2] == pytest.approx(want[:2], rel=1e-5), name
    assert all(0.5 < balance < 4 and z > 0 and 1 <= max_load <= 2 for balance, z, max_load in
               result["straight"]["statistics"])  # 2 of 4 experts: at most twice the mean
