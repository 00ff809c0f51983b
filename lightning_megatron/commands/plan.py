"""``lightning-megatron plan``: the best layouts of a config's model on N GPUs, and a config that runs the best.

    lightning-megatron plan --config configs/gpt-8.3b.yaml --gpus 512 --gpu v100 --nodes-of 16
    lightning-megatron plan --config configs/llama-3.1-70b.yaml --gpus 64 --gpu h100 --write-config best.yaml
    lightning-megatron plan --config configs/gpt-1.3b.yaml --gpus 8 --gpu-memory 40GB --json
    lightning-megatron plan --config configs/llama-3.1-8b.yaml --gpus 1 --gpu-memory 24GB --host-memory 64GB --disk 1TB
    lightning-megatron plan --fine-tuning-fit --gpu rtx-4090
    lightning-megatron plan --model path/to/Qwen3-8B --gpus 8 --gpu h100 --seq-length 4096 --global-batch-size 64
    lightning-megatron plan --model-name deepseek-v3 --gpus 1024 --gpu h100 --seq-length 4096 --global-batch-size 4096

The model, global batch, sequence length and precision come from the config (``--global-batch-size``,
``--seq-length`` and ``--precision`` override them); the layout is searched (``--keep`` keeps some of the
config's strategy arguments as they are). The table lists the fastest layouts that fit, ranked by predicted
tokens/s; ``--json`` prints every evaluated layout; ``--write-config`` writes the config with the best
layout, which ``lightning-megatron fit --config`` runs; ``--plot`` draws memory and tokens/s per layout
(``pip install lightning-megatron[plot]``); ``--fine-tuning-fit`` plans published models on one ``--gpu`` with LoRA
and QLoRA (``plan.fine_tuning``); ``--model`` plans a Hugging Face directory's (or a bare ``config.json``'s) model
from its sizes (``plan.hf_model``: the families we convert as ``pretrained=`` reads them, other decoders as their
Llama-shaped equivalent, said in the output); ``--model-name`` plans one of ``GPTConfig``'s presets (e.g.
``qwen3-30b-a3b``, ``gpt-oss-120b``, ``deepseek-v3``), a Mixture of Experts with its active parameters and the
model FLOPs of a token (its ``top_k`` experts, the shared ones and dense layers: what MFU counts). The offload
tiers (``offload_optimizer``, ``offload_parameters``: ``cpu``, ``nvme``) are searched too: ``--host-memory`` and
``--disk`` (a node's RAM and free NVMe) bound them.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import yaml

from lightning_megatron.models.flops import flops_per_batch
from lightning_megatron.plan.hardware import GIB, GPUS, Hardware, parse_gpu, presets_with_memory
from lightning_megatron.offload.settings import DEFAULT_BUFFER_MB
from lightning_megatron.plan.layout import OFFLOAD_PATH_PLACEHOLDER, Layout, Workload
from lightning_megatron.plan.fine_tuning import fine_tuning_fits, format_fits
from lightning_megatron.plan.hf_model import HFModel, hf_model, transformers_parameters
from lightning_megatron.plan.no_fit import explain_no_fit
from lightning_megatron.plan.planner import SEARCHED, LayoutPlan, Planner
from lightning_megatron.simulate.fake_world import StageMailbox, simulation_device
from lightning_megatron.simulate.report import compare_with_plan, format_report, parse_ranks, ranks_that_differ
from lightning_megatron.simulate.step import Job, RankResult, simulate_rank
from lightning_megatron.strategy.options import StrategyOptions



def module_factory(model_section: dict) -> Callable[[], Any]:
    """A function building the config's LightningModule (``class_path`` and ``init_args``) anew, its arguments read
    as LightningCLI reads them (jsonargparse: typed by the signature, so YAML's ``3e-05`` is a float)."""
    from jsonargparse import ArgumentParser
    from lightning.pytorch import LightningModule

    class_path = model_section.get("class_path")
    if not class_path or "." not in class_path:
        raise ValueError(f"The config's model section needs a class_path (e.g. lightning_megatron.models.GPT); "
                         f"got {model_section!r}.")
    parser = ArgumentParser(exit_on_error=False)
    parser.add_subclass_arguments(LightningModule, "model")
    try:
        parsed = parser.parse_object({"model": model_section})
    except Exception as error:  # jsonargparse's ArgumentError: the message names the argument
        raise ValueError(f"The config's model section: {error}") from None
    return lambda: parser.instantiate(parsed).model


def planner_from_config(config: dict, *, gpus: int, hardware: Hardware, global_batch_size: Optional[int] = None,
                        seq_length: Optional[int] = None, precision: Optional[str] = None,
                        keep: Sequence[str] = (), make_module: Optional[Callable[[], Any]] = None) -> Planner:
    """The planner of a fit config (``make_module``, when given, builds the model instead of its model section)."""
    trainer = config.get("trainer") or {}
    strategy = _strategy_arguments(config)
    data = (config.get("data") or {}).get("init_args") or {}
    unknown = sorted(set(keep) - set(SEARCHED))
    if unknown:
        raise ValueError(f"--keep {','.join(unknown)}: not layout fields; choose among {', '.join(SEARCHED)}.")
    fixed = {name: strategy.get(name, Layout.__dataclass_fields__[name].default) for name in keep}
    if strategy.get("overlap_param_gather"):
        fixed["overlap_param_gather"] = True
    if strategy.get("pipeline_layers_per_stage"):
        fixed["pipeline_layers_per_stage"] = tuple(strategy["pipeline_layers_per_stage"])
    workload = Workload(
        # The data module's global batch is one loader batch; the Trainer's accumulation makes the optimizer step's.
        global_batch_size=global_batch_size or (data.get("global_batch_size") or _missing("global_batch_size"))
        * int(trainer.get("accumulate_grad_batches", 1)),
        seq_length=seq_length or data.get("seq_length") or _missing("seq_length"),
        precision=str(precision or trainer.get("precision", "bf16-true")),
        bucket_size_mb=float(strategy.get("bucket_size_mb", 25.0)),
        pad_vocab_to_multiple_of=int(strategy.get("pad_vocab_to_multiple_of", 128)),
        offload_buffer_mb=float(strategy.get("offload_buffer_mb", DEFAULT_BUFFER_MB)),
        fp8=bool(strategy.get("fp8")))
    return Planner(make_module or module_factory(config.get("model") or {}), workload, hardware, world_size=gpus,
                   fixed=fixed)


def model_config(model: HFModel, *, gpus: int, global_batch_size: Optional[int], seq_length: Optional[int],
                 precision: Optional[str]) -> dict:
    """The fit config ``--model`` plans: the directory's model (``pretrained``, where it converts natively), the
    batch and sequence length given, no strategy arguments."""
    missing = [flag for flag, value in (("--global-batch-size", global_batch_size), ("--seq-length", seq_length))
               if value is None]
    if missing:
        raise ValueError(f"--model needs {' and '.join(missing)} (a config.json has no batch).")
    if seq_length > model.config.max_seq_length:
        raise ValueError(f"--seq-length {seq_length} exceeds the {model.config.max_seq_length} positions of {model.path} "
                         f"(max_position_embeddings), which training would refuse; plan at most that many tokens.")
    init_args = {"pretrained": os.fspath(model.path.parent)} if model.native and model.path.name == "config.json" \
        else {}
    module = model.lightning_module
    return {"model": {"class_path": f"{module.__module__.rsplit('.', 1)[0]}.{module.__name__}", "init_args": init_args},
            "trainer": {"devices": gpus, "precision": precision or "bf16-true"},
            "data": {"init_args": {"global_batch_size": global_batch_size, "seq_length": seq_length}}}


def preset_config(name: str, *, gpus: int, global_batch_size: Optional[int], seq_length: Optional[int],
                  precision: Optional[str]) -> dict:
    """The fit config ``--model-name`` plans: ``GPT(config=name)``, a ``GPTConfig`` preset, with the batch and sequence
    length given and no strategy arguments."""
    from lightning_megatron.models.gpt import GPT_PRESETS

    if name not in GPT_PRESETS:
        raise ValueError(f"--model-name {name!r} is not a GPTConfig preset; choose one of "
                         f"{', '.join(sorted(GPT_PRESETS))}.")
    missing = [flag for flag, value in (("--global-batch-size", global_batch_size), ("--seq-length", seq_length))
               if value is None]
    if missing:
        raise ValueError(f"--model-name needs {' and '.join(missing)} (a preset has no batch).")
    return {"model": {"class_path": "lightning_megatron.models.GPT", "init_args": {"config": name}},
            "trainer": {"devices": gpus, "precision": precision or "bf16-true"},
            "data": {"init_args": {"global_batch_size": global_batch_size, "seq_length": seq_length}}}


def describe_parameters(planner: Planner) -> str:
    """The planned model's parameters (vocabulary padding included) and, for a Mixture of Experts, those one token
    uses and its training FLOPs (forward and backward: the model FLOPs behind MFU)."""
    def count(n: float) -> str:
        return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"

    text = f"{count(planner.inventory(1).total_parameters)} parameters"
    config = planner.shape.config
    if planner.shape.num_experts:  # a GPTConfig (BERT has no experts)
        seq = planner.workload.seq_length
        per_token = flops_per_batch(config, 1, seq) / seq
        text += (f" ({count(config.num_active_parameters())} active a token; {per_token / 1e9:.3g} GFLOPs a token to "
                 f"train at {seq} tokens)")
    return text


def describe_model(model: HFModel) -> str:
    """What ``--model`` read and did not model, and ``transformers``' own count of the model's parameters against
    the planned model's (without the vocabulary padding the strategy adds, which the plan counts)."""
    lines = [f"  {note}" for note in model.notes]
    counted = transformers_parameters(model.fields)
    if counted is not None:
        name, count = counted
        planned = model.parameters()
        difference = planned - count
        lines.append(f"  transformers' {name} of this config: {count:,} parameters; the planned model {planned:,} "
                     f"before vocabulary padding"
                     + (f" ({difference:+,}: pieces not modelled, {abs(difference) / count:.3%})" if difference
                        else " (the same)"))
    return "\n".join(lines)


def _strategy_arguments(config: dict) -> dict:
    """The config's ``trainer.strategy.init_args`` (empty when the strategy is given by name)."""
    strategy = (config.get("trainer") or {}).get("strategy")
    return dict((strategy.get("init_args") or {}) if isinstance(strategy, dict) else {})


def _missing(name: str):
    raise ValueError(f"The config's data section has no {name}; pass --{name.replace('_', '-')}.")


def configured_layout(config: dict, world: int, workload: Workload) -> Layout:
    """The layout a config's strategy arguments (and Trainer accumulation) describe on ``world`` GPUs."""
    trainer = config.get("trainer") or {}
    strategy = _strategy_arguments(config)
    fields = {name: strategy[name] for name in Layout.__dataclass_fields__ if name in strategy}
    if fields.get("pipeline_layers_per_stage"):
        fields["pipeline_layers_per_stage"] = tuple(fields["pipeline_layers_per_stage"])
    model_parallel = (fields.get("tensor_parallel_size", 1) * fields.get("pipeline_parallel_size", 1)
                      * fields.get("context_parallel_size", 1))
    if fields.get("data_parallel_size", "auto") == "auto":
        if world % model_parallel:
            raise ValueError(f"{world} GPUs are not a multiple of the config's tp x pp x cp = {model_parallel}.")
        fields["data_parallel_size"] = world // model_parallel
    accumulate = int(trainer.get("accumulate_grad_batches", 1))
    if fields.get("pipeline_parallel_size", 1) == 1:  # one pass takes the loader's whole per-rank batch
        fields["micro_batch_size"] = max(1, workload.global_batch_size // fields["data_parallel_size"] // accumulate)
    return Layout(**fields, accumulate_grad_batches=accumulate)


def describe_configured(planner: Planner, layout: Layout) -> str:
    """Every pipeline rank's predicted memory for the config's own layout, and its step time."""
    from lightning_megatron.plan.layout import check_layout

    check_layout(layout, planner.workload, planner.module, planner.shape.num_layers)
    plan = planner.evaluate(layout)
    lines = [f"as configured: {layout.label()} on {planner.world_size} x {planner.hardware.name}"]
    for rank in planner.rank_memory(layout):
        state = ", ".join(f"{key.replace('_', ' ')} {value / GIB:.2f}" for key, value in rank.model_state_bytes.items())
        lines.append(f"  pipeline rank {rank.pipeline_rank}: model state {sum(rank.model_state_bytes.values()) / GIB:.2f} "
                     f"GiB ({state}), activations {rank.activation_bytes / GIB:.2f} GiB, buffers "
                     f"{rank.buffer_bytes / GIB:.2f} GiB: {rank.total / GIB:.2f} GiB per GPU")
    lines.append(f"  host RAM {plan.host_bytes_per_gpu / GIB:.2f} GiB per GPU, disk {plan.disk_bytes_per_gpu / GIB:.2f} GiB "
                 f"per GPU ({plan.ranks_per_node} GPUs per node)")
    verdict = ("fits" if plan.fits else "does NOT fit (" + "; ".join(plan.limits) + ")")
    lines.append(f"  {verdict} in {planner.hardware.memory_bytes / GIB:.1f} GiB per GPU; "
                 f"step {plan.step_seconds:.3g} s, {plan.tokens_per_second:,.0f} tokens/s, MFU {plan.mfu:.1%}")
    return "\n".join(lines)


def job_of(config: dict, gpus: int) -> Job:
    """The ``Job`` a fit config runs on ``gpus`` GPUs."""
    trainer = config.get("trainer") or {}
    data = (config.get("data") or {}).get("init_args") or {}
    for name in ("global_batch_size", "seq_length"):
        if not data.get(name):
            raise ValueError(f"The config's data section has no {name}, which the simulated batches need.")
    return Job(module_factory(config.get("model") or {}), StrategyOptions(**_strategy_arguments(config)), world_size=gpus,
               precision=str(trainer.get("precision", "32-true")), loader_batch_size=int(data["global_batch_size"]),
               seq_length=int(data["seq_length"]), accumulate_grad_batches=int(trainer.get("accumulate_grad_batches", 1)),
               gradient_clip_val=trainer.get("gradient_clip_val"), device=simulation_device())


def simulate_config(config: dict, *, gpus: int, hardware: Hardware, ranks: Optional[str] = None,
                    progress=None) -> list[RankResult]:
    """Simulate ``ranks`` (``--ranks``' text; default: the ranks that differ) of ``config`` on ``gpus`` GPUs, each
    with the planner's prediction for it (``RankResult.planned``)."""
    job = job_of(config, gpus)
    parallel = job.parallel_config
    chosen = parse_ranks(ranks, parallel) if ranks else ranks_that_differ(parallel)
    planner = planner_from_config(config, gpus=gpus, hardware=hardware)
    layout = configured_layout(config, gpus, planner.workload)
    mailbox = StageMailbox()
    results = []
    for number, rank in enumerate(chosen, 1):
        if progress is not None:
            progress(f"simulating rank {rank} ({number}/{len(chosen)}) of {gpus} ...")
        result = simulate_rank(job, rank, mailbox)
        compare_with_plan(result, planner, layout)
        results.append(result)
    return results


def layout_config(config: dict, plan: LayoutPlan, workload: Workload, hardware: Hardware, world: int) -> dict:
    """``config`` with the strategy, devices and batch of ``plan``: what ``lightning-megatron fit`` runs."""
    out = copy.deepcopy(config)
    trainer = out.setdefault("trainer", {})
    strategy = trainer.get("strategy") if isinstance(trainer.get("strategy"), dict) else {}
    configured = dict(strategy.get("init_args") or {})
    path = configured.pop("offload_path", None)
    for name in ("offload_optimizer", "offload_parameters"):  # the plan's arguments name them where they are used
        configured.pop(name, None)
    init_args = {**configured, **plan.layout.strategy_arguments()}
    if path and "offload_path" in init_args:  # the config already names the disk: keep it over the placeholder
        init_args["offload_path"] = path
    trainer["strategy"] = {"class_path": "lightning_megatron.Megatron3DStrategy", "init_args": init_args}
    devices = min(world, hardware.gpus_per_node)
    trainer["devices"], trainer["num_nodes"] = devices, world // devices
    trainer["precision"] = workload.precision
    trainer["accumulate_grad_batches"] = plan.layout.accumulate_grad_batches
    data = out.setdefault("data", {}).setdefault("init_args", {})
    # The data module's global batch is one loader batch; accumulation makes the optimizer step's.
    data["global_batch_size"] = workload.global_batch_size // plan.layout.accumulate_grad_batches
    data["seq_length"] = workload.seq_length
    return out


def written_config_text(written: dict) -> str:
    """The YAML of a written config; a planned ``"nvme"`` tier's ``offload_path`` is a placeholder, said so on top."""
    text = yaml.safe_dump(written, sort_keys=False)
    if OFFLOAD_PATH_PLACEHOLDER in text:
        text = (f"# SET offload_path: the planner chose the 'nvme' offload tier; replace {OFFLOAD_PATH_PLACEHOLDER}\n"
                f"# with a folder on a fast local NVMe disk with the free space the plan names.\n") + text
    return text


def memory_override_note(hardware: Hardware) -> str:
    """What ``--gpu-memory`` without the matching ``--gpu`` predicts (``parse_gpu`` named the hardware
    ``"a100 rates with 24GB"``), and the catalogue's GPUs of that memory."""
    same = [key for key in presets_with_memory(hardware.memory_bytes) if key != "h100-te"]
    named = f": --gpu {', '.join(same)} for their own" if same else ""
    rates = hardware.name.split(" rates with ")[0]
    return (f"(--gpu-memory sets the memory only: the rates are {rates}'s; the catalogue's GPUs of "
            f"{hardware.memory_bytes / 1e9:.0f} GB{named})")


def format_table(plans: Sequence[LayoutPlan], hardware: Hardware) -> str:
    """One row per layout; ``host/node`` and ``disk/node``: the offload tiers' RAM (with ``HOST_PROCESS_BYTES`` a
    rank) and files of a node's ranks together, the figures ``--host-memory`` and ``--disk`` bound."""
    rows = [("#", "layout", "memory/GPU", "host/node", "disk/node", "fits", "step s", "tokens/s", "MFU",
             "where the time goes")]
    for index, plan in enumerate(plans, 1):
        parts = sorted(((v, k) for k, v in plan.time.parts().items() if v > 0), reverse=True)[:3]
        verdict = "yes" if plan.fits else "no: " + ", ".join(limit.split(":")[0] for limit in plan.limits)
        rows.append((str(index), plan.layout.label(), f"{plan.memory_per_gpu_bytes / GIB:.1f} GiB",
                     f"{plan.host_bytes_per_node / GIB:.1f} GiB", f"{plan.disk_bytes_per_node / GIB:.1f} GiB"
                     if plan.disk_bytes_per_node else "-",
                     verdict, f"{plan.step_seconds:.3g}", f"{plan.tokens_per_second:,.0f}",
                     f"{plan.mfu:.1%}", ", ".join(f"{k.replace('_', ' ')} {v / plan.step_seconds:.0%}" for v, k in parts)))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(lines)


def plot(plans: Sequence[LayoutPlan], hardware: Hardware, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("--plot needs matplotlib: pip install 'lightning-megatron[plot]'.") from None
    figure, axis = plt.subplots(figsize=(8, 5))
    memory = [p.memory_per_gpu_bytes / GIB for p in plans]
    speed = [p.tokens_per_second for p in plans]
    axis.scatter(memory, speed, c=["tab:blue" if p.fits else "tab:gray" for p in plans], s=12)
    axis.axvline(hardware.memory_bytes / GIB, color="tab:red", linestyle="--", label="GPU memory")
    for rank, p in enumerate([p for p in plans if p.fits][:3]):  # the best three, labelled apart
        point = (p.memory_per_gpu_bytes / GIB, p.tokens_per_second)
        axis.scatter(*point, marker="*", s=120, color="tab:orange", zorder=3)
        axis.annotate(f"{rank + 1}. {p.layout.label()}", point, xytext=(-150, -18 * (rank + 1)),
                      textcoords="offset points", fontsize=8, arrowprops={"arrowstyle": "-", "color": "0.5"})
    axis.set_xlabel("predicted memory per GPU (GiB)")
    axis.set_ylabel("predicted tokens/s")
    axis.set_xscale("log")
    axis.set_title(f"{len(plans)} layouts on {hardware.name} (blue: fit, grey: do not)")
    axis.legend(loc="lower right")
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="lightning-megatron plan", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, help="a lightning-megatron fit config (YAML)")
    parser.add_argument("--model", type=Path,
                        help="instead of a config: a Hugging Face model directory or its config.json (sizes only, no "
                             "weights read); needs --seq-length and --global-batch-size (--gpus: 1 by default)")
    parser.add_argument("--model-name",
                        help="instead of a config: a GPTConfig preset (e.g. qwen3-30b-a3b, gpt-oss-120b, deepseek-v3); "
                             "needs --seq-length and --global-batch-size (--gpus: 1 by default)")
    parser.add_argument("--fine-tuning-fit", action="store_true",
                        help="instead of a config: which published models fine-tune on ONE --gpu with LoRA (16-bit "
                             "base) and with QLoRA (4-bit NF4 base), rank-16 adapters (--seq-length, "
                             "--global-batch-size: 4096 and 16 by default)")
    parser.add_argument("--gpus", type=int, help="GPUs in all (default: the config's devices x num_nodes)")
    parser.add_argument("--gpu", default="a100",
                        help=f"one of {', '.join(GPUS)} (default a100: the 80 GB SXM), or custom:peak=TFLOPS,hbm=GBPS,"
                             f"nvlink=GBPS,network=GBPS[,memory=GB,node=N,base=PRESET]")
    parser.add_argument("--gpu-memory", help="memory per GPU, e.g. 80GB, 24GB or 40GiB (default: the GPU's; the "
                                             "--gpu's rates are kept: --gpu rtx-4090 for a 24 GB GPU's own)")
    parser.add_argument("--host-memory", help="RAM of a node for the offload tiers, e.g. 256GB (default: the GPU's "
                                              "node's in the catalogue: a DGX's 2 TB, 1.5 TB for v100; 128 GB for a "
                                              "rtx-4090 or a6000 workstation)")
    parser.add_argument("--disk", help="free NVMe disk of a node for the 'nvme' offload tier, e.g. 2TB (default: the "
                                       "GPU's node's: a DGX's 30 TB)")
    parser.add_argument("--nodes-of", type=int, help="GPUs per node (default: the GPU's node: a DGX's 8)")
    parser.add_argument("--global-batch-size", type=int, help="sequences per optimizer step (default: the config's)")
    parser.add_argument("--seq-length", type=int, help="tokens per sequence (default: the config's)")
    parser.add_argument("--precision", help="trainer precision (default: the config's)")
    parser.add_argument("--keep", default="", help=f"comma list of strategy arguments to keep from the config: "
                                                   f"{', '.join(SEARCHED)}")
    parser.add_argument("--as-configured", action="store_true",
                        help="predict the config's own layout (every pipeline rank's memory) instead of searching")
    parser.add_argument("--top", type=int, default=10, help="rows of the table")
    parser.add_argument("--json", action="store_true", help="print every evaluated layout as JSON instead")
    parser.add_argument("--write-config", type=Path, help="write the config with the best layout here")
    parser.add_argument("--plot", type=Path, help="draw memory and tokens/s per layout into this image")
    parser.add_argument("--verify", action="store_true",
                        help="run the best layout's training step for the ranks that differ (lightning-megatron "
                             "simulate) and print each rank's simulated peak beside the prediction")
    args = parser.parse_args(argv)
    if [args.config is not None, args.model is not None, args.model_name is not None,
            args.fine_tuning_fit].count(True) != 1:
        parser.error("give one of --config (a fit config to plan), --model (a Hugging Face directory or config.json), "
                     "--model-name (a GPTConfig preset) or --fine-tuning-fit")
    if (args.model is not None or args.model_name is not None) and (args.keep or args.as_configured):
        parser.error("--keep and --as-configured read a config's strategy; --model and --model-name have none: use "
                     "--config")
    try:
        hardware = parse_gpu(args.gpu, memory=args.gpu_memory, gpus_per_node=args.nodes_of,
                             host_memory=args.host_memory, disk=args.disk)
        if args.fine_tuning_fit:
            fits = fine_tuning_fits(hardware, seq_length=args.seq_length or 4096,
                                    global_batch_size=args.global_batch_size or 16)
            print(format_fits(fits, hardware))
            return
        model = None
        if args.model is not None:
            model = hf_model(args.model)
            config = model_config(model, gpus=args.gpus or 1, global_batch_size=args.global_batch_size,
                                  seq_length=args.seq_length, precision=args.precision)
            if args.write_config is not None and not config["model"]["init_args"]:
                raise ValueError(f"--write-config: {args.model} is not a Hugging Face directory of a family we convert "
                                 f"({model.model_type}): its plan is that of an equivalent model, which fit would "
                                 f"train from random weights. Plan a directory GPT(pretrained=...) reads, or --config.")
        elif args.model_name is not None:
            config = preset_config(args.model_name, gpus=args.gpus or 1, global_batch_size=args.global_batch_size,
                                   seq_length=args.seq_length, precision=args.precision)
        else:
            config = yaml.safe_load(args.config.read_text())
        trainer = config.get("trainer") or {}
        gpus = args.gpus or int(trainer.get("devices", 1)) * int(trainer.get("num_nodes", 1))
        planner = planner_from_config(config, gpus=gpus, hardware=hardware, global_batch_size=args.global_batch_size,
                                      seq_length=args.seq_length, precision=args.precision,
                                      keep=[k for k in args.keep.split(",") if k],
                                      make_module=model and model.make_module)
        if args.as_configured:
            print(describe_configured(planner, configured_layout(config, gpus, planner.workload)))
            if " rates with " in hardware.name:
                print(memory_override_note(hardware))
            return
        result = planner.plan()
    except (ValueError, TypeError, OSError, yaml.YAMLError) as error:
        raise SystemExit(f"lightning-megatron plan: {error}") from None
    if args.json:
        print(json.dumps([p.to_json(planner.workload.precision) for p in result.plans], indent=1))
    else:
        shape = planner.shape
        name = args.model_name or (args.model or args.config).name
        print(f"{name}: {describe_parameters(planner)}, {shape.num_layers} layers, "
              f"hidden {shape.hidden_size}; global batch {planner.workload.global_batch_size} x "
              f"{planner.workload.seq_length} tokens, {planner.workload.precision}, {planner.optimizer_name}")
        if model is not None:
            print(describe_model(model))
        print(f"{gpus} x {hardware.name} ({hardware.memory_bytes / GIB:.1f} GiB, {hardware.gpus_per_node} per node; "
              f"{hardware.host_memory_bytes / GIB:,.0f} GiB host memory, {hardware.disk_bytes / GIB:,.0f} GiB disk per "
              f"node): {len(result.plans)} valid layouts, {len(result.fitting)} fit")
        if " rates with " in hardware.name:
            print(memory_override_note(hardware))
        if result.plans:
            print(format_table(result.fitting[: args.top] or result.plans[: min(args.top, 3)], hardware))
    if result.best is None:
        print(explain_no_fit(result, planner), file=sys.stderr)
        raise SystemExit(1)
    if args.write_config is not None:
        written = layout_config(config, result.best, planner.workload, hardware, gpus)
        if args.write_config.exists():
            raise SystemExit(f"--write-config {args.write_config} exists; the planner never overwrites a file. "
                             f"Choose a new name.")
        args.write_config.write_text(written_config_text(written))
        print(f"wrote {args.write_config}: lightning-megatron fit --config {args.write_config}", file=sys.stderr)
        if "offload_path" in written["trainer"]["strategy"]["init_args"]:
            print(f"set offload_path in {args.write_config} to a folder on a fast local NVMe disk with "
                  f"{result.best.disk_bytes_per_gpu / GIB:.1f} GiB free per GPU", file=sys.stderr)
    if args.plot is not None:
        plot(result.plans, hardware, args.plot)
    if args.verify:
        best = layout_config(config, result.best, planner.workload, hardware, gpus)
        print(f"verifying {result.best.layout.label()} (lightning-megatron simulate):")
        try:
            print(format_report(simulate_config(best, gpus=gpus, hardware=hardware,
                                                progress=lambda line: print(line, file=sys.stderr, flush=True))))
        except (ValueError, TypeError) as error:
            raise SystemExit(f"lightning-megatron plan --verify: {error}") from None
