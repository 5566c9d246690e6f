"""torch.compile inside pipeline stages: each stage's blocks compiled in place, after the split.

torchtitan's order: tensor parallelism, then recomputation, then ``torch.compile`` of each block
(``block.compile()``, in place), then FSDP2. Compiling *after* the split lets every rank compile only
its own stages; compiling in place (``Module.compile``: the module object and its parameters stay, so
FSDP2, the tied-weight bookkeeping, parameter names and checkpoints see the same modules) leaves no
``OptimizedModule`` wrapper in a stage.

What is compiled:

* on the Sequential path, the **repeated blocks**: the Sequential's children of its most frequent
  class (a Sequential with no repeated class: every child). Blocks of one class share one compiled
  program (dynamo caches per code object, and treats a block's parameters as inputs), so a stage
  compiles once whatever its number of blocks;
* on the traced path, each stage's **program** (its export graph), once per stage and traced program.

Not under the schedules that split each backward into an input and a weight pass (interleaved zero
bubble, ZBV, DualPipeV): torch 2.13 finds the weight pass's part of the autograd graph by walking it,
and a compiled block is one node there (its whole fused backward, weight gradients included), so the
weight pass runs that backward again (no time saved); compiled in place, the Sequential GPT of the
tests trained under ZBV came out with weights up to 0.38 off one process's after four AdamW steps.
torch refuses ``OptimizedModule`` stages there itself (``_check_torch_compile_compatibility``,
pytorch#161904); the plan refuses compiled stages there with the reason (:meth:`Compile.check`).

Compiled with dynamic sizes (``dynamic=True``) unless told otherwise: one program then serves every
sequence length and micro-batch size, as one traced program does. :class:`CompileWatch` times the
compilations (reported apart from the steps) and turns dynamo's recompile-limit warning (after which
a stage silently runs eagerly) into this package's warning with the fix.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from lightning_parallel._options import unknown_option_error
from lightning_parallel.layout.choices import SPLIT_BACKWARD_SCHEDULES
from lightning_parallel.pipeline.stage_source import PreparedStage, StageSource
from lightning_parallel.techniques.contract import Technique
from lightning_parallel.techniques.job import Job
from lightning_parallel.techniques.ledgers import MemoryLedger

CompileOptions = dict[str, Any]
"""torch.compile's keywords for each stage's blocks."""

COMPILE_KEYS = ("fullgraph", "dynamic", "backend", "mode", "options", "disable", "recompile_limit")
"""torch.compile's keywords a stage takes (``model`` is the stage's own module)."""

MEMORY_NOTE = (
    "compiled stages: activations modelled as eager saves them (measured on the eager model); inductor's "
    "fused kernels usually save fewer, so read the peaks as an estimate from above"
)
"""What compiling does to the planner's memory model (:meth:`Compile.memory`): nothing measured, an
estimate from above; the planner prints this note under a compiled plan's table."""


class Compile(Technique):
    """``compile=``: each stage's blocks (or traced programs) compiled in place after the split.

    Example::

        ParallelPlan(compile=True).compile        # {'dynamic': True}
    """

    name, fields, searched = "compile", ("compile",), ("compile",)  # (the search leaves it off)

    def normalized(self, plan: Any) -> dict[str, Any]:
        return {"compile": checked_compile_options(plan.compile)}

    def check(self, plan: Any) -> None:
        check_compile(plan.compile, plan.schedule, plan.tensor_parallel_size)

    def label(self, plan: Any) -> str:
        return " +compile" if plan.compile is not None else ""

    def stages(self, view: Any, job: Job) -> str | None:
        return apply(view, job.plan.compile) if job.plan.compile is not None else None

    def memory(self, ledger: MemoryLedger) -> None:
        """Nothing moved: the activations are measured on the eager model (:data:`MEMORY_NOTE`)."""
        if ledger.plan.compile is not None:
            ledger.notes.append(MEMORY_NOTE)


TECHNIQUE = Compile()


def checked_compile_options(value: Any) -> CompileOptions | None:
    """``compile=`` as the stages take it: ``None`` (off), or the keywords for ``torch.compile``.

    ``True`` is torch.compile's defaults with ``dynamic=True``; a dict is torch.compile's keywords
    (``{"mode": "max-autotune-no-cudagraphs"}``, ``{"backend": "aot_eager"}``), ``dynamic`` defaulting
    to True there too.

    Raises:
        TypeError: neither a bool nor a dict, or a key that torch.compile does not take (naming the
            closest one).

    Example::

        >>> checked_compile_options(True)
        {'dynamic': True}
        >>> checked_compile_options({"mode": "max-autotune-no-cudagraphs"})["mode"]
        'max-autotune-no-cudagraphs'
        >>> checked_compile_options(False) is None
        True
    """
    if value is None or value is False:
        return None
    if value is True:
        return {"dynamic": True}
    if not isinstance(value, Mapping):
        raise TypeError(
            f"compile must be True, False or a dict of torch.compile's options (e.g. {{'mode': "
            f"'max-autotune-no-cudagraphs'}}), got {type(value).__name__}"
        )
    for key in value:
        if key not in COMPILE_KEYS:
            raise unknown_option_error("PipelineStrategy(compile={...})", str(key), COMPILE_KEYS)
    return {"dynamic": True, **value}


