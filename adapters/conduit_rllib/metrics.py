"""RLlib's buffer metrics at a fraction of their cost: ``CoalescedMetricsLogger``.

RLlib's episode buffers log about 25 values per ``add()`` and per ``sample()`` (``_update_add_metrics``,
``_update_sample_metrics``) into a ``MetricsLogger``; each ``log_value`` costs ~20 us here, about 1 ms per
add + sample on the learner's thread, more than the Conduit kernels' dispatch. RLlib reads them once per iteration
(``get_metrics()`` -> ``reduce()``). This logger queues the values per key and hands them to RLlib's logger when
anything reads it: a sum (``reduce="sum"`` / ``"lifetime_sum"``, no window, no throughput) as one value, a windowed
mean as its last ``window`` values (all its Stats object keeps), anything else value by value in order. What
``reduce()`` returns is what RLlib's own logger returns for the same calls (``tests/test_rllib_adapter.py`` compares
them through RLlib's own metric functions).
"""

from __future__ import annotations

import functools
import math

import numpy as np
from ray.rllib.utils.metrics.metrics_logger import MetricsLogger

_SUMS = ("sum", "lifetime_sum")


class CoalescedMetricsLogger(MetricsLogger):
    """A ``MetricsLogger`` whose ``log_value`` calls are queued per key and coalesced until the logger is read."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._queued: dict = {}  # key -> (log_value options, values), in the order keys were first logged

    def log_value(self, key, value, **options) -> None:
        key = tuple(key) if isinstance(key, list) else key
        entry = self._queued.get(key)
        if entry is not None and entry[0] != options:
            self.flush()  # the same key with other options: RLlib's logger sees the calls in their order
            entry = None
        if entry is None:
            self._queued[key] = (options, [value])
        else:
            entry[1].append(value)

    def flush(self) -> None:
        """Hand every queued value to RLlib's logger."""
        queued, self._queued = self._queued, {}
        for key, (options, values) in queued.items():
            reduce, window = options.get("reduce"), options.get("window")
            if reduce in _SUMS and window is None and not options.get("with_throughput"):
                values = [np.nansum(values)]  # what RLlib's SumStats reduces them to
            elif window is not None and math.isfinite(window) and reduce in ("mean", None) and \
                    options.get("ema_coeff") is None:
                values = values[-int(window):]  # a windowed mean keeps no more than these
            for value in values:
                MetricsLogger.log_value(self, key, value, **options)


def _flushed_first(name: str):
    method = getattr(MetricsLogger, name)

    @functools.wraps(method)
    def read(self, *args, **kwargs):
        self.flush()
        return method(self, *args, **kwargs)

    return read


for _name in ("peek", "reduce", "compile", "get_state", "set_state", "reset", "delete", "log_dict", "aggregate",
              "log_time", "merge_and_log_n_dicts"):
    setattr(CoalescedMetricsLogger, _name, _flushed_first(_name))
