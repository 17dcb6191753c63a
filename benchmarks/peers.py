"""The contenders, behind one interface, each used the way its own users use it.

Every contender takes ``(spec, capacity, batch_size, per=None, seed=0)`` where ``spec`` maps leaf name to
``(shape, dtype)`` of one item, and offers:

  prepare(batch)            -> what ``add`` consumes (NumPy dict; TensorDict for TorchRL); done outside the timing
  add(prepared)             writes a chunk (leading item axis) and returns once the write has happened
  sample(batch_size)        -> Sampled(data, ids, weights), ready to use (JAX arrays blocked on)
  prepare_priorities(p)     -> what ``update_priorities`` consumes (a JAX array for JAX contenders)
  update_priorities(ids, p) PER contenders only: stores (p + eps) ** alpha for the sampled items
  state_bytes()             bytes of the buffer's own arrays (None when unknown)
  jit_cache_entries()       compiled executables held by its jitted functions (JAX contenders; None otherwise)

Prioritized contenders use the same law: stored priority (p + eps) ** alpha, new items at the largest priority seen,
P(i) = stored_i / total, importance weights (N * P(i)) ** -beta normalised by the largest weight: over the batch for
Conduit, Flashbax (computed in its jitted sample) and NumPy, as Conduit defines it; over the whole buffer for cpprb,
whose min tree is built in.

A contender whose library cannot run here raises ``Unavailable`` from its constructor with the reason, which the
benchmark prints instead of a row.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any, NamedTuple, Optional

import numpy as np

Spec = dict  # name -> (shape tuple, numpy dtype) of one item


class Unavailable(RuntimeError):
    """The contender cannot run in this environment; the message says why."""


@dataclass(frozen=True)
class PER:
    alpha: float = 0.6
    beta: float = 0.4
    eps: float = 1e-6


class Sampled(NamedTuple):
    data: Any  # the batch: dict of arrays (or a TensorDict)
    ids: Any  # what update_priorities takes back (None for uniform samplers)
    weights: Any  # importance weights (None for uniform samplers)


def item_bytes(spec: Spec) -> int:
    return sum(int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize for shape, dtype in spec.values())


def random_batch(spec: Spec, n: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """``n`` items of random content (never zero pages): normal floats, random bits for integers and booleans."""
    out = {}
    for name, (shape, dtype) in spec.items():
        dtype = np.dtype(dtype)
        if dtype == np.bool_:
            out[name] = rng.random((n, *shape)) < 0.5
        elif np.issubdtype(dtype, np.floating):
            out[name] = rng.standard_normal((n, *shape), dtype=np.float32).astype(dtype)
        else:
            info = np.iinfo(dtype)
            out[name] = rng.integers(info.min, info.max, (n, *shape), dtype=dtype, endpoint=True)
    return out


def _num_items(batch) -> int:
    return len(next(iter(batch.values())))


class Contender:
    name = "contender"
    is_jax = False
    prioritized = False

    def prepare(self, batch):
        return batch

    def prepare_priorities(self, priorities: np.ndarray):
        return priorities

    def update_priorities(self, ids, priorities) -> None:
        raise NotImplementedError(f"{self.name} is not prioritized")

    def state_bytes(self) -> Optional[int]:
        return None

    def jit_cache_entries(self) -> Optional[int]:
        return None

    def notes(self) -> dict[str, Any]:
        return {}

    def release(self) -> None:
        """Drop the buffer now (the driver frees each group of contenders before building the next): JAX arrays
        are deleted, every other attribute dropped. The contender is unusable afterwards."""
        delete_jax_arrays(self.__dict__.get("state"))
        self.__dict__.clear()


def delete_jax_arrays(tree) -> None:
    """Delete every JAX array of ``tree`` (None: nothing) now, instead of when the last reference goes."""
    if tree is None:
        return
    import jax

    for leaf in jax.tree_util.tree_leaves(tree):
        if isinstance(leaf, jax.Array) and not leaf.is_deleted():
            leaf.delete()


# ------------------------------------------------------------------------------------------------------------------
# NumPy ring buffer and NumPy sum-tree PER (our own code)
# ------------------------------------------------------------------------------------------------------------------
class NumpyRing(Contender):
    """Per-leaf NumPy arrays, a write cursor, uniform sampling with replacement by fancy indexing."""

    name = "numpy"

    def __init__(self, spec: Spec, capacity: int, batch_size: int, per: Optional[PER] = None, seed: int = 0):
        self.capacity = capacity
        self.data = {name: np.empty((capacity, *shape), dtype) for name, (shape, dtype) in spec.items()}
        self.cursor = 0
        self.size = 0
        self.rng = np.random.default_rng(seed)

    def _write(self, batch) -> tuple[int, int]:
        """Copy a chunk in at the cursor (two slices when it wraps); returns (first slot, count)."""
        n = _num_items(batch)
        start, cap = self.cursor, self.capacity
        head = min(n, cap - start)
        for name, arr in self.data.items():
            src = batch[name]
            arr[start:start + head] = src[:head]
            if head < n:
                arr[:n - head] = src[head:]
        self.cursor = (start + n) % cap
        self.size = min(self.size + n, cap)
        return start, n

    def add(self, batch) -> None:
        self._write(batch)

    def _gather(self, idx):
        return {name: arr[idx] for name, arr in self.data.items()}

    def sample(self, batch_size: int) -> Sampled:
        idx = self.rng.integers(0, self.size, batch_size)
        return Sampled(self._gather(idx), None, None)

    def state_bytes(self) -> int:
        return sum(a.nbytes for a in self.data.values())


class NumpyToJax(Contender):
    """A NumPy ring feeding a JAX learner: its sampled batch is ``jax.device_put`` and blocked on.

    What a JAX learner pays for a host-side buffer (the comparison Conduit's on-device delivery is for). Wraps an
    existing ``NumpyRing`` so the buffer is not held twice; it has no ``add`` of its own."""

    name = "numpy+device_put"
    is_jax = True

    def __init__(self, ring: NumpyRing):
        import jax

        self._jax = jax
        self.ring = ring
        self._device = jax.devices()[0]

    def add(self, batch) -> None:
        self.ring.add(batch)

    def sample(self, batch_size: int) -> Sampled:
        out = self._jax.device_put(self.ring.sample(batch_size).data, self._device)
        self._jax.block_until_ready(out)
        return Sampled(out, None, None)

    def release(self) -> None:
        self.__dict__.clear()  # the ring is the wrapped contender's, released with it


class NumpySumTreePER(NumpyRing):
    """Prioritized replay over the NumPy ring: a binary sum tree in one flat float64 array.

    Layout: node 1 is the root, node k has children 2k and 2k+1, the ``L = 2**depth`` leaves are nodes [L, 2L) and
    leaf ``L + i`` holds item i's stored priority (p + eps) ** alpha (0 for empty slots). Every operation is
    vectorised over the batch: one NumPy op per tree level, never a Python loop over items. Importance weights are
    normalised over the batch, as Conduit's are, so no min tree is kept.
    """

    name = "numpy-sumtree"
    prioritized = True

    def __init__(self, spec: Spec, capacity: int, batch_size: int, per: Optional[PER] = None, seed: int = 0):
        super().__init__(spec, capacity, batch_size, None, seed)
        self.per = per or PER()
        self.depth = max(1, math.ceil(math.log2(capacity)))
        self.leaves = 1 << self.depth
        self.sum = np.zeros(2 * self.leaves, np.float64)
        self.max_priority = 1.0  # raw priority new items get (before eps and alpha)

    # -- tree maintenance -------------------------------------------------------------------------------------------
    def _set_range(self, start: int, values: np.ndarray) -> None:
        """Leaves [start, start + len(values)) (no wrap) and every ancestor, one slice op per level."""
        lo, hi = self.leaves + start, self.leaves + start + len(values) - 1
        self.sum[lo:hi + 1] = values
        for _ in range(self.depth):
            lo, hi = lo >> 1, hi >> 1
            self.sum[lo:hi + 1] = self.sum[2 * lo:2 * hi + 2:2] + self.sum[2 * lo + 1:2 * hi + 2:2]

    def _set_points(self, slots: np.ndarray, values: np.ndarray) -> None:
        """Scattered leaves and their ancestors. Duplicate slots are harmless: the last value wins at the leaf and
        every ancestor is recomputed from its children, so duplicates write the same sum."""
        pos = slots.astype(np.int64) + self.leaves
        self.sum[pos] = values
        for _ in range(self.depth):
            pos >>= 1
            left = 2 * pos
            self.sum[pos] = self.sum[left] + self.sum[left + 1]

    # -- contender interface ----------------------------------------------------------------------------------------
    def add(self, batch) -> None:
        start, n = self._write(batch)
        value = (self.max_priority + self.per.eps) ** self.per.alpha
        head = min(n, self.capacity - start)
        self._set_range(start, np.full(head, value))
        if head < n:
            self._set_range(0, np.full(n - head, value))

    def sample(self, batch_size: int) -> Sampled:
        total = self.sum[1]
        # stratified draws: one uniform point in each of batch_size equal segments of the total mass
        u = (np.arange(batch_size) + self.rng.random(batch_size)) * (total / batch_size)
        node = np.ones(batch_size, np.int64)
        for _ in range(self.depth):
            left = node << 1
            mass = self.sum[left]
            right = u >= mass
            u = np.where(right, u - mass, u)
            node = left + right
        # float rounding can step onto an empty leaf at the far right: clamp into the filled range
        slots = np.minimum(node - self.leaves, self.size - 1)
        stored = self.sum[slots + self.leaves]
        # (N P(i))^-beta / max_j (N P(j))^-beta over the batch  =  (stored_i / min_j stored_j)^-beta
        weights = (stored / stored.min()) ** -self.per.beta
        return Sampled(self._gather(slots), slots, weights.astype(np.float32))

    def update_priorities(self, ids, priorities) -> None:
        self.max_priority = max(self.max_priority, float(priorities.max()))
        self._set_points(ids, (priorities.astype(np.float64) + self.per.eps) ** self.per.alpha)

    def state_bytes(self) -> int:
        return super().state_bytes() + self.sum.nbytes


# ------------------------------------------------------------------------------------------------------------------
# cpprb
# ------------------------------------------------------------------------------------------------------------------
def _cpprb_env(spec: Spec) -> dict:
    # cpprb stores scalar leaves with a trailing axis of 1 ("shape" defaults to 1)
    return {name: {"shape": shape if shape else 1, "dtype": np.dtype(dtype)} for name, (shape, dtype) in spec.items()}


class CpprbUniform(Contender):
    name = "cpprb"

    def __init__(self, spec: Spec, capacity: int, batch_size: int, per: Optional[PER] = None, seed: int = 0):
        try:
            import cpprb
        except ImportError as exc:
            raise Unavailable(f"cpprb is not installed ({exc})") from None
        np.random.seed(seed)  # cpprb draws indices from NumPy's global generator
        self.rb = cpprb.ReplayBuffer(capacity, _cpprb_env(spec))
        self.spec = spec

    def add(self, batch) -> None:
        self.rb.add(**batch)

    def sample(self, batch_size: int) -> Sampled:
        return Sampled(self.rb.sample(batch_size), None, None)

    def state_bytes(self) -> int:
        return self.rb.get_buffer_size() * item_bytes(self.spec)


class CpprbPER(CpprbUniform):
    name = "cpprb-per"
    prioritized = True

    def __init__(self, spec: Spec, capacity: int, batch_size: int, per: Optional[PER] = None, seed: int = 0):
        try:
            import cpprb
        except ImportError as exc:
            raise Unavailable(f"cpprb is not installed ({exc})") from None
        np.random.seed(seed)
        self.per = per or PER()
        self.rb = cpprb.PrioritizedReplayBuffer(capacity, _cpprb_env(spec), alpha=self.per.alpha, eps=self.per.eps)
        self.spec = spec

    def sample(self, batch_size: int) -> Sampled:
        out = self.rb.sample(batch_size, beta=self.per.beta)
        ids, weights = out.pop("indexes"), out.pop("weights")
        return Sampled(out, ids, weights)

    def update_priorities(self, ids, priorities) -> None:
        self.rb.update_priorities(ids, priorities)


# ------------------------------------------------------------------------------------------------------------------
# Flashbax (jitted as its users jit it: add donates the state, the sampling key is carried)
# ------------------------------------------------------------------------------------------------------------------
def jit_cache_size(*fns) -> Optional[int]:
    """Compiled entries in the caches of the jitted functions ``fns`` together (None where JAX does not say)."""
    try:
        return sum(fn._cache_size() for fn in fns)
    except AttributeError:
        return None


def _example_item(spec: Spec):
    import jax.numpy as jnp

    return {name: jnp.zeros(shape, dtype) for name, (shape, dtype) in spec.items()}


def _tree_nbytes(tree) -> int:
    import jax

    return sum(int(x.nbytes) for x in jax.tree_util.tree_leaves(tree))


class FlashbaxUniform(Contender):
    """``fbx.make_item_buffer`` with ``add_sequences=True`` (a chunk of items per add). Flashbax's buffer functions
    are pure, so another batch size is another ``make_item_buffer(sample_batch_size=...)`` sampling the same state
    (built and jitted on first use)."""

    name = "flashbax"
    is_jax = True

    def __init__(self, spec: Spec, capacity: int, batch_size: int, per: Optional[PER] = None, seed: int = 0):
        try:
            import flashbax as fbx
            import jax
        except ImportError as exc:
            raise Unavailable(f"flashbax is not installed ({exc})") from None
        self._jax, self._fbx = jax, fbx
        self.batch_size = batch_size
        self.capacity = capacity
        buffer = fbx.make_item_buffer(max_length=capacity, min_length=1, sample_batch_size=batch_size,
                                      add_sequences=True)
        self.state = buffer.init(_example_item(spec))
        self.key = jax.random.key(seed)
        self._add = jax.jit(buffer.add, donate_argnums=0)
        self._samplers = {batch_size: self._jit_sample(buffer)}
        self._sample = self._samplers[batch_size]

    def _jit_sample(self, buffer):
        jax = self._jax

        def sample(state, key):
            key, sub = jax.random.split(key)
            return buffer.sample(state, sub).experience, key

        return jax.jit(sample)

    def add(self, batch) -> None:
        self.state = self._add(self.state, batch)
        self._jax.block_until_ready(self.state)

    def sample(self, batch_size: int) -> Sampled:
        fn = self._samplers.get(batch_size)
        if fn is None:
            fn = self._samplers[batch_size] = self._jit_sample(self._fbx.make_item_buffer(
                max_length=self.capacity, min_length=1, sample_batch_size=batch_size, add_sequences=True))
        data, self.key = fn(self.state, self.key)
        self._jax.block_until_ready(data)
        return Sampled(data, None, None)

    def state_bytes(self) -> int:
        return _tree_nbytes(self.state)

    def jit_cache_entries(self) -> Optional[int]:
        return jit_cache_size(self._add, *self._samplers.values())


class FlashbaxPER(Contender):
    """``fbx.make_prioritised_item_buffer`` (device="cpu"); sample and ``set_priorities`` jitted separately, as a
    learner that computes TD errors between them does. Flashbax returns probabilities, not importance weights:
    the jitted sample computes them (normalised over the batch: Flashbax keeps no min tree)."""

    name = "flashbax-per"
    is_jax = True
    prioritized = True

    def __init__(self, spec: Spec, capacity: int, batch_size: int, per: Optional[PER] = None, seed: int = 0):
        try:
            import flashbax as fbx
            import jax
            import jax.numpy as jnp
        except ImportError as exc:
            raise Unavailable(f"flashbax is not installed ({exc})") from None
        self._jax = jax
        self.per = per = per or PER()
        self.batch_size = batch_size
        buffer = fbx.make_prioritised_item_buffer(max_length=capacity, min_length=1, sample_batch_size=batch_size,
                                                  add_sequences=True, priority_exponent=per.alpha, device="cpu")
        self.state = buffer.init(_example_item(spec))
        self.key = jax.random.key(seed)

        def sample(state, key):
            key, sub = jax.random.split(key)
            out = buffer.sample(state, sub)
            n = jnp.where(state.is_full, capacity, state.current_index).astype(jnp.float32)
            weights = (n * out.probabilities) ** -per.beta
            return out.experience, out.indices, weights / jnp.max(weights), key

        def update(state, indices, priorities):
            return buffer.set_priorities(state, indices, priorities + per.eps)

        self._add = jax.jit(buffer.add, donate_argnums=0)
        self._sample = jax.jit(sample)
        self._update = jax.jit(update, donate_argnums=0)

    def add(self, batch) -> None:
        self.state = self._add(self.state, batch)
        self._jax.block_until_ready(self.state)

    def sample(self, batch_size: int) -> Sampled:
        assert batch_size == self.batch_size
        data, ids, weights, self.key = self._sample(self.state, self.key)
        self._jax.block_until_ready((data, ids, weights))
        return Sampled(data, ids, weights)

    def prepare_priorities(self, priorities):
        return self._jax.device_put(priorities)

    def update_priorities(self, ids, priorities) -> None:
        self.state = self._update(self.state, ids, priorities)
        self._jax.block_until_ready(self.state)

    def state_bytes(self) -> int:
        return _tree_nbytes(self.state)

    def jit_cache_entries(self) -> Optional[int]:
        return jit_cache_size(self._add, self._sample, self._update)


# ------------------------------------------------------------------------------------------------------------------
# TorchRL
# ------------------------------------------------------------------------------------------------------------------
_torch_status: Optional[str] = None


def import_torch():
    """Import torch pinned to one thread (ARCHITECTURE.md: 2 threads on 2 shared cores are many times slower)."""
    import logging

    import torch

    logging.getLogger("torchrl").setLevel(logging.WARNING)  # its INFO lines would interleave with the tables

    torch.set_num_threads(1)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # only settable before the first inter-op parallel work; harmless afterwards
        pass
    return torch


def torchrl_status() -> dict[str, Any]:
    """Whether TorchRL imports, and whether its C++ extension (the segment trees PER needs) loads, with reasons."""
    out: dict[str, Any] = {"torchrl": None, "extension": None}
    try:
        import_torch()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import torchrl
        out["torchrl"] = f"torchrl {torchrl.__version__} imports"
        out["torchrl_ok"] = True
    except Exception as exc:
        out["torchrl"] = f"TorchRL unavailable: import failed: {type(exc).__name__}: {exc}"
        out["torchrl_ok"] = False
        out["extension_ok"] = False
        return out
    try:
        import torch
        import torchrl._torchrl  # noqa: F401

        out["extension"] = "torchrl._torchrl loads"
        out["extension_ok"] = True
    except Exception as exc:
        msg = str(exc)
        if len(msg) > 160:
            msg = msg[:160] + "..."
        out["extension"] = (f"torchrl's C++ extension (torchrl._torchrl, which holds the SumSegmentTree/MinSegmentTree "
                            f"of PrioritizedSampler) does not load with torch {torch.__version__}: it was built "
                            f"against another torch ABI ({type(exc).__name__}: {msg})")
        out["extension_ok"] = False
    return out


def start_torchrl(seed: int):
    """(torch on 1 thread and seeded, tensordict.TensorDict, the torchrl.data package), imported quietly; Unavailable
    with the reason when TorchRL does not import."""
    status = torchrl_status()
    if not status["torchrl_ok"]:
        raise Unavailable(status["torchrl"])
    torch = import_torch()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from tensordict import TensorDict
        from torchrl import data
    torch.manual_seed(seed)
    return torch, TensorDict, data


class TorchRLUniform(Contender):
    """``ReplayBuffer(storage=LazyTensorStorage(capacity), batch_size=B)`` over TensorDicts; torch on 1 thread."""

    name = "torchrl"

    def __init__(self, spec: Spec, capacity: int, batch_size: int, per: Optional[PER] = None, seed: int = 0,
                 fixed_batch: bool = True):
        self.fixed_batch = fixed_batch  # False: no batch size in the constructor, rb.sample(batch_size) per call
        self._torch, self._TensorDict, data = start_torchrl(seed)
        self.rb = self._make(data, capacity, batch_size, per)
        self.batch_size = batch_size

    def _make(self, data, capacity, batch_size, per):
        if not self.fixed_batch:
            return data.ReplayBuffer(storage=data.LazyTensorStorage(capacity))
        return data.ReplayBuffer(storage=data.LazyTensorStorage(capacity), batch_size=batch_size)

    def prepare(self, batch):
        # a torch user holds tensors already: convert outside the timing (zero-copy from NumPy)
        n = _num_items(batch)
        return self._TensorDict({k: self._torch.from_numpy(v) for k, v in batch.items()}, batch_size=[n])

    def add(self, batch) -> None:
        self.rb.extend(batch)

    def sample(self, batch_size: int) -> Sampled:
        if not self.fixed_batch:
            return Sampled(self.rb.sample(batch_size), None, None)
        assert batch_size == self.batch_size
        return Sampled(self.rb.sample(), None, None)

    def state_bytes(self) -> Optional[int]:
        try:
            storage = self.rb._storage._storage
            return sum(int(t.numel() * t.element_size()) for t in storage.values(True, True))
        except Exception:
            return None


class TorchRLPER(TorchRLUniform):
    """``TensorDictReplayBuffer`` with ``PrioritizedSampler``: needs torchrl's C++ extension."""

    name = "torchrl-per"
    prioritized = True

    def __init__(self, spec: Spec, capacity: int, batch_size: int, per: Optional[PER] = None, seed: int = 0):
        status = torchrl_status()
        if not status["torchrl_ok"]:
            raise Unavailable(status["torchrl"])
        if not status["extension_ok"]:
            raise Unavailable("TorchRL PER unavailable: " + status["extension"])
        self.per = per or PER()
        super().__init__(spec, capacity, batch_size, self.per, seed)
        self.fixed_batch = True

    def _make(self, data, capacity, batch_size, per):
        return data.TensorDictReplayBuffer(
            storage=data.LazyTensorStorage(capacity), batch_size=batch_size,
            sampler=data.PrioritizedSampler(capacity, alpha=per.alpha, beta=per.beta, eps=per.eps),
            priority_key="td_error")

    def sample(self, batch_size: int) -> Sampled:
        td = self.rb.sample()
        return Sampled(td, td.get("index"), td.get("_weight"))

    def prepare_priorities(self, priorities):
        return self._torch.from_numpy(priorities)

    def update_priorities(self, ids, priorities) -> None:
        self.rb.update_priority(ids, priorities)


# ------------------------------------------------------------------------------------------------------------------
# Conduit-JAX
# ------------------------------------------------------------------------------------------------------------------
def _conduit_spec(spec: Spec):
    from conduit_jax import ExperienceSpec

    return ExperienceSpec.from_example({name: np.zeros(shape, dtype) for name, (shape, dtype) in spec.items()})


def conduit_prioritized_available() -> Optional[str]:
    """None when Conduit's prioritized sampler exists, else why not."""
    from conduit_jax import ExperienceDataPlane, samplers

    missing = []
    if not callable(getattr(samplers, "prioritized", None)):
        missing.append("conduit_jax.samplers.prioritized")
    if not callable(getattr(ExperienceDataPlane, "update_priorities", None)):
        missing.append("ExperienceDataPlane.update_priorities")
    return None if not missing else "missing " + " and ".join(missing)


class Conduit(Contender):
    """``ExperienceDataPlane`` on a ``default_mesh(devices)``; NumPy chunks in through ``ingest``, batches out of
    ``sample()`` as JAX arrays (blocked on). With ``per`` it uses ``samplers.prioritized`` and
    ``plane.update_priorities(delivery.ids, priorities)``."""

    is_jax = True

    def __init__(self, spec: Spec, capacity: int, batch_size: int, per: Optional[PER] = None, seed: int = 0,
                 devices: int = 1, chunk: int = 1000):
        import jax

        from conduit_jax import ExperienceDataPlane, default_mesh, samplers

        self._jax = jax
        self.devices = devices
        self.chunk = chunk
        if devices > jax.device_count():
            raise Unavailable(f"needs {devices} devices, the process has {jax.device_count()} (set XLA_FLAGS="
                              f"--xla_force_host_platform_device_count={devices} before JAX starts)")
        self.prioritized = per is not None
        if per is not None:
            why = conduit_prioritized_available()
            if why:
                raise Unavailable(f"conduit prioritized: not available yet ({why})")
            sampler = samplers.prioritized(batch_size, alpha=per.alpha, beta=per.beta, eps=per.eps)
        else:
            sampler = samplers.uniform(batch_size)
        self.name = f"conduit[{devices}dev]" if devices == 1 else f"conduit[{devices}dev-emulated,correctness-cfg]"
        self.plane = ExperienceDataPlane(_conduit_spec(spec), capacity, sampler, mesh=default_mesh(devices),
                                         seed=seed)
        self.batch_size = batch_size

    def add(self, batch) -> None:
        self.plane.ingest(batch)
        self.plane.block_until_ready()

    def sample(self, batch_size: int) -> Sampled:
        assert batch_size == self.batch_size
        delivery = self.plane.sample()
        self._jax.block_until_ready(delivery)
        return Sampled(delivery.data, delivery.ids, delivery.weights)

    def prepare_priorities(self, priorities):
        return self._jax.device_put(priorities)

    def update_priorities(self, ids, priorities) -> None:
        # checked now, applied inside the next sample's kernel (which the cycle blocks on): reading plane.state
        # here would force the update into a kernel of its own, as a caller that inspects the state gets
        self.plane.update_priorities(ids, priorities)

    def state_bytes(self) -> int:
        return _tree_nbytes(self.plane.state)

    def jit_cache_entries(self) -> Optional[int]:
        return sum(self.plane.engine.kernel_cache_sizes().values())

    def notes(self) -> dict[str, Any]:
        from conduit_jax import replay

        config = self.plane.config
        return {"row_bytes": config.layout.row_bytes, "shards": self.plane.num_shards,
                "ingest_bucket_rows": replay.padded_rows(self.chunk, self.plane.num_shards, config.shard_capacity),
                "compile_counts": self.plane.compile_counts()}

    def release(self) -> None:
        plane = self.__dict__.get("plane")
        if plane is not None:
            delete_jax_arrays(plane.state)
            plane.__dict__.clear()
        self.__dict__.clear()


class ConduitRecycling(Contender):
    """The plane of a built ``Conduit`` contender, sampled with ``sample(recycle=previous)``: each batch is written
    into the buffers of the batch before it, which the timed loop is done with (a learner handing back the batch it
    trained on). No buffer of its own; the first call also draws the batch that the second recycles."""

    is_jax = True

    def __init__(self, base: Conduit):
        self._jax, self.base, self._previous = base._jax, base, None

    def add(self, batch) -> None:
        self.base.add(batch)

    def sample(self, batch_size: int) -> Sampled:
        assert batch_size == self.base.batch_size
        plane = self.base.plane
        if self._previous is None:
            self._previous = plane.sample()
        delivery = self._previous = plane.sample(recycle=self._previous)
        self._jax.block_until_ready(delivery)
        return Sampled(delivery.data, delivery.ids, delivery.weights)

    def jit_cache_entries(self) -> Optional[int]:
        return self.base.jit_cache_entries()

    def release(self) -> None:
        self.__dict__.clear()  # the plane is the wrapped contender's, released with it


# ------------------------------------------------------------------------------------------------------------------
# W4: the PPO experience path (one rollout in, epochs x minibatches out, every minibatch ready)
# ------------------------------------------------------------------------------------------------------------------
class PPOContender(Contender):
    """A rollout buffer for PPO. ``add(rollout)`` stores a whole rollout (``capacity`` items), ``minibatch()``
    delivers the next shuffled minibatch (each item once per epoch), ``iterate(rollout)`` is one PPO iteration:
    ``add`` then ``epochs x (capacity // minibatch)`` minibatches, each ready. ``sample(b)`` is ``minibatch()``."""

    def __init__(self, spec: Spec, capacity: int, minibatch: int, epochs: int, seed: int = 0):
        self.capacity, self.minibatch_size, self.epochs = capacity, minibatch, epochs
        self.per_epoch = capacity // minibatch

    def sample(self, batch_size: int) -> Sampled:
        assert batch_size == self.minibatch_size
        return Sampled(self.minibatch(), None, None)

    def iterate(self, rollout):
        self.add(rollout)
        out = None
        for _ in range(self.epochs * self.per_epoch):
            out = self.minibatch()
        return out


class NumpyEpochs(PPOContender):
    """Per-leaf NumPy arrays of one rollout; per epoch ``rng.permutation(n)``, per minibatch a fancy-index gather
    of every leaf (CleanRL's loop)."""

    name = "numpy"

    def __init__(self, spec: Spec, capacity: int, minibatch: int, epochs: int, seed: int = 0):
        super().__init__(spec, capacity, minibatch, epochs, seed)
        self.data = {name: np.empty((capacity, *shape), dtype) for name, (shape, dtype) in spec.items()}
        self.rng = np.random.default_rng(seed)
        self.perm = None
        self.step = 0

    def add(self, rollout) -> None:
        for name, arr in self.data.items():
            np.copyto(arr, rollout[name])
        self.perm, self.step = None, 0

    def minibatch(self):
        if self.perm is None or self.step == self.per_epoch:
            self.perm, self.step = self.rng.permutation(self.capacity), 0
        idx = self.perm[self.step * self.minibatch_size:(self.step + 1) * self.minibatch_size]
        self.step += 1
        return {name: arr[idx] for name, arr in self.data.items()}

    def state_bytes(self) -> int:
        return sum(a.nbytes for a in self.data.values())


class JaxShuffleEpochs(PPOContender):
    """PureJaxRL's update: the rollout on the device (``jax.device_put``, blocked on), then one jitted call that for
    each epoch draws ``jax.random.permutation``, gathers every leaf with it and reshapes into minibatches
    (``lax.scan`` over epochs): all ``epochs x minibatches`` batches come out of one call, as PureJaxRL's nested
    scans consume them. It has no per-minibatch call (``minibatch()`` is not offered)."""

    name = "jax-shuffle(purejaxrl)"
    is_jax = True

    def __init__(self, spec: Spec, capacity: int, minibatch: int, epochs: int, seed: int = 0):
        import jax
        import jax.numpy as jnp
        from jax import lax

        super().__init__(spec, capacity, minibatch, epochs, seed)
        self._jax = jax
        self.key = jax.random.key(seed)
        self.state = None
        per_epoch, n = self.per_epoch, capacity

        def update(batch, key):
            def epoch(key, _):
                key, sub = jax.random.split(key)
                perm = jax.random.permutation(sub, n)
                shuffled = jax.tree_util.tree_map(lambda x: jnp.take(x, perm, axis=0), batch)
                return key, jax.tree_util.tree_map(
                    lambda x: x.reshape(per_epoch, minibatch, *x.shape[1:]), shuffled)

            key, minibatches = lax.scan(epoch, key, None, length=epochs)
            return minibatches, key

        self._update = jax.jit(update)

    def add(self, rollout) -> None:
        self.state = self._jax.device_put(rollout)
        self._jax.block_until_ready(self.state)

    def iterate(self, rollout):
        self.add(rollout)
        out, self.key = self._update(self.state, self.key)
        self._jax.block_until_ready(out)
        return out

    def state_bytes(self) -> Optional[int]:
        return None if self.state is None else _tree_nbytes(self.state)

    def jit_cache_entries(self) -> Optional[int]:
        return jit_cache_size(self._update)


class TorchRLEpochs(PPOContender):
    """``ReplayBuffer(LazyTensorStorage(n), sampler=SamplerWithoutReplacement(), batch_size=minibatch)``: ``extend``
    the rollout, then ``sample()`` per minibatch (TorchRL's PPO tutorial); torch on 1 thread."""

    name = "torchrl"

    def __init__(self, spec: Spec, capacity: int, minibatch: int, epochs: int, seed: int = 0):
        self._torch, self._TensorDict, data = start_torchrl(seed)
        super().__init__(spec, capacity, minibatch, epochs, seed)
        self.rb = data.ReplayBuffer(storage=data.LazyTensorStorage(capacity), sampler=data.SamplerWithoutReplacement(),
                                    batch_size=minibatch)

    def prepare(self, batch):
        n = _num_items(batch)
        return self._TensorDict({k: self._torch.from_numpy(v) for k, v in batch.items()}, batch_size=[n])

    def add(self, rollout) -> None:
        self.rb.extend(rollout)

    def minibatch(self):
        return self.rb.sample()

    def state_bytes(self) -> Optional[int]:
        return TorchRLUniform.state_bytes(self)


class ConduitEpochs(PPOContender):
    """``ExperienceDataPlane(spec, n, samplers.epochs(minibatch), mesh=default_mesh(1))``: ``ingest`` the rollout
    (a new epoch starts), then ``sample()`` per minibatch, each blocked on."""

    is_jax = True
    name = "conduit[1dev]"

    def __init__(self, spec: Spec, capacity: int, minibatch: int, epochs: int, seed: int = 0):
        import jax

        from conduit_jax import ExperienceDataPlane, default_mesh, samplers

        super().__init__(spec, capacity, minibatch, epochs, seed)
        self._jax = jax
        self.plane = ExperienceDataPlane(_conduit_spec(spec), capacity, samplers.epochs(minibatch),
                                         mesh=default_mesh(1), seed=seed)

    def add(self, rollout) -> None:
        self.plane.ingest(rollout)
        self.plane.block_until_ready()

    def minibatch(self):
        delivery = self.plane.sample()
        self._jax.block_until_ready(delivery)
        return delivery.data

    def state_bytes(self) -> int:
        return _tree_nbytes(self.plane.state)

    def jit_cache_entries(self) -> Optional[int]:
        return sum(self.plane.engine.kernel_cache_sizes().values())

    def notes(self) -> dict[str, Any]:
        return {"row_bytes": self.plane.config.layout.row_bytes, "compile_counts": self.plane.compile_counts()}

    def release(self) -> None:
        Conduit.release(self)


class ConduitFusedEpochs(PPOContender):
    """Conduit's fused path on the same plane as ``ConduitEpochs``: ``ingest`` the rollout, then one jitted call of
    ``plane.sample_fn(batches=epochs x minibatches)`` with the state donated, returning every minibatch stacked (one
    gather per leaf), as a learner that samples inside its own jitted update would."""

    is_jax = True
    name = "conduit[fused-jit]"

    def __init__(self, base: ConduitEpochs):
        import jax

        super().__init__(None, base.capacity, base.minibatch_size, base.epochs)
        self._jax = jax
        self.base = base
        step = base.plane.sample_fn(batches=base.epochs * base.per_epoch)

        def fused(state):
            state, delivery = step(state)
            return state, delivery.data

        self._fused = jax.jit(fused, donate_argnums=0)

    def add(self, rollout) -> None:
        self.base.add(rollout)

    def iterate(self, rollout):
        plane = self.base.plane
        self.add(rollout)
        plane.state, out = self._fused(plane.state)
        self._jax.block_until_ready(out)
        return out

    def jit_cache_entries(self) -> Optional[int]:
        return jit_cache_size(self._fused)

    def release(self) -> None:
        self.__dict__.clear()  # the plane is the wrapped contender's


# ------------------------------------------------------------------------------------------------------------------
# W5: sequences of consecutive steps of one environment (recurrent learners)
# ------------------------------------------------------------------------------------------------------------------
def time_major_to_streams(batch, streams: int):
    """A time-major chunk (item ``t * streams + e``) as ``[streams, steps, ...]`` leaves, contiguous."""
    out = {}
    for name, x in batch.items():
        steps = x.shape[0] // streams
        out[name] = np.ascontiguousarray(x.reshape(steps, streams, *x.shape[1:]).swapaxes(0, 1))
    return out


class NumpySequences(Contender):
    """Per-leaf NumPy rings laid out per stream, ``[streams, steps, ...]`` (each window is contiguous); ``add`` writes
    a time-major chunk transposed into every stream's ring; ``sample`` draws (stream, start) uniformly over the
    windows that do not cross the write cursor and gathers ``arr[stream[:, None], (start[:, None] + arange(L)) %
    steps]`` for every leaf: one fancy index per leaf, [B, L, ...] out."""

    name = "numpy-windows"

    def __init__(self, spec: Spec, capacity: int, batch_size: int, length: int, streams: int, seed: int = 0):
        self.streams, self.length = streams, length
        self.steps = capacity // streams
        self.data = {name: np.empty((streams, self.steps, *shape), dtype) for name, (shape, dtype) in spec.items()}
        self.cursor = self.filled = 0
        self.rng = np.random.default_rng(seed)
        self.offsets = np.arange(length)

    def prepare(self, batch):
        return time_major_to_streams(batch, self.streams)

    def add(self, batch) -> None:
        t = next(iter(batch.values())).shape[1]
        start, cap = self.cursor, self.steps
        head = min(t, cap - start)
        for name, arr in self.data.items():
            src = batch[name]
            arr[:, start:start + head] = src[:, :head]
            if head < t:
                arr[:, :t - head] = src[:, head:]
        self.cursor = (start + t) % cap
        self.filled = min(self.filled + t, cap)

    def sample(self, batch_size: int) -> Sampled:
        windows = self.filled - self.length + 1
        stream = self.rng.integers(0, self.streams, batch_size)
        first = (self.cursor - self.filled) % self.steps  # oldest stored step
        start = (first + self.rng.integers(0, windows, batch_size)) % self.steps
        idx = (start[:, None] + self.offsets[None, :]) % self.steps
        return Sampled({name: arr[stream[:, None], idx] for name, arr in self.data.items()}, None, None)

    def state_bytes(self) -> int:
        return sum(a.nbytes for a in self.data.values())


class FlashbaxTrajectory(Contender):
    """``fbx.make_trajectory_buffer(add_batch_size=streams, sample_sequence_length=L, period=1, ...)``: state
    ``[streams, steps, ...]``; chunks are transposed to ``[streams, steps, ...]`` outside the timing; ``add``
    jitted with the state donated, ``sample`` jitted with the key carried; [B, L, ...] out."""

    name = "flashbax-trajectory"
    is_jax = True

    def __init__(self, spec: Spec, capacity: int, batch_size: int, length: int, streams: int, seed: int = 0):
        try:
            import flashbax as fbx
            import jax
        except ImportError as exc:
            raise Unavailable(f"flashbax is not installed ({exc})") from None
        self._jax = jax
        self.streams = streams
        buffer = fbx.make_trajectory_buffer(add_batch_size=streams, sample_batch_size=batch_size,
                                            sample_sequence_length=length, period=1, min_length_time_axis=length,
                                            max_length_time_axis=capacity // streams)
        self.state = buffer.init(_example_item(spec))
        self.key = jax.random.key(seed)

        def sample(state, key):
            key, sub = jax.random.split(key)
            return buffer.sample(state, sub).experience, key

        self._add = jax.jit(buffer.add, donate_argnums=0)
        self._sample = jax.jit(sample)

    def prepare(self, batch):
        return time_major_to_streams(batch, self.streams)

    def add(self, batch) -> None:
        self.state = self._add(self.state, batch)
        self._jax.block_until_ready(self.state)

    def sample(self, batch_size: int) -> Sampled:
        data, self.key = self._sample(self.state, self.key)
        self._jax.block_until_ready(data)
        return Sampled(data, None, None)

    def state_bytes(self) -> int:
        return _tree_nbytes(self.state)

    def jit_cache_entries(self) -> Optional[int]:
        return jit_cache_size(self._add, self._sample)


class TorchRLSequences(Contender):
    """``TensorDictReplayBuffer(storage=LazyTensorStorage(capacity, ndim=2), sampler=SliceSampler(slice_len=L,
    end_key="episode_end"), batch_size=B * L)``: the storage is ``[steps, streams]`` and ``extend`` takes ``[streams,
    steps]`` chunks along time; torch on 1 thread. ``episode_end`` is a bool leaf that is never set, stored with the
    data (1 B per step): with no episode ends each stream is one trajectory, so the windows may cross an episode end
    as the other contenders' do, and the slice sampler's uniform draw over trajectories (streams of equal length),
    then over starts, is uniform over the stored windows, and no window spans the seam at the write cursor
    (tests/test_peers.py). ``sample`` reshapes the flat ``[B * L]`` slices to ``[B, L, ...]`` (a view)."""

    name = "torchrl-slices"

    def __init__(self, spec: Spec, capacity: int, batch_size: int, length: int, streams: int, seed: int = 0):
        self._torch, self._TensorDict, data = start_torchrl(seed)
        self.streams, self.batch_size, self.length = streams, batch_size, length
        self.rb = data.TensorDictReplayBuffer(storage=data.LazyTensorStorage(capacity, ndim=2),
                                              sampler=data.SliceSampler(slice_len=length, end_key="episode_end"),
                                              batch_size=batch_size * length)

    def prepare(self, batch):
        # outside the timing, as for the peers that store [streams, steps]: transposed, then zero-copy tensors
        per_stream = time_major_to_streams(batch, self.streams)
        shape = next(iter(per_stream.values())).shape[:2]
        leaves = {k: self._torch.from_numpy(v) for k, v in per_stream.items()}
        leaves["episode_end"] = self._torch.zeros(shape, dtype=self._torch.bool)
        return self._TensorDict(leaves, batch_size=list(shape))

    def add(self, batch) -> None:
        self.rb.extend(batch)

    def sample(self, batch_size: int) -> Sampled:
        assert batch_size == self.batch_size
        return Sampled(self.rb.sample().reshape(self.batch_size, self.length), None, None)

    def state_bytes(self) -> Optional[int]:
        return TorchRLUniform.state_bytes(self)


class ConduitSequences(Conduit):
    """``ExperienceDataPlane(spec, capacity, samplers.sequences(B, L, streams, pad=pad), mesh=default_mesh(1))``;
    time-major chunks through ``ingest``, ``sample()`` -> data [B, L, ...] (and ``mask`` [B, L] with ``pad``)."""

    def __init__(self, spec: Spec, capacity: int, batch_size: int, length: int, streams: int, seed: int = 0,
                 pad: bool = True, chunk: int = 1024):
        import jax

        from conduit_jax import ExperienceDataPlane, default_mesh, samplers

        self._jax = jax
        self.devices, self.chunk = 1, chunk
        self.prioritized = False
        self.name = "conduit[1dev]"
        self.plane = ExperienceDataPlane(_conduit_spec(spec), capacity,
                                         samplers.sequences(batch_size, length, streams, pad=pad),
                                         mesh=default_mesh(1), seed=seed)
        self.batch_size = batch_size

    def sample(self, batch_size: int) -> Sampled:
        delivery = self.plane.sample()
        self._jax.block_until_ready(delivery)
        return Sampled(delivery.data, delivery.ids, delivery.mask)
