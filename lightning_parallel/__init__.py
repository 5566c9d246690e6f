"""Lightning plugins for models that are too big or too slow for one device.

Importing the package registers its strategies in Lightning's ``StrategyRegistry``, so
``Trainer(strategy="pipeline")`` works after ``import lightning_parallel``.
"""

from lightning_parallel.callbacks.accumulation import GradientAccumulationScheduler
from lightning_parallel.callbacks.checkpoint import CheckpointWriteError, Rank0Checkpoint
from lightning_parallel.callbacks.metrics import AllReducedMetrics
from lightning_parallel.callbacks.timeline import PipelineTimeline
from lightning_parallel.callbacks.token_loss import TokenWeightedLoss
from lightning_parallel.callbacks.watchdog import HangWatchdog
from lightning_parallel.checkpoint.consolidate import consolidate_checkpoint
from lightning_parallel.data.eval_sampler import EvalDistributedSampler
from lightning_parallel.data.padding import pad_to_multiple, padding_to_multiple
from lightning_parallel.data.resumable_sampler import ResumableDistributedSampler
from lightning_parallel.grads.item_weights import labelled_tokens
from lightning_parallel.pipeline.step_scope import CollectiveOutsideStepError
from lightning_parallel.plan.parallel_plan import ParallelPlan
from lightning_parallel.planner.estimate import estimate_memory
from lightning_parallel.sources.pretrained import load_pretrained
from lightning_parallel.strategies import PipelineStrategy, register_strategies

__version__ = "0.1.0"

__all__ = [
    "AllReducedMetrics",
    "CheckpointWriteError",
    "CollectiveOutsideStepError",
    "EvalDistributedSampler",
    "GradientAccumulationScheduler",
    "HangWatchdog",
    "ParallelPlan",
    "PipelineStrategy",
    "PipelineTimeline",
    "Rank0Checkpoint",
    "ResumableDistributedSampler",
    "TokenWeightedLoss",
    "__version__",
    "consolidate_checkpoint",
    "estimate_memory",
    "labelled_tokens",
    "load_pretrained",
    "pad_to_multiple",
    "padding_to_multiple",
]

register_strategies()
