"""The core invariant: every layout gives the single-process losses and weights (fp32, dropout off)."""

import json

import pytest
import torch

from launch import run_job
from workers.gpt_setup import (CLIP, CONFIG, DEEP_CONFIG, GEMMA3_CONFIG, GEMMA_CONFIG, LLAMA_CONFIG, LORA, MTP_CONFIG,
                               QWEN3_CONFIG, SEED, batches, document_batches, optimizer, sgd_optimizer)
from lightning_megatron.models import GPTModel
from lightning_megatron.parallel.names import is_adapter_name
from lightning_megatron.peft.lora import apply_lora

LAYOUTS = {
    2: ["tp2-dp1", "tp2-dp1-sp-mb2", "tp1-dp2-mb2", "pp2-tp1-dp1-mb4", "pp2-tp1-dp1-mb4-gpipe",
        "pp2-vpp2-tp1-dp1-mb4", "tp1-dp2-z1", "tp1-dp2-mb2-z2", "tp1-dp2-z1-sgd", "tp1-dp2-z2-sgd"],
    4: ["tp2-dp2", "tp2-dp2-sp-mb2", "tp4-dp1", "tp4-dp1-sp", "pp4-tp1-dp1-mb8", "pp2-tp2-dp1-sp-mb2",
        "pp2-tp1-dp2-mb2", "tp1-dp4-z1", "tp1-dp4-mb2-z2-sgd", "tp2-dp2-sp-z1", "tp2-dp2-z2", "pp2-tp1-dp2-mb2-z1"],
    8: ["pp2-tp2-dp2-mb2", "pp2-vpp2-tp2-dp2-sp-mb4", "pp2-tp2-dp2-sp-mb2-z2"],
}
# The Llama-shaped model in the same jobs (2 key/value groups: tp2 splits them, tp4 replicates each on 2 ranks).
LAYOUTS[2] += ["llama-tp2-dp1", "llama-tp2-dp1-sp-mb2", "llama-pp2-tp1-dp1-mb4", "llama-pp2-vpp2-tp1-dp1-mb4",
               "llama-tp1-dp2-z1"]
LAYOUTS[4] += ["llama-tp4-dp1", "llama-tp4-dp1-sp-mb2", "llama-tp2-dp2-sp-z1", "llama-pp2-tp2-dp1-sp-mb2",
               "llama-tp1-dp4-mb2-z2"]
