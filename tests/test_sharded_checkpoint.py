"""Sharded checkpoints: saved at (tp=2, pp=2, dp=2, ZeRO-1), resumed at other layouts, damaged on purpose."""

import json
import math
import shutil

import pytest
import torch

from launch import run_job
from lightning_megatron.checkpoint import consolidated_state_dict, open_sharded, read_full_tensors
from lightning_megatron.checkpoint.pieces import Placement, flat_range_boxes
from lightning_megatron.parallel.shards import TensorShard

SAVE = {"tp": 2, "pp": 2, "zero_stage": 1, "layers": 4, "steps": 4, "save_every": 2, "snapshot_step": 2, "async": True}
STEP2 = "checkpoints/epoch=0-step=2.ckpt"
STEP4 = "checkpoints/epoch=0-step=4.ckpt"


@pytest.mark.parametrize("shape", [(7,), (3, 4), (2, 3, 4)])
def test_flat_range_boxes_cover_each_element_of_the_range_once(shape):
    numel = math.prod(shape)
    for start in range(numel + 1):
        for stop in range(start, numel + 1):
            hits = torch.zeros(shape, dtype=torch.long)
            for box in flat_range_boxes(shape, start, stop):
                region = tuple(slice(o, o + s) for o, s in zip(box.offsets, box.sizes))
                hits[region] += 1
                assert torch.arange(numel).view(shape)[region].flatten()[0] == box.flat_start
            expected = torch.zeros(numel, dtype=torch.long)
            expected[start:stop] = 1
            assert torch.equal(hits.flatten(), expected), (start, stop)


def test_placement_offsets_tensor_parallel_shards_and_drops_vocab_padding():
    # A (5, 2) embedding padded to 8 rows over tp=2: rank 1 holds rows 4..7, of which only row 4 is real.
    shard = TensorShard(dim=0, global_shape=(5, 2), padded_size=8, rank=1, world=2)
    local = torch.arange(8.0).view(4, 2)
    views = Placement((5, 2), shard).views(local)
    assert list(views) == [(4, 0)] and torch.equal(views[(4, 0)], local[:1])
    # ZeRO pieces are flat ranges of the shard. Rank 0's elements 3..6: half a row, a row, half a row.
    rank0 = TensorShard(dim=0, global_shape=(5, 2), padded_size=8, rank=0, world=2)
    views = Placement((5, 2), rank0, 3, 7).views(torch.arange(4.0))
    assert {k: v.tolist() for k, v in views.items()} == {(1, 1): [[0.0]], (2, 0): [[1.0, 2.0]], (3, 0): [[3.0]]}
    # Rank 1's elements 1..4 reach into the padding (global rows 5 and up), which is not saved.
    views = Placement((5, 2), shard, 1, 5).views(torch.arange(4.0))
    assert {k: v.tolist() for k, v in views.items()} == {(4, 1): [[0.0]]}


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
    """4 steps at (tp=2, pp=2, dp=2, ZeRO-1), sharded checkpoints after steps 2 and 4, written in the background."""
    out = tmp_path_factory.mktemp("saved")
    results, _ = run_job("checkpoint_layouts", 8, out, json.dumps(SAVE))
    return out, results[0]["losses"], torch.load(out / "weights.pt", weights_only=True)


@pytest.mark.slow
def test_each_rank_writes_its_own_shards_of_the_saved_weights(saved_run):
    out, _, _ = saved_run
    saved = open_sharded(out / STEP2)
    assert saved.info["layout"]["tensor_parallel_size"] == 2 and saved.info["global_step"] == 2
    files = {item.relative_path for item in saved.index.storage_data.values()}
    assert len(files) == 8, files
    qkv = saved.tensors()["state_dict/model.blocks.0.attn.qkv.weight"]
    assert len(qkv.chunks) == 2  # one per tensor-parallel rank, written once although dp=2 holds two copies
    expected = torch.load(out / "weights_step2.pt", weights_only=True)
    consolidated = consolidated_state_dict(out / STEP2)
    assert consolidated.keys() == expected.keys()
    for name, value in expected.items():
        assert torch.equal(consolidated[name], value), name


