"""Hugging Face outputs vs our converted model, every family at several layouts over the same processes.

argv: OUT_DIR CHECKS, a comma list of ``<case>:<layout>``: a case is ``gpt2``, ``bert`` or one of
``hf_llama_setup.CASES`` or ``MOE_CASES``; a layout is ``tp<t>`` or ``pp<p>`` or ``tp<t>-pp<p>``, optionally ``-sp``
(sequence parallel), data parallelism taking the remaining ranks. Every rank builds the random HF
model from the shared seed and computes its outputs (the oracle: the logits; BERT's masked-LM and
sentence-order logits, with padding), converts its state dict, builds our model the way the
strategy does (meta device, tensor-parallel plan, pipeline split, materialise) and loads this rank's
part of the converted weights. Each rank writes ``rank{r}.json``: per check, the max |output
difference| where this rank holds the outputs (else null), and whether gathering the weights back
and converting them to HF gives the HF state dict bit for bit (spelled as checkpoints store it: one tensor
per expert).
"""

import json
import re
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist

import hf_bert_setup
import hf_gpt2_setup
import hf_llama_setup
from lightning_megatron.checkpoint.full import gather_full_state_dict, local_state_dict_from_full, merge_pipeline_stages
from lightning_megatron.huggingface import FAMILIES
from lightning_megatron.models import BERTModel, GPTModel
from lightning_megatron.models.gpt import gpt_tensor_parallel_plan
from lightning_megatron.parallel import ParallelConfig, ParallelState
from lightning_megatron.parallel.initialize import initialize_parameters
from lightning_megatron.pipeline import PipelineLayout
from lightning_megatron.pipeline.stage import split_for_pipeline
from lightning_megatron.expert_parallel.apply import prepare_experts
from lightning_megatron.tensor_parallel import parallelize
from lightning_megatron.tensor_parallel.mappings import gather_from_tensor_parallel
from entry import run_script


def converted(hf, **case):
    """What every case shares: our config and full state dict through the family ``model_type`` names."""
    family = FAMILIES[hf.config.model_type]
    hf_state = hf.state_dict()
    config = family.config_from_hf(hf.config.to_dict(), hf_state.keys())
    return SimpleNamespace(config=config, hf_state_dict=family.canonical_hf_state_dict(hf_state, config),
                           full_state_dict=family.state_dict_from_hf(hf_state, config), to_hf=family.hf_state_dict, **case)


def gpt2_case():
    hf = hf_gpt2_setup.build_hf_model()
    input_ids = hf_gpt2_setup.sample_input_ids()
    with torch.no_grad():
        expected = [hf(input_ids).logits]
    return converted(hf, model_class=GPTModel, plan=gpt_tensor_parallel_plan, input_ids=input_ids, side={},
                     expected=expected, seed=hf_gpt2_setup.SEED)


def bert_case():
    hf = hf_bert_setup.build_hf_model()
    inputs = hf_bert_setup.sample_inputs()
    with torch.no_grad():
        out = hf(**inputs)
    side = {name: value for name, value in inputs.items() if name != "input_ids"}
    return converted(hf, model_class=BERTModel, plan=BERTModel.tensor_parallel_plan, input_ids=inputs["input_ids"],
                     side=side, expected=[out.prediction_logits, out.seq_relationship_logits], seed=hf_bert_setup.SEED)


def llama_case(name: str):
    hf = hf_llama_setup.build_hf_model(name)
    input_ids = hf_llama_setup.sample_input_ids()
    with torch.no_grad():
        expected = [hf(input_ids).logits]
    return converted(hf, model_class=GPTModel, plan=gpt_tensor_parallel_plan, input_ids=input_ids, side={},
                     expected=expected, seed=hf_llama_setup.SEED)


