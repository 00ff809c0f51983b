"""Pipeline stage layout and the errors a user gets for layouts that cannot work (single process)."""

import pytest
import torch

from lightning_megatron import Megatron3DStrategy
from lightning_megatron.models import GPT, GPTConfig, GPTModel
from lightning_megatron.parallel import ParallelConfig
from lightning_megatron.pipeline import PipelineLayout, theoretical_bubble
from lightning_megatron.pipeline.layout import check_micro_batches
from lightning_megatron.pipeline.stage import split_for_pipeline


def test_even_and_custom_stage_layouts_and_interleaved_rank_assignment():
    even = PipelineLayout(num_layers=8, pipeline_parallel_size=2, virtual_pipeline_size=2)
    assert even.stage_layers() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert even.stages_of_rank(0) == [0, 2] and even.stages_of_rank(1) == [1, 3]
    custom = PipelineLayout(num_layers=8, pipeline_parallel_size=3, layers_per_stage=(2, 4, 2))
    assert custom.stage_layers() == [[0, 1], [2, 3, 4, 5], [6, 7]]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(num_layers=6, pipeline_parallel_size=4), r"num_layers=6 does not divide into .* = 4 \* 1 = 4"),
        (dict(num_layers=8, pipeline_parallel_size=2, virtual_pipeline_size=3), r"2 \* 3 = 6 equal stages"),
        (dict(num_layers=8, pipeline_parallel_size=2, layers_per_stage=(3, 4)), r"summing to num_layers=8 .* summing to 7"),
        (dict(num_layers=8, pipeline_parallel_size=1, virtual_pipeline_size=2), r"virtual_pipeline_size=2 .* pipeline_parallel_size=1"),
    ],
)
def test_bad_stage_layouts(kwargs, message):
    with pytest.raises(ValueError, match=message):
        PipelineLayout(**kwargs)


def test_micro_batch_errors():
    assert check_micro_batches(schedule="1f1b", batch_size=8, micro_batch_size=2, pipeline_parallel_size=4) == 4
    with pytest.raises(ValueError, match=r"per-rank batch of 8 .* micro_batch_size=3"):
        check_micro_batches(schedule="1f1b", batch_size=8, micro_batch_size=3, pipeline_parallel_size=2)
    with pytest.raises(ValueError, match=r"needs at least pipeline_parallel_size=4 micro-batches .* gives 2"):
        check_micro_batches(schedule="1f1b", batch_size=8, micro_batch_size=4, pipeline_parallel_size=4)
    assert check_micro_batches(schedule="gpipe", batch_size=8, micro_batch_size=4, pipeline_parallel_size=4) == 2


def test_strategy_rejects_bad_schedules_up_front():
    with pytest.raises(ValueError, match="Unknown pipeline_schedule 'zigzag'"):
        Megatron3DStrategy(pipeline_parallel_size=2, pipeline_schedule="zigzag")
    with pytest.raises(ValueError, match="needs virtual_pipeline_size >= 2"):
        Megatron3DStrategy(pipeline_parallel_size=2, pipeline_schedule="interleaved_1f1b")
    with pytest.raises(ValueError, match=r"virtual_pipeline_size=2 interleaves .* pipeline_parallel_size=1"):
        Megatron3DStrategy(virtual_pipeline_size=2, pipeline_schedule="interleaved_1f1b")


def test_gpt_validates_pipeline_layout_before_any_process_group():
    gpt = GPT(GPTConfig(num_layers=6))
    with pytest.raises(ValueError, match="num_layers=6 does not divide"):
        gpt.validate_parallel_config(ParallelConfig(pipeline_parallel_size=4, data_parallel_size=1))


def test_split_keeps_global_names_and_marks_the_tied_embedding_copy():
    with torch.device("meta"):
        model = GPTModel(GPTConfig(num_layers=4))
    layout = PipelineLayout(num_layers=4, pipeline_parallel_size=2)
    stages = split_for_pipeline(model, GPTModel.pipeline_blocks(), layout.stage_layers(), layout.stages_of_rank(1))
    names = [name for name, _ in model.named_parameters()]
    assert names[0] == "blocks.2.ln_1.weight" and "lm_head.weight" in names and model.embedding is None
    head = model.lm_head.weight
    assert head.pipeline_tied and head.tied_names == ("lm_head.weight", "embedding.wte.weight")
    assert len(stages) == 1 and len(stages[0].layers) == 2 and stages[0].is_last and not stages[0].is_first
    assert [name for name, _ in stages[0].named_parameters()][0] == "layers.0.ln_1.weight"  # the root is not registered


def test_theoretical_bubble():
    assert theoretical_bubble(4, 8) == pytest.approx((3 / 8) / (1 + 3 / 8))
    assert theoretical_bubble(4, 8, 2) == pytest.approx((3 / 16) / (1 + 3 / 16))


