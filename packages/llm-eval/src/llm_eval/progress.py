"""Progress on stderr: a live line on a terminal, plain lines when stderr is piped or logged
(each step on a line of its own, live-only updates left out), so a log stays readable."""

from __future__ import annotations

import sys
import time


class Progress:
    def __init__(self, total: int = 0, stream=None):
        self.stream = stream or sys.stderr
        self.live = self.stream.isatty()
        self.total, self.done, self.started = total, 0, time.perf_counter()
        self._open = False  # a live line not yet ended

    def say(self, text: str) -> None:
        """A line that stays (a stage begins or ends)."""
        self._write(text, keep=True)

    def update(self, text: str) -> None:
        """A transient status (e.g. layers loaded so far): live only, nothing when piped."""
        if self.live:
            self._write(text, keep=False)

    def step(self, label: str) -> None:
        """One of `total` units done: a bar, the count, elapsed and estimated time left."""
        self.done += 1
        elapsed = time.perf_counter() - self.started
        left = elapsed / self.done * (self.total - self.done)
        bar = "#" * (20 * self.done // self.total)
        text = f"[{bar:<20}] {self.done}/{self.total} {label} ({elapsed:.0f}s, ~{left:.0f}s left)"
        self._write(text, keep=not self.live or self.done >= self.total)

    def restart(self, total: int) -> None:
        """Count a new series of steps (e.g. the timed rounds after the warm-up)."""
        self.total, self.done, self.started = total, 0, time.perf_counter()

    def close(self) -> None:
        """End a live line left open, so what is printed next starts on a fresh line."""
        if self._open:
            self.stream.write("\n")
            self.stream.flush()
            self._open = False

    def _write(self, text: str, keep: bool) -> None:
        if self.live:
            self.stream.write("\r\033[K" + text + ("\n" if keep else ""))
            self._open = not keep
        else:
            self.stream.write(text + "\n")
        self.stream.flush()
