"""Learners that take a Conduit batch through DLPack instead of running RLlib's learner connector on episodes.

With ``replay_buffer_config["deliver"] = "torch"`` a Conduit buffer's ``sample()`` returns a ``ConduitBatch`` (the
train-batch columns, already n-step transformed and weighted by the plane's kernels, packed in one JAX array). RLlib's
DQN / SAC ``training_step`` hands it, unchanged, to ``learner_group.update(episodes=...)``; these learners recognise
it and build the torch ``MultiAgentBatch`` from it with ``words_to_torch`` (one DLPack hand-over, zero-copy on the
learner's device when the plane delivers there, and a view per column; see ``dlpack.py``), skipping episode
reconstruction and the connector pipeline
(``AddObservationsFromEpisodesToBatch`` ... ``NumpyToTensor``). Everything else (episodes from env runners, other
data) goes through RLlib's own path. RLlib's algorithm code is not changed; select with
``config.training(learner_class=ConduitDQNTorchLearner)``.

Requires a local learner (``num_learners=0``, the learner in the process that owns the buffer), where a DLPack
hand-off is possible; RLlib would split a ``ConduitBatch`` like a list of episodes for remote learners.
"""

from __future__ import annotations

import time

from ray.rllib.algorithms.dqn.torch.dqn_torch_learner import DQNTorchLearner
from ray.rllib.algorithms.sac.torch.sac_torch_learner import SACTorchLearner
from ray.rllib.core.learner.learner import Learner
from ray.rllib.policy.sample_batch import MultiAgentBatch, SampleBatch

from conduit_rllib.batch import ConduitBatch
from conduit_rllib.dlpack import words_to_torch

if not hasattr(Learner, "_make_batch_if_necessary"):  # pragma: no cover - guards an RLlib upgrade
    raise ImportError("conduit_rllib.learners needs ray.rllib Learner._make_batch_if_necessary (ray 2.60)")


class ConduitLearnerMixin:
    """Turns a ``ConduitBatch`` into the learner's torch batch via DLPack; anything else goes to RLlib."""

    conduit_batch_seconds = 0.0  # time spent turning Conduit batches into torch batches (for the experiments)

    def _make_batch_if_necessary(self, training_data):
        episodes = training_data.episodes
        if isinstance(episodes, ConduitBatch):
            start = time.perf_counter()
            columns = words_to_torch(episodes.take_words(), episodes.layout, episodes.names, device=self._device)
            batch = MultiAgentBatch({episodes.module_id: SampleBatch(columns)}, env_steps=len(episodes))
            self.conduit_batch_seconds += time.perf_counter() - start
            return batch
        return super()._make_batch_if_necessary(training_data)


class ConduitDQNTorchLearner(ConduitLearnerMixin, DQNTorchLearner):
    """RLlib's DQN torch learner, fed by a Conduit buffer with ``deliver="torch"``."""


class ConduitSACTorchLearner(ConduitLearnerMixin, SACTorchLearner):
    """RLlib's SAC torch learner, fed by a Conduit buffer with ``deliver="torch"``."""
