"""The CPU guards of the CUDA paths (``lightning_megatron/parallel/guards.py``): every tensor handed to a collective is
on the run's device, and the host syncs of a training step do not grow with layers, micro-batches or experts.

The guards themselves are tested on one process, where each must fail (a tensor off the device, N reads counted N
times). The layout matrix trains through ``Trainer(strategy=Megatron3DStrategy(...))`` in one launch of 4 ranks
(``tests/workers/device_guards.py``), every run under both guards, and prints its syncs per step by layout and by
call site.
"""

import inspect
import re
from collections import Counter

import numpy as np

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.overrides import _get_current_function_mode
from torch.utils._python_dispatch import _get_current_dispatch_mode

from launch import run_job
from lightning_megatron.optim import clip
from lightning_megatron.parallel.guards import check_collective_devices, count_host_syncs


# ------------------------------------------------------------------------------------------- one process
COLLECTIVES = {
    "all_reduce": lambda t, g: dist.all_reduce(t, group=g),
    "all_gather_into_tensor": lambda t, g: dist.all_gather_into_tensor(torch.empty(3), t, group=g),
    "reduce_scatter_tensor": lambda t, g: dist.reduce_scatter_tensor(torch.empty(3), t, group=g),
    "all_gather": lambda t, g: dist.all_gather([torch.empty(3)], t, group=g),
    "broadcast": lambda t, g: dist.broadcast(t, src=0, group=g),
    "reduce": lambda t, g: dist.reduce(t, dst=0, group=g),
    "all_to_all_single": lambda t, g: dist.all_to_all_single(torch.empty(3), t, group=g),
    "all_reduce (functional)": lambda t, g: funcol.wait_tensor(funcol.all_reduce(t, "sum", g)),
}


@pytest.mark.parametrize("name", COLLECTIVES)
def test_a_collective_handed_a_tensor_off_the_device_raises_naming_it(one_rank_group, name):
    group = one_rank_group
    collective = COLLECTIVES[name]
    with check_collective_devices("cpu") as checked:
        collective(torch.ones(3), group)  # on the device: runs
    assert sum(checked.values()) >= 1
    with pytest.raises(RuntimeError) as raised, check_collective_devices("cpu"):
        collective(torch.ones(3, device="meta"), group)
    message = str(raised.value)
    assert message.startswith(f"collective {name.split(' ')[0]} (")  # torch.distributed's name of the operator
    assert "on meta of shape [3]" in message and "device is cpu" in message
    with pytest.raises(RuntimeError, match="on cpu of shape \\[3\\].*device is meta"), check_collective_devices("meta"):
        collective(torch.ones(3), group)


def test_the_collective_check_names_the_call_site_and_restores_dispatch(one_rank_group):
    group = one_rank_group
    with pytest.raises(RuntimeError, match=r"test_device_guards.py:\d+"), check_collective_devices("cpu"):
        dist.all_reduce(torch.zeros(2, 5, device="meta"), group=group)
    assert _get_current_dispatch_mode() is None
    dist.all_reduce(torch.ones(3), group=group)  # unchecked again


def test_reads_in_a_loop_are_counted_one_by_one_with_their_call_site():
    values = torch.arange(7.0)
    with count_host_syncs() as syncs:
        for value in values:
            value.item()
    line = inspect.currentframe().f_lineno - 1  # the line of value.item() above
    assert syncs.total == 7 and syncs.by_kind == {"item": 7}
    assert syncs.sites["item"] == {f"{__file__}:{line}": 7}
    syncs.reset()
    assert syncs.total == 0 and not syncs.sites


