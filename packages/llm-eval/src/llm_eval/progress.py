"""A one-line progress bar on stderr for sweeps and progressions."""

from __future__ import annotations

import sys
import time


class Progress:
    def __init__(self, total: int):
        self.total, self.done, self.started = total, 0, time.perf_counter()

    def step(self, label: str) -> None:
        self.done += 1
        elapsed = time.perf_counter() - self.started
        left = elapsed / self.done * (self.total - self.done)
        bar = "#" * (20 * self.done // self.total)
        print(
            f"\r[{bar:<20}] {self.done}/{self.total} {label} ({elapsed:.0f}s, ~{left:.0f}s left)",
            end="" if self.done < self.total else "\n",
            file=sys.stderr,
            flush=True,
        )
