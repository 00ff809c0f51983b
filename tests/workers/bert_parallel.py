"""BERT under tensor (and data) parallelism: a few layouts, then a Trainer.fit, over the same processes.

argv: OUT_DIR LAYOUTS, where LAYOUTS is a comma list of ``{pre|post}-[pp{P}-]tp{T}-dp{D}[-sp]``
(pipelined layouts run 2 micro-batches per rank through the 1F1B schedule). For
each layout, rank 0 writes the losses, masked-token accuracy counts and full (gathered) weights
to ``{layout}.pt``. Then a 2-step ``Trainer.fit`` of ``BERT("bert-tiny")`` with
``BERTDataModule`` under ``Megatron3DStrategy(tensor_parallel_size=world)``; every rank writes its
losses and metrics to rank{r}.json, rank 0 the gathered weights to fit_weights.pt.
"""

import json
import re
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist

from bert_setup import CLIP, CONFIGS, SEED, batches, fit_datamodule, fit_model, fit_trainer_kwargs, model_loss, optimizer
from lightning_megatron import Megatron3DStrategy
from lightning_megatron.checkpoint import gather_full_state_dict, merge_pipeline_stages
from lightning_megatron.models import BERTModel
from lightning_megatron.optim import GradientSynchronizer, clip_grads_by_global_norm
from lightning_megatron.optim.partial_grads import partial_grad_groups
from lightning_megatron.parallel import ParallelConfig, ParallelState, TensorParallelRNG
from lightning_megatron.parallel.initialize import initialize_parameters
from lightning_megatron.pipeline import PipelineLayout
from lightning_megatron.pipeline.runner import PipelineRunner
from lightning_megatron.pipeline.stage import split_for_pipeline
from lightning_megatron.tensor_parallel import parallelize
from entry import run_script


def main(out_dir: Path, args: list[str]) -> None:
    layouts = args[0].split(",")
    rank = dist.get_rank()
    summary = {}

    for layout in layouts:
        match = re.fullmatch(r"(pre|post)-(?:pp(\d+)-)?tp(\d+)-dp(\d+)(-sp)?", layout)
        config, pp, tp, dp, sp = CONFIGS[match[1]], int(match[2] or 1), int(match[3]), int(match[4]), bool(match[5])
        state = ParallelState.create(ParallelConfig(tensor_parallel_size=tp, pipeline_parallel_size=pp,
                                                    data_parallel_size=dp, sequence_parallel=sp), "cpu")
        tp_group, dp_group = state.tensor_parallel_group, state.data_parallel_group

        with torch.device("meta"):
            model = BERTModel(config)
        rng = TensorParallelRNG(SEED, state.tensor_parallel_rank, torch.device("cpu"))
        parallelize(model, BERTModel.tensor_parallel_plan(config), state, rng=rng)
        if pp > 1:
            stage_layout = PipelineLayout(num_layers=config.num_layers, pipeline_parallel_size=pp)
            local = stage_layout.stages_of_rank(state.pipeline_parallel_rank)
            stages = split_for_pipeline(model, BERTModel.pipeline_blocks(), stage_layout.stage_layers(), local)
        initialize_parameters(model, SEED, device="cpu", only_meta=True)
        params = list(model.parameters())
        opt = optimizer(params)
        sync = GradientSynchronizer(params, data_parallel_group=dp_group, bucket_size_mb=0.01,
                                    partial_grad_groups=partial_grad_groups(params, state))
        if pp > 1:
            runner = PipelineRunner(stages, local, num_stages=stage_layout.num_stages, group=state.pipeline_parallel_group,
                                    device=torch.device("cpu"), schedule="1f1b", micro_batch_size=2, root=model,
                                    before_backward=lambda n, _tokens: sync.start_micro_batch(sync=True, backward_passes=n))
            model.loss = runner.loss  # as the strategy does: loss() runs the schedule, backward included

        losses, correct = [], []
        for batch in batches():
            per_rank = len(batch["input_ids"]) // dp
            local = {k: v[state.data_parallel_rank * per_rank : (state.data_parallel_rank + 1) * per_rank] for k, v in batch.items()}
            sync.start_micro_batch(sync=True)
            out = model_loss(model, local)
            if pp == 1:
                out.loss_sum.backward()
            sync.finish(out.num_tokens)
            clip_grads_by_global_norm(params, CLIP, model_parallel_group=state.model_parallel_group,
                                      is_first_tensor_rank=state.tensor_parallel_rank == 0)
            opt.step()
            sync.zero()
            totals = torch.stack([out.loss_sum.detach(), out.num_tokens.float(), out.num_correct.float()])
            if dp_group is not None:
                dist.all_reduce(totals, group=dp_group)
            losses.append((totals[0] / totals[1]).item())
            correct.append(int(totals[2]))

        weights = merge_pipeline_stages(gather_full_state_dict(model, tp_group), state.pipeline_parallel_group)
        sync.remove()
        if rank == 0:
            torch.save({"losses": losses, "correct": correct, "weights": weights}, out_dir / f"{layout}.pt")
        summary[layout] = losses

    class RecordLosses(L.Callback):
        def __init__(self):
            self.losses = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.losses.append(float(outputs["loss"]))

    L.seed_everything(7)
    record = RecordLosses()
    trainer = L.Trainer(accelerator="cpu", devices=dist.get_world_size(), callbacks=[record],
                        strategy=Megatron3DStrategy(tensor_parallel_size=dist.get_world_size(), bucket_size_mb=0.01),
                        **fit_trainer_kwargs())
    trainer.fit(fit_model(), datamodule=fit_datamodule())
    fit_weights = trainer.strategy.full_state_dict()
    if rank == 0:
        torch.save(fit_weights, out_dir / "fit_weights.pt")
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    result = {"layouts": summary, "fit_losses": record.losses, "fit_metrics": metrics,
              "global_step": trainer.global_step}
    (out_dir / f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()


if __name__ == "__main__":
    run_script(main)
