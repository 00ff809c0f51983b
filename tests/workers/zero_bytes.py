"""Per-rank model-state bytes under ZeRO stages 0-2 with 16-bit parameters and AdamW.

argv: OUT_DIR. For layouts tp1-dp4 and tp2-dp2 over 4 ranks, each rank writes the measured
bytes after one step, the local parameter count and the padding bound to rank{r}.json.
"""

import json
from pathlib import Path

import torch
import torch.distributed as dist

from gpt_setup import CONFIG, SEED, batches
from lightning_megatron.models import GPTModel
from lightning_megatron.optim import GradientSynchronizer
from lightning_megatron.optim.main_params import MainParamOptimizer, model_state_bytes
from lightning_megatron.parallel import ParallelConfig, ParallelState
from lightning_megatron.parallel.initialize import initialize_parameters
from lightning_megatron.tensor_parallel import parallelize
from entry import run_script


def main(out_dir: Path, args: list[str]) -> None:
    results = {}
    for tp, dp in ((1, 4), (2, 2)):
        for zero_stage in (0, 1, 2):
            state = ParallelState.create(ParallelConfig(tensor_parallel_size=tp, data_parallel_size=dp, zero_stage=zero_stage), "cpu")
            with torch.device("meta"):
                model = GPTModel(CONFIG)
            parallelize(model, model.tensor_parallel_plan(), state)
            initialize_parameters(model, SEED, device="cpu", only_meta=True)
            model.to(torch.bfloat16)
            params = list(model.parameters())
            optimizer = torch.optim.AdamW(params, lr=1e-3)
            sync = GradientSynchronizer(params, data_parallel_group=state.data_parallel_group, zero_stage=zero_stage,
                                        bucket_size_mb=0.05)
            main = MainParamOptimizer(optimizer, sync)
            input_ids, labels = batches()[0]
            rows = slice(state.data_parallel_rank * 2, state.data_parallel_rank * 2 + 2)
            sync.start_micro_batch(sync=True)
            loss_sum, tokens = model.loss(input_ids[rows], labels[rows])
            loss_sum.backward()
            sync.finish(tokens)
            main.prepare_step()
            optimizer.step()
            main.finish_step()
            sync.zero()
            results[f"tp{tp}-dp{dp}-z{zero_stage}"] = {
                "bytes": model_state_bytes(params, sync, main, optimizer),
                "psi": sum(p.numel() for p in params),
                "buckets": len(sync.buckets),
                "dp": dp,
            }
            sync.remove()
    (out_dir / f"rank{dist.get_rank()}.json").write_text(json.dumps(results))
    dist.barrier()


if __name__ == "__main__":
    run_script(main)