def test_zero_bubble_schedules_placement_and_checks():
    v = PipelineLayout(num_layers=8, pipeline_parallel_size=4, virtual_pipeline_size=2, schedule="zbv")
    assert [v.stages_of_rank(r) for r in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    assert [v.rank_of_stage(s) for s in range(8)] == [0, 1, 2, 3, 3, 2, 1, 0]
    loop = PipelineLayout(num_layers=8, pipeline_parallel_size=4, virtual_pipeline_size=2,
                          schedule="interleaved_zero_bubble")
    assert loop.stages_of_rank(1) == [1, 5] and loop.rank_of_stage(5) == 1
    with pytest.raises(ValueError, match="exactly two stages on each rank"):
        PipelineLayout(num_layers=12, pipeline_parallel_size=2, virtual_pipeline_size=3, schedule="dualpipev")
    with pytest.raises(ValueError, match=r"2 \* pipeline_parallel_size=8 micro-batches .* gives 6"):
        check_micro_batches(schedule="dualpipev", batch_size=6, micro_batch_size=1, pipeline_parallel_size=4)
    with pytest.raises(ValueError, match=r"m=9 micro-batches .*\(9 % 2 != 0\)"):
        check_micro_batches(schedule="interleaved_zero_bubble", batch_size=9, micro_batch_size=1, pipeline_parallel_size=4)
    with pytest.raises(ValueError, match="zero_stage=3"):
        Megatron3DStrategy(pipeline_parallel_size=2, virtual_pipeline_size=2, pipeline_schedule="zbv", zero_stage=3)
    with pytest.raises(ValueError, match="needs a schedule with several stages per rank"):
        Megatron3DStrategy(pipeline_parallel_size=2, virtual_pipeline_size=2, pipeline_schedule="1f1b")


def test_simulated_bubble_plays_out_an_action_table():
    """GPipe's table (every forward, then every full backward) played out gives Narayanan et al.'s formula."""
    from types import SimpleNamespace

    from lightning_megatron.pipeline.timeline import simulated_bubble, theoretical_bubble

    def action(kind, stage, mb):
        return SimpleNamespace(computation_type=SimpleNamespace(value=kind), stage_index=stage, microbatch_index=mb,
                               sub_actions=None)

    p, m = 4, 8
    table = {r: [action("F", r, i) for i in range(m)] + [None] + [action("B", r, i) for i in range(m)]
             for r in range(p)}
    assert simulated_bubble(table) == pytest.approx(theoretical_bubble(p, m))
    # The same order with the backward split: the previous stage waits only for I, so the drain costs (p-1)(F + I)
    # instead of (p-1)(F + I + W) against m(F + I + W) of work (Qi et al.'s point).
    split = {r: [action("F", r, i) for i in range(m)] + [a for i in range(m) for a in (action("I", r, i),
             action("W", r, i))] for r in range(p)}
    ratio = 2 * (p - 1) / (3 * m)
    assert simulated_bubble(split) == pytest.approx(ratio / (1 + ratio))
    with pytest.raises(RuntimeError, match="cannot be played out"):
        simulated_bubble({0: [action("B", 0, 0)], 1: [action("F", 1, 0)]})


def test_timeline_clock_follows_the_stage_device_and_reads_once_per_step():
    """The recorder times by the stage device's clock (CUDA events on a GPU, where the host clock would time only
    the kernel launches; the host clock on the CPU) and turns its marks into events when they are read."""
    import time
    from types import SimpleNamespace

    from lightning_megatron.pipeline.timeline import CudaEventClock, HostClock, TimelineRecorder, step_clock

    assert isinstance(step_clock(torch.device("cuda", 1)), CudaEventClock)
    assert step_clock(torch.device("cuda", 1)).device == torch.device("cuda", 1)
    assert isinstance(step_clock("cpu"), HostClock) and isinstance(step_clock(None), HostClock)

    def work(chunk_id, *args, **kwargs):
        time.sleep(0.01)

    stage = SimpleNamespace(stage_index=1, device=torch.device("cpu"), forward_one_chunk=work,
                            backward_one_chunk=work, backward_weight_one_chunk=work)
    recorder = TimelineRecorder(rank=3)
    recorder.instrument(stage)
    assert isinstance(recorder.clock, HostClock)
    stage.forward_one_chunk(0)  # not active: not recorded
    recorder.active = True
    stage.forward_one_chunk(0)
    stage.backward_one_chunk(0)
    recorder.active = False
    events = recorder.events
    assert [(e.rank, e.stage, e.micro_batch, e.kind) for e in events] == [(3, 1, 0, "forward"), (3, 1, 0, "backward")]
    assert all(e.end - e.start >= 0.01 for e in events) and events[0].end <= events[1].start
    events.clear()
    assert recorder.events == []
