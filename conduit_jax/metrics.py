"""Experience-path instrumentation: wall-clock spans per stage, measured from outside the kernels.

Every span is a pair of ``time.perf_counter`` stamps taken by the shell around a dispatch and, where the stage's
result is needed, around ``block_until_ready``. The number the project is judged on is the *exposed* experience path:
the time the learner's thread spends in ``ingest``, ``deliver()`` (the ``exposed`` spans) and ``update_priorities``
(``Timeline.exposed_path``). Work that finished on another thread while the learner computed is hidden and does not
count. ``Timeline.chrome_trace()`` exports every span in the Chrome / Perfetto trace-event format.
"""

from __future__ import annotations

import collections
import json
import threading
import time
from typing import Optional

import numpy as np

class Timeline:
    """A bounded record of spans: (stage, start, end) in seconds from the timeline's creation."""

    def __init__(self, max_spans: int = 100_000):
        self._origin = time.perf_counter()
        self._spans: collections.deque = collections.deque(maxlen=max_spans)
        self._durations: dict[str, collections.deque] = collections.defaultdict(lambda: collections.deque(maxlen=10_000))
        self._counts: collections.Counter = collections.Counter()
        self._lock = threading.Lock()

    def record(self, stage: str, start: float, end: float) -> None:
        with self._lock:
            self._spans.append((stage, start - self._origin, end - self._origin, threading.get_ident()))
            self._durations[stage].append(end - start)
            self._counts[stage] += 1

    def span(self, stage: str) -> "_Span":
        """``with timeline.span('sample'): ...`` records the block's wall time."""
        return _Span(self, stage)

    def summary(self) -> dict[str, dict[str, float]]:
        """Per stage: calls, median, p99 and mean in microseconds, and total seconds (over the kept window)."""
        out = {}
        with self._lock:
            for stage, durations in self._durations.items():
                values = np.asarray(durations) * 1e6
                out[stage] = {"calls": self._counts[stage], "median_us": float(np.median(values)),
                              "p99_us": float(np.percentile(values, 99)), "mean_us": float(values.mean()),
                              "total_s": float(values.sum() / 1e6)}
        return out

    def exposed_path(self) -> dict[str, float]:
        """The experience path on the learner's thread, from the kept spans: its ``ingest``, ``update`` and
        ``exposed`` (``deliver()``) spans, or where nothing was delivered its ``ingest``, ``update`` and ``sample``
        spans. The learner's thread is whichever called ``deliver()`` (every thread when none did). Returns the
        total seconds, the batches, the mean per batch in microseconds and each part's total seconds."""
        with self._lock:
            spans = list(self._spans)
        learner = {tid for stage, _, _, tid in spans if stage == "exposed"}
        draw = "exposed" if learner else "sample"
        parts = {"ingest": 0.0, "update": 0.0, draw: 0.0}
        batches = 0
        for stage, start, end, tid in spans:
            if stage in parts and (not learner or tid in learner):
                parts[stage] += end - start
                batches += stage == draw
        total = sum(parts.values())
        return {"total_s": total, "batches": batches, "per_batch_us": total / batches * 1e6 if batches else 0.0,
                "parts_s": parts}

    def chrome_trace(self, path: Optional[str] = None) -> dict:
        """The spans as Chrome trace events (open in chrome://tracing or ui.perfetto.dev); written to ``path``."""
        with self._lock:
            events = [{"name": stage, "cat": "conduit", "ph": "X", "ts": start * 1e6, "dur": (end - start) * 1e6,
                       "pid": 0, "tid": tid} for stage, start, end, tid in self._spans]
        trace = {"traceEvents": events, "displayTimeUnit": "ms"}
        if path is not None:
            with open(path, "w") as f:
                json.dump(trace, f)
        return trace


class _Span:
    def __init__(self, timeline: Timeline, stage: str):
        self.timeline, self.stage = timeline, stage

    def __enter__(self):
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.timeline.record(self.stage, self.start, time.perf_counter())
        return False