# Packed samples with Megatron-LM's document masks (learned and rotary positions restarting per document).
LAYOUTS[2] += ["doc-tp2-dp1-sp-mb2", "doc-pp2-tp1-dp1-mb4", "llama-doc-tp1-dp2-z1"]
LAYOUTS[4] += ["llama-doc-pp2-tp2-dp1-sp-mb2", "doc-tp2-dp2-z2"]
# Zero-bubble schedules: the backward split into input- and weight-gradient passes (the weight pass must reach the dp
# buckets and ZeRO); ZB-V and DualPipeV put the first and last stage, hence both uses of the tied embedding, on rank 0.
LAYOUTS[2] += ["pp2-tp1-dp1-mb4-zb", "pp2-vpp2-tp1-dp1-mb4-zbv", "llama-pp2-vpp2-tp1-dp1-mb4-dualpipev"]
LAYOUTS[4] += ["pp2-vpp2-tp1-dp2-mb2-zbv-z1", "pp2-vpp2-tp1-dp2-mb4-dualpipev-z2", "llama-pp2-vpp2-tp2-dp1-sp-mb2-zbv"]
LAYOUTS[8] += ["pp4-tp1-dp2-mb4-zb-z1", "deep-pp4-vpp2-tp1-dp2-mb4-zbv-z2"]
# The chunked loss (head and cross-entropy fused, 7 tokens at a time) against the unchunked reference: tp2 + SP (its
# per-chunk gathers), pp2 (the last stage hands the final norm's output to the loss), tp2 x dp2, with ZeRO-1 + SP.
LAYOUTS[2] += ["chunk-tp2-dp1-sp-mb2", "chunk-pp2-tp1-dp1-mb4"]
LAYOUTS[4] += ["chunk-tp2-dp2", "chunk-tp2-dp2-sp-z1"]
# ZeRO 1/2 with the parameter all-gathers overlapped with the next forward (overlap_param_gather).
LAYOUTS[2] += ["tp1-dp2-z1-ogather", "tp1-dp2-mb2-z2-ogather"]
LAYOUTS[4] += ["tp2-dp2-sp-z1-ogather", "tp2-dp2-z2-ogather", "pp2-tp1-dp2-mb2-z1-ogather", "pp2-tp1-dp2-mb2-z2-ogather"]
# tp_comm_overlap (the sequence-parallel collectives overlapped with the GEMMs), next to the same layout without it.
# GPT and Llama at tp2; at tp4 the Llama model's key/value heads are replicated; GPT under pp2.
LAYOUTS[2] += ["tp2-dp1-sp-mb2-tpo", "llama-tp2-dp1-sp-mb2-tpo"]
LAYOUTS[4] += ["llama-tp4-dp1-sp-mb2-tpo", "pp2-tp2-dp1-sp-mb2-tpo"]
# Regional compilation (every layer's forward compiled once for all 4), with sequence parallelism and full
# recomputation of the compiled layers, at tp1-dp2 and at pp2. The aot_eager backend: dynamo's and AOT autograd's
# tracing of our autograd functions and collectives, forward and backward, without inductor's code generation,
# which costs ~2 minutes on 2 busy cores for a layer's 6 graphs (~3 s here). Inductor at tp2-sp with recomputation
# ("-compile-rc") passes at the same 1e-5 (its fused fp32 kernels: 1.3e-7 worst weight deviation, eager 1.1e-7).
COMPILE_LAYOUTS = ["tp2-dp1-sp-mb2-compile_aot-rc", "tp1-dp2-compile_aot", "pp2-tp1-dp1-mb4-compile_aot"]
LAYOUTS[2] += COMPILE_LAYOUTS
# AdamW's fused and multi-tensor kernels on the fp32 pieces of the distributed optimizer (ZeRO-1, dp2), against the
# reference's for-loop AdamW: fused rounds differently (about 1e-7 after 10 steps of a lone AdamW), within 1e-5.
LAYOUTS[2] += ["tp1-dp2-z1-fused", "tp1-dp2-mb2-z2-foreach"]
# The fp32 main parameters and AdamW's state offloaded to host memory (cpu) or to files stepped in tiles (nvme), at
# ZeRO-1 and 2 with tp2 (+SP), and without ZeRO under pp2: each bit for bit its twin (the same layout without offload
# where that steps fp32 main pieces too; without ZeRO the plain layout steps the parameters themselves, and its
# gradient norm, summed over other tensor shapes, may differ in the last bit: there the cpu tier is the twin).
OFFLOAD_TWINS = {2: {"pp2-tp1-dp1-mb4-offcpu": None, "pp2-tp1-dp1-mb4-offnvme": "pp2-tp1-dp1-mb4-offcpu",
                     "tp1-dp2-mb2-z2-offcpu": "tp1-dp2-mb2-z2"},
                 4: {"tp2-dp2-sp-z1-offcpu": "tp2-dp2-sp-z1", "tp2-dp2-sp-z1-offnvme": "tp2-dp2-sp-z1",
                     "tp2-dp2-z2-offcpu": "tp2-dp2-z2", "tp2-dp2-z2-offnvme": "tp2-dp2-z2"}}
for _world, _twins in OFFLOAD_TWINS.items():
    LAYOUTS[_world] += list(_twins)
# FP8 (tensorwise "t", rowwise "r"), each against one process running the same pieces of the global batch (dp ranks x
# micro-batches) one after another in fp8: a tensorwise scale is a function of the piece it is computed on. The scales
# are then the same at every layout (amaxes reduced over tp), and so is the first step, to 1e-7. But a layout adds in
# another fp32 order (tp's partial sums, dp's gradient reduction, ZeRO's sharded norm) and once such a last-bit
# difference lands on an fp8 rounding boundary, one element rounds the other way (a 6% step of e4m3) and the runs part
# at the fp8 level: measured from the second or third step's backward (the losses still equal), 1e-5..6e-4 apart in
# the weights by step 5, at tp2 and at dp4 alike, a tenth to a hundredth of what fp8 itself changes. No layout-free
# scale can avoid that. So fp8 layouts compare their first step ("-s1": forward, backward, gradient reduction,
# clipping, optimizer step) to the same 1e-5 as every other layout; without the tp reduction of the amaxes the first
# forward already differs (tests/test_fp8.py).
FP8_LAYOUTS = {2: {"tp2-dp1-sp-mb2-fp8t-s1": "tp1-dp1-mb2-fp8t-s1", "pp2-tp1-dp1-mb4-fp8t-s1": "tp1-dp1-mb4-fp8t-s1",
                   "tp1-dp2-z1-fp8r-s1": "tp1-dp1-mb2-fp8r-s1", "tp2-dp1-mb2-fp8r-s1": "tp1-dp1-mb2-fp8r-s1"},
               4: {"tp2-dp2-fp8t-s1": "tp1-dp1-mb2-fp8t-s1", "tp2-dp2-sp-mb2-z2-fp8r-s1": "tp1-dp1-mb4-fp8r-s1",
                   "pp2-tp2-dp1-sp-mb2-fp8t-s1": "tp1-dp1-mb2-fp8t-s1",
                   "pp2-tp1-dp2-mb2-z1-fp8r-s1": "tp1-dp1-mb4-fp8r-s1"}}
