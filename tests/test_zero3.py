"""ZeRO stage 3 (FSDP2 over dp) composed with tensor parallelism, on 4 real processes.

* Training: tp1-dp4 and tp2-dp2 (with and without sequence parallelism; micro-batches
  reduce-scattered every backward or accumulated unsharded, mean-sized backward) and
  pp2 x dp2 (1F1B) give the single-process losses and weights to the tolerances of
  ``test_layout_invariance.py`` (fp32, AdamW and SGD-momentum, global-norm clipping active).
  The model is built on the meta device and only dp chunks of tp shards are materialised
  (``-pre``: tp shards materialised first); the full state dict gathers and loads back.
* Bytes: each rank's parameter, gradient and Adam-state shards are exactly FSDP's dim-0
  chunks of its tp-local parameters, 4 + 4 + 8 bytes per element: 16 Psi / N, the ZeRO-3
  formula, in fp32 and under bf16 mixed precision (fp32 sharded params = the main params).
"""

import pytest
import torch

from launch import launch
from test_layout_invariance import LOSS_TOL, WEIGHT_TOL, _reference
from workers.gpt_setup import CONFIG, CONFIGS, optimizer, sgd_optimizer
from lightning_megatron.models import GPTModel
from lightning_megatron.optim.zero3 import apply_zero3
from lightning_megatron.parallel import ParallelConfig, ParallelState

LAYOUTS = ["tp2-dp2-sp", "tp1-dp4", "tp2-dp2-pre", "tp1-dp4-mb2-nosync-sgd", "tp2-dp2-sp-mb2-sgd", "pp2-tp1-dp2-mb2",
           "llama-tp2-dp2-sp", "mqa-tp2-dp2",  # Llama-shaped: key/value groups split over tp2; replicated (multi-query)
           "moe-tp2-dp2-sp",  # Mixture of Experts (ep1: every rank holds every expert, FSDP shards them over dp)
           "llama-tp2-dp2-sp-tpo"]  # tp_comm_overlap: FSDP's gathered weights in the overlapped linears


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("zero3")
    results, _ = launch("zero3_training.py", 4, out, ",".join(["bytes", *LAYOUTS]))
    return out, results


@pytest.mark.parametrize("make_optimizer", [optimizer, sgd_optimizer], ids=["adamw", "sgd"])
def test_zero3_matches_single_process(run, make_optimizer):
    out, results = run
    references = {name: _reference(make_optimizer, config) for name, config in CONFIGS.items()}
    layouts = [layout for layout in LAYOUTS if layout.endswith("-sgd") == (make_optimizer is sgd_optimizer)]
    for layout in layouts:
        ref_losses, ref_weights = references[layout.split("-")[0] if layout.split("-")[0] in CONFIGS else "gpt"]
        result = torch.load(out / f"{layout}.pt", weights_only=True)
        assert len(result["losses"]) == len(ref_losses)
        loss_dev = max(abs(a - b) for a, b in zip(result["losses"], ref_losses))
        assert loss_dev < LOSS_TOL, f"{layout}: losses {result['losses']} vs reference {ref_losses}"
        assert result["weights"].keys() == ref_weights.keys()
        weight_dev = {k: (result["weights"][k] - ref_weights[k]).abs().max().item() for k in ref_weights}
        worst = max(weight_dev, key=weight_dev.get)
        print(f"{layout}: worst loss deviation {loss_dev:.2e}, worst weight deviation {weight_dev[worst]:.2e} ({worst})")
        assert weight_dev[worst] < WEIGHT_TOL, f"{layout}: {worst} deviates by {weight_dev[worst]:.2e}"
        for rank in results:  # every dp rank logged the same global loss
            assert rank[layout]["losses"] == pytest.approx(result["losses"], abs=1e-6)


def test_full_state_dict_round_trips(run):
    _, results = run
    assert all(rank[LAYOUTS[0]]["load_ok"] for rank in results)


@pytest.mark.parametrize("layout", ["tp1-dp4", "tp2-dp2"])
@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
def test_model_state_bytes_are_16_psi_over_n(run, layout, precision):
    """Psi tp-local params, N = dp: fp32 param shards 4Psi/N + fp32 grad shards 4Psi/N + Adam 8Psi/N."""
    _, results = run
    entries = [rank["bytes"][f"{layout}-{precision}"] for rank in results]
    psi, n = entries[0]["psi"], entries[0]["dp"]
    for entry in entries:
        sizes, chunk = entry["bytes"], entry["chunked_numel"]
        assert sizes == {"parameters": 4 * chunk, "gradients": 4 * chunk, "optimizer_state": 8 * chunk}, entry
        print(f"{layout} {precision}: {sum(sizes.values())} bytes per rank, 16 Psi / N = {16 * psi / n:.0f}")
        assert sum(sizes.values()) == pytest.approx(16 * psi / n, abs=16 * n)  # FSDP chunking; here it divides
        assert entry["grad_dtypes"] == ["torch.float32"]
        # Layers see plain tensors of the tp-local shape, in the compute dtype.
        assert entry["forward_weight"] == ["Tensor", "torch.bfloat16" if precision == "bf16-mixed" else "torch.float32"]
    for tp_rank in range(len(results) // n):  # summed over the dp ranks of one tp rank: exactly 16 Psi
        group = entries[tp_rank::len(results) // n]
        assert sum(sum(e["bytes"].values()) for e in group) == 16 * group[0]["psi"]


def test_zero3_needs_a_mesh():
    with torch.device("meta"):
        model = GPTModel(CONFIG)
    with pytest.raises(ValueError, match="needs torch.distributed"):
        apply_zero3(model, ParallelState(ParallelConfig(), torch.device("cpu")), layers_pattern="blocks.*")
