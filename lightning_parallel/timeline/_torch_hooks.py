"""The private torch names the pipeline timeline wraps, reached from this one module (torch 2.13).

Every schedule, single- or multi-stage, runs its compute through three methods of the stage base class
``torch.distributed.pipelining.stage._PipelineStageBase``: ``forward_one_chunk``, ``backward_one_chunk``
(``full_backward=False``: the input-gradient half of a split backward) and ``backward_weight_one_chunk``
(the weight-gradient half). Its point-to-point traffic goes through two module functions of
``torch.distributed.pipelining.schedules``: ``_batch_p2p`` (posts sends/receives) and ``_wait_batch_p2p``
(blocks until they finish), which the schedules look up as module globals at each call.

:func:`patched` swaps all five for timed wrappers for the duration of one recorded step, and puts the
originals back after it: nothing is wrapped when no step is recorded. ``tests/test_timeline.py`` fails
loudly if any of these names moves or changes its signature.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from torch.distributed.pipelining import schedules
from torch.distributed.pipelining.stage import _PipelineStageBase

STAGE_METHODS = ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk")
SCHEDULE_FUNCTIONS = ("_batch_p2p", "_wait_batch_p2p")

# span(name, category, **args) -> a context manager that times what runs inside it
Span = Callable[..., Any]


def _backward_kind(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    # backward_one_chunk(self, bwd_chunk_id, loss=None, full_backward=True, last_backward=False)
    full = kwargs.get("full_backward", args[1] if len(args) > 1 else True)
    return "B" if full else "I"


@contextmanager
def patched(span: Span) -> Iterator[None]:
    """Time every stage compute call and P2P post/wait through ``span`` while inside."""
    originals = {name: getattr(_PipelineStageBase, name) for name in STAGE_METHODS}
    functions = {name: getattr(schedules, name) for name in SCHEDULE_FUNCTIONS}

    def stage_wrapper(name: str, kind: Callable[[tuple, dict], str]) -> Callable[..., Any]:
        original = originals[name]

        @functools.wraps(original)
        def wrapper(self: Any, chunk: int, *args: Any, **kwargs: Any) -> Any:
            with span(kind(args, kwargs), "compute", stage=self.stage_index, mb=int(chunk)):
                return original(self, chunk, *args, **kwargs)

        return wrapper

    def post(ops: list[Any], desc: str | None = None) -> Any:
        with span("p2p post", "comm", ops=len(ops)):
            return functions["_batch_p2p"](ops, desc)

    def wait(work: list[Any]) -> Any:
        with span("p2p wait", "wait", ops=len(work)):
            return functions["_wait_batch_p2p"](work)

    wrappers = {
        "forward_one_chunk": stage_wrapper("forward_one_chunk", lambda a, k: "F"),
        "backward_one_chunk": stage_wrapper("backward_one_chunk", _backward_kind),
        "backward_weight_one_chunk": stage_wrapper("backward_weight_one_chunk", lambda a, k: "W"),
    }
    try:
        for name, wrapper in wrappers.items():
            setattr(_PipelineStageBase, name, wrapper)
        schedules._batch_p2p, schedules._wait_batch_p2p = post, wait
        yield
    finally:
        for name, original in originals.items():
            setattr(_PipelineStageBase, name, original)
        for name, function in functions.items():
            setattr(schedules, name, function)