for _world, _fp8 in FP8_LAYOUTS.items():
    LAYOUTS[_world] += list(_fp8)
# LoRA (gpt_setup.LORA on qkv, proj, fc, proj of every layer, Llama's an adapter per projection, PEFT's; the base
# frozen), AdamW over the adapters with clipping:
# tp2 + SP on GPT ("column" fc) and Llama (QueryGroupColumn qkv, PackedColumn [gate | up]; with full recomputation),
# pp2 (zero bubble: the weight-gradient pass of the adapters only), ZeRO-1 and 2 over dp, tp2 x dp2, and tp4, which
# replicates each of the Llama model's 2 key/value heads on 2 ranks (and so the k and v adapters' B, KeyValueHeads).
# Regional compilation passes too ("llama-tp2-dp1-sp-mb2-compile_aot-rc-lora", 8e-8), at a minute a run: not here.
LORA_LAYOUTS = {2: ["tp2-dp1-sp-mb2-lora", "llama-tp2-dp1-sp-mb2-rc-lora", "llama-pp2-tp1-dp1-mb4-zb-lora",
                    "llama-tp1-dp2-z1-lora"],
                4: ["llama-tp2-dp2-lora", "llama-tp4-dp1-sp-mb2-lora", "llama-tp2-dp2-sp-mb2-z2-lora"]}
for _world, _lora in LORA_LAYOUTS.items():
    LAYOUTS[_world] += _lora
# Qwen3's per-head q/k norms: one gain each, replicated, applied by each tp rank to its own heads only, so its gradient
# is summed over tp with or without sequence parallelism (tp4 replicates each key head on 2 ranks, which normalise it
# alike); wider heads than hidden / heads. tp2 x dp2 (+ SP), tp4, pp2 x dp2, and LoRA per projection at tp2 x dp2.
QWEN3_LAYOUTS = ["qwen3-tp2-dp2", "qwen3-tp2-dp2-sp-mb2", "qwen3-tp4-dp1", "qwen3-pp2-tp1-dp2-mb2", "qwen3-tp2-dp2-lora"]
LAYOUTS[4] += QWEN3_LAYOUTS
LORA_LAYOUTS[4].append("qwen3-tp2-dp2-lora")
# Gemma 3's pieces outside attention (gpt_setup.GEMMA_CONFIG): the extra norms replicated and, under SP, summed over tp
# as ln_1/ln_2; the soft-capped logits of each rank's vocabulary slice (rank 1's mostly padding, kept at -inf) in the
# vocab-parallel loss, unchunked and chunked; the scaled embedding on the first stage and the cap on the last under pp2;
# full recomputation of the sandwich layers at tp2 + SP.
LAYOUTS[2] += ["gemma-tp2-dp1-sp-mb2-rc", "gemma-pp2-tp1-dp1-mb4", "gemmachunk-tp2-dp1-sp-mb2"]
# Gemma 3 whole (gpt_setup.GEMMA3_CONFIG, a converted Gemma3ForCausalLM): its reference trains as transformers' model
# does (test_gemma3_reference_trains_as_transformers_gemma3), so these layouts give transformers' losses; cp2:
# test_context_parallel.py.
LAYOUTS[4] += ["gemma3-tp2-dp2", "gemma3-pp2-tp1-dp2-mb2"]
# Multi-token prediction (gpt_setup.MTP_CONFIG, 2 depths) on packed documents: its losses (main and MTP) and weights at
# tp2 x dp2 + SP (the depths' norms and eh_proj on sequence shards) and pp2 x dp2 (the depths on the last stage, which
# embeds the shifted tokens with its pipeline-tied copy of the embedding).
MTP_LAYOUTS = ["mtp-doc-tp2-dp2-sp-mb2", "mtp-doc-pp2-tp1-dp2-mb2"]
LAYOUTS[4] += MTP_LAYOUTS
LOSS_TOL, WEIGHT_TOL = 1e-5, 1e-5


