"""PPO with a Conduit plane as the staging area between RLlib's env runners and its torch learner.

``ConduitPPOTorchLearner`` (select with ``config.training(learner_class=ConduitPPOTorchLearner)``; RLlib's algorithm
code is unchanged) changes two steps of ``Learner.update`` and keeps the rest:

1. **GAE in JAX.** RLlib's ``GeneralAdvantageEstimation`` connector piece (a NumPy loop over the batch) is replaced
   by ``ConduitGAE``, appended at the same place after RLlib's own pieces: it runs the value head (torch, no grad),
   hands values, rewards and episode-boundary flags to JAX through DLPack (zero-copy: fresh, aligned tensors), runs
   the core's ``transforms.gae`` (an associative scan, O(log n) depth; compiled by ``engine.compiled``, the batch
   padded to a power of two so sizes do not recompile) and hands advantages (standardised like RLlib does) and value
   targets back to torch through DLPack (zero-copy). The maths is RLlib's ``compute_value_targets`` (same boundary conventions as
   ``AddOneTsToEpisodesAndTruncate``).
2. **Epoch minibatches from the plane.** Instead of RLlib's ``MiniBatchCyclicIterator`` (slices and per-epoch
   shuffles of torch tensors), the finished train batch is ingested into an ``ExperienceDataPlane`` with
   ``samplers.epochs(minibatch_size)`` (torch -> JAX zero-copy for the duration of the ingest). Each epoch's
   minibatches come out of one jitted call (the plane's pure sampling step scanned over the epoch, state donated) and
   reach torch through DLPack once per column per epoch (zero-copy); a minibatch is a view of that block. One
   delivery and one DLPack hand-over per minibatch cost several times RLlib's slicing. The batch of
   ``n`` rows is padded cyclically to ``C = ceil(n / minibatch_size) * minibatch_size`` rows (its first ``C - n``
   rows once more, as RLlib's cyclic iterator also repeats rows), so each epoch is ``C / minibatch_size`` minibatches
   with every row at least once (RLlib: ``ceil(num_epochs * n / minibatch_size)`` minibatches in all, so up to
   ``num_epochs - 1`` fewer). The plane's capacity is ``minibatch_size`` times a power of two and its storage is
   emptied before each batch, so the varying ``n`` (train batch + one bootstrap row per episode chunk) reuses one
   compiled plane.

Every epoch is a fresh shuffle (RLlib shuffles only with ``shuffle_batch_per_epoch``, PPO's default). Falls back to
RLlib's own iterator without ``minibatch_size``, for multi-module batches, ``num_total_minibatches`` (several
learners), data iterators, and stateful modules (GAE falls back to RLlib's piece too).
"""

from __future__ import annotations

import collections
import dataclasses
import math
import time

import jax
import jax.numpy as jnp
import numpy as np
import torch
from ray.rllib.algorithms.ppo.torch.ppo_torch_learner import PPOTorchLearner
from ray.rllib.connectors.connector_v2 import ConnectorV2
from ray.rllib.connectors.learner.general_advantage_estimation import GeneralAdvantageEstimation
from ray.rllib.core.columns import Columns
from ray.rllib.core.rl_module.apis.value_function_api import ValueFunctionAPI
from ray.rllib.evaluation.postprocessing import Postprocessing
from ray.rllib.policy.sample_batch import MultiAgentBatch, SampleBatch

from conduit_jax import ExperienceDataPlane, ExperienceSpec, default_mesh, engine, samplers, transforms
from conduit_jax.replay import compile_size
from conduit_rllib.dlpack import jax_to_torch, torch_to_jax

# the GAE kernel is compiled for compile_size(max(n, _MIN_BUCKET)) rows (a power of two; padding rows are masked out)
_MIN_BUCKET = 256


# RLlib's ``compute_value_targets`` + advantage standardisation on the first ``n`` rows of padded columns
gae = engine.compiled(transforms.gae, "rllib_gae", static_argnames=("gamma", "lambda_", "standardize"))


def _padded(tensor: torch.Tensor, size: int, dtype: torch.dtype) -> torch.Tensor:
    out = torch.zeros(size, dtype=dtype)
    out[: tensor.shape[0]] = tensor.detach().to("cpu", dtype)
    return out


