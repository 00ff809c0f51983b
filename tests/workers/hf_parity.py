"""Hugging Face GPT-2 logits vs our converted GPT at several layouts over the same processes (2 ranks).

argv: OUT_DIR LAYOUTS, a comma list of ``tp2``, ``tp2-sp``, ``pp2``. Every rank builds the
random HF model from the shared seed and computes its logits (the oracle), converts its
state dict, builds our model the way the strategy does (meta device, tensor-parallel plan,
pipeline split, materialise) and loads this rank's part of the converted weights. Each rank
writes ``rank{r}.json``: per layout, the max |logit difference| where this rank holds the
logits (else null), and whether gathering the weights back and converting them to HF gives
the HF state dict bit for bit.
"""

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from hf_gpt2_setup import SEED, build_hf_model, sample_input_ids
from lightning_megatron.checkpoint.full import gather_full_state_dict, local_state_dict_from_full, merge_pipeline_stages
from lightning_megatron.checkpoint.hf import gpt_config_from_hf, gpt_state_dict_from_hf, hf_state_dict_from_gpt
from lightning_megatron.models import GPTModel
from lightning_megatron.parallel import ParallelConfig, ParallelState
from lightning_megatron.parallel.initialize import initialize_parameters
from lightning_megatron.pipeline import PipelineLayout
from lightning_megatron.pipeline.stage import split_for_pipeline
from lightning_megatron.tensor_parallel import parallelize
from lightning_megatron.tensor_parallel.mappings import gather_from_tensor_parallel

LAYOUTS = {
    "tp2": ParallelConfig(tensor_parallel_size=2),
    "tp2-sp": ParallelConfig(tensor_parallel_size=2, sequence_parallel=True),
    "pp2": ParallelConfig(pipeline_parallel_size=2),
}


def build(state: ParallelState, config, full_state_dict):
    """Our model as the strategy builds it, holding this rank's part of ``full_state_dict``; and its pipeline stage."""
    with torch.device("meta"):
        model = GPTModel(config)
    parallelize(model, GPTModel.tensor_parallel_plan(), state)
    stage = None
    pp = state.config.pipeline_parallel_size
    if pp > 1:
        layout = PipelineLayout(num_layers=config.num_layers, pipeline_parallel_size=pp)
        (stage,) = split_for_pipeline(model, GPTModel.pipeline_blocks(), layout.stage_layers(),
                                      layout.stages_of_rank(state.pipeline_parallel_rank))
    initialize_parameters(model, SEED, device="cpu", only_meta=True)
    model.load_state_dict(local_state_dict_from_full(model, full_state_dict))
    return model.eval(), stage


def pipeline_logits(state: ParallelState, stage, input_ids: torch.Tensor, hidden_size: int):
    """Two stages by hand: the first sends its hidden state to the second, which returns the logits."""
    group = state.pipeline_parallel_group
    rank = state.pipeline_parallel_rank
    peer = dist.get_global_rank(group, 1 - rank)
    if rank == 0:
        dist.send(stage(input_ids).contiguous(), dst=peer)
        return None
    hidden = torch.empty(*input_ids.shape, hidden_size)
    dist.recv(hidden, src=peer)
    return stage(hidden)


def check(layout: str, config, full_state_dict, hf_state_dict, input_ids, expected) -> dict:
    state = ParallelState.create(LAYOUTS[layout], "cpu")
    model, stage = build(state, config, full_state_dict)
    with torch.no_grad():
        if stage is None:
            logits = gather_from_tensor_parallel(model(input_ids), state.tensor_parallel_group)
        else:
            logits = pipeline_logits(state, stage, input_ids, config.hidden_size)
    deviation = None if logits is None else (logits[..., : config.vocab_size] - expected).abs().max().item()
    gathered = merge_pipeline_stages(gather_full_state_dict(model, state.tensor_parallel_group),
                                     state.pipeline_parallel_group)
    back = hf_state_dict_from_gpt(gathered, config)
    identical = back.keys() == hf_state_dict.keys() and all(torch.equal(back[k], v) for k, v in hf_state_dict.items())
    return {"max_abs_diff": deviation, "round_trip_identical": identical}


if __name__ == "__main__":
    out_dir, layouts = Path(sys.argv[1]), sys.argv[2].split(",")
    dist.init_process_group("gloo")
    hf = build_hf_model()
    input_ids = sample_input_ids()
    with torch.no_grad():
        expected = hf(input_ids).logits
    config = gpt_config_from_hf(hf.config)
    hf_state_dict = hf.state_dict()
    full_state_dict = gpt_state_dict_from_hf(hf_state_dict, config)
    results = {layout: check(layout, config, full_state_dict, hf_state_dict, input_ids, expected) for layout in layouts}
    (out_dir / f"rank{dist.get_rank()}.json").write_text(json.dumps(results))
    dist.barrier()
    os._exit(0)  # skip gloo's C++ teardown: with several meshes alive it aborts at random (torch 2.13)