def check_compile(options: CompileOptions | None, schedule: str, tensor_parallel_size: int) -> None:
    """Refuse compiled stages where torch 2.13 cannot run them (see this module's docstring).

    Raises:
        ValueError: a schedule that splits each backward, or tensor-parallel stages.

    Example::

        >>> check_compile({"dynamic": True}, "1f1b", 1)     # fine
        >>> check_compile(None, "zbv", 2)                   # fine: nothing compiled
    """
    if options is None:
        return
    # torch workaround: https://github.com/pytorch/pytorch/issues/161904
    #   canary: test_torch_split_backward_schedules_take_compiled_stages
    if schedule in SPLIT_BACKWARD_SCHEDULES:
        raise ValueError(
            f"compile with schedule={schedule!r} is not supported: that schedule splits each backward "
            f"into an input and a weight pass, and a compiled block's backward is one fused function "
            f"(torch 2.13 refuses compiled stages there, pytorch#161904; in place its weight pass reruns "
            f"it and gave wrong gradients). Use compile with '1f1b', 'gpipe', 'interleaved_1f1b' or "
            f"'looped_bfs', or compile=False with {schedule!r}"
        )
    if tensor_parallel_size > 1:
        raise ValueError(
            f"compile with tensor_parallel_size={tensor_parallel_size} is not supported: torch 2.13 fails to "
            f"compile blocks whose weights are tensor-parallel DTensors (AOTAutograd's tracing recurses "
            f"without end). Use compile with tensor_parallel_size=1, or tensor parallelism without compile"
        )


def apply(stages: StageSource, options: CompileOptions) -> str:
    """Compile each of this rank's stages in place (the stage view's ``each_stage``): its blocks (the
    units of the view's ``block_class``, every unit without one), or a traced stage's whole program
    as it is prepared; what is compiled, in words.

    Example::

        compile.apply(runner.stages, {"dynamic": True})
    """
    if stages.graphs:
        stages.each_stage(functools.partial(_compile_program, options))
        return f"each stage's program is compiled (torch.compile, {options})"
    block = stages.block_class

    def compile_blocks(stage: PreparedStage) -> None:
        compile_in_place([(name, unit) for name, unit in stage.units if block in (None, type(unit))], options)

    stages.each_stage(compile_blocks)
    what = f"its {block.__name__} layers" if block is not None else "its layers"
    return f"each stage compiles {what} in place (torch.compile, {options})"


def _compile_program(options: CompileOptions, stage: PreparedStage) -> None:
    """A traced stage's program compiled in place, with its own compiled entries (one per stage)."""
    compile_in_place([(f"stage {stage.index}", stage.module)], options, isolated=True)
    if stage.index == 0 and stage.runs is None:  # its inputs are slices of the batch (see OwnInputs)
        stage.runs = OwnInputs(stage.module)


def compile_in_place(
    units: Sequence[tuple[str, nn.Module]], options: CompileOptions, isolated: bool = False
) -> list[str]:
    """``module.compile(**options)`` for each unit (no ``OptimizedModule``); returns the names compiled.

    ``isolated``: each unit keeps its own compiled entries and recompile limit (torch 2.13's
    ``isolate_recompiles``), for units that cannot share a program (each traced stage's graph).
    Compiling twice is a no-op.

    Example::

        compile_in_place(list(stage.named_children()), {"dynamic": True})
    """
    done = []
    for name, module in units:
        if not is_compiled(module):
            kwargs = {**options, **({"isolate_recompiles": True} if isolated else {})}
            if type(module).__module__.startswith("torch."):
                compile_torch_module(module, kwargs)
            else:
                module.compile(**kwargs)
        done.append(name)
    return done


# torch workaround: https://github.com/pytorch/pytorch/issues/150915
#   canary: test_torch_compiles_a_sequential_compiled_in_place
def compile_torch_module(module: nn.Module, options: CompileOptions) -> None:
    """Compile one of torch's own modules (an ``nn.Sequential`` block) in place, as ``Module.compile``
    does, through a function of this package.

    ``Module.compile`` compiles the module's ``_call_impl``, whose frame (and ``Sequential.forward``'s)
    lies in torch's own files, which dynamo skips: the block ran eagerly, marked compiled, and no frame
    was ever compiled. A frame of this package is traced, and dynamo inlines torch's modules from it.

    Example::

        compile_torch_module(nn.Sequential(nn.Linear(4, 4), nn.Tanh()), {"dynamic": True})
    """
    call = module._call_impl

    def run(*args: Any, **kwargs: Any) -> Any:
        return call(*args, **kwargs)

    module._compiled_call_impl = torch.compile(run, **options)


