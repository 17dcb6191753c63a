"""RLlib's replay-buffer metrics at less cost per call: ``BufferMetrics`` runs RLlib's own
``EpisodeReplayBuffer._update_add_metrics`` / ``_update_sample_metrics`` (RLlib computes every name, value and reduce
setting, so what is logged is what RLlib logs) with a ``PushingLogger`` in place of the buffer's ``MetricsLogger``.

``MetricsLogger.log_value`` flattens the key, takes a lock, looks the key up twice and checks its arguments on every
call before it pushes the value onto the key's ``Stats``; a buffer logs ~25 values per ``add`` and per ``sample()``,
~100 us each time on this machine. A ``PushingLogger`` sends a key's first value through ``log_value`` (which creates
its ``Stats`` with RLlib's settings) and pushes later ones onto that ``Stats`` directly, what ``log_value`` does for a
key that exists. A sum without a window (``reduce="sum"`` or ``"lifetime_sum"``: RLlib's counts) re-adds its values
with NumPy on every push; its integer values are added up on the host instead and pushed as one value when the
metrics are read (``LoggedMetrics.metrics``, ``get_metrics()``): for integers the sum and every ``Stats`` state are
what pushing each value gives. A ``PushingLogger`` forgets its ``Stats`` (and what waited for them) when the logger's
tree is replaced (``reset``, ``set_state``); a buffer whose logger is replaced (``buffer.metrics = ...``) pushes what
waited into the old one and takes a new ``PushingLogger``.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
from ray.rllib.core import DEFAULT_AGENT_ID, DEFAULT_MODULE_ID
from ray.rllib.utils.metrics.metrics_logger import MetricsLogger
from ray.rllib.utils.metrics.stats.lifetime_sum import LifetimeSumStats
from ray.rllib.utils.metrics.stats.sum import SumStats
from ray.rllib.utils.replay_buffers.episode_replay_buffer import EpisodeReplayBuffer


class PushingLogger:
    """Stands in for ``logger`` where RLlib's buffer code calls ``log_value`` (see the module docstring)."""

    __slots__ = ("logger", "_tree", "_stats", "_summed", "_waiting")

    def __init__(self, logger: MetricsLogger):
        self.logger, self._tree, self._stats, self._summed, self._waiting = logger, None, {}, set(), {}

    def log_value(self, key, value, **kwargs) -> None:
        if self.logger.stats is not self._tree:  # reset / set_state give the logger a new tree
            self._tree, self._stats, self._summed, self._waiting = self.logger.stats, {}, set(), {}
        stats = self._stats.get(key)
        if stats is None:
            self.logger.log_value(key, value, **kwargs)
            node = self.logger.stats
            for part in key if isinstance(key, tuple) else (key,):
                node = node[part]
            self._stats[key] = node
            if _summed_on_host(node):
                self._summed.add(key)
        elif key in self._summed and isinstance(value, (int, np.integer)) and not isinstance(value, bool):
            self._waiting[key] = self._waiting.get(key, 0) + value
        else:
            waiting = self._waiting.pop(key, None)
            if waiting is not None:  # a summed key takes another value: what waited goes first, in order
                stats.push(waiting)
            stats.push(value)

    def flush(self) -> None:
        """Push the sums waiting on the host onto their ``Stats`` (of the logger's current tree)."""
        if self._waiting and self.logger.stats is self._tree:
            for key, total in self._waiting.items():
                self._stats[key].push(total)
        self._waiting = {}


def _summed_on_host(stats) -> bool:
    """Whether ``stats`` only adds its values up (no window): integers for it can wait on the host."""
    return isinstance(stats, (SumStats, LifetimeSumStats)) and getattr(stats, "_window", None) is None