class ConduitGAE(ConnectorV2):
    """Learner connector piece: GAE advantages and value targets computed in JAX (see the module docstring)."""

    def __init__(self, input_observation_space=None, input_action_space=None, *, gamma: float, lambda_: float,
                 **kwargs):
        super().__init__(input_observation_space, input_action_space, **kwargs)
        self.gamma, self.lambda_ = float(gamma), float(lambda_)
        self.seconds = 0.0

    def __call__(self, *, rl_module, episodes, batch, **kwargs):
        start = time.perf_counter()
        for module_id, module_batch in batch.items():
            module = rl_module[module_id]
            if not isinstance(module, ValueFunctionAPI):
                continue
            with torch.no_grad():
                values = module.compute_values(module_batch)
            device = values.device
            n = int(values.shape[0])
            size = compile_size(max(n, _MIN_BUCKET))
            # fresh, 64-byte-aligned CPU tensors owned here: handed to JAX without a copy
            inputs = [_padded(values, size, torch.float32),
                      _padded(module_batch[Columns.REWARDS], size, torch.float32),
                      _padded(module_batch[Columns.TERMINATEDS], size, torch.bool),
                      _padded(module_batch[Columns.TRUNCATEDS], size, torch.bool)]
            advantages, targets = gae(*(torch_to_jax(t, copy=False) for t in inputs), np.int32(n),
                                      gamma=self.gamma, lambda_=self.lambda_)
            module_batch[Postprocessing.ADVANTAGES] = jax_to_torch(advantages, device=device)[:n]
            module_batch[Postprocessing.VALUE_TARGETS] = jax_to_torch(targets, device=device)[:n]
        self.seconds += time.perf_counter() - start
        return batch


