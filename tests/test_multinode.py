"""Two "nodes" on this machine: one torchrun per node (``launch_nodes``), ``Trainer(num_nodes=2, devices=2)``.

One run of 4 steps is stopped (as a preempted run is) and resumed across both nodes, and every piece is compared with one single-process run
of the same seed, data and global batch (the core invariant):

* steps 1-2 at tp=2 x dp=2, a c10d rendezvous (node ranks by arrival), ``last.ckpt`` in a shared directory;
  then, in the same processes, a save and a load on node-local directories, which every rank refuses;
* step 3 at the same layout, a static rendezvous (``--node-rank``), ``ckpt_path="last"`` after a crash
  left the replacement of ``last.ckpt`` half done, finished by one of the four processes under the lock;
* step 4 at pp=2 x dp=2 (pipeline stages on different nodes), ``ckpt_path="last"`` again;
* ``ckpt_path="last"`` with node-local checkpoint directories, where node 0 has a ``last.ckpt`` and node 1
  none: every rank refuses at fit start instead of half of them waiting in the load for ever.
"""

import json
import shutil

import lightning as L
import pytest
import torch

from launch import launch_nodes
from workers.trainer_setup import datamodule, model, trainer_kwargs
from lightning_megatron import Megatron3DStrategy
from lightning_megatron.checkpoint import open_sharded
from lightning_megatron.checkpoint.replacement import INFO_FILE, partial_path, replaced_path
from lightning_megatron.checkpoint.shared_storage import check_shards_here
from lightning_megatron.checkpoint.sharded import write_tensors

