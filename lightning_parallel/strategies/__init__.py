"""Lightning strategies of lightning_parallel and their registration in the StrategyRegistry."""

from lightning.pytorch.strategies import StrategyRegistry

# (name, strategy class, description, init kwargs); filled in as the strategies land.
_REGISTRY_ENTRIES: list[tuple[str, type, str, dict]] = []


def register_strategies() -> None:
    """Register every strategy name of this package in Lightning's ``StrategyRegistry`` (idempotent)."""
    for name, cls, description, init_params in _REGISTRY_ENTRIES:
        if name not in StrategyRegistry:
            StrategyRegistry.register(name, cls, description=description, **init_params)
