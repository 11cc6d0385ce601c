"""Progress of a long step, in one style for every stage: a bar when stderr is a terminal, a log
line every 15 seconds (and at the end) when it is not (a log file, CI, a job scheduler).

    progress = Progress("sampling", total=len(todo), unit="question")
    for ...:
        progress.update(len(groups), trajectories_per_s=f"{rate:.2f}")
    progress.close()

Both show done/total, the rate, the time left and the caller's figures; the bar is tqdm's. This
module counts and prints; it does not time phases (etagent.timing does) or log metrics.
"""

from __future__ import annotations

import logging
import sys
import time

from tqdm import tqdm

log = logging.getLogger("etagent.progress")

LINE_EVERY_S = 15.0


class Progress:
    def __init__(self, name: str, total: int | None, unit: str, initial: int = 0, bar: bool | None = None, every_s: float = LINE_EVERY_S):
        """``bar``: None picks by whether stderr is a terminal; False always writes lines, one
        every ``every_s`` seconds (0: one per update)."""
        self.name, self.total, self.unit = name, total, unit
        self.done = self.initial = initial
        self.started = self.logged = time.monotonic()
        self.figures: dict[str, object] = {}
        self.every_s = every_s
        use_bar = sys.stderr.isatty() if bar is None else bar and sys.stderr.isatty()
        self.bar = tqdm(total=total, initial=initial, desc=name, unit=unit, dynamic_ncols=True) if use_bar else None

    def update(self, n: int = 1, **figures) -> None:
        self.done += n
        self.figures.update(figures)
        if self.bar is not None:
            self.bar.update(n)
            if figures:
                self.bar.set_postfix(self.figures, refresh=False)
        elif (n and time.monotonic() - self.logged >= self.every_s) or self.done == self.total:
            self.write_line()

    def write_line(self) -> None:
        elapsed = time.monotonic() - self.started
        rate = (self.done - self.initial) / elapsed if elapsed > 0 else 0.0
        of = f"/{self.total}" if self.total is not None else ""
        left = ""
        if self.total is not None and rate > 0 and self.done < self.total:
            left = f", {format_seconds((self.total - self.done) / rate)} left"
        extra = "".join(f", {key} {value}" for key, value in self.figures.items())
        log.info("%s: %d%s %ss (%.2f/s%s)%s", self.name, self.done, of, self.unit, rate, left, extra)
        self.logged = time.monotonic()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        elif self.done != self.total and self.done > self.initial:  # the last line, if update did not just write it
            self.write_line()


def format_seconds(seconds: float) -> str:
    minutes, s = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{s:02d}" if hours else f"{minutes}:{s:02d}"