STEPS, SAVED_AT = 4, 2
SHARED_FIX = "Sharded checkpoints need one directory that every node sees"


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One process, 4 steps: the losses, the final weights, and a checkpoint after step 2."""
    root = tmp_path_factory.mktemp("reference")
    losses = []

    class Record(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            losses.append(float(outputs["loss"]))
            if trainer.global_step == SAVED_AT:
                trainer.save_checkpoint(root / "step2.ckpt")

    L.seed_everything(7)
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=Megatron3DStrategy(), callbacks=[Record()],
                        **{**trainer_kwargs({"steps": STEPS}), "limit_val_batches": 0})
    trainer.fit(model({}), datamodule=datamodule({}))
    return losses, trainer.strategy.full_state_dict(), root / "step2.ckpt"


def replica_losses(results, step_count):
    """Per step, the mean over the dp replicas (the ranks of the last pipeline stage; tp ranks agree)."""
    last_stage = [r for r in results if r["pipeline_rank"] == max(x["pipeline_rank"] for x in results)]
    per_rank = torch.tensor([r["losses"] for r in last_stage])
    assert per_rank.shape == (len(last_stage), step_count)
    return per_rank.mean(0).tolist()


def node_of(results):
    """Global rank -> the launch (the "machine") it runs in."""
    return {r["global_rank"]: r["launch"] for r in results}


@pytest.fixture(scope="module")
def run(tmp_path_factory, reference):
    """Three launches of one training run; the checkpoint directory is shared by both nodes."""
    root = tmp_path_factory.mktemp("multinode")
    shared = root / "shared"
    nodes = [root / "node0", root / "node1"]
    (nodes[0] / "local").mkdir(parents=True)
    shutil.copytree(reference[2], nodes[0] / "local" / "ref.ckpt")  # on node 0's disk only
    first, _ = launch_nodes("multinode.py", 2, 2, root / "first", json.dumps(
        {"tp": 2, "steps": STEPS, "stop_at": SAVED_AT, "dirpath": str(shared), "local_save": "local/after.ckpt",
         "local_load": "local/ref.ckpt"}), cwds=nodes)

    # A crash between the renames of the step-2 save of last.ckpt, and a later save's unfinished leftovers.
    last = shared / "last.ckpt"
    shutil.copytree(last, partial_path(last))
    (partial_path(last) / INFO_FILE).unlink()  # written last: without it a save provably did not finish
    last.rename(replaced_path(last))
    second, second_procs = launch_nodes("multinode.py", 2, 2, root / "second", json.dumps(
        {"tp": 2, "steps": STEPS, "stop_at": SAVED_AT + 1, "dirpath": str(shared), "ckpt_path": "last"}), rendezvous="static")
    third, _ = launch_nodes("multinode.py", 2, 2, root / "third", json.dumps(
        {"tp": 1, "pp": 2, "steps": STEPS, "dirpath": str(shared), "ckpt_path": "last"}))
    return {"root": root, "nodes": nodes, "shared": shared, "first": first, "second": second, "third": third,
            "second_procs": second_procs}


@pytest.mark.slow
def test_tensor_parallel_groups_stay_in_a_node_and_data_parallel_crosses_nodes(run):
    for results in (run["first"], run["second"]):  # tp=2 x dp=2, c10d then static rendezvous
        assert sorted(r["global_rank"] for r in results) == [0, 1, 2, 3]
        node = node_of(results)
        for r in results:
            # Lightning's node rank is the launch's (torchrun's GROUP_RANK), the same for both of its processes.
            assert {x["node_rank"] for x in results if x["launch"] == r["launch"]} == {r["node_rank"]}
            assert r["global_rank"] == 2 * r["node_rank"] + r["local_rank"]
            assert len(r["groups"]["tp"]) == 2 and {node[m] for m in r["groups"]["tp"]} == {r["launch"]}
            assert len(r["groups"]["dp"]) == 2 and {node[m] for m in r["groups"]["dp"]} == {0, 1}
    # The static rendezvous honours --node-rank; c10d numbers the nodes in the order they join.
    assert all(r["node_rank"] == r["launch"] for r in run["second"])
    # pp=2 x dp=2: the stages on different nodes (pp outermost, as Megatron lays it out), dp inside a node.
    node = node_of(run["third"])
    for r in run["third"]:
        assert r["groups"]["tp"] == [r["global_rank"]]
        assert len(r["groups"]["pp"]) == 2 and {node[m] for m in r["groups"]["pp"]} == {0, 1}
        assert len(r["groups"]["dp"]) == 2 and {node[m] for m in r["groups"]["dp"]} == {r["launch"]}


@pytest.mark.slow
def test_two_node_training_saved_and_resumed_at_two_layouts_matches_one_process(run, reference):
    ref_losses, ref_weights, _ = reference
    assert replica_losses(run["first"], SAVED_AT) == pytest.approx(ref_losses[:SAVED_AT], rel=1e-5)
    assert {r["resumed_at"] for r in run["second"]} == {SAVED_AT}
    assert replica_losses(run["second"], 1) == pytest.approx(ref_losses[SAVED_AT:SAVED_AT + 1], rel=1e-5)
    assert {r["resumed_at"] for r in run["third"]} == {SAVED_AT + 1}  # tp=2 -> pp=2, both nodes' shards read
    assert replica_losses(run["third"], 1) == pytest.approx(ref_losses[SAVED_AT + 1:], rel=1e-5)
    weights = torch.load(run["root"] / "third" / "weights.pt", weights_only=True)
    assert weights.keys() == ref_weights.keys()
    worst = max((weights[k] - ref_weights[k]).abs().max().item() for k in ref_weights)
    assert worst < 1e-5, f"weights deviate by {worst:.2e}"
    assert open_sharded(run["shared"] / "last.ckpt").info["global_step"] == STEPS
    assert sorted(p.name for p in run["shared"].iterdir() if not p.name.endswith(".lock")) == ["last.ckpt"]


@pytest.mark.slow
def test_both_nodes_finish_the_interrupted_save_once_under_the_lock(run):
    """Four processes on two nodes start at once; exactly one finds the half-done replacement and finishes it,
    the others find it finished, and all four resume from the same step (checked above)."""
    errors = "".join(proc.stderr for proc in run["second_procs"])
    assert errors.count("lightning-megatron: restored") == 1, errors[-3000:]
    assert errors.count("a save that did not finish") == 1, errors[-3000:]


@pytest.mark.slow
def test_a_save_to_node_local_directories_is_refused_on_every_rank(run):
    node, home = node_of(run["first"]), run["first"][0]["launch"]  # rank 0's node (c10d: whichever joined first)
    other = 1 - home
    for r in run["first"]:
        assert SHARED_FIX in r["errors"]["local_save"], r["errors"]
    owners = [rank for rank in sorted(node) if node[rank] == other]
    assert f"the shards of ranks {owners[0]}, {owners[1]} (node {other}" in run["first"][0]["errors"]["local_save"]
    home_dir, other_dir = run["nodes"][home] / "local", run["nodes"][other] / "local"
    # Nothing took the name; rank 0 removed its unfinished directory, the other node's stays for the next start.
    assert not (home_dir / "after.ckpt").exists() and not partial_path(home_dir / "after.ckpt").exists()
    assert not (other_dir / "after.ckpt").exists()


@pytest.mark.slow
def test_a_load_from_a_node_local_directory_is_refused_on_every_rank(run):
    node = node_of(run["first"])
    sees = [rank for rank in sorted(node) if node[rank] == 0]  # the copy is on node 0's (launch 0's) disk
    blind = [rank for rank in sorted(node) if node[rank] == 1]
    for r in run["first"]:
        error = r["errors"]["local_load"]
        assert f"exists for ranks {sees[0]}, {sees[1]}" in error and f"not for ranks {blind[0]}, {blind[1]}" in error
        assert SHARED_FIX in error


@pytest.mark.slow
def test_resuming_last_from_node_local_directories_is_refused_at_fit_start(reference, tmp_path):
    nodes = [tmp_path / "node0", tmp_path / "node1"]
    shutil.copytree(reference[2], nodes[0] / "ckpts" / "last.ckpt")
    (nodes[1] / "ckpts").mkdir(parents=True)
    results, _ = launch_nodes("multinode.py", 2, 2, tmp_path / "out", json.dumps(
        {"tp": 2, "steps": STEPS, "dirpath": "ckpts", "ckpt_path": "last"}), rendezvous="static", cwds=nodes)
    assert len(results) == 4
    for r in results:
        error = r["errors"]["fit"]
        assert "holds different files on different ranks" in error and "ranks 0, 1 (node 0" in error, error
        assert "ranks 2, 3 (node 1" in error and "an empty directory" in error and SHARED_FIX in error
    assert sorted(p.name for p in (nodes[0] / "ckpts").iterdir() if not p.name.endswith(".lock")) == ["last.ckpt"]


def test_rank_zero_refuses_a_save_whose_shards_are_not_in_its_directory(tmp_path):
    """What a node-local directory looks like to rank 0 before the rename: the index lists a file it lacks."""
    partial = partial_path(tmp_path / "step.ckpt")
    write_tensors(partial, {"weight": torch.arange(6.0)})
    check_shards_here(partial, tmp_path / "step.ckpt", ["node 0 (a)"])  # all there: nothing to say
    shard = next(partial.glob("__*.distcp"))
    shard.rename(tmp_path / shard.name)  # "written on another node's disk"
    with pytest.raises(RuntimeError, match=r"the shards of rank 0 \(node 0 \(a\)\) are not in .*1 of 1 files missing"):
        check_shards_here(partial, tmp_path / "step.ckpt", ["node 0 (a)"])
