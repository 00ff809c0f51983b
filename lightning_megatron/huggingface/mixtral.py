"""Hugging Face ``MixtralForCausalLM`` <-> our GPT with a Mixture of Experts in every layer: the Llama mapping
(``llama.py``) with Mixtral's config fields and expert names.

Mixtral is Mistral whose every MLP is a Mixture of Experts: a router (``gate``) takes the softmax
of its logits, picks ``num_experts_per_tok`` of ``num_local_experts`` SwiGLU experts (each
``intermediate_size`` wide) and renormalises their weights to sum to 1, which is
``MoEConfig(score_function="softmax", normalize_topk=True)``. Checkpoints store each expert as
``block_sparse_moe.experts.{e}.w1``/``w3``/``w2`` (gate, up, down); ``transformers`` 5 holds a
layer's experts stacked in memory, in a module called ``mlp`` (``mlp.experts.gate_up_proj``
``[E, 2f, h]``, ``mlp.experts.down_proj``), and reading accepts that too. An export writes the
per-expert tensors, as ``save_pretrained`` does, so ``from_pretrained`` of any version loads it.

``router_aux_loss_coef`` is read as ``MoEConfig.aux_loss_coeff``: the load-balancing coefficient
the model was trained with (ours is Megatron-Core's per-sequence loss, not ``transformers``'
per-batch one), whether or not ``output_router_logits`` (``transformers``' switch that adds it to
its loss) is on; an export writes it back, with ``output_router_logits: false``. Not modelled, so
refused: ``router_jitter_noise`` (input noise in training). The sliding window is treated
as Mistral's (``mistral.py``). ``capacity_factor`` and ``z_loss_coeff`` only change training and
have no Mixtral field: they are not exported.
"""

from __future__ import annotations

from typing import Any, Optional

from lightning_megatron.huggingface.llama import (Dialect, ExpertNames, Fields, checkpoint_name, dense_layer_problems,
                                                  window_of_every_layer, window_to_every_layer)
from lightning_megatron.models.gpt import GPTConfig
from lightning_megatron.models.moe import MoEConfig


def _mixtral_fields(fields: Fields, problems: list[str]) -> dict[str, Any]:
    if fields["router_jitter_noise"]:
        problems.append(f"router_jitter_noise={fields['router_jitter_noise']}: our router does not perturb its "
                        f"inputs (0.0)")
    moe = MoEConfig(num_experts=fields["num_local_experts"], top_k=fields["num_experts_per_tok"],
                    score_function="softmax", normalize_topk=True,
                    aux_loss_coeff=float(fields["router_aux_loss_coef"]))
    return {"moe": moe, **window_of_every_layer(fields)}


def _mixtral_hf_fields(config: GPTConfig, problems: list[str]) -> dict[str, Any]:
    if config.qkv_bias:
        problems.append(f"add_bias_linear={config.add_bias_linear}, add_qkv_bias={config.add_qkv_bias}: "
                        f"MixtralForCausalLM has no biases")
    moe = config.moe
    if moe is None:  # named by the checks every dialect shares
        return {}
    problems += dense_layer_problems(config, "Mixtral")
    if not moe.normalize_topk:
        problems.append("moe.normalize_topk=False: Mixtral renormalises the chosen experts' weights to sum to 1")
    return {"intermediate_size": config.moe_ffn_size,
            **window_to_every_layer(config, "MixtralForCausalLM", problems),
            "num_local_experts": moe.num_experts, "num_experts_per_tok": moe.top_k,
            "router_aux_loss_coef": moe.aux_loss_coeff, "output_router_logits": False, "router_jitter_noise": 0.0}


def _mixtral_name(name: str) -> Optional[str]:
    """``transformers`` 5 calls a layer's MoE block ``mlp`` in memory, its checkpoints ``block_sparse_moe`` (Mixtral
    has no other MLP)."""
    name = checkpoint_name(name)
    return None if name is None else name.replace(".mlp.", ".block_sparse_moe.")


MIXTRAL = Dialect(
    model_type="mixtral", architecture="MixtralForCausalLM",
    defaults={"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
              "num_attention_heads": 32, "num_key_value_heads": 8, "max_position_embeddings": 4096 * 32,
              "rms_norm_eps": 1e-5, "rope_theta": 1e6, "sliding_window": None, "num_local_experts": 8,
              "num_experts_per_tok": 2, "router_aux_loss_coef": 0.001, "router_jitter_noise": 0.0},
    read_fields=_mixtral_fields, write_fields=_mixtral_hf_fields,
    experts=ExpertNames("block_sparse_moe", projections=("w1", "w3", "w2")), hf_name=_mixtral_name)
FAMILY = MIXTRAL.family()

mixtral_config_from_hf = MIXTRAL.config_from_hf
hf_config_from_mixtral = MIXTRAL.hf_config
