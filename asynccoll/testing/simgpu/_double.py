"""Doubles built from the real vendor functions."""

from __future__ import annotations

import inspect
from typing import Any, Callable


def strict(real: Any, impl: Callable[..., Any], *, method: bool = False) -> Callable[..., Any]:
    """A double of ``real`` (a function or class of torch, cuda-bindings or nccl4py).

    Every call is first bound to ``real``'s own signature, so a misspelled keyword,
    a missing argument or one too many raises ``TypeError`` exactly where the real
    function would (what ``unittest.mock.create_autospec`` checks); then ``impl``
    runs. Unlike an autospec mock it records no calls: a mock's call list keeps every
    argument (tensors, streams) alive and grows without bound over a benchmark.
    ``method``: ``real`` is an unbound method; the double is called without ``self``.
    """
    sig = inspect.signature(real)
    if method:
        params = list(sig.parameters.values())[1:]
        sig = sig.replace(parameters=params)

    def double(*args: Any, **kwargs: Any) -> Any:
        sig.bind(*args, **kwargs)
        return impl(*args, **kwargs)

    double.__name__ = getattr(real, "__name__", "double")
    double.__qualname__ = double.__name__
    double.__doc__ = getattr(real, "__doc__", None)
    double.__signature__ = sig  # type: ignore[attr-defined]
    double.__wrapped_real__ = real  # type: ignore[attr-defined]
    return double
