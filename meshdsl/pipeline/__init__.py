"""``md.pipeline``: pipeline parallelism, a model's stacked layers split into stages over a mesh axis.

A layout rule ``layers: stage`` makes each device along ``stage`` one pipeline stage;
:func:`value_and_grad` runs a model's ``pre``/``layer``/``post`` parts on microbatches under the
chosen schedule (:class:`PipelineConfig`: GPipe, 1F1B or interleaved). :mod:`.schedule` holds the
schedules' arithmetic (who runs what at each tick, the bubble), :mod:`.run` the program that runs them.
"""

from meshdsl.pipeline.config import SCHEDULES, PipelineConfig
from meshdsl.pipeline.run import STAGE_LAYERS, check_model, value_and_grad
from meshdsl.pipeline.schedule import Segment, bubble, schedule_bubble, ticks, timetable

__all__ = [
    "SCHEDULES",
    "STAGE_LAYERS",
    "PipelineConfig",
    "Segment",
    "bubble",
    "check_model",
    "schedule_bubble",
    "ticks",
    "timetable",
    "value_and_grad",
]
