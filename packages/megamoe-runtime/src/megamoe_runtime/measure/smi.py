"""The GPU's clock and power beside a measurement: nvidia-smi sampled in the background.

A reading taken under the board's power limit runs on whatever SM clock the limit allows at
that moment (docs/benchmarks.md, "The power limit"), so a benchmark that compares readings taken
at different moments shows the clock of each beside it: `SmiSampler` keeps nvidia-smi's lines,
each stamped with the host clock (`time.time()`) as it arrives, and `between` hands out those of
one reading's span.
"""

from __future__ import annotations

import statistics
import subprocess
import threading
import time
from collections.abc import Sequence

# the SM clock (MHz), the board's power draw (W) and the clock-limit reasons (0x4: the software
# power cap)
SMI_FIELDS = ("clocks.sm", "power.draw", "clocks_event_reasons.active")


class SmiSampler:
    """nvidia-smi's `fields` every `period_ms`, read by a background thread until `stop()`.

    `samples`: (host time, values) per line, the values as nvidia-smi printed them (strings;
    `median_of` reads a numeric field). `command`: the program to run in nvidia-smi's place
    (a test's stand-in), given the same arguments."""

    def __init__(
        self,
        fields: Sequence[str] = SMI_FIELDS,
        *,
        period_ms: int = 50,
        command: Sequence[str] = ("nvidia-smi",),
    ):
        if period_ms < 1:
            raise ValueError(f"period_ms must be >= 1, got {period_ms}")
        self.fields = tuple(fields)
        self.samples: list[tuple[float, tuple[str, ...]]] = []
        try:
            self.process = subprocess.Popen(
                [
                    *command,
                    f"--query-gpu={','.join(self.fields)}",
                    "--format=csv,noheader,nounits",
                    "-lms",
                    str(period_ms),
                ],
                stdout=subprocess.PIPE,
                text=True,
            )
        except FileNotFoundError as missing:
            raise RuntimeError(
                f"SmiSampler runs {command[0]!r}, which is not on this machine's PATH "
                "(it comes with the NVIDIA driver)"
            ) from missing
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.process.stdout:
            values = tuple(value.strip() for value in line.split(","))
            if len(values) == len(self.fields):  # not a partial or an error line
                self.samples.append((time.time(), values))

    def between(self, start: float, end: float) -> list[tuple[float, tuple[str, ...]]]:
        """The samples stamped from `start` to `end` (host time, `time.time()`)."""
        return [sample for sample in list(self.samples) if start <= sample[0] <= end]

    def median_of(self, field: str, start: float, end: float) -> float:
        """The median of numeric field `field` over the samples from `start` to `end`; NaN where
        none arrived then or nvidia-smi printed no number ("[N/A]")."""
        return self.median_over(field, [(start, end)])

    def median_over(self, field: str, spans: Sequence[tuple[float, float]]) -> float:
        """The median of numeric field `field` over the samples inside any of `spans` ((start,
        end) host times: the readings of one candidate among others'; a sample in two spans
        counts once); NaN where none arrived then or nvidia-smi printed no number."""
        if field not in self.fields:
            raise ValueError(f"field {field!r} is not sampled; sampled: {', '.join(self.fields)}")
        index = self.fields.index(field)
        numbers = []
        for stamp, values in list(self.samples):
            if any(start <= stamp <= end for start, end in spans):
                try:
                    numbers.append(float(values[index]))
                except ValueError:
                    continue
        return statistics.median(numbers) if numbers else float("nan")

    def stop(self) -> None:
        """Ends nvidia-smi and waits for the reader to take its last lines."""
        self.process.terminate()
        self.process.wait()
        self.reader.join(timeout=5)

    def __enter__(self) -> SmiSampler:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
