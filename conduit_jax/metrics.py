"""Experience-path instrumentation: wall-clock spans per stage, measured from outside the kernels.

Every span is a pair of ``time.perf_counter`` stamps taken by the shell around a dispatch and, where the stage's
result is needed, around ``block_until_ready``. The number the project is judged on is the *exposed* experience path:
the time the learner's thread spends in ``ingest``, ``deliver()`` (the ``exposed`` spans) and ``update_priorities``
(``Timeline.exposed_path``), less the time ``update_priorities`` waits for the learner's own TD errors to be computed
(its step, recorded as ``td_wait``). Work that finished on another thread while the learner computed is hidden and does not
count. ``Timeline.chrome_trace()`` exports every span in the Chrome / Perfetto trace-event format.
"""

from __future__ import annotations

import collections
import json
import threading
import time
from typing import Any, Optional

import numpy as np

class Timeline:
    """A bounded record of spans: (stage, start, end) in seconds from the timeline's creation."""

    def __init__(self, max_spans: int = 100_000):
        self._origin = time.perf_counter()
        self._spans: collections.deque = collections.deque(maxlen=max_spans)
        self._durations: dict[str, collections.deque] = collections.defaultdict(lambda: collections.deque(maxlen=10_000))
        self._counts: collections.Counter = collections.Counter()
        self._lock = threading.Lock()

    def record(self, stage: str, start: float, end: float, thread: Optional[int] = None) -> None:
        """A span of ``stage``, on ``thread`` (an id from ``threading.get_ident``; default: the calling thread)."""
        with self._lock:
            self._spans.append((stage, start - self._origin, end - self._origin,
                                threading.get_ident() if thread is None else thread))
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

    def exposed_path(self) -> dict[str, Any]:
        """The experience path on the learner's thread per delivered batch, from the kept spans: the thread's
        ``ingest`` and ``update`` spans since its previous batch plus the ``exposed`` span (``deliver()``) that
        handed the batch over; where nothing was delivered, ``sample`` spans mark the batches. The learner's thread
        is whichever called ``deliver()`` (every thread when none did). Returns the median and mean per batch in
        microseconds over the batches after the first (the first carries everything ingested before learning
        started, and compilations), the batch count and each part's total seconds."""
        with self._lock:
            spans = sorted(self._spans, key=lambda span: span[2])
        learner = {tid for stage, _, _, tid in spans if stage == "exposed"}
        draw = "exposed" if learner else "sample"
        parts = {"ingest": 0.0, "update": 0.0, draw: 0.0}
        per_batch, pending = [], 0.0
        for stage, start, end, tid in spans:
            if stage not in parts or (learner and tid not in learner):
                continue
            parts[stage] += end - start
            pending += end - start
            if stage == draw:
                per_batch.append(pending)
                pending = 0.0
        steady = np.asarray(per_batch[1:] or per_batch) * 1e6
        return {"median_us": float(np.median(steady)) if steady.size else 0.0,
                "mean_us": float(steady.mean()) if steady.size else 0.0, "batches": len(per_batch),
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
