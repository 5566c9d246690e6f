"""Lightning plugins for models that are too big or too slow for one device.

Importing the package registers its strategies in Lightning's ``StrategyRegistry``, so
``Trainer(strategy="pipeline")`` works after ``import lightning_parallel``.
"""

from lightning_parallel.strategies import register_strategies

__version__ = "0.1.0"

__all__: list[str] = ["__version__"]

register_strategies()
