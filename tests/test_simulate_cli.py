"""``lightning-megatron simulate`` and ``plan --verify`` end to end on a tiny config (in this process: the simulation
needs no process group of its own making, only a process without one)."""

from __future__ import annotations

import json

import pytest
import yaml

from lightning_megatron.commands.plan import main as plan_main
from lightning_megatron.commands.simulate import main as simulate_main

TINY = {
    "trainer": {"devices": 4, "precision": "bf16-true", "accumulate_grad_batches": 2, "gradient_clip_val": 1.0,
                "strategy": {"class_path": "lightning_megatron.Megatron3DStrategy",
                             "init_args": {"tensor_parallel_size": 2, "sequence_parallel": True, "zero_stage": 1}}},
    "model": {"class_path": "lightning_megatron.models.GPT",
              "init_args": {"config": {"vocab_size": 512, "max_seq_length": 128, "hidden_size": 64, "num_layers": 2,
                                       "num_heads": 4, "dropout": 0.1, "attention_dropout": 0.1},
                            "learning_rate": 3e-4, "min_learning_rate": 3e-05}},
    "data": {"init_args": {"seq_length": 128, "global_batch_size": 4}},
}


@pytest.fixture
def tiny_config(tmp_path):
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(TINY))
    return path


def test_simulated_ranks_match_the_plan(tiny_config, capsys):
    """Every rank that differs (tp2 x dp2: rank 0 and the last data-parallel rank) holds the planner's model state
    byte for byte, and its simulated peak is within 5% of the planned one; the collectives name their groups, and
    the tensor-parallel traffic of sequence parallelism is there (all-gathers and reduce-scatters over tp)."""
    simulate_main(["--config", str(tiny_config), "--json"])
    ranks = json.loads(capsys.readouterr().out)["ranks"]
    assert [r["rank"] for r in ranks] == [0, 2]
    for rank in ranks:
        assert rank["model_state_bytes"] == rank["planned"]["model_state_bytes"]
        assert abs(rank["simulated_peak_bytes"] / rank["planned_peak_bytes"] - 1) <= 0.05, rank
        kinds = {(row["group"], row["kind"]) for row in rank["collectives"]}
        assert {("tp", "all_gather"), ("tp", "reduce_scatter"), ("dp x cp", "reduce_scatter"),
                ("dp x cp", "all_gather")} <= kinds
        assert rank["checkpoint_entries"] > 0 and rank["stand_ins"] >= 1


def test_plan_verify_simulates_the_recommended_layout(tiny_config, capsys):
    plan_main(["--config", str(tiny_config), "--gpus", "2", "--verify", "--top", "1"])
    out = capsys.readouterr().out
    assert "verifying" in out and "simulated peak" in out and "x planned" in out


def test_bad_ranks_are_refused_by_name(tiny_config):
    with pytest.raises(SystemExit, match="rank 9 is outside the world of 4 ranks"):
        simulate_main(["--config", str(tiny_config), "--ranks", "0,9"])
