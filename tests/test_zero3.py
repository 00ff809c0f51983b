"""ZeRO stage 3 (FSDP2 over dp) composed with tensor parallelism, on 4 real processes.

* Training: tp1-dp4 and tp2-dp2 (with and without sequence parallelism; micro-batches
  reduce-scattered every backward or accumulated unsharded, mean-sized backward) and
  pp2 x dp2 (1F1B) give the single-process losses and weights to the tolerances of
  ``test_layout_invariance.py`` (fp32, AdamW and SGD-momentum, global-norm clipping active).
  The model is built on the meta device and only dp chunks of tp shards are materialised
  (``-pre``: tp shards materialised first); the full state dict gathers and loads back.
* Bytes: each rank's parameter, gradient and Adam-state shards are exactly FSDP's dim-0
  chunks of its tp-local parameters, 4 + 4 + 8 bytes per element: 16 Psi / N, the ZeRO-3
  formula, in fp32 and under bf16 mixed precision (fp32 sharded params = the main params),
  also with ``offload_parameters="cpu"`` (the same bytes, in host memory).
* Parameter offload (``offload_parameters="cpu"``, FSDP's ``CPUOffloadPolicy``) at tp2-dp2-sp: every FSDP
  group carries the policy, shards, gradients and Adam state are on the CPU, and the run matches the
  single process and, bit for bit, the same layout without offload (on this CPU-only machine the
  "device" is the CPU too). A sharded checkpoint saved from it loads at tp2-dp2 ZeRO-1 without offload,
  every piece as saved.
* LoRA (``-lora``): FSDP2 groups that mix the frozen base with the trained adapters (FSDP2 asks one dtype of the
  trained parameters only); the adapters match the single process, the base is unchanged and holds no gradient
  or optimizer state.
"""

import pytest
import torch

from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

from launch import run_job
from test_layout_invariance import _check_lora, _deviations, _reference
from workers.buffer_setup import BufferedGPT
from workers.gpt_setup import CLIP, CONFIG, CONFIGS, LLAMA_CONFIG, LORA, SEED, batches, optimizer, sgd_optimizer
from lightning_megatron.checkpoint import consolidated_state_dict, read_full_tensors
from lightning_megatron.models import GPTModel
from lightning_megatron.offload.settings import OffloadSettings
from lightning_megatron.optim.zero3 import apply_zero3, offload_policy
from lightning_megatron.parallel import ParallelConfig, ParallelState

LAYOUTS = ["tp2-dp2-sp", "tp1-dp4", "tp2-dp2-pre", "tp1-dp4-mb2-nosync-sgd", "tp2-dp2-sp-mb2-sgd", "pp2-tp1-dp2-mb2",
           "llama-tp2-dp2-sp", "mqa-tp2-dp2",  # Llama-shaped: key/value groups split over tp2; replicated (multi-query)
           "moe-tp2-dp2-sp",  # Mixture of Experts (ep1: every rank holds every expert, FSDP shards them over dp)
           "llama-tp2-dp2-sp-tpo",  # tp_comm_overlap: FSDP's gathered weights in the overlapped linears
           # The chunked loss: the head's weight gathered by the root (pp1) or by the head's own FSDP unit (pp2).
           "chunk-tp2-dp2-sp", "chunk-pp2-tp1-dp2-mb2",
           "tp2-dp2-sp-cpu-ckpt",  # offload_parameters="cpu"; then a checkpoint saved, resumed at ZeRO-1
           # FP8 (FSDP gathers the fp32 weights, the layers cast them), against one process running the same pieces
           # of the batch, their first step (conftest.FP8_REFERENCES; test_layout_invariance.py says why).
           "tp1-dp4-fp8t-s1", "pp2-tp1-dp2-mb2-fp8r-s1", "tp2-dp2-sp-fp8t-s1",
           # LoRA: FSDP2 groups holding the frozen base and the trained adapters; only the adapters step.
           "llama-tp2-dp2-sp-lora",
           # Gemma's zero-centred norms start at zero under ZeRO-3's meta initialisation too (parallel.initialize's
           # rule_for); its four norms, GeGLU, scaled embedding and soft-capped head through FSDP's gathers.
           "gemma-tp2-dp2-sp"]
FP8_SINGLE = {"tp1-dp4-fp8t-s1": "tp1-dp1-mb4-fp8t-s1", "pp2-tp1-dp2-mb2-fp8r-s1": "tp1-dp1-mb4-fp8r-s1",
              "tp2-dp2-sp-fp8t-s1": "tp1-dp1-mb2-fp8t-s1"}
OFFLOADED = "tp2-dp2-sp-cpu-ckpt"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("zero3")
    results, _ = run_job("zero3_training", 4, out, ",".join(["bytes", *LAYOUTS]))
    return out, results


@pytest.mark.slow
@pytest.mark.parametrize("make_optimizer", [optimizer, sgd_optimizer], ids=["adamw", "sgd"])
def test_zero3_matches_single_process(run, make_optimizer, fp8_reference):
    out, results = run
    # chunk-: the chunked loss against the unchunked model's reference.
    references = {name: _reference(make_optimizer, config) for name, config in CONFIGS.items()
                  if name not in ("chunk", "gemmachunk")}
    layouts = [layout for layout in LAYOUTS if layout.endswith("-sgd") == (make_optimizer is sgd_optimizer)]
    for layout in layouts:
        if layout in FP8_SINGLE:
            ref_losses, ref_weights = fp8_reference[FP8_SINGLE[layout]]
        elif layout.endswith("-lora"):
            ref_losses, ref_weights = _reference(make_optimizer, LLAMA_CONFIG, lora=LORA)
            _check_lora(layout, 4, torch.load(out / f"{layout}.pt", weights_only=True), out)
        else:
            ref_losses, ref_weights = references.get(layout.split("-")[0], references["gpt"])
        result = torch.load(out / f"{layout}.pt", weights_only=True)
        _deviations(result, ref_losses, ref_weights, layout)
        for rank in results:  # every dp rank logged the same global loss
            assert rank[layout]["losses"] == pytest.approx(result["losses"], abs=1e-6)