class BufferMetrics:
    """A buffer's RLlib metrics: its ``MetricsLogger`` (``logger``), and RLlib's ``_update_*_metrics`` run for the
    buffer with a ``PushingLogger`` over it (see the module docstring)."""

    __slots__ = ("logger", "pushing")

    def __init__(self, logger: MetricsLogger):
        self.logger, self.pushing = logger, None

    def current(self) -> MetricsLogger:
        """The logger with every value logged so far on it."""
        if self.pushing is not None:
            self.pushing.flush()
        return self.logger

    def use(self, logger: MetricsLogger) -> None:
        """Log onto ``logger`` from now on (what waited goes onto the one before)."""
        self.current()
        self.logger = logger

    def _run(self, update, buffer, metrics: dict) -> None:
        if self.pushing is None or self.pushing.logger is not self.logger:
            self.pushing = PushingLogger(self.logger)
        update(_LoggingAs(self.pushing, buffer), **metrics)

    def update_add(self, buffer, **metrics) -> None:
        """RLlib's ``EpisodeReplayBuffer._update_add_metrics(buffer, **metrics)``."""
        self._run(EpisodeReplayBuffer._update_add_metrics, buffer, metrics)

    def update_sample(self, buffer, **metrics) -> None:
        """RLlib's ``EpisodeReplayBuffer._update_sample_metrics(buffer, **metrics)``."""
        self._run(EpisodeReplayBuffer._update_sample_metrics, buffer, metrics)

    def added(self, buffer, steps: int, episodes_added: int, evicted: int, steps_evicted: int) -> None:
        """A single-agent add's metrics (RLlib's default agent and module)."""
        agent, module = DEFAULT_AGENT_ID, DEFAULT_MODULE_ID
        self.update_add(
            buffer, num_episodes_added=episodes_added, num_env_steps_added=steps, num_episodes_evicted=evicted,
            num_env_steps_evicted=steps_evicted, agent_to_num_episodes_added={agent: episodes_added},
            agent_to_num_steps_added={agent: steps}, agent_to_num_episodes_evicted={agent: evicted},
            agent_to_num_steps_evicted={agent: steps_evicted}, module_to_num_episodes_added={module: episodes_added},
            module_to_num_steps_added={module: steps}, module_to_num_episodes_evicted={module: evicted},
            module_to_num_steps_evicted={module: steps_evicted})

    def sampled(self, buffer, steps: int, mean_n: Optional[float], resamples: int, episodes: int = 0,
                unique_steps: Optional[int] = None) -> None:
        """A single-agent sample's metrics; ``mean_n`` None for sequence batches (RLlib logs no n-step there);
        ``episodes`` and ``unique_steps``: the distinct episodes and steps drawn, where RLlib counts them."""
        agent, module = DEFAULT_AGENT_ID, DEFAULT_MODULE_ID
        unique = steps if unique_steps is None else unique_steps
        self.update_sample(
            buffer, num_env_steps_sampled=steps, num_episodes_per_sample=episodes, num_env_steps_per_sample=unique,
            sampled_n_step=mean_n, num_resamples=resamples, agent_to_num_steps_sampled={agent: steps},
            agent_to_num_episodes_per_sample={agent: episodes}, agent_to_num_steps_per_sample={agent: unique},
            agent_to_sampled_n_step=None if mean_n is None else {agent: mean_n},
            agent_to_num_resamples={agent: resamples}, module_to_num_steps_sampled={module: steps},
            module_to_num_episodes_per_sample={module: episodes}, module_to_num_steps_per_sample={module: unique},
            module_to_sampled_n_step=None if mean_n is None else {module: mean_n},
            module_to_num_resamples={module: resamples})


class _LoggingAs:
    """The buffer as RLlib's metric updates read it, its ``metrics`` the ``PushingLogger``."""

    __slots__ = ("metrics", "_buffer")

    def __init__(self, metrics: PushingLogger, buffer):
        self.metrics, self._buffer = metrics, buffer

    def __getattr__(self, name: str):
        return getattr(self._buffer, name)


class LoggedMetrics:
    """RLlib's ``metrics`` attribute and ``get_metrics()`` for a buffer logging through a ``BufferMetrics``
    (``self._logged``): reading either pushes what waited on the host first."""

    @property
    def metrics(self) -> MetricsLogger:
        return self._logged.current()

    @metrics.setter
    def metrics(self, logger: MetricsLogger) -> None:
        self._logged.use(logger)

    def get_metrics(self):
        return self.metrics.reduce()
