"""Runs that fail (or waste) on purpose, launched by torchrun. argv: OUT_DIR SCENARIO.

Every rank's stderr goes to OUT_DIR/rank{r}.stderr (so a test reads exactly what that rank printed last).

* ``stall``: tp=2 with timeout=STALL_TIMEOUT_SECONDS; rank 1 stalls (up to STALL_SECONDS, until SIGTERM) in
  ``on_after_backward`` of step 2, so rank 0 waits in optimizer step 2 (the collectives after backward: gradient
  norm, clipping).
  Rank 1 writes ``stall_started`` (a time.time() stamp) first. The error is not caught.
* ``meta_error [PORT,PORT,...]``: tp=2 and a plan entry that names no submodule: the strategy's set-up fails while
  the model is on the meta device. The error is not caught. Given ports (of stores the test hosts), each rank first
  forks a copy of itself per port, one after another, each pair of copies a run of its own (OUT_DIR/run{i}/
  rank{r}.stderr, its exit code in run{i}/rank{r}.exit): each copy leaves through the interpreter's exit as a fresh
  process does, without paying the imports again. Then the rank runs the scenario itself (what torchrun reports).
* ``checks``: Trainer(devices=1) and Trainer(devices=4) against the 2 processes torchrun started (each error
  is recorded), then a tp=2 fit of a model without a plan and one with an empty plan (the warnings are
  recorded), the timeout of the world group and of the layout's groups, and last a dp=2 fit with the 'nvme'
  optimizer tier at a relative offload_path that is a regular file in rank 1's working directory only (each
  rank's error is recorded). Rank r writes rank{r}.json.
"""

import json
import os
import sys
import time
import warnings
from datetime import timedelta
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist

from fault_models import MISNAMED_PLAN, STALL_SECONDS, STALL_TIMEOUT_SECONDS, Planned, Unplanned, trainer_kwargs
from lightning_megatron import Megatron3DStrategy
from lightning_megatron.strategy.requeue import StopOnSignal

out_dir, scenario = Path(sys.argv[1]), sys.argv[2]
rank = int(os.environ["RANK"])
stderr = open(out_dir / f"rank{rank}.stderr", "w")
os.dup2(stderr.fileno(), 2)  # C++ and Python output of this rank alike
sys.stderr = os.fdopen(2, "w", buffering=1)


class StallRankOne(L.Callback):
    def on_after_backward(self, trainer, pl_module):
        if trainer.global_step == 2 and trainer.global_rank == 1:
            (out_dir / "stall_started").write_text(repr(time.time()))
            # Stalled until torchrun, its peer gone, sends SIGTERM (the strategy's handler says so): then this rank
            # leaves at once rather than after torchrun's 30 s grace and SIGKILL, which would only slow the test.
            stop = next(c for c in trainer.callbacks if isinstance(c, StopOnSignal))
            deadline = time.monotonic() + STALL_SECONDS
            while time.monotonic() < deadline and not stop.received:
                time.sleep(0.05)
            os._exit(143)


def forked_runs(ports: list[int]):
    """One run per port, one after another: yield None in this process after its forked copy has ended; in the copy,
    yield the run's folder (the caller then runs the scenario there). Forked before any process group exists, a
    copy starts as a fresh process would after its imports; the run's store is the one at its port, hosted by the
    test as torchrun's agent hosts the launch's: no rank's exit ends it (a store on rank 0 would go with rank 0, and
    rank 1's last look at it print the store's error below its own)."""
    for run, port in enumerate(ports):
        run_dir = out_dir / f"run{run}"
        run_dir.mkdir(exist_ok=True)
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            os.dup2(os.open(run_dir / f"rank{rank}.stderr", os.O_WRONLY | os.O_CREAT | os.O_TRUNC), 2)
            yield run_dir
            return
        _, status = os.waitpid(pid, 0)
        (run_dir / f"rank{rank}.exit").write_text(str(os.waitstatus_to_exitcode(status)))
        yield None


L.seed_everything(7)
if scenario == "stall":
    strategy = Megatron3DStrategy(tensor_parallel_size=2, timeout=timedelta(seconds=STALL_TIMEOUT_SECONDS))
    trainer = L.Trainer(devices=2, strategy=strategy, max_steps=4, gradient_clip_val=1.0, callbacks=[StallRankOne()],
                        **trainer_kwargs())
    trainer.fit(Planned())
elif scenario == "meta_error":
    for run_dir in forked_runs([int(port) for port in sys.argv[3].split(",")] if len(sys.argv) > 3 else []):
        if run_dir is not None:  # this process is a forked copy: it runs the scenario as its run's rank and ends
            break
    trainer = L.Trainer(devices=2, strategy=Megatron3DStrategy(tensor_parallel_size=2), max_steps=1, **trainer_kwargs())
    trainer.fit(Planned(MISNAMED_PLAN))
elif scenario == "checks":
    result = {}
    for devices in (1, 4):
        trainer = L.Trainer(devices=devices, strategy=Megatron3DStrategy(), max_steps=1, **trainer_kwargs())
        try:
            trainer.fit(Planned())
            result[f"devices={devices}"] = None
        except Exception as error:
            result[f"devices={devices}"] = f"{type(error).__name__}: {error}"
    for name, module in (("no plan", Unplanned()), ("empty plan", Planned({}))):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer = L.Trainer(devices=2, strategy=Megatron3DStrategy(tensor_parallel_size=2), max_steps=1,
                                **trainer_kwargs())
            trainer.fit(module)
        result[name] = [str(w.message) for w in caught if "replicated" in str(w.message)]
    # The default timeout, on the world group and on groups of the layout's own (new_group: torch gives them 30 min).
    state = trainer.strategy.parallel_state
    groups = {"world": dist.group.WORLD, "tp": state.tensor_parallel_group,
              "model_parallel": state.model_parallel_group}
    result["timeouts"] = {name: group._get_backend(torch.device("cpu")).options._timeout.total_seconds()
                          for name, group in groups.items()}
    # The 'nvme' tier's checks fail on rank 1 alone: every rank must stop in set-up, none wait in a collective.
    here = out_dir / f"cwd{rank}"
    here.mkdir()
    if rank == 1:
        (here / "offload_here").write_text("a file, not a folder")
    os.chdir(here)
    trainer = L.Trainer(devices=2, strategy=Megatron3DStrategy(offload_optimizer="nvme", offload_path="offload_here"),
                        max_steps=1, **trainer_kwargs())
    try:
        trainer.fit(Planned())
        result["nvme path"] = None
    except Exception as error:
        result["nvme path"] = f"{type(error).__name__}: {error}"
    result["nvme files left"] = sorted(str(p.relative_to(here)) for p in here.rglob("*"))
    (out_dir / f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    os._exit(0)  # skip gloo's C++ teardown (see the other workers)
else:
    raise SystemExit(f"unknown scenario {scenario!r}")
