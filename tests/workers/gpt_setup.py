"""The tiny GPT, data and optimiser shared by the layout-invariance worker and its single-process reference."""

from dataclasses import replace

import torch

from lightning_megatron.models import GPTConfig, RopeScaling
from lightning_megatron.models.latent_attention import MLAConfig
from lightning_megatron.models.moe import MoEConfig
from lightning_megatron.models.multi_token_prediction import MTPConfig
from lightning_megatron.models.rotary import RopeScaling
from lightning_megatron.peft.lora import LoRAConfig

SEED = 1234
STEPS = 5
GLOBAL_BATCH = 8
SEQ = 16
CONFIG = GPTConfig(vocab_size=257, max_seq_length=SEQ, hidden_size=32, num_layers=4, num_heads=4)
# Llama-shaped (RMSNorm, rotary, SwiGLU, untied), 2 key/value groups (tp=4 replicates them), with Qwen2's qkv bias so
# that the bias follows the query-group layout too.
LLAMA_CONFIG = GPTConfig.from_name("llama-tiny", vocab_size=257, max_seq_length=SEQ, hidden_size=32, num_layers=4,
                                   num_heads=4, num_query_groups=2, ffn_hidden_size=48, add_qkv_bias=True)
# Multi-query: one key/value head, replicated on every tp rank.
MQA_CONFIG = replace(LLAMA_CONFIG, num_query_groups=1)
# Eight layers: two per stage of pp4 x vpp2 (the V-shaped zero-bubble schedules hold two stages per rank).
DEEP_CONFIG = replace(CONFIG, num_layers=8)
# The chunked loss (head and cross-entropy fused, 7 tokens of logits at a time, 3 of each rank's under tp2 + SP: no
# micro-batch divides into them): its layouts compare with the unchunked single-process reference.
CHUNKED_CONFIG = replace(CONFIG, loss_chunk_tokens=7)
# Qwen3-shaped: per-head q/k RMSNorm (one gain per norm, replicated, each tp rank normalising its own heads) and heads
# 16 channels wide, not 32 / 4 = 8; no biases.
QWEN3_CONFIG = replace(LLAMA_CONFIG, kv_channels=16, qk_layernorm=True, add_qkv_bias=False)
# Gemma-3-shaped (its pieces outside attention): zero-centred RMSNorm, four norms per layer, GeGLU, the embedding scaled
# by sqrt(hidden), tied head, and a final-logit cap low enough to bend the logits (Gemma 3's own configs have none);
# "gemmachunk": the same with the chunked loss, compared with the unchunked reference.
GEMMA_CONFIG = replace(QWEN3_CONFIG, normalization="ZeroCenteredRMSNorm", layer_norm_eps=1e-6, activation="geglu",
                       norm_position="sandwich", embedding_multiplier=32 ** 0.5, tie_embeddings=True,
                       final_logit_softcapping=2.0)
# Sliding windows (5 of the 16 positions) in layers 0, 2 and 3, their own rotary base, a softmax scale other than
# 1/sqrt(head_dim): the window crosses the chunks of cp2 and the documents of packed samples.
WINDOW_CONFIG = replace(LLAMA_CONFIG, sliding_window=5, rotary_base_local=100.0, softmax_scale=0.3,
                        layer_types=("sliding_attention", "full_attention", "sliding_attention", "sliding_attention"))
# Gemma 3 whole (what GPT.from_hf makes of a Gemma3ForCausalLM): GEMMA_CONFIG's pieces with WINDOW_CONFIG's layer
# types, window and local rotary base, the full layers' rotary positions linearly scaled, query_pre_attn_scalar 12.
GEMMA3_CONFIG = replace(GEMMA_CONFIG, sliding_window=5, layer_types=WINDOW_CONFIG.layer_types, rotary_base_local=100.0,
                        softmax_scale=12 ** -0.5, rope_scaling=RopeScaling(factor=4.0, rope_type="linear"))
# Multi-token prediction, 2 depths, on the untied Llama model: under pp2 the last stage embeds the shifted tokens with
# its own copy of the first stage's embedding, kept equal only by the pipeline tie.
MTP_CONFIG = replace(LLAMA_CONFIG, mtp=MTPConfig(num_layers=2, loss_scaling_factor=0.5))
CONFIGS = {"gpt": CONFIG, "llama": LLAMA_CONFIG, "mqa": MQA_CONFIG, "deep": DEEP_CONFIG, "chunk": CHUNKED_CONFIG,
           "qwen3": QWEN3_CONFIG, "gemma": GEMMA_CONFIG, "gemmachunk": replace(GEMMA_CONFIG, loss_chunk_tokens=7),
           "gemma3": GEMMA3_CONFIG, "mtp": MTP_CONFIG}

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
MOE_CONFIGS = {name: replace(LLAMA_CONFIG, moe=moe) for name, moe in VARIANTS.items()}
# DeepSeek-V3-shaped: multi-head latent attention (values narrower than the heads, so padded) over a dense first layer
# and three MoE layers with sigmoid scores, the expert bias, group-limited top-k (2 of 4 experts in 1 of 2 groups), the
# routed scaling factor and an ungated shared expert; YaRN with DeepSeek's mscale and mscale_all_dim (cos/sin and the
# softmax scale both scaled) and DeepSeek's norm eps, so that it exports as a DeepseekV3ForCausalLM.
MLA = MLAConfig(q_lora_rank=16, kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6)
MLA_YARN = RopeScaling(rope_type="yarn", factor=2.0, original_max_position_embeddings=8, mscale=0.707,
                       mscale_all_dim=1.0)