LOADS = {  # (tp, pp, virtual pp, zero_stage, context parallel, optimizer offload tier): world size
    (2, 2, 1, 1, 1, "none"): 8,  # the saving layout: exact
    (1, 1, 1, 0, 1, "none"): 1,
    (4, 1, 1, 2, 1, "nvme"): 8,  # the optimizer state read into the 'nvme' tier's files in place, and saved from them
    (1, 2, 2, 1, 1, "none"): 4,  # interleaved: each rank holds layers 0 and 2 or 1 and 3; ZeRO-1 over dp2
    (2, 1, 1, 3, 2, "none"): 4,  # tp2 x cp2, ZeRO-3: FSDP over the 2 context-parallel replicas, each batch cut by the strategy
}


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LOADS), ids=[f"tp{t}-pp{p}-vpp{v}-zero{z}-cp{c}" + (f"-{o}" if o != "none" else "")
                                                     for t, p, v, z, c, o in LOADS])
def test_resume_at_another_layout_continues_the_same_run(saved_run, layout, tmp_path):
    out, straight_losses, straight_weights = saved_run
    tp, pp, vpp, zero, cp, offload = layout
    world = LOADS[layout]
    options = {"tp": tp, "pp": pp, "vpp": vpp, "zero_stage": zero, "cp": cp, "layers": 4, "steps": 4,
               "ckpt_path": str(out / STEP2), "offload": offload if offload != "none" else False}
    results, _ = run_job("checkpoint_layouts", world, tmp_path, json.dumps(options))
    assert all("error" not in r for r in results), results
    losses = results[0]["losses"]
    weights = torch.load(tmp_path / "weights.pt", weights_only=True)
    if layout == (2, 2, 1, 1, 1):
        assert losses == straight_losses[2:]
        assert all(torch.equal(weights[k], straight_weights[k]) for k in straight_weights)
    else:
        assert losses == pytest.approx(straight_losses[2:], abs=1e-5)
        worst = max((weights[k] - straight_weights[k]).abs().max().item() for k in straight_weights)
        assert worst < 1e-5, f"weights deviate by {worst:.2e}"

    final = consolidated_state_dict(tmp_path / "final.ckpt")  # and this layout saves what it holds
    assert final.keys() == weights.keys() and all(torch.equal(final[k], weights[k]) for k in weights)
    if offload != "none":
        # Saved from the offload tier's files: the same tensors, under the same keys, as the saving run's own step-4
        # checkpoint made without offload, so either loads wherever the other does.
        # Its fp32 main parameters are copies (saved too, equal to the fp32 weights); the rest is the same set of keys.
        ours, theirs = read_full_tensors(tmp_path / "final.ckpt"), read_full_tensors(out / STEP4)
        mains = {key for key in ours.keys() - theirs.keys() if key.startswith("main_params/")}
        assert ours.keys() - mains == theirs.keys() and mains
        assert all(torch.equal(ours[key], ours[key.replace("main_params/", "state_dict/", 1)]) for key in mains)
        worst = max((ours[k].double() - theirs[k].double()).abs().max().item() for k in theirs)
        assert worst < 1e-5, f"the offloaded run's checkpoint deviates by {worst:.2e}"
        assert not list((tmp_path / "offload").iterdir()), "the 'nvme' tier's files outlived the run"

    # What each rank holds right after the restore (weights, optimizer state) is the checkpoint's, box by box,
    # and together the ranks hold all of it.
    saved = read_full_tensors(out / STEP2)
    covered = {key: torch.zeros(value.shape, dtype=torch.bool) for key, value in saved.items()}
    for rank in range(world):
        for key, offsets, piece in torch.load(tmp_path / f"pieces{rank}.pt", weights_only=True):
            if key not in saved and key.startswith("main_params/"):  # a copy the saving run did not need: its weights
                key = key.replace("main_params/", "state_dict/", 1)
            region = tuple(slice(o, o + s) for o, s in zip(offsets, piece.shape))
            assert torch.equal(piece, saved[key][region]), (rank, key, offsets)
            covered[key][region] = True
    optimizer_keys = [key for key in saved if key.startswith("optimizer/")]
    assert any(key.endswith("/exp_avg_sq") for key in optimizer_keys)
    assert all(covered[key].all() for key in covered), [key for key in covered if not covered[key].all()]


