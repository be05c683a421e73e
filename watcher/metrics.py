"""Counters the daemon keeps about itself (read by tests, benchmarks and logs)."""

from __future__ import annotations

import threading
from collections import Counter


class Metrics:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()
        self._reports: Counter[tuple[str, str]] = Counter()

    def add(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counts[name] += n

    def reported(self, task_id: str, file_id: str) -> None:
        with self._lock:
            self._counts["reports"] += 1
            self._reports[(task_id, file_id)] += 1

    def get(self, name: str) -> int:
        with self._lock:
            return self._counts[name]

    def reports_of(self, task_id: str, file_id: str) -> int:
        """Verification reports sent for one entry."""
        with self._lock:
            return self._reports[(task_id, file_id)]

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)
