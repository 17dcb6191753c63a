"""conduit_rllib: Conduit-JAX as RLlib's experience path (ray 2.60, new API stack, torch learners).

* Replay buffers (``replay_buffer_config={"type": "conduit_rllib.<ClassName>", ...}``):
  ``ConduitEpisodeReplayBuffer`` (uniform), ``ConduitPrioritizedEpisodeReplayBuffer`` (PER), and for multi-agent
  episodes ``ConduitMultiAgentEpisodeReplayBuffer``, ``ConduitMultiAgentPrioritizedEpisodeReplayBuffer`` --
  ``buffers.py``; their shared implementation in ``store.py`` (one ring: add, sample, priorities, state),
  ``multi_agent.py`` (a store per module), ``draws.py`` (the kernels' pure steps), ``episode_index.py`` (the host-side
  episode index) and ``batch.py`` (``ConduitBatch``, what ``deliver="torch"`` hands a learner).
* Learners fed through DLPack (``config.training(learner_class=...)``): ``ConduitDQNTorchLearner``,
  ``ConduitSACTorchLearner`` (with ``deliver="torch"`` buffers) -- ``learners.py``; ``ConduitPPOTorchLearner`` (GAE
  in JAX, epoch minibatches from a plane) -- ``ppo.py``.
* Checkpoints with the buffer (``store_buffer_in_checkpoints``): ``ConduitDQN``, ``ConduitSAC``,
  ``with_buffer_checkpoints(Algo)`` -- ``algorithms.py`` / ``checkpoint.py``; ``ConduitSACConfig`` lets SAC's config
  validation accept a Conduit buffer type.
* The DLPack bridge: ``jax_to_torch``, ``torch_to_jax``, ``words_to_torch`` (a packed ``ConduitBatch``'s columns)
  and what is zero-copy -- ``dlpack.py``.

This package is the only place where Conduit code imports torch or ray; ``conduit_jax`` never does.
"""

from conduit_rllib.buffers import (ConduitBatch, ConduitEpisodeReplayBuffer, ConduitMultiAgentEpisodeReplayBuffer,
                                   ConduitMultiAgentPrioritizedEpisodeReplayBuffer,
                                   ConduitPrioritizedEpisodeReplayBuffer)
from conduit_rllib.algorithms import ConduitDQN, ConduitSAC, ConduitSACConfig, with_buffer_checkpoints
from conduit_rllib.checkpoint import BufferCheckpointError, BufferCheckpointMixin, load_buffer, save_buffer
from conduit_rllib.dlpack import jax_shards_to_torch, jax_to_torch, shares_memory, torch_to_jax, words_to_torch
from conduit_rllib.learners import ConduitDQNTorchLearner, ConduitLearnerMixin, ConduitSACTorchLearner
from conduit_rllib.ppo import ConduitGAE, ConduitPPOTorchLearner, EpochStaging

__version__ = "0.1.0"

__all__ = [
    "BufferCheckpointError", "BufferCheckpointMixin", "ConduitBatch", "ConduitDQN", "ConduitDQNTorchLearner",
    "ConduitEpisodeReplayBuffer", "ConduitGAE", "ConduitLearnerMixin", "ConduitMultiAgentEpisodeReplayBuffer",
    "ConduitMultiAgentPrioritizedEpisodeReplayBuffer", "ConduitPPOTorchLearner",
    "ConduitPrioritizedEpisodeReplayBuffer", "ConduitSAC", "ConduitSACConfig", "ConduitSACTorchLearner", "EpochStaging",
    "jax_shards_to_torch", "jax_to_torch", "load_buffer", "save_buffer", "shares_memory", "torch_to_jax",
    "with_buffer_checkpoints", "words_to_torch",
]
