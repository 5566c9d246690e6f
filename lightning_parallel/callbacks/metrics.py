"""AllReducedMetrics (being written: see its issue)."""

from lightning.pytorch.callbacks import Callback


class AllReducedMetrics(Callback):
    """Placeholder until its issue lands; using it raises."""

    def __init__(self, *args, **kwargs) -> None:
        raise NotImplementedError("AllReducedMetrics has not landed yet")