def test_every_kind_of_host_sync_is_counted_and_device_moves_are_not():
    x, mask = torch.tensor([3.0, 0.0]), torch.tensor([True, False])
    kinds = [
        ("item", lambda: x[0].item()), ("tolist", lambda: x.tolist()), ("bool", lambda: bool(x[0])),
        ("bool", lambda: 1 if x[0] > 0 else 0), ("int", lambda: int(x[0])), ("int", lambda: list(range(x[0].long()))),
        ("float", lambda: float(x[0])), ("numpy", lambda: x.numpy()), ("numpy", lambda: np.asarray(x)),
        ("print", lambda: f"{x[0]:.2f}"), ("compare", lambda: torch.equal(x, x)), ("compare", lambda: x.allclose(x)),
        ("to_host", lambda: x.cpu()), ("dynamic_shape", lambda: x.nonzero()), ("dynamic_shape", lambda: x.unique()),
        ("dynamic_shape", lambda: x[mask]), ("dynamic_shape", lambda: x.masked_select(mask)),
        ("dynamic_shape", lambda: torch.where(mask)), ("dynamic_shape", lambda: x.clone().__setitem__(mask, 1.0)),
        ("dynamic_shape", lambda: torch.repeat_interleave(torch.tensor([1, 2]))),
        ("dynamic_shape", lambda: torch.bincount(torch.tensor([0, 2]))),
    ]
    for kind, call in kinds:
        with count_host_syncs() as syncs:
            call()
        assert syncs.by_kind == {kind: 1}, (kind, dict(syncs.by_kind))
    with count_host_syncs() as syncs:  # none of these waits for the device
        x.to("cpu"), x.to(torch.float64), x.sum(), torch.where(mask, x, 0.0), x[0], x.repeat_interleave(2)
        x.to("cpu", non_blocking=True), torch.empty(2).copy_(x)
    assert syncs.total == 0, syncs.report()


def test_explicit_synchronisation_is_counted_and_restored():
    original = torch.cuda.synchronize
    with count_host_syncs() as syncs:
        with pytest.raises((AssertionError, RuntimeError)):  # this CPU build has no CUDA to wait for
            torch.cuda.synchronize()
    assert syncs.by_kind == {"synchronize": 1}
    assert torch.cuda.synchronize is original and _get_current_function_mode() is None


def test_a_device_filter_counts_only_that_devices_tensors_and_sites_name_the_package_line():
    with count_host_syncs(device="meta") as syncs:
        torch.tensor(1.0).item()
    assert syncs.total == 0
    grads = [torch.ones(4)]
    with count_host_syncs() as syncs:
        clip.scale_to_norm(grads, 1.0, torch.tensor(2.0))
    source, first = inspect.getsourcelines(clip.scale_to_norm)
    line = first + next(i for i, text in enumerate(source) if "float(norm)" in text)
    assert syncs.sites == {"float": Counter({f"lightning_megatron/optim/clip.py:{line}": 1})}


def test_torch_optimizers_host_step_counters_are_left_out_only_where_every_tensor_counts():
    params = [torch.nn.Parameter(torch.ones(3)) for _ in range(4)]
    optimizer = torch.optim.AdamW(params, foreach=False)
    for param in params:
        param.grad = torch.ones(3)
    with count_host_syncs() as syncs:  # on CPU they stand for the host counters they are on a GPU
        optimizer.step()
        optimizer.step()
    assert syncs.total == 0, syncs.report()
    with count_host_syncs(device="cpu") as syncs:  # a named device: its tensors' reads count, torch.optim's too
        optimizer.step()
    assert syncs.by_kind["item"] > 0, syncs.report()


# ------------------------------------------------------------------------------------------- the layout matrix
CASES = ("gpt-tp2-dp2-z1", "llama-pp2-dp2-z1", "moe-dp4-ep2-z1", "gpt-cp2-dp2", "sft-packed-tp2-dp2-z2",
         "sft-packed-cp2-dp2-z1", "gpt-tp2-dp2-z3", "gpt-dp4-z1-fp16-offload", "gpt-tp2-dp2-z1-fp16-true")
#: Each case at 2 layers and 2 micro-batches, then with one of them doubled (and the experts, for MoE).
VARIANTS = {case: ["L2M2", "L4M2", "L2M4"] + (["L2M2E8"] if case.startswith("moe") else []) for case in CASES}
#: Collectives each case must issue (and the device check therefore see): proof the check is wired in.
EXPECTED_COLLECTIVES = {
    "gpt-tp2-dp2-z1": {"all_reduce", "reduce_scatter_tensor", "all_gather_into_tensor"},
    "llama-pp2-dp2-z1": {"send/isend", "recv/irecv", "reduce_scatter_tensor"},
    "moe-dp4-ep2-z1": {"all_to_all_single", "reduce_scatter_tensor"},
    "gpt-cp2-dp2": {"send/isend", "recv/irecv", "all_reduce"},
    "sft-packed-tp2-dp2-z2": {"all_reduce", "reduce_scatter_tensor"},
    "sft-packed-cp2-dp2-z1": {"send/isend", "recv/irecv", "reduce_scatter_tensor"},
    "gpt-tp2-dp2-z3": {"all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce"},
    "gpt-dp4-z1-fp16-offload": {"reduce_scatter_tensor", "all_gather_into_tensor"},
    "gpt-tp2-dp2-z1-fp16-true": {"all_reduce", "reduce_scatter_tensor", "all_gather_into_tensor"},
}
#: Host syncs of one optimizer step, at most, on any rank; none per layer, micro-batch or expert. Today's (rank 0 of
#: pp2, the most): the step's verdicts (token count, backward scale, non-finite check, clipping: 4), the CPU
#: optimizer's step counters (one read per parameter group: 2), the pipeline's backward scale (1) and its loss
#: totals broadcast as an object from the last stage (``.cpu()`` and torch's object-collective reads: 4).
MAX_SYNCS_PER_STEP = 12


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    runs = [f"{case}/{variant}" for case in CASES for variant in VARIANTS[case]]
    results, _ = run_job("device_guards", 4, tmp_path_factory.mktemp("device_guards"), ",".join(runs), timeout=900)
    print_table(results)
    return results


