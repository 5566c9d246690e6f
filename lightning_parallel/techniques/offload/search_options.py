"""What the planner's search may try with offload: the technique's search options, declared once.

Each :class:`~lightning_parallel.techniques.contract.SearchOption` here is a keyword of the planner's
``Search`` and (unless its ``flag`` is None) a flag of ``python -m lightning_parallel.planner``; the
technique's ``variants`` read them back (``search.asks(OFFLOAD)``). A new one is one declaration here and
its name in ``Offload.search_options``.
"""

from __future__ import annotations

from lightning_parallel.techniques.contract import SearchOption

OFFLOAD = SearchOption(
    "offload", True, "do not try offloading to the host", flag="--no-offload", suggest="offload"
)
"""Try offloading to the host (not with tensor parallelism, which offload refuses); the advice offers it
when nothing fits without it."""

OFFLOAD_PARAMETERS = SearchOption("offload_parameters", True, flag=None)
"""With ``offload``, also FSDP2's shards (its process group needs a host backend, which ``plan="auto"``
cannot add on an accelerator once the group is up): a keyword only."""

OFFLOAD_DIR = SearchOption(
    "offload_dir",
    None,
    "also try the optimizer state in files under this directory (offload_to='disk'), chosen only where the "
    "host memory cannot hold it",
)
"""With ``offload``, also the optimizer state in files under this directory (the disk tier,
``offload_to="disk"``), chosen only where the host memory cannot hold it."""

SEARCH_OPTIONS = (OFFLOAD, OFFLOAD_PARAMETERS, OFFLOAD_DIR)
"""The offload technique's search options, in the order its flags are listed."""