@pytest.mark.slow
def test_a_missing_shard_stops_every_rank_with_the_file_named(saved_run, tmp_path):
    out, _, _ = saved_run
    damaged = tmp_path / "damaged.ckpt"
    shutil.copytree(out / STEP2, damaged)
    (damaged / "__5_0.distcp").unlink()
    options = {"tp": 2, "pp": 1, "zero_stage": 3, "layers": 4, "steps": 4, "ckpt_path": str(damaged)}
    results, _ = run_job("checkpoint_layouts", 2, tmp_path / "run", json.dumps(options))
    assert len(results) == 2
    for result in results:  # no rank hangs in a collective waiting for one that gave up
        assert "__5_0.distcp is missing" in result["error"], result


@pytest.mark.slow
def test_full_checkpoint_gathers_on_rank_zero_alone(tmp_path):
    """checkpoint_format="full" gathers onto rank 0, piece by piece: what it saves is what the every-rank gather
    saved (tensor by tensor, at tp2 x pp2 with a tied embedding, pp2 x dp2, and Llama tp2 x dp2 under ZeRO-3), and
    the other ranks get nothing back and allocate no tensor data (the every-rank gather built the whole state on
    each)."""
    layouts = ["tp2-pp2", "pp2-dp2", "llama-tp2-dp2-zero3"]
    results, _ = run_job("full_gather", 4, tmp_path, ",".join(layouts))
    for layout in layouts:
        new = torch.load(tmp_path / f"{layout}-new.pt", weights_only=True)
        old = torch.load(tmp_path / f"{layout}-old.pt", weights_only=True)
        assert list(new) == list(old), layout
        for name in old:
            assert new[name].dtype == old[name].dtype and torch.equal(new[name], old[name]), (layout, name)
        report = [rank[layout] for rank in results]
        print(layout, [(r["new_bytes"], r["old_bytes"], r["own_bytes"], r["full_bytes"]) for r in report])
        assert report[0]["new_bytes"] >= report[0]["full_bytes"]  # rank 0 holds the state
        for rank in report[1:]:
            assert rank["new_keys"] == 0 and rank["new_bytes"] == 0, (layout, rank)
            assert rank["old_bytes"] > rank["own_bytes"]  # the every-rank gather: copies of every rank's pieces


@pytest.mark.slow
def test_multi_token_prediction_checkpoint_resumes_at_another_layout(tmp_path):
    """A model with multi-token prediction saved at pp2 x dp2 (the depths and the last stage's tied copy of the
    embedding on stage 1) resumes at tp2 (the depths split over tp, one embedding): the same main and MTP losses
    (the Trainer's logged ``mtp_loss``) and weights as the run that went straight on."""
    save = {"tp": 1, "pp": 2, "zero_stage": 1, "layers": 2, "steps": 4, "save_every": 2, "mtp": 1}
    straight, _ = run_job("checkpoint_layouts", 4, tmp_path / "save", json.dumps(save))
    resume = {"tp": 2, "pp": 1, "zero_stage": 0, "layers": 2, "steps": 4, "mtp": 1,
              "ckpt_path": str(tmp_path / "save" / STEP2)}
    resumed, _ = run_job("checkpoint_layouts", 2, tmp_path / "resume", json.dumps(resume))
    assert all("error" not in r for r in straight + resumed), resumed
    assert len(straight[0]["mtp_losses"]) == 4 and straight[0]["mtp_losses"] != straight[0]["losses"]
    assert resumed[0]["losses"] == pytest.approx(straight[0]["losses"][2:], abs=1e-5)
    assert resumed[0]["mtp_losses"] == pytest.approx(straight[0]["mtp_losses"][2:], abs=1e-5)
    expected = torch.load(tmp_path / "save" / "weights.pt", weights_only=True)
    weights = torch.load(tmp_path / "resume" / "weights.pt", weights_only=True)
    assert weights.keys() == expected.keys() and any(k.startswith("model.mtp.depths.") for k in weights)
    worst = max((weights[k] - expected[k]).abs().max().item() for k in expected)
    assert worst < 1e-5, f"weights deviate by {worst:.2e}"