MOE_CONFIGS["mla"] = replace(
    LLAMA_CONFIG, num_query_groups=None, add_qkv_bias=False, layer_norm_eps=1e-6, mla=MLA, rope_scaling=MLA_YARN,
    softmax_scale=MLA.softmax_scale(MLA_YARN),
    moe=replace(VARIANTS["bias"], layer_freq=(0, 1, 1, 1), shared_expert_gate=False, router_num_groups=2,
                router_group_topk=1, router_topk_scaling_factor=2.5))
# Its attention alone, in dense layers (context parallelism refuses MoE layers).
MLA_CONFIG = replace(MOE_CONFIGS["mla"], moe=None)
# Qwen3-MoE-shaped: Qwen3's attention (q/k norms, 16-channel heads, no biases), MoE layers without a shared expert
# (layer 2 dense, as mlp_only_layers=[2]), weights renormalised, the load-balancing loss on, no z-loss.
MOE_CONFIGS["qwen3moe"] = replace(QWEN3_CONFIG, moe=replace(MOE, z_loss_coeff=0.0, shared_expert_size=0,
                                                            shared_expert_gate=False))
# GPT-OSS's pieces on the same sizes: attention sinks and biases, YaRN, sliding and full layers alternating, clamped-SwiGLU
# experts with biases and a router bias (no shared expert), in every layer as GPT-OSS has them (so that the gpt_oss
# family exports it: test_moe.py starts from transformers' loss).
MOE_CONFIGS["oss"] = replace(
    LLAMA_CONFIG, add_qkv_bias=False, add_attention_bias=True, attention_sinks=True, activation="clamped_swiglu",
    sliding_window=4, layer_types=("sliding_attention", "full_attention") * 2,
    rope_scaling=RopeScaling(rope_type="yarn", factor=4.0, original_max_position_embeddings=8),
    moe=replace(MOE, layer_freq=1, router_bias=True, add_bias_linear=True, shared_expert_size=0,
                shared_expert_gate=False))
CONFIGS["moe"] = MOE_CONFIGS["moe"]

LR, WEIGHT_DECAY, CLIP = 1e-2, 0.1, 0.5
# LoRA on every linear of attention and the MLP (qkv by query group, SwiGLU's packed [gate | up], both row layers).
LORA = LoRAConfig(rank=4, alpha=8.0)


EOS = 256


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(input_ids, labels) per step; about 10% of the labels are ignored (-100), unevenly per sample."""
    generator = torch.Generator().manual_seed(SEED)
    out = []
    for _ in range(STEPS):
        tokens = torch.randint(0, CONFIG.vocab_size, (GLOBAL_BATCH, SEQ + 1), generator=generator)
        labels = tokens[:, 1:].clone()
        labels[torch.rand(labels.shape, generator=generator) < 0.1] = -100
        out.append((tokens[:, :-1], labels))
    return out


def document_batches() -> list[tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]]:
    """(input_ids, labels, side inputs) per step: packed samples of several documents each (an end-of-document id
    every ~5 tokens), with all three of Megatron-LM's document masks, as GPTDataset makes them."""
    from lightning_megatron.data.gpt_dataset import DocumentMasks, document_masked_sample

    generator = torch.Generator().manual_seed(SEED + 1)
    out = []
    for _ in range(STEPS):
        tokens = torch.randint(0, EOS, (GLOBAL_BATCH, SEQ + 1), generator=generator)
        tokens[torch.rand(tokens.shape, generator=generator) < 0.2] = EOS
        samples = [document_masked_sample(row.numpy(), EOS, DocumentMasks(True, True, True)) for row in tokens]
        batch = {key: torch.stack([sample[key] for sample in samples]) for key in samples[0]}
        out.append((batch.pop("input_ids"), batch.pop("labels"), batch))
    return out


def optimizer(params, **implementation) -> torch.optim.Optimizer:
    """torch's AdamW; ``implementation``: its ``fused``/``foreach`` arguments (none: the for-loop on CPU)."""
    # eps: AdamW divides by sqrt(v) + eps, which turns fp32 rounding noise in near-zero gradients into large
    # updates when eps is small: GPT's key bias has an exactly-zero gradient (softmax ignores a shift of all
    # scores), and the Llama model's untied input embedding has rows seen once or twice per batch. Measured on
    # the untied model at dp2: eps 1e-6 leaves 1e-5 deviations from the reference, 1e-4 6e-7, 1e-3 2e-7.
    return torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY, eps=1e-3, **implementation)


def sgd_optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=LR * 10, momentum=0.9, weight_decay=WEIGHT_DECAY)
