"""The tiny Mixture-of-Experts GPT, its variants and data, shared by the MoE workers and their single-process references."""

from dataclasses import replace

from gpt_setup import LLAMA_CONFIG
from lightning_megatron.models.moe import MoEConfig

# Llama-shaped, 4 layers of which 3 are MoE (layer 2 dense), 4 experts top-2 each 32 wide, a gated shared expert
# (Qwen2-MoE's), and both auxiliary losses on so that their gradients are part of every comparison.
MOE = MoEConfig(num_experts=4, top_k=2, ffn_hidden_size=32, layer_freq=(1, 1, 0, 1), aux_loss_coeff=1e-2,
                z_loss_coeff=1e-3, shared_expert_size=32, shared_expert_gate=True)
VARIANTS = {
    "moe": MOE,
    # Capacity 1.0: about a tenth of the assignments are dropped at the first step.
    "cap": replace(MOE, capacity_factor=1.0),
    # DeepSeek-V3-style: sigmoid scores, aux-loss-free expert bias (a large rate so it moves the routing in 5 steps).
    "bias": replace(MOE, score_function="sigmoid", expert_bias=True, expert_bias_update_rate=0.05, aux_loss_coeff=0.0),
    # Qwen2-MoE's default routing: no renormalisation of the chosen weights; no shared expert.
    "plain": replace(MOE, normalize_topk=False, shared_expert_size=0, shared_expert_gate=False),
}
CONFIGS = {name: replace(LLAMA_CONFIG, moe=moe) for name, moe in VARIANTS.items()}
