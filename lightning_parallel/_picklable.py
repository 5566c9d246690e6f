"""A user's callable that travels to spawned ranks: pickling it fails with its holder's name and the fix.

A spawn or forkserver launch (``strategy="ddp_spawn"``, ``PipelineStrategy(start_method="spawn")``)
pickles the Trainer with its callbacks, strategy and data loaders in the main process, before any rank
starts. A lambda, or a function defined inside another, cannot be pickled, and pickle's own message names
the function but not where it was given ("Can't pickle <function <lambda>>: attribute lookup <lambda>
on __main__ failed"). An object that holds a user's callable checks it when it is pickled, and names
itself in the error.
"""

from __future__ import annotations

import copy
import os
import pickle
from multiprocessing.reduction import ForkingPickler
from typing import Any

_FIX = (
    "a spawn launch (strategy='ddp_spawn', start_method='spawn' or 'forkserver') pickles it for every "
    "rank: define it with `def` at the top level of a module (a lambda or a function defined inside "
    "another function cannot be pickled), or launch without pickling: strategy='ddp' from a script, "
    "PipelineStrategy(start_method='popen'), or start_method='fork'"
)


def describe(value: Any) -> str:
    """A callable as a user finds it in their code: ``<lambda> (train.py:12)``; other values by ``repr``.

    Example::

        >>> describe(len)
        'len'
    """
    code = getattr(value, "__code__", None)
    name = getattr(value, "__qualname__", None)
    if name is None or not callable(value):
        return repr(value)
    if code is None:
        return name
    return f"{name} ({os.path.basename(code.co_filename)}:{code.co_firstlineno})"


def check_picklable(value: Any, holder: str) -> None:
    """Raise ``pickle.PicklingError`` naming ``holder`` and the fix when ``value`` cannot be pickled.

    ``holder`` is where the user gave ``value``, with ``{}`` where it goes:
    ``"TokenWeightedLoss(count={})"``. ``value`` is pickled as a launch pickles it (multiprocessing's
    ``ForkingPickler``).

    Raises:
        pickle.PicklingError: ``value`` cannot be pickled; the cause is chained.

    Example::

        >>> check_picklable(lambda batch: 1, "TokenWeightedLoss(count={})")
        Traceback (most recent call last):
        _pickle.PicklingError: TokenWeightedLoss(count=<lambda> (...)) cannot be pickled, and a spawn ...
    """
    try:
        ForkingPickler.dumps(value)
    except Exception as err:
        raise pickle.PicklingError(
            f"{holder.format(describe(value))} cannot be pickled, and {_FIX} ({type(err).__name__}: {err})"
        ) from err


class HoldsUserCallables:
    """Mixin for an object holding a user's callables: pickling it checks them first, copying does not.

    A subclass lists them in :meth:`_user_callables`. The check runs in ``__getstate__``: in the main
    process, while a spawn launch pickles the object and before any rank starts. ``copy.copy`` and
    ``copy.deepcopy`` copy the object as usual, without the check (they do not pickle the callables).

    Example::

        class Collate(HoldsUserCallables):
            def __init__(self, fn):
                self.fn = fn

            def _user_callables(self):
                return {"Collate({})": self.fn}

        pickle.dumps(Collate(lambda samples: samples))   # PicklingError: Collate(<lambda> (x.py:7)) ...
    """

    def _user_callables(self) -> dict[str, Any]:
        """``{holder: callable}``, the holder as :func:`check_picklable` takes it."""
        return {}

    def __getstate__(self) -> dict[str, Any]:
        for holder, value in self._user_callables().items():
            check_picklable(value, holder)
        return dict(self.__dict__)

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    def __copy__(self) -> Any:
        copied = object.__new__(type(self))
        copied.__dict__.update(self.__dict__)
        return copied

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        copied = object.__new__(type(self))
        memo[id(self)] = copied
        copied.__dict__.update(copy.deepcopy(self.__dict__, memo))
        return copied
