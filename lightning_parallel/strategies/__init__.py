"""Lightning strategies of lightning_parallel and their registration in the StrategyRegistry."""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_parallel.strategies.pipeline.strategy import PipelineStrategy

__all__ = ["PipelineStrategy", "register_strategies"]


def register_strategies() -> None:
    """Register every strategy name of this package in Lightning's ``StrategyRegistry`` (idempotent)."""
    PipelineStrategy.register_strategies(StrategyRegistry)
