"""Unknown options: a misspelt keyword argument is a TypeError naming it and the closest valid option."""

import difflib
import functools
import inspect
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

_KEYWORD_KINDS = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)

_Init = TypeVar("_Init", bound=Callable[..., None])


def unknown_option_error(owner: str, name: str, valid: Iterable[str]) -> TypeError:
    """The error for option ``name`` that ``owner`` does not take: the closest valid option, or all of them.

    Example::

        >>> unknown_option_error("Rank0Checkpoint", "montor", ["monitor", "mode"])
        TypeError("Rank0Checkpoint got an unknown option 'montor': did you mean 'monitor'?")
    """
    names = sorted(valid)
    close = difflib.get_close_matches(name, names, n=1)
    hint = f"did you mean {close[0]!r}?" if close else f"the options are {', '.join(names)}"
    return TypeError(f"{owner} got an unknown option {name!r}: {hint}")


def keyword_names(function: Callable[..., Any]) -> frozenset[str]:
    """The parameters of ``function`` that can be given by keyword (``self`` excluded)."""
    params = inspect.signature(function).parameters
    return frozenset(n for n, p in params.items() if p.kind in _KEYWORD_KINDS and n != "self")


def checks_options(init: _Init) -> _Init:
    """Decorate an ``__init__`` so that an unknown keyword is a TypeError naming the closest valid one.

    Python's own error names the unknown keyword but not the one meant. The signature seen by
    ``inspect.signature`` (and so by LightningCLI) is unchanged.

    Example::

        >>> class Callback:
        ...     @checks_options
        ...     def __init__(self, monitor: str = "loss") -> None:
        ...         self.monitor = monitor
        >>> Callback(montor="val_loss")
        Traceback (most recent call last):
        TypeError: Callback got an unknown option 'montor': did you mean 'monitor'?
    """
    valid = keyword_names(init)
    owner = init.__qualname__.rsplit(".", 1)[0]

    @functools.wraps(init)
    def checked(self: Any, *args: Any, **kwargs: Any) -> None:
        for name in kwargs:
            if name not in valid:
                raise unknown_option_error(owner, name, valid)
        init(self, *args, **kwargs)

    return checked  # type: ignore[return-value]
