"""PassTimer: the seconds each pass takes over a compile (stats["pass_seconds"]), summed over the floor's
candidates and the memory budget's refits, which run the same passes again, and how often each ran
(stats["pass_calls"]: its "reshuffle", the last pass of every finished plan, counts the full schedules a compile
made)."""

from __future__ import annotations

import time


class PassTimer:
    """Each pass's seconds, summed over every call of it in a compile, and its number of calls."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}

    def run(self, name: str, function, *args, **kwargs):
        """Call `function(*args, **kwargs)`, adding the seconds it took to pass `name`'s; returns what it returns."""
        start = time.perf_counter()
        result = function(*args, **kwargs)
        self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start
        self.calls[name] = self.calls.get(name, 0) + 1
        return result
