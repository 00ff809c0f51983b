"""Tiny random ``transformers`` causal LMs of the families ``HFCausalLM`` is checked on, shared by its tests and
their rank-pool worker (``hf_causal_layouts``): the layout words' family names -> config fields."""

import torch

SIZES = dict(vocab_size=257, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, bos_token_id=1, eos_token_id=2)
#: Qwen3: per-head q/k norms, head_dim wider than hidden / heads. Phi-3: fused qkv_proj and gate_up_proj (its plan
#: gathers them). OLMo 2: q/k norms over the whole projections (its plan gathers q, k, v). Gemma 3: tied scaled
#: embeddings, (1 + w) norms, four per layer, a sliding window (6) shorter than the sequence (16), a pad token.
FAMILIES = {
    "qwen3": dict(model_type="qwen3", head_dim=16, **SIZES),
    "phi3": dict(model_type="phi3", pad_token_id=0, **SIZES),
    "olmo2": dict(model_type="olmo2", pad_token_id=0, **SIZES),
    "gemma3": dict(model_type="gemma3_text", head_dim=8, sliding_window=6, pad_token_id=0, **SIZES),
}


def save_family(name: str, directory, seed: int = 0) -> None:
    """A random ``AutoModelForCausalLM`` of family ``name`` written by ``save_pretrained`` (its norm gains and biases
    moved off their constant start, so that a wrong gain or a missed one shows)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = dict(FAMILIES[name])
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 1:
                param.add_(0.1 * torch.randn_like(param))
    model.save_pretrained(directory)


#: The Trainer run of the pooled job (``hf_causal_layouts``' ``fit-``) and of its one-process reference.
FIT = {"steps": 4, "clip": 0.5, "seed": 7,
       "strategies": [{"tensor_parallel_size": 2, "zero_stage": 3},
                      {"pipeline_parallel_size": 2, "zero_stage": 1, "micro_batch_size": 2}]}


def fit_module(directory):
    from lightning_megatron.models import HFCausalLM

    return HFCausalLM(pretrained=directory, learning_rate=3e-3, warmup_steps=2, adam_eps=1e-6)
PREDICT_IDS = torch.arange(2 * 12).reshape(2, 12) * 7 % 257  # what the resumed run predicts the logits of
