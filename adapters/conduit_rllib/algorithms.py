"""Algorithm and config classes that wire Conduit into RLlib without changing RLlib's algorithm code.

* ``ConduitDQN`` / ``ConduitSAC``: RLlib's DQN / SAC plus ``BufferCheckpointMixin`` (the replay buffer is part of
  ``algo.save()`` / ``algo.restore()`` / ``Algorithm.from_checkpoint`` with ``store_buffer_in_checkpoints``)::

      config = DQNConfig(algo_class=ConduitDQN).training(store_buffer_in_checkpoints=True, replay_buffer_config={
          "type": "conduit_rllib.ConduitPrioritizedEpisodeReplayBuffer", "n_step": 3, ...})

* ``ConduitSACConfig``: RLlib 2.60's ``SACConfig.validate`` accepts only the four built-in episode buffer names as
  ``replay_buffer_config["type"]``; this config validates a ``"conduit_rllib.*"`` type as its RLlib counterpart
  (uniform or prioritized) and builds ``ConduitSAC``. It also has ``store_buffer_in_checkpoints`` (DQN's
  ``training()`` argument, missing from SAC's config)::

      config = ConduitSACConfig().training(store_buffer_in_checkpoints=True, replay_buffer_config={
          "type": "conduit_rllib.ConduitEpisodeReplayBuffer", ...})

* ``with_buffer_checkpoints(SomeAlgorithm)``: the same mixin for another algorithm (the class is registered in
  ``conduit_rllib.algorithms`` so checkpoints can unpickle it; in a new process call it again before
  ``Algorithm.from_checkpoint``).
"""

from __future__ import annotations

from ray.rllib.algorithms.dqn import DQN
from ray.rllib.algorithms.sac import SAC, SACConfig

from conduit_rllib.checkpoint import BufferCheckpointMixin

_CONDUIT_TYPES = "conduit_rllib."


class ConduitDQN(BufferCheckpointMixin, DQN):
    """RLlib's DQN whose replay buffer is part of its checkpoints when ``store_buffer_in_checkpoints`` is set."""


class ConduitSAC(BufferCheckpointMixin, SAC):
    """RLlib's SAC whose replay buffer is part of its checkpoints when ``store_buffer_in_checkpoints`` is set."""


class ConduitSACConfig(SACConfig):
    """``SACConfig`` that accepts ``"conduit_rllib.*"`` replay buffer types and builds ``ConduitSAC``."""

    def __init__(self, algo_class=None):
        super().__init__(algo_class=algo_class or ConduitSAC)
        self.store_buffer_in_checkpoints = False

    def training(self, *, store_buffer_in_checkpoints=None, **kwargs):
        if store_buffer_in_checkpoints is not None:
            self.store_buffer_in_checkpoints = bool(store_buffer_in_checkpoints)
        return super().training(**kwargs)

    def validate(self) -> None:
        buffer_config = self.replay_buffer_config
        kind = buffer_config.get("type") if isinstance(buffer_config, dict) else None
        if not (isinstance(kind, str) and kind.startswith(_CONDUIT_TYPES)):
            return super().validate()
        # RLlib checks the name against its own four; validate as the RLlib buffer this one replaces
        buffer_config["type"] = "PrioritizedEpisodeReplayBuffer" if "Prioritized" in kind else "EpisodeReplayBuffer"
        try:
            super().validate()
        finally:
            buffer_config["type"] = kind


_CLASSES: dict = {DQN: ConduitDQN, SAC: ConduitSAC}


def with_buffer_checkpoints(algorithm_class):
    """``algorithm_class`` with ``BufferCheckpointMixin`` (one class per algorithm, cached)."""
    if algorithm_class not in _CLASSES:
        name = f"Conduit{algorithm_class.__name__}"
        cls = type(name, (BufferCheckpointMixin, algorithm_class), {"__module__": __name__, "__qualname__": name})
        # RLlib pickles the algorithm class into every checkpoint; unpickling looks it up here
        globals().setdefault(name, cls)
        _CLASSES[algorithm_class] = cls
    return _CLASSES[algorithm_class]