def print_table(results) -> None:
    print("\nhost syncs per optimizer step (steps 2 and 3), ranks 0..3")
    for run in results[0]:
        print(f"  {run:34s} " + "  ".join(f"{r[run]['syncs_per_step']}" for r in results))
    print("call sites, rank 0 (calls over steps 2 and 3)")
    for run in results[0]:
        print(f"  {run}")
        for site, count in sorted(results[0][run]["sites"].items(), key=lambda item: -item[1]):
            print(f"    {count:5d}  {site}")


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_every_collective_of_the_layout_sees_only_tensors_on_the_root_device(matrix, case):
    for variant in VARIANTS[case]:
        for rank, result in enumerate(matrix):
            run = result[f"{case}/{variant}"]
            assert run["root_device"] == "cpu"
            missing = EXPECTED_COLLECTIVES[case] - set(run["collectives"])
            assert not missing, f"{case}/{variant} rank {rank}: the check saw no {missing} ({run['collectives']})"


#: The two reads that scale by design, each checked to be exactly this many per optimizer step (``layers``,
#: ``micro`` batches, context-parallel ``cp`` ranks) and then left out of the constant: the all-to-all of expert
#: parallelism takes its split sizes as host integers (one read per MoE layer per micro-batch, forward only;
#: none at ep=1), and the CPU attention back end plans its tiles on the host once per micro-batch per distinct ring
#: block (a CPU tensor: no device to wait for; the CUDA back end builds its block masks on the device, none).
SCALING_SITES = {
    "tolist lightning_megatron/expert_parallel/dispatcher.py": lambda layers, micro, cp: layers * micro,
    "tolist lightning_megatron/context_parallel/masks.py": lambda layers, micro, cp: micro * cp,
}


def _variant_sizes(case: str, variant: str) -> tuple[int, int, int]:
    """(layers, micro-batches, cp ranks) of a run from its names: ``L4M2`` and ``-cp2-``."""
    layers, micro = re.fullmatch(r"L(\d+)M(\d+)(?:E\d+)?", variant).groups()
    return int(layers), int(micro), 2 if "-cp2-" in f"{case}-" else 1


def _constant_part(case: str, variant: str, run: dict, where: str) -> list[int]:
    """The run's host syncs per step less the scaling sites, after checking those against their formulas."""
    steps = len(run["syncs_per_step"])
    scaled = 0
    for prefix, expected in SCALING_SITES.items():
        count = sum(n for site, n in run["sites"].items() if site.startswith(prefix + ":"))
        if count:
            assert count == steps * expected(*_variant_sizes(case, variant)), f"{where}: {prefix} read {count} times"
            scaled += count // steps
    return [n - scaled for n in run["syncs_per_step"]]


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_host_syncs_per_step_do_not_grow_with_layers_micro_batches_or_experts(matrix, case):
    for rank, result in enumerate(matrix):
        base = _constant_part(case, VARIANTS[case][0], result[f"{case}/{VARIANTS[case][0]}"], case)
        for variant in VARIANTS[case]:
            run = result[f"{case}/{variant}"]
            where = f"{case}/{variant} rank {rank}: {run['syncs_per_step']} syncs at steps 2, 3; sites {run['sites']}"
            steps = _constant_part(case, variant, run, where)
            assert steps[0] == steps[1] and steps[0] <= MAX_SYNCS_PER_STEP, where
            assert steps == base, f"{where}; {VARIANTS[case][0]}: {base} once the scaling sites are left out"
