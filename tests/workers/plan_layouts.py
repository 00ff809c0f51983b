"""The layouts whose model-state bytes the planner must predict byte for byte (``tests/test_plan.py``), and the
models they train: the Trainer worker's tiny GPT (4 layers, tied embeddings), a Llama-shaped one (grouped-query
attention, untied output layer), the same with LoRA adapters (its base frozen) and a Mixture-of-Experts one."""

from dataclasses import replace

from trainer_setup import model
from lightning_megatron.models import GPT
from lightning_megatron.models.moe import MoEConfig


def _case(precision, model="gpt", bucket_size_mb=0.01, **strategy):
    return {"precision": precision, "model": model, "bucket_size_mb": bucket_size_mb, "strategy": strategy}


BYTE_LAYOUTS = {
    "dp4-z0": _case("32-true", zero_stage=0),
    "dp4-z1": _case("32-true", zero_stage=1),
    "dp4-z2-bf16": _case("bf16-true", zero_stage=2),
    "dp4-z3": _case("32-true", zero_stage=3),
    "tp2-dp2-z1-bf16": _case("bf16-true", tensor_parallel_size=2, zero_stage=1),
    "tp2-dp2-z3-mixed": _case("bf16-mixed", tensor_parallel_size=2, zero_stage=3),
    "tp4-bf16": _case("bf16-true", tensor_parallel_size=4),
    "tp4": _case("32-true", tensor_parallel_size=4, bucket_size_mb=25.0),
    "pp2-dp2-z1": _case("32-true", pipeline_parallel_size=2, zero_stage=1, micro_batch_size=2),
    "pp2-tp2-mixed": _case("bf16-mixed", pipeline_parallel_size=2, tensor_parallel_size=2, micro_batch_size=2),
    "pp2v2-dp2-z2-bf16": _case("bf16-true", pipeline_parallel_size=2, virtual_pipeline_size=2, zero_stage=2,
                               pipeline_schedule="interleaved_1f1b", micro_batch_size=2),
    "pp2-dp2-z3": _case("32-true", pipeline_parallel_size=2, zero_stage=3, micro_batch_size=2),
    "tp2-dp2-z1-offload-bf16": _case("bf16-true", tensor_parallel_size=2, zero_stage=1, offload_optimizer=True),
    "dp4-offload": _case("32-true", offload_optimizer=True),
    "tp2-cp2-z1": _case("32-true", tensor_parallel_size=2, context_parallel_size=2, zero_stage=1),
    "llama-tp2-dp2-z1-bf16": _case("bf16-true", model="llama", tensor_parallel_size=2, zero_stage=1),
    "moe-dp4-ep2-z1": _case("32-true", model="moe", expert_parallel_size=2, zero_stage=1),
    "moe-dp4-ep2-z3-mixed": _case("bf16-mixed", model="moe", expert_parallel_size=2, zero_stage=3),
    # Whole experts on each tp rank (MoE parallel folding): ep2 over the tp x dp slots, expert-data-parallel size 2.
    "moe-tp2-dp2-ep2etp1-z1-bf16": _case("bf16-true", model="moe", tensor_parallel_size=2, expert_parallel_size=2,
                                         expert_tensor_parallel_size=1, zero_stage=1),
    # LoRA on the Llama-shaped model (one bucket: the formula of tests/test_plan.py holds without bucket padding).
    "lora-tp2-dp2-z1-bf16": _case("bf16-true", model="lora", tensor_parallel_size=2, zero_stage=1, bucket_size_mb=25.0),
    "lora-pp2-dp2-z2-bf16": _case("bf16-true", model="lora", pipeline_parallel_size=2, zero_stage=2, micro_batch_size=2,
                                  bucket_size_mb=25.0),
    "lora-dp4-z3-bf16": _case("bf16-true", model="lora", zero_stage=3),
}
#: The adapters of the "lora" model: rank 4 on every linear of attention and the MLP.
LORA = {"rank": 4, "alpha": 8.0}


def byte_model(case) -> GPT:
    if case["model"] in ("llama", "lora"):
        llama = model({"layers": 4, "preset": "llama-tiny", "groups": 2})
        return llama if case["model"] == "llama" else GPT(llama.config, learning_rate=3e-3, warmup_steps=2, lora=LORA)
    gpt = model({"layers": 4, **({"preset": "llama-tiny", "groups": 2} if case["model"] == "moe" else {})})
    if case["model"] == "moe":
        moe = MoEConfig(num_experts=4, top_k=2, ffn_hidden_size=32, layer_freq=(1, 0, 1, 1))
        gpt = GPT(replace(gpt.config, moe=moe), learning_rate=3e-3, warmup_steps=2, adam_eps=1e-6)
    return gpt