@pytest.mark.slow
def test_full_state_dict_round_trips(run):
    _, results = run
    assert all(rank[LAYOUTS[0]]["load_ok"] for rank in results)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["tp1-dp4", "tp2-dp2"])
@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed", "bf16-mixed-cpu"])
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
        assert entry["forward_weight"] == ["Tensor", "torch.float32" if precision == "fp32" else "torch.bfloat16"]
    for tp_rank in range(len(results) // n):  # summed over the dp ranks of one tp rank: exactly 16 Psi
        group = entries[tp_rank::len(results) // n]
        assert sum(sum(e["bytes"].values()) for e in group) == 16 * group[0]["psi"]


def test_zero3_needs_a_mesh():
    with torch.device("meta"):
        model = GPTModel(CONFIG)
    with pytest.raises(ValueError, match="needs torch.distributed"):
        apply_zero3(model, ParallelState(ParallelConfig(), torch.device("cpu")), layers_pattern="blocks.*")


@pytest.mark.slow
def test_cpu_parameter_offload_is_configured_and_changes_no_result(run):
    out, results = run
    for rank in results:
        assert rank[OFFLOADED]["offload"] == {"policies": ["CPUOffloadPolicy"], "params": ["cpu"], "grads": ["cpu"],
                                              "optimizer_state": ["cpu"]}
        assert rank["tp2-dp2-sp"]["offload"]["policies"] == ["OffloadPolicy"]
    offloaded = torch.load(out / f"{OFFLOADED}.pt", weights_only=True)
    plain = torch.load(out / "tp2-dp2-sp.pt", weights_only=True)
    assert offloaded["losses"] == plain["losses"]
    assert all(torch.equal(offloaded["weights"][k], plain["weights"][k]) for k in plain["weights"])


@pytest.mark.slow
def test_checkpoint_saved_with_cpu_offload_resumes_at_zero1(run):
    out, results = run
    path = out / f"{OFFLOADED}.ckpt"
    weights = torch.load(out / f"{OFFLOADED}.pt", weights_only=True)["weights"]
    consolidated = consolidated_state_dict(path)
    assert consolidated.keys() == weights.keys()
    assert all(torch.equal(consolidated[k], weights[k]) for k in weights)
    saved = read_full_tensors(path)
    covered = {key: torch.zeros(value.shape, dtype=torch.bool) for key, value in saved.items()}
    for rank in range(len(results)):
        for key, offsets, piece in torch.load(out / f"{OFFLOADED}-resumed{rank}.pt", weights_only=True):
            region = tuple(slice(o, o + s) for o, s in zip(offsets, piece.shape))
            assert torch.equal(piece, saved[key][region]), (rank, key, offsets)
            covered[key][region] = True
    assert any(key.endswith("/exp_avg_sq") for key in saved)
    assert all(covered[key].all() for key in covered), [key for key in covered if not covered[key].all()]


def test_offload_policy_per_tier():
    assert type(offload_policy(OffloadSettings(), "cuda")) is OffloadPolicy
    assert offload_policy(OffloadSettings(parameters="cpu"), "cuda") == CPUOffloadPolicy(pin_memory=True)
    assert offload_policy(OffloadSettings(parameters="cpu"), "cpu") == CPUOffloadPolicy(pin_memory=False)  # no GPU
    with pytest.raises(ValueError, match="offload_parameters='cpu'.*offload_optimizer='nvme'"):
        OffloadSettings.from_options(offload_parameters="nvme", zero_stage=3)  # refused where it is normalised


@pytest.mark.slow
def test_user_buffers_keep_their_values_under_zero3(tmp_path):
    """ZeRO-3 empties the module (``to_empty``: stale device memory on CUDA, NaN here with the deterministic fill)
    to materialise its meta parameters' shards; a user's buffers that hold values (persistent or not) must come
    back as they were: dp2 ZeRO-3 gives the losses of one process without ZeRO, with no NaN."""
    results, _ = run_job("zero3_buffers", 2, tmp_path)
    torch.manual_seed(SEED)
    model = BufferedGPT(CONFIG)
    opt = optimizer(list(model.parameters()))
    reference = []
    for input_ids, labels in batches()[:3]:
        loss_sum, tokens = model.loss(input_ids, labels)
        (loss_sum / tokens).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
        reference.append((loss_sum / tokens).item())
    assert results[0]["losses"] == pytest.approx(reference, abs=1e-5)


def test_meta_buffers_nobody_fills_are_refused_by_zero3():
    """A buffer left on the meta device with no ``initialize_buffers()`` to fill it has no value anywhere: refused,
    naming it, before anything is allocated (``to_empty`` would hand it uninitialised memory), as without ZeRO-3."""
    from lightning_megatron.optim.zero3 import _real_buffers

    with torch.device("meta"):
        model = GPTModel(CONFIG)
        model.blocks["0"].register_buffer("table", torch.ones(4))
    with pytest.raises(RuntimeError, match=r"Buffers \['blocks.0.table'\] are on the meta device and no "
                                           r"initialize_buffers\(\) of their module fills them"):
        _real_buffers(model)