class EpochStaging:
    """Stages a finished PPO train batch in a plane and yields its epoch minibatches as torch batches.

    One plane per (module, spec, minibatch size, capacity bucket): its capacity is ``minibatch_size`` times a power of
    two, so the varying batch size (train batch + one bootstrap row per episode chunk) reuses one compiled plane.
    Before each batch the plane's storage is reset to empty (the sampler's random stream goes on), so an epoch covers
    exactly the rows of this batch."""

    def __init__(self, seed: int = 0, max_planes: int = 4):
        self.seed = seed
        self.max_planes = max_planes
        # key -> (plane, its empty storage, {minibatches per epoch: jitted epoch})
        self._planes: collections.OrderedDict = collections.OrderedDict()
        self.seconds = 0.0  # ingest + deliveries + DLPack, excluding the learner's own work between minibatches

    def _plane(self, spec: ExperienceSpec, rows: int, minibatch: int, module_id: str):
        """The plane for this batch (its storage emptied) and its cache of compiled epochs."""
        capacity = minibatch * (1 << max(0, (rows // minibatch - 1).bit_length()))
        key = (module_id, spec, minibatch, capacity)
        entry = self._planes.pop(key, None)
        if entry is None:
            plane = ExperienceDataPlane(spec, capacity, samplers.epochs(minibatch), mesh=default_mesh(1),
                                        seed=self.seed)
            entry = (plane, jax.tree_util.tree_map(jnp.copy, plane.state.storage), {})
            while len(self._planes) >= self.max_planes:
                self._planes.popitem(last=False)
        self._planes[key] = entry
        plane, empty, epochs = entry
        # drop the previous batch: fresh (empty) storage, the sampler's key and epoch counter carry on
        plane.state = dataclasses.replace(plane.state, storage=jax.tree_util.tree_map(jnp.copy, empty))
        return plane, epochs

    def minibatches(self, module_id: str, module_batch: SampleBatch, *, num_epochs: int, minibatch_size: int,
                    device: torch.device):
        start = time.perf_counter()
        columns = {k: v for k, v in module_batch.items() if isinstance(v, torch.Tensor)}
        n = len(module_batch)
        size = minibatch_size or n
        rows = math.ceil(n / size) * size
        if rows > n:  # cyclic padding: the first rows - n rows once more (fresh tensors, owned here)
            columns = jax.tree_util.tree_map(lambda t: torch.cat([t, t[: rows - n]]), columns)
        arrays = jax.tree_util.tree_map(lambda t: torch_to_jax(t, copy=False), columns)
        spec = ExperienceSpec.from_structs(jax.tree_util.tree_map(
            lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), arrays))
        plane, epochs = self._plane(spec, rows, size, module_id)
        # the JAX arrays alias torch memory only while ingest runs: the plane packs them and keeps no reference
        plane.ingest(arrays)
        del arrays, columns
        self.seconds += time.perf_counter() - start
        per_epoch = rows // size
        if per_epoch not in epochs:
            epochs[per_epoch] = _epoch_kernel(plane, per_epoch)
        epoch = epochs[per_epoch]
        for _ in range(num_epochs):
            start = time.perf_counter()
            state, blocks = epoch(plane.state)
            plane.state = state
            # [per_epoch, size, ...] per column; the learner sees one view per minibatch
            tensors = jax.tree_util.tree_map(lambda a: jax_to_torch(a, device=device), blocks)
            self.seconds += time.perf_counter() - start
            for i in range(per_epoch):
                start = time.perf_counter()
                batch = {key: tensor[i] for key, tensor in tensors.items()}
                out = MultiAgentBatch({module_id: SampleBatch(batch)}, env_steps=n)
                self.seconds += time.perf_counter() - start
                yield out


def _epoch_kernel(plane: ExperienceDataPlane, per_epoch: int):
    """One jitted call delivering an epoch's ``per_epoch`` minibatches: the plane's pure sampling step drawing them
    all at once, one gather per column (the state is donated and stored back by the caller)."""
    step = plane.sample_fn(batches=per_epoch)

    def epoch(state):
        state, delivery = step(state)
        return state, delivery.data

    return engine.compiled(epoch, "ppo_epoch", donate_argnums=0)


class ConduitPPOTorchLearner(PPOTorchLearner):
    """RLlib's PPO torch learner with GAE in JAX and epoch minibatches delivered by a Conduit plane."""

    def build(self) -> None:
        super().build()
        self._conduit_gae = None
        if self._learner_connector is not None and self.config.add_default_connectors_to_learner_pipeline:
            names = [type(piece).__name__ for piece in self._learner_connector.connectors]
            stateful = any(self.module[module_id].is_stateful() for module_id in self.module.keys())  # noqa: SIM118 (a MultiRLModule)
            if GeneralAdvantageEstimation.__name__ in names and not stateful:
                self._learner_connector.remove(GeneralAdvantageEstimation.__name__)
                self._conduit_gae = ConduitGAE(gamma=self.config.gamma, lambda_=self.config.lambda_)
                self._learner_connector.append(self._conduit_gae)
        self._conduit_staging = EpochStaging(seed=int(self.config.seed or 0))

    def _create_iterator_if_necessary(self, *, training_data, num_total_minibatches: int = 0, num_epochs: int = 1,
                                      minibatch_size=None, shuffle_batch_per_epoch: bool = False, **kwargs):
        if training_data.data_iterators or num_total_minibatches or not minibatch_size:
            return super()._create_iterator_if_necessary(
                training_data=training_data, num_total_minibatches=num_total_minibatches, num_epochs=num_epochs,
                minibatch_size=minibatch_size, shuffle_batch_per_epoch=shuffle_batch_per_epoch, **kwargs)
        batch = self._make_batch_if_necessary(training_data=training_data)
        for module_id in list(batch.policy_batches):
            if not self.should_module_be_updated(module_id, batch):
                del batch.policy_batches[module_id]
        if not batch.policy_batches:
            return {}
        if len(batch.policy_batches) != 1 or any(m.is_stateful() for m in (
                self.module[mid] for mid in batch.policy_batches)):
            return _rllib_iterator(batch, num_epochs, minibatch_size, shuffle_batch_per_epoch)
        (module_id, module_batch), = batch.policy_batches.items()
        return self._conduit_staging.minibatches(module_id, module_batch, num_epochs=num_epochs,
                                                 minibatch_size=minibatch_size, device=self._device)


def _rllib_iterator(batch, num_epochs, minibatch_size, shuffle):
    from ray.rllib.utils.minibatch_utils import MiniBatchCyclicIterator, MiniBatchDummyIterator

    if minibatch_size or num_epochs > 1:
        return MiniBatchCyclicIterator(batch, num_epochs=num_epochs, minibatch_size=minibatch_size or batch.count,
                                       shuffle_batch_per_epoch=shuffle and num_epochs > 1)
    return MiniBatchDummyIterator(batch, num_epochs=num_epochs, minibatch_size=minibatch_size,
                                  shuffle_batch_per_epoch=False)
