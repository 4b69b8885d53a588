"""A persistent knob cache: the best knobs found per kernel and problem class, as JSON on disk.

The file is `$MEGAMOE_KNOB_CACHE` when set, else ~/.cache/megamoe/knobs.json. A key names the
kernel op, the GPU, the dtype, the weight dims and the rows-per-expert bucket (a power of two), so
a tuned entry serves every batch of the same class. Writes merge with what is on disk and replace
the file atomically, so concurrent tuners lose at most their own last entry, never the file.

megamoe ships a read-only cache of its own (`shipped_knob_cache()`): entries measured by the
project where the tuner beat the default profile clearly and repeatably. Lookups try the user's
cache first, then the shipped one, then fall back to the default profile.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

ENVIRONMENT_VARIABLE = "MEGAMOE_KNOB_CACHE"
FORMAT_VERSION = 1
SHIPPED_CACHE_PATH = Path(__file__).with_name("shipped_knobs.json")


def default_cache_path() -> Path:
    configured = os.environ.get(ENVIRONMENT_VARIABLE)
    if configured:
        return Path(configured)
    return Path.home() / ".cache" / "megamoe" / "knobs.json"


def rows_per_expert_bucket(rows_per_expert: float) -> int:
    """The smallest power of two >= rows_per_expert (1 for an empty batch)."""
    bucket = 1
    while bucket < rows_per_expert:
        bucket *= 2
    return bucket


@dataclass(frozen=True)
class KnobKey:
    op: str
    device_name: str
    dtype: str
    out_features: int
    in_features: int
    rows_per_expert_bucket: int

    def text(self) -> str:
        return (
            f"{self.op}|{self.device_name}|{self.dtype}|n{self.out_features}|k{self.in_features}"
            f"|r{self.rows_per_expert_bucket}"
        )


class KnobCache:
    def __init__(self, path: Path | str | None = None):
        self.path = Path(path) if path is not None else default_cache_path()
        self._entries: dict[str, dict[str, Any]] | None = None

    def _load(self) -> dict[str, dict[str, Any]]:
        if not self.path.exists():
            return {}
        try:
            document = json.loads(self.path.read_text())
        except json.JSONDecodeError as error:
            raise ValueError(
                f"knob cache {self.path} is not valid JSON ({error}); delete it or point "
                f"{ENVIRONMENT_VARIABLE} elsewhere"
            ) from error
        if document.get("format") != FORMAT_VERSION:
            return {}  # an older format: ignored, rewritten by the next tuning run
        return document.get("entries", {})

    def entries(self) -> dict[str, dict[str, Any]]:
        if self._entries is None:
            self._entries = self._load()
        return self._entries

    def get(self, key: KnobKey) -> dict[str, Any] | None:
        """The stored knobs (a dict of fields) for `key`, or None."""
        entry = self.entries().get(key.text())
        return None if entry is None else entry["knobs"]

    def put(self, key: KnobKey, knobs: dict[str, Any], *, microseconds: float) -> None:
        merged = self._load()
        merged[key.text()] = {"knobs": knobs, "microseconds": microseconds}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        handle, temporary = tempfile.mkstemp(dir=self.path.parent, prefix=".knobs-", suffix=".json")
        with os.fdopen(handle, "w") as stream:
            json.dump(
                {"format": FORMAT_VERSION, "entries": merged}, stream, indent=1, sort_keys=True
            )
        os.replace(temporary, self.path)
        self._entries = merged


@cache
def shipped_knob_cache() -> KnobCache:
    """The knob entries megamoe ships (read them, never `put` into them)."""
    return KnobCache(SHIPPED_CACHE_PATH)
