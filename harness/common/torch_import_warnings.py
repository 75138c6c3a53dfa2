"""What torch warns as the harness itself imports it, said once, where a plain session says it.

torch warns "Failed to initialize NumPy" once in each process that imports it without numpy.
In a plain session that is the pytest process, when the test modules import torch, and the
warnings summary shows it once. The harness's own processes import torch before any test
code does, and each would add a copy: the fork server and spawned ranks (their start-up
output lands in a report), and a launched session's configure (printed raw, once per rank).
So the ranks' side imports torch `without_numpy_notice()`, and a launched session holds what
its configure raised (`held()`) and raises it again while pytest collects (`raise_again`),
where the test modules' own `import torch` would have raised it.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

NUMPY_NOTICE = "Failed to initialize NumPy"  # torch's words (tensor_numpy.cpp), a prefix


@contextlib.contextmanager
def without_numpy_notice() -> Iterator[None]:
    """Import torch here without its NumPy warning; any other warning is shown as before."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=NUMPY_NOTICE, category=UserWarning)
        yield


@contextlib.contextmanager
def held(into: list[warnings.WarningMessage]) -> Iterator[None]:
    """Keep the warnings raised in this block in `into` instead of showing them."""
    with warnings.catch_warnings(record=True) as caught:
        try:
            yield
        finally:
            into.extend(caught)


def raise_again(kept: list[warnings.WarningMessage]) -> None:
    """Raise `kept` again, each from where it was first raised (pytest's filters apply: one
    a filter turns into an error is dropped, as there is no test module here to fail)."""
    for each in kept:
        with contextlib.suppress(Warning):
            warnings.warn_explicit(
                each.message, each.category, each.filename, each.lineno, source=each.source
            )
    kept.clear()
