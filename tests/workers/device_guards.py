"""``Trainer.fit`` over a matrix of layouts on the same 4 ranks, every run under both guards of
``lightning_megatron.parallel.guards``: every collective's tensors on the strategy's device, and the host syncs of
each optimizer step counted by kind and call site.

argv: OUT_DIR RUNS (a comma list of ``<case>/L<layers>M<micro-batches>[E<experts>]``, cases in :data:`CASES`).
Rank r writes rank{r}.json: per run, the syncs of optimizer steps 2 and 3 (the first step builds what later steps
reuse), those steps' syncs by kind and by call site, the collectives the device check saw, and the strategy's root
device. Micro-batches are the pipeline schedule's under pp, else Lightning's gradient accumulation (one
micro-batch of one sample per Lightning batch); either way each rank trains ``M`` samples per step.
"""

import json
import os
import re
from collections import Counter
from dataclasses import replace
from pathlib import Path

import lightning as L
import torch

from trainer_setup import model
from lightning_megatron import Megatron3DStrategy
from lightning_megatron.data import GPTDataModule, SFTDataModule
from lightning_megatron.models import GPT
from lightning_megatron.models.moe import MoEConfig
from lightning_megatron.parallel.guards import check_collective_devices, count_host_syncs
from entry import run_script


def main(out_dir: Path, args: list[str]) -> None:
    STEPS = 3
    #: case -> the model family, its data, precision and the strategy's layout (4 ranks each).
    CASES = {
        "gpt-tp2-dp2-z1": dict(family="gpt", strategy=dict(tensor_parallel_size=2, zero_stage=1)),
        "llama-pp2-dp2-z1": dict(family="llama", strategy=dict(pipeline_parallel_size=2, zero_stage=1)),
        "moe-dp4-ep2-z1": dict(family="moe", strategy=dict(expert_parallel_size=2, zero_stage=1)),
        "gpt-cp2-dp2": dict(family="gpt", strategy=dict(context_parallel_size=2)),
        "sft-packed-tp2-dp2-z2": dict(family="llama", data="sft", strategy=dict(tensor_parallel_size=2, zero_stage=2)),
        "sft-packed-cp2-dp2-z1": dict(family="llama", data="sft", strategy=dict(context_parallel_size=2, zero_stage=1)),
        "gpt-tp2-dp2-z3": dict(family="gpt", strategy=dict(tensor_parallel_size=2, zero_stage=3)),
        "gpt-dp4-z1-fp16-offload": dict(family="gpt", precision="16-mixed",
                                        strategy=dict(zero_stage=1, offload_optimizer="cpu")),
        "gpt-tp2-dp2-z1-fp16-true": dict(family="gpt", precision="16-true",
                                         strategy=dict(tensor_parallel_size=2, zero_stage=1)),
    }

    def parse(run: str) -> tuple[dict, int, int, int]:
        case, sizes = run.split("/")
        layers, micro_batches, experts = re.fullmatch(r"L(\d+)M(\d+)(?:E(\d+))?", sizes).groups()
        return CASES[case], int(layers), int(micro_batches), int(experts or 4)

    def build_model(family: str, layers: int, experts: int, seq_length: int) -> GPT:
        options = {"layers": layers, **({} if family == "gpt" else {"preset": "llama-tiny", "groups": 2})}
        config = replace(model(options).config, max_seq_length=seq_length)
        if family == "moe":
            config = replace(config, moe=MoEConfig(num_experts=experts, top_k=2, ffn_hidden_size=32))
        return GPT(config, learning_rate=3e-3, warmup_steps=2, adam_eps=1e-6)

    class StepSyncs(L.Callback):
        """The host syncs of each optimizer step: the sum over its Lightning batches (data loading and the batch's move
        to the device left out), by kind and by call site."""

        def __init__(self, syncs) -> None:
            self.syncs = syncs
            self.steps: dict[int, dict] = {}

        def _snapshot(self) -> tuple[Counter, dict]:
            return Counter(self.syncs.by_kind), {kind: Counter(sites) for kind, sites in self.syncs.sites.items()}

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.start, self.step = self._snapshot(), trainer.global_step + 1

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            (kinds, sites), (kinds0, sites0) = self._snapshot(), self.start
            step = self.steps.setdefault(self.step, {"kinds": Counter(), "sites": Counter()})
            step["kinds"].update(kinds - kinds0)
            for kind, counts in sites.items():
                step["sites"].update({f"{kind} {site}": n for site, n in (counts - sites0.get(kind, Counter())).items()})

    def run(name: str) -> dict:
        case, layers, micro_batches, experts = parse(name)
        strategy_kwargs = dict(case["strategy"])
        pipelined = strategy_kwargs.get("pipeline_parallel_size", 1) > 1
        tp, pp = strategy_kwargs.get("tensor_parallel_size", 1), strategy_kwargs.get("pipeline_parallel_size", 1)
        cp = strategy_kwargs.get("context_parallel_size", 1)
        dp = int(os.environ["WORLD_SIZE"]) // (tp * pp * cp)
        samples = dp * (micro_batches if pipelined else 1)  # per Lightning batch, over all dp ranks
        seq_length = 128 if case.get("data") == "sft" else 32  # SFT: room for a few conversations per sample
        if case.get("data") == "sft":
            data = SFTDataModule(seq_length=seq_length, packing=True, global_batch_size=samples, seed=3)
        else:
            data = GPTDataModule(seq_length=seq_length, global_batch_size=samples, max_files=24, seed=3, split="80,10,10")
        L.seed_everything(7)
        strategy = Megatron3DStrategy(**strategy_kwargs, micro_batch_size=1, bucket_size_mb=0.01)
        with count_host_syncs() as syncs, check_collective_devices(torch.device("cpu")) as checked:
            counter = StepSyncs(syncs)
            trainer = L.Trainer(accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]), strategy=strategy,
                                precision=case.get("precision", "32-true"), callbacks=[counter], max_steps=STEPS,
                                accumulate_grad_batches=1 if pipelined else micro_batches, gradient_clip_val=0.5,
                                limit_val_batches=0, num_sanity_val_steps=0, logger=False, enable_checkpointing=False,
                                enable_progress_bar=False, enable_model_summary=False)
            trainer.fit(build_model(case["family"], layers, experts, seq_length), datamodule=data)
        steady = [counter.steps[step] for step in range(2, STEPS + 1)]
        return {"syncs_per_step": [sum(step["kinds"].values()) for step in steady],
                "kinds": dict(sum((step["kinds"] for step in steady), Counter())),
                "sites": dict(sum((step["sites"] for step in steady), Counter())),
                "collectives": dict(checked), "root_device": str(strategy.root_device)}

    runs = args[0].split(",")
    rank = int(os.environ["RANK"])
    results = {name: run(name) for name in runs}
    (out_dir / f"rank{rank}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    run_script(main, join=False)