# torch workaround: no upstream issue found
#   canary: test_dynamo_compiles_once_for_micro_batches_sliced_from_batches_of_several_sizes
class OwnInputs(nn.Module):
    """Runs ``module`` on inputs that are not views: a view's base is copied out first.

    A pipeline's first stage receives each micro-batch as a slice (a view) of the batch, and dynamo
    guards on a view's base as well as on the view; with duck sizing a batch size that happens to equal
    a sequence length becomes one symbol, so the short last batch of an epoch fails the guard and
    compiles the stage again. Copying the slice (the micro-batch's input, once per micro-batch) keeps
    the compiled program to the sizes it actually reads.

    Example::

        stage = PipelineStage(OwnInputs(compiled_stage_module), 0, num_stages, device)
    """

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        def own(t: Any) -> Any:
            return t.clone() if isinstance(t, torch.Tensor) and t._base is not None else t

        return self.module(*[own(a) for a in args], **{k: own(v) for k, v in kwargs.items()})


def is_compiled(module: nn.Module) -> bool:
    """Whether ``module`` was compiled in place (``Module.compile``).

    Example::

        >>> is_compiled(nn.Linear(2, 2))
        False
    """
    return module.__dict__.get("_compiled_call_impl") is not None


def compiled_names(modules: Sequence[tuple[str, nn.Module]]) -> list[str]:
    """The names of the modules (and their submodules) compiled in place, as ``name.sub``."""
    return [
        f"{name}.{sub}" if sub else name
        for name, module in modules
        for sub, m in module.named_modules()
        if is_compiled(m)
    ]


class CompileWatch:
    """Times torch.compile's compilations, and reports a recompile limit reached (one process).

    Dynamo runs a frame whose compiled entries reached their limit eagerly from then on, saying so
    once in its log; this turns that log record into ``warn(message)`` with the fix. ``seconds`` is
    the time spent compiling since :meth:`start` (every compilation: the first forward's, the
    backward's, a new mode's), which the strategy reports apart from the steps.

    Example::

        watch = CompileWatch(warnings.warn)
        watch.start()
        ...                                  # steps that compile
        watch.seconds, watch.compilations
        watch.stop()
    """

    _LOGGER = "torch._dynamo"

    def __init__(self, warn: Callable[[str], Any], info: Callable[[str], Any] | None = None) -> None:
        self.warn, self.info = warn, info
        self.seconds = 0.0
        self.compilations = 0
        self.limit_hits: list[str] = []
        self._began: float | None = None
        self._handler: _LimitHandler | None = None

    def start(self) -> None:
        """Begin timing and watching (idempotent)."""
        if self._handler is not None:
            return
        handler = self._handler = _LimitHandler(self._limit_hit)
        logging.getLogger(self._LOGGER).addHandler(handler)
        torch._dynamo.callback_handler.register_start_callback(self._on_start)
        torch._dynamo.callback_handler.register_end_callback(self._on_end)

    def stop(self) -> None:
        """Stop timing and watching (idempotent)."""
        if self._handler is None:
            return
        logging.getLogger(self._LOGGER).removeHandler(self._handler)
        torch._dynamo.callback_handler.remove_start_callback(self._on_start)
        torch._dynamo.callback_handler.remove_end_callback(self._on_end)
        self._handler = None

    @contextlib.contextmanager
    def reporting(self, what: str) -> Iterator[None]:
        """Run the block; if it compiled, say (through ``info``) how long, apart from the steps."""
        before = self.seconds
        yield
        if self.seconds > before and self.info is not None:
            self.info(
                f"PipelineStrategy: torch.compile took {self.seconds - before:.1f} s in {what}; "
                f"{self.seconds:.1f} s in all on this rank, counted apart from the steps as "
                f"trainer.strategy.compile_seconds"
            )

    def _on_start(self, _args: Any) -> None:
        self._began = time.perf_counter()

    def _on_end(self, _args: Any) -> None:
        if self._began is not None:
            self.seconds += time.perf_counter() - self._began
            self.compilations += 1
            self._began = None

    def _limit_hit(self, record: str) -> None:
        self.limit_hits.append(record)
        if len(self.limit_hits) == 1:
            self.warn(
                "PipelineStrategy(compile=...): torch.compile reached its recompile limit on a stage, which "
                "now runs eagerly (slower, same numbers). torch.compile said:\n    "
                + record.replace("\n", "\n    ")
                + "\nEach new kind of input (mode, sizes it specialised on) compiles again: pad batches to a "
                "few lengths (lightning_parallel.padding_to_multiple), keep compile's dynamic=True, or raise "
                "the limit with compile={'recompile_limit': 16}"
            )


class _LimitHandler(logging.Handler):
    """Catches dynamo's "hit config.recompile_limit" warning (torch 2.13's wording)."""

    def __init__(self, on_hit: Callable[[str], Any]) -> None:
        super().__init__(logging.WARNING)
        self.on_hit = on_hit

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = record.getMessage()
        except Exception:  # a malformed record is not ours to fix
            return
        if "recompile_limit" in text and "hit config" in text:
            self.on_hit(text)
