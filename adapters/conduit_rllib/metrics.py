"""RLlib's replay-buffer metrics at less cost per call: ``BufferMetrics`` runs RLlib's own
``EpisodeReplayBuffer._update_add_metrics`` / ``_update_sample_metrics`` (RLlib computes every name, value and reduce
setting, so what is logged is what RLlib logs) on the buffer, with a ``PushingLogger`` in place of its
``MetricsLogger`` for the call.

``MetricsLogger.log_value`` flattens the key, takes a lock, looks the key up twice and checks its arguments on every
call before it pushes the value onto the key's ``Stats``; a buffer logs ~25 values per ``add`` and per ``sample()``,
~100 us each time on this machine. A ``PushingLogger`` sends a key's first value through ``log_value`` (which creates
its ``Stats`` with RLlib's settings) and pushes later ones onto that ``Stats`` directly, what ``log_value`` does for a
key that exists. It forgets its ``Stats`` when the logger's tree is replaced (``reset``, ``set_state``); a
``BufferMetrics`` takes a new one when the buffer's logger is replaced (its ``metrics`` attribute reassigned).
"""

from __future__ import annotations

from typing import Optional

from ray.rllib.core import DEFAULT_AGENT_ID, DEFAULT_MODULE_ID
from ray.rllib.utils.metrics.metrics_logger import MetricsLogger
from ray.rllib.utils.replay_buffers.episode_replay_buffer import EpisodeReplayBuffer


class PushingLogger:
    """Stands in for ``logger`` where RLlib's buffer code calls ``log_value`` (see the module docstring)."""

    __slots__ = ("logger", "_tree", "_stats")

    def __init__(self, logger: MetricsLogger):
        self.logger, self._tree, self._stats = logger, None, {}

    def log_value(self, key, value, **kwargs) -> None:
        if self.logger.stats is not self._tree:  # reset / set_state give the logger a new tree
            self._tree, self._stats = self.logger.stats, {}
        stats = self._stats.get(key)
        if stats is None:
            self.logger.log_value(key, value, **kwargs)
            node = self.logger.stats
            for part in key if isinstance(key, tuple) else (key,):
                node = node[part]
            self._stats[key] = node
        else:
            stats.push(value)


class BufferMetrics:
    """A buffer's RLlib metrics: RLlib's ``_update_*_metrics`` run on the buffer while its ``metrics`` is a
    ``PushingLogger`` over its ``MetricsLogger`` (put back after each call; a buffer whose ``metrics`` is reassigned
    gets a new ``PushingLogger``)."""

    __slots__ = ("pushing",)

    def __init__(self):
        self.pushing: Optional[PushingLogger] = None

    def _run(self, update, buffer, metrics: dict) -> None:
        logger = buffer.metrics
        if self.pushing is None or self.pushing.logger is not logger:
            self.pushing = PushingLogger(logger)
        buffer.metrics = self.pushing
        try:
            update(buffer, **metrics)
        finally:
            buffer.metrics = logger

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
