"""Pipeline parallelism: stage layout, stage split, schedule runner, timeline measurement."""

from lightning_megatron.pipeline.blocks import PipelineBlocks
from lightning_megatron.pipeline.layout import SCHEDULES, PipelineLayout
from lightning_megatron.pipeline.timeline import TimelineRecorder, measured_bubble, render, theoretical_bubble

__all__ = ["PipelineBlocks", "PipelineLayout", "SCHEDULES", "TimelineRecorder", "measured_bubble", "render",
           "theoretical_bubble"]