@pytest.fixture(scope="module")
def reference():
    """Plain PyTorch, one process, the whole global batch, torch's own clipping; per optimizer."""
    return {"adamw": _reference(optimizer, CONFIG), "sgd": _reference(sgd_optimizer, CONFIG),
            "llama": _reference(optimizer, LLAMA_CONFIG), "doc": _reference(optimizer, CONFIG, documents=True),
            "llama-doc": _reference(optimizer, LLAMA_CONFIG, documents=True), "deep": _reference(optimizer, DEEP_CONFIG),
            "lora": _reference(optimizer, CONFIG, lora=LORA), "llama-lora": _reference(optimizer, LLAMA_CONFIG, lora=LORA),
            "qwen3": _reference(optimizer, QWEN3_CONFIG), "qwen3-lora": _reference(optimizer, QWEN3_CONFIG, lora=LORA),
            "gemma": _reference(optimizer, GEMMA_CONFIG), "gemma3": _reference(optimizer, GEMMA3_CONFIG),
            "mtp-doc": _reference(optimizer, MTP_CONFIG, documents=True, mtp_losses=MTP_REFERENCE_LOSSES)}


MTP_REFERENCE_LOSSES: list[float] = []  # the "mtp-doc" reference's mtp_loss per step


@pytest.mark.slow
def test_gemma3_reference_trains_as_transformers_gemma3(reference):
    """The Gemma 3 layouts' reference is transformers': its Gemma3ForCausalLM, loaded with the reference's initial
    weights (exported), trained by the same AdamW with the same clipping on the same batches, gives its losses and
    (converted back) its weights. fp32; measured 4.8e-7 (losses) and 2.5e-6 (weights)."""
    transformers = pytest.importorskip("transformers")
    from lightning_megatron.huggingface import family_for

    family = family_for(GEMMA3_CONFIG)
    torch.manual_seed(SEED)
    initial = GPTModel(GEMMA3_CONFIG).state_dict()
    hf = transformers.Gemma3ForCausalLM(transformers.AutoConfig.for_model(**family.hf_config(GEMMA3_CONFIG)))
    hf.load_state_dict(family.hf_state_dict(initial, GEMMA3_CONFIG))
    opt = optimizer(list(hf.parameters()))
    losses = []
    for input_ids, labels in batches():  # labels already shifted: the loss by hand, over the kept tokens
        logits = hf(input_ids).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(hf.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    ref_losses, ref_weights = reference["gemma3"]
    back = family.state_dict_from_hf(hf.state_dict(), GEMMA3_CONFIG)
    loss_dev = max(abs(a - b) for a, b in zip(losses, ref_losses))
    weight_dev = max((back[name] - value).abs().max().item() for name, value in ref_weights.items())
    print(f"gemma3 vs transformers: worst loss deviation {loss_dev:.2e}, worst weight deviation {weight_dev:.2e}")
    assert loss_dev < LOSS_TOL and weight_dev < WEIGHT_TOL, (losses, ref_losses)
    assert min((value - initial[name]).abs().max().item() for name, value in ref_weights.items()) > 1e-3  # all trained


def _reference(make_optimizer, config, documents=False, lora=None, mtp_losses=None):
    torch.manual_seed(SEED)
    model = GPTModel(config)
    if lora is not None:
        apply_lora(model, lora, seed=SEED)
    opt = make_optimizer([p for p in model.parameters() if p.requires_grad])
    losses = []
    for input_ids, labels, side in document_batches() if documents else [(*batch, {}) for batch in batches()]:
        loss_sum, tokens = model.loss(input_ids, labels, **side)
        loss = loss_sum / tokens
        loss.backward()
        if mtp_losses is not None:
            sums, counts = model.mtp_statistics
            mtp_losses.append((sums.sum() / counts.sum()).item())
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _deviations(result, ref_losses, ref_weights, layout):
    """Assert ``result`` (a layout's losses and weights) matches the reference; print the worst deviations."""
    assert len(result["losses"]) == len(ref_losses)
    loss_dev = max(abs(a - b) for a, b in zip(result["losses"], ref_losses))
    assert loss_dev < LOSS_TOL, f"{layout}: losses {result['losses']} vs reference {ref_losses}"
    assert result["weights"].keys() == ref_weights.keys()
    weight_dev = {k: (result["weights"][k] - ref_weights[k]).abs().max().item() for k in ref_weights}
    worst = max(weight_dev, key=weight_dev.get)
    print(f"{layout}: worst loss deviation {loss_dev:.2e}, worst weight deviation {weight_dev[worst]:.2e} ({worst})")
    for k in sorted(weight_dev, key=weight_dev.get)[-4:]:
        print("   ", k, f"{weight_dev[k]:.2e}")
    assert weight_dev[worst] < WEIGHT_TOL, f"{layout}: {worst} deviates by {weight_dev[worst]:.2e}"


@pytest.mark.slow
@pytest.mark.parametrize("world", sorted(LAYOUTS))
def test_layouts_match_single_process(world, reference, fp8_reference, tmp_path):
    run_job("layout_invariance", world, tmp_path, ",".join(LAYOUTS[world]))
    for layout, single in FP8_LAYOUTS.get(world, {}).items():
        _deviations(torch.load(tmp_path / f"{layout}.pt", weights_only=True), *fp8_reference[single], layout)
    for layout in [layout for layout in LAYOUTS[world] if layout not in FP8_LAYOUTS.get(world, {})]:
        kind = "llama" if layout.startswith("llama-") else "deep" if layout.startswith("deep-") else \
            "qwen3" if layout.startswith("qwen3-") else "gemma" if layout.startswith(("gemma-", "gemmachunk-")) else \
            "gemma3" if layout.startswith("gemma3-") else "mtp" if layout.startswith("mtp-") else \
            "sgd" if layout.endswith("-sgd") else "adamw"  # chunk-: GPT's; gemmachunk-: the unchunked gemma's
        if "doc-" in layout:
            kind = {"llama": "llama-doc", "mtp": "mtp-doc"}.get(kind, "doc")
        if layout.endswith("-lora"):
            kind = f"{kind}-lora" if kind in ("llama", "qwen3") else "lora"
        _deviations(torch.load(tmp_path / f"{layout}.pt", weights_only=True), *reference[kind], layout)

    for layout in [layout for layout in LAYOUTS[world] if layout in MTP_LAYOUTS]:
        mtp_losses = json.loads((tmp_path / f"{layout}-mtp.json").read_text())
        assert len(mtp_losses) == len(MTP_REFERENCE_LOSSES), layout
        assert max(abs(a - b) for a, b in zip(mtp_losses, MTP_REFERENCE_LOSSES)) < LOSS_TOL, \
            f"{layout}: mtp losses {mtp_losses} vs reference {MTP_REFERENCE_LOSSES}"

    # Overlapping the parameter gathers moves when they complete, not what they compute: bit for bit the same run.
    for layout in LAYOUTS[world]:
        synchronous = layout.removesuffix("-ogather")
        if layout.endswith("-ogather") and synchronous in LAYOUTS[world]:
            overlapped, plain = (torch.load(tmp_path / f"{name}.pt", weights_only=True) for name in (layout, synchronous))
            assert overlapped["losses"] == plain["losses"], layout
            assert all(torch.equal(value, plain["weights"][name]) for name, value in overlapped["weights"].items()), layout
    for layout, twin in OFFLOAD_TWINS.get(world, {}).items():
        # Where the state lives, and stepping it in tiles, changes no arithmetic of the for-loop AdamW.
        if twin is not None:
            offloaded, other = (torch.load(tmp_path / f"{name}.pt", weights_only=True) for name in (layout, twin))
            assert offloaded["losses"] == other["losses"], layout
            assert all(torch.equal(value, other["weights"][name]) for name, value in offloaded["weights"].items()), layout
        for rank in range(world) if layout.endswith("-offnvme") else ():
            moved = json.loads((tmp_path / f"{layout}-offload{rank}.json").read_text())
            # Each step reads and writes every byte of the state once (main, exp_avg, exp_avg_sq): 2x its size.
            state_bytes = 4 * moved["elements"] * (1 + len(moved["state_keys"]))
            assert moved["state_keys"] == ["exp_avg", "exp_avg_sq"] and moved["tiles"] > 1, moved
            assert moved["read"] == moved["written"] == moved["steps"] * state_bytes, moved
            assert moved["folder_removed"] and moved["on_cpu"], moved
    for layout in LORA_LAYOUTS.get(world, []):
        _check_lora(layout, world, torch.load(tmp_path / f"{layout}.pt", weights_only=True), tmp_path)
    for layout in [layout for layout in LAYOUTS[world] if layout.endswith("-tpo")]:
        # Overlapping the communication changes only the order of fp32 sums inside GEMMs.
        overlapped = torch.load(tmp_path / f"{layout}.pt", weights_only=True)
        in_turn = torch.load(tmp_path / f"{layout.removesuffix('-tpo')}.pt", weights_only=True)
        assert max(abs(a - b) for a, b in zip(overlapped["losses"], in_turn["losses"])) < LOSS_TOL, layout
        for name, value in overlapped["weights"].items():
            assert (value - in_turn["weights"][name]).abs().max() < WEIGHT_TOL, f"{layout}: {name}"

    if world == 2:
        for layout in COMPILE_LAYOUTS:
            for rank in range(world):
                dynamo = json.loads((tmp_path / f"{layout}-dynamo{rank}.json").read_text())
                # A layer compiles into 3 graphs (attention's per-rank stream is swapped in eagerly between them):
                # more would mean the 4 identical layers did not share the compiled code.
                assert 0 < dynamo["graphs"] <= 3 and dynamo["recompiles"] == 0, f"{layout}, rank {rank}: {dynamo}"
        # Same micro-batches, same per-micro-batch backward: the schedule only reorders work.
        one_f_one_b = torch.load(tmp_path / "pp2-tp1-dp1-mb4.pt", weights_only=True)
        gpipe = torch.load(tmp_path / "pp2-tp1-dp1-mb4-gpipe.pt", weights_only=True)
        assert one_f_one_b["losses"] == gpipe["losses"]
        for name, value in one_f_one_b["weights"].items():
            assert torch.equal(value, gpipe["weights"][name]), f"GPipe and 1F1B differ in {name}"


def _check_lora(layout, world, result, tmp_path):
    """Beyond matching the reference: the frozen base is bit for bit the initial one and holds no gradient, optimizer
    state or fp32 copy on any rank; the adapters trained (B away from its zero start, so A got gradients too)."""
    torch.manual_seed(SEED)
    per_projection = layout.startswith(("llama-", "qwen3-"))
    model = GPTModel(QWEN3_CONFIG if layout.startswith("qwen3-") else LLAMA_CONFIG if per_projection else CONFIG)
    initial = {name: value.clone() for name, value in model.state_dict().items()}
    apply_lora(model, LORA, seed=SEED)
    start = {name: value for name, value in model.state_dict().items() if is_adapter_name(name)}
    weights = result["weights"]
    adapters = [name for name in weights if is_adapter_name(name)]
    assert {name for name in weights if not is_adapter_name(name)} == set(initial), layout
    for name, value in initial.items():
        assert torch.equal(weights[name], value), f"{layout}: frozen {name} changed"
    # A and B trained (q and k's A move least: their gradients wait for B to leave zero, then by about lr a step)
    assert all((weights[name] - start[name]).abs().max() > 1e-4 for name in adapters), layout
    # 4 layers x (A, B) x qkv, proj, fc, proj; Llama's adapters are per projection: q, k, v, o, gate, up, down.
    assert len(adapters) == 4 * 2 * (7 if per_projection else 4), adapters
    for rank in range(world):
        held = json.loads((tmp_path / f"{layout}-frozen{rank}.json").read_text())
        assert held["frozen"] > held["trainable"] > 0 and held["frozen_grads"] == 0, (layout, rank, held)
        assert not held["frozen_in_optimizer"] and held["sync"] == held["trainable"], (layout, rank, held)
        assert held["state"] == 2 * held["stepped"] <= 2 * held["trainable"], (layout, rank, held)  # AdamW's moments


@pytest.mark.slow
def test_fp8_references_train_in_fp8(reference, fp8_reference):
    """The fp8 single-process runs differ from the fp32 run by fp8's error (so fp8 is on), by no more than a few
    percent of the loss (so they train), and the two recipes differ from each other."""
    fp32_losses, _ = reference["adamw"]
    tensorwise, rowwise = fp8_reference["tp1-dp1-mb4-fp8t-s1"][0], fp8_reference["tp1-dp1-mb4-fp8r-s1"][0]
    for losses in (tensorwise, rowwise):
        deviation = max(abs(a - b) / b for a, b in zip(losses, fp32_losses))
        assert 1e-5 < deviation < 0.03, (losses, fp32_losses)
    assert max(abs(a - b) for a, b in zip(tensorwise, rowwise)) > 1e-5