def parallel_config(layout: str, world_size: int) -> ParallelConfig:
    match = re.fullmatch(r"(?:ep(\d+)-?)?(?:tp(\d+))?-?(?:pp(\d+))?(-sp)?", layout)
    if match is None or not (match[1] or match[2] or match[3]):
        raise ValueError(f"Unknown layout {layout!r}: expected e.g. tp2, pp2, tp2-pp2, tp2-sp, ep2, ep2-tp2.")
    return ParallelConfig.for_world(world_size, tensor_parallel_size=int(match[2] or 1),
                                    pipeline_parallel_size=int(match[3] or 1), sequence_parallel=bool(match[4]),
                                    expert_parallel_size=int(match[1] or 1))


def build(state: ParallelState, case):
    """Our model as the strategy builds it, holding this rank's part of the converted weights; and its pipeline stage."""
    with torch.device("meta"):
        model = case.model_class(case.config)
    parallelize(model, case.plan(case.config), state)
    prepare_experts(model, state)
    stage = None
    pp = state.config.pipeline_parallel_size
    if pp > 1:
        layout = PipelineLayout(num_layers=case.config.num_layers, pipeline_parallel_size=pp)
        (stage,) = split_for_pipeline(model, case.model_class.pipeline_blocks(), layout.stage_layers(),
                                      layout.stages_of_rank(state.pipeline_parallel_rank))
    initialize_parameters(model, case.seed, device="cpu", only_meta=True)
    model.load_state_dict(local_state_dict_from_full(model, case.full_state_dict))
    return model.eval(), stage


def pipeline_outputs(state: ParallelState, stage, case):
    """Two stages by hand: the first sends its hidden state to the second, which returns the head's outputs."""
    group = state.pipeline_parallel_group
    rank = state.pipeline_parallel_rank
    peer = dist.get_global_rank(group, 1 - rank)
    if rank == 0:
        dist.send(stage(case.input_ids, **case.side).contiguous(), dst=peer)
        return None
    hidden = torch.empty(*case.input_ids.shape, case.config.hidden_size)
    dist.recv(hidden, src=peer)
    return stage(hidden, **case.side)


def as_list(outputs) -> list:
    """GPT: the logits; BERT: masked-LM and sentence-order logits (its head also passes the labels through)."""
    return [outputs] if isinstance(outputs, torch.Tensor) else list(outputs[:2])


def check(state: ParallelState, case) -> dict:
    model, stage = build(state, case)
    with torch.no_grad():
        outputs = model(case.input_ids, **case.side) if stage is None else pipeline_outputs(state, stage, case)
    deviation = None
    if outputs is not None:
        outputs = as_list(outputs)
        outputs[0] = gather_from_tensor_parallel(outputs[0], state.tensor_parallel_group)  # vocab-parallel logits
        outputs[0] = outputs[0][..., : case.config.vocab_size]
        deviation = max((got - want).abs().max().item() for got, want in zip(outputs, case.expected, strict=True))
    gathered = merge_pipeline_stages(gather_full_state_dict(model, state.tensor_parallel_group),
                                     state.pipeline_parallel_group)
    if state.config.expert_parallel_size > 1:
        gathered = merge_pipeline_stages(gathered, state.expert_parallel_group)
    back = case.to_hf(gathered, case.config)
    identical = back.keys() == case.hf_state_dict.keys() and all(torch.equal(back[k], v) for k, v in case.hf_state_dict.items())
    return {"max_abs_diff": deviation, "round_trip_identical": identical}


def main(out_dir: Path, args: list[str]) -> None:
    checks = args[0].split(",")
    builders = {"gpt2": gpt2_case, "bert": bert_case,
                **{name: (lambda name=name: llama_case(name))
                   for name in (*hf_llama_setup.CASES, *hf_llama_setup.MOE_CASES)}}
    cases, states, results = {}, {}, {}
    for item in checks:
        name, layout = item.split(":")
        if name not in cases:
            cases[name] = builders[name]()
        if layout not in states:  # one mesh per layout, shared by every case
            states[layout] = ParallelState.create(parallel_config(layout, dist.get_world_size()), "cpu")
        results[item] = check(states[layout], cases[name])
    (out_dir / f"rank{dist.get_rank()}.json").write_text(json.dumps(results))
    dist.barrier()


if __name__ == "__main__":
    run_script(main)
