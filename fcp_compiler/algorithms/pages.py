"""Large numpy arrays in base pages while the compiler, the validator or the simulator runs.

NumPy advises the kernel to back every large array with transparent huge pages (madvise MADV_HUGEPAGE). Where the
kernel then compacts memory or clears a whole 2 MiB page at each first touch (THP defrag "madvise", the common
default, and virtual machines), the passes' many short-lived arrays of millions of rows pay it again and again: a
4096-GPU compile spent a quarter of its time in the kernel clearing pages (benchmarks/compile_latency.py --pages
measures it). Inside :func:`base_pages` the advice is off; it is NumPy's own switch (the one the
NUMPY_MADVISE_HUGEPAGE environment variable sets), restored when the last caller leaves.
"""

from __future__ import annotations

import contextlib
import importlib
import threading
from collections.abc import Callable, Iterator


def _numpy_switch() -> Callable[[bool], bool] | None:
    """NumPy's _set_madvise_hugepage(enabled) -> previous setting, or None where this NumPy has none."""
    for name in ("numpy._core.multiarray", "numpy.core.multiarray"):  # NumPy 2, then 1.26
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        return getattr(module, "_set_madvise_hugepage", None)
    return None


_SWITCH = _numpy_switch()
_LOCK = threading.Lock()
_state = {"inside": 0, "before": True}  # callers inside, and the setting the first of them found


def huge_pages_advised() -> bool | None:
    """Whether NumPy now advises huge pages for large arrays (None where it cannot be told)."""
    if _SWITCH is None:
        return None
    with _LOCK:
        current = _SWITCH(True)
        _SWITCH(current)
    return current


@contextlib.contextmanager
def base_pages() -> Iterator[None]:
    """Within the block, NumPy does not advise huge pages for the arrays it allocates; the setting found on entry
    comes back when the last of any nested or concurrent callers leaves (a process-wide switch, counted under a
    lock). Also a decorator: ``@base_pages()``."""
    if _SWITCH is None:
        yield
        return
    with _LOCK:
        if _state["inside"] == 0:
            _state["before"] = _SWITCH(False)
        _state["inside"] += 1
    try:
        yield
    finally:
        with _LOCK:
            _state["inside"] -= 1
            if _state["inside"] == 0:
                _SWITCH(_state["before"])
