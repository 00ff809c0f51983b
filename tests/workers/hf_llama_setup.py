"""The small random Hugging Face Llama-shaped decoders shared by ``tests/test_hf_llama.py`` and ``hf_parity.py``.

Seven cases, each exercising one thing a mapping can get wrong: grouped-query attention (4 heads, 2
key/value groups: tp=4 replicates each group's key/value heads on 2 ranks), multi-query attention (1
group), Mistral (its sliding window longer than the sequences), Qwen2 (biases on q, k, v; tied
embeddings), Qwen3 (per-head q/k RMSNorm; heads of 32 channels, not 64 / 4 = 16), Gemma 3 (four (1 + w) norms a
layer, GeGLU, a window of 6 in three of four layers with their own rotary base, query_pre_attn_scalar 20 for heads of
24 channels, soft-capped logits, tied embeddings) and Llama-3.1's rotary
frequency scaling (an original context short enough that the scaling changes the logits of these sequences:
without it they move by ~5e-2).

Three Mixture-of-Experts cases (``MOE_CASES``, ``tests/test_hf_moe.py``): Mixtral (4 experts, top-2,
renormalised weights, every layer MoE), Qwen2-MoE with MoE in every second layer
(``decoder_sparse_step=2``: layers 1 and 3 of 4; 8 experts, weights not renormalised, a gated shared
expert), and Qwen2-MoE with a dense layer named by ``mlp_only_layers``, ``norm_topk_prob=True`` and
tied embeddings. Two Qwen3-MoE cases (q/k norms, heads 32 wide, no shared expert): 8 experts top-4 renormalised with
the middle of 3 layers dense (``mlp_only_layers``), and top-2 not renormalised in every second layer
(``decoder_sparse_step=2``) with tied embeddings. Every width and the heads split over tp=2.
"""

import torch

SEED = 0
BASE_FIELDS = dict(vocab_size=300, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
                   num_hidden_layers=2, max_position_embeddings=64, rms_norm_eps=1e-6, bos_token_id=None,
                   eos_token_id=None)
LLAMA_3_1_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 4.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
#: Gemma 3: four layers of both types, a window shorter than the sequences, local/global rotary bases apart (the
#: global one linearly scaled), query_pre_attn_scalar not head_dim, logits soft-capped hard enough to bend them.
GEMMA3_FIELDS = {**BASE_FIELDS, "num_hidden_layers": 4, "head_dim": 24, "query_pre_attn_scalar": 20,
                 "sliding_window": 6, "final_logit_softcapping": 5.0, "tie_word_embeddings": True, "pad_token_id": None,
                 "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"],
                 "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                                     "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}}}
CASES = {  # name -> (transformers class, config fields)
    "llama-gqa": ("LlamaForCausalLM", BASE_FIELDS),
    "llama-mqa": ("LlamaForCausalLM", {**BASE_FIELDS, "num_key_value_heads": 1}),
    "mistral": ("MistralForCausalLM", {**BASE_FIELDS, "sliding_window": 48}),
    "qwen2": ("Qwen2ForCausalLM", {**BASE_FIELDS, "tie_word_embeddings": True}),
    "qwen3": ("Qwen3ForCausalLM", {**BASE_FIELDS, "head_dim": 32, "tie_word_embeddings": False}),
    "llama-3.1-rope": ("LlamaForCausalLM", {**BASE_FIELDS, "max_position_embeddings": 256,
                                            "rope_parameters": LLAMA_3_1_ROPE}),
    "gemma3": ("Gemma3ForCausalLM", GEMMA3_FIELDS),
}
QWEN2_MOE_FIELDS = {**BASE_FIELDS, "num_hidden_layers": 4, "decoder_sparse_step": 2, "num_experts": 8,
                    "num_experts_per_tok": 2, "moe_intermediate_size": 24, "shared_expert_intermediate_size": 40,
                    "norm_topk_prob": False}
QWEN3_MOE_FIELDS = {**BASE_FIELDS, "head_dim": 32, "num_hidden_layers": 3, "mlp_only_layers": [1], "num_experts": 8,
                    "num_experts_per_tok": 4, "moe_intermediate_size": 24, "norm_topk_prob": True,
                    "tie_word_embeddings": False}
MOE_CASES = {
    "mixtral": ("MixtralForCausalLM", {**BASE_FIELDS, "intermediate_size": 48, "num_local_experts": 4,
                                       "num_experts_per_tok": 2}),
    "qwen2-moe": ("Qwen2MoeForCausalLM", QWEN2_MOE_FIELDS),
    "qwen2-moe-norm": ("Qwen2MoeForCausalLM", {**QWEN2_MOE_FIELDS, "num_hidden_layers": 3, "decoder_sparse_step": 1,
                                               "mlp_only_layers": [1], "norm_topk_prob": True,
                                               "tie_word_embeddings": True}),
    "qwen3-moe": ("Qwen3MoeForCausalLM", QWEN3_MOE_FIELDS),
    "qwen3-moe-step": ("Qwen3MoeForCausalLM", {**QWEN3_MOE_FIELDS, "num_hidden_layers": 2, "mlp_only_layers": [],
                                               "decoder_sparse_step": 2, "num_experts_per_tok": 2,
                                               "norm_topk_prob": False, "tie_word_embeddings": True}),
}
MODEL_TYPES = {"llama-gqa": "llama", "llama-mqa": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3",
               "gemma3": "gemma3_text", "llama-3.1-rope": "llama", "mixtral": "mixtral", "qwen2-moe": "qwen2_moe", "qwen2-moe-norm": "qwen2_moe",
               "qwen3-moe": "qwen3_moe", "qwen3-moe-step": "qwen3_moe"}
BATCH, SEQ = 2, 32  # shorter than Mistral's window; splits over tp=2 under sequence parallelism
TOLERANCE = 1e-4  # fp32; measured 0.0 at every layout (the same ops in the same order); MoE: see test_hf_moe.py


def build_hf_model(case: str, **overrides):
    """The case's (``CASES`` or ``MOE_CASES``) ``transformers`` model built offline, every parameter random (RMSNorm
    gains, biases and routers included, so that no mapping error hides behind an init of ones or zeros), in eval
    mode."""
    import transformers

    class_name, fields = {**CASES, **MOE_CASES}[case]
    config_class = getattr(transformers, class_name.replace("ForCausalLM", "TextConfig" if "Gemma" in class_name
                                                              else "Config"))
    torch.manual_seed(SEED)
    model = getattr(transformers, class_name)(config_class(**{**fields, **overrides})).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.2)
        if case in MOE_CASES:  # tokens that differ enough to reach every expert (else attention's average dominates)
            model.model.embed_tokens.weight.normal_(0.0, 2.0)
    return model


def sample_input_ids() -> torch.Tensor:
    return torch.randint(0, BASE_FIELDS["vocab_size"], (BATCH, SEQ), generator=torch.Generator().manual_seed(SEED))
