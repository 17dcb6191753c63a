"""W8: the LLM-RL rollout path: a generation of ragged token groups in, one learner-ready batch of them out.

GRPO-like shapes: groups of G = 8 responses, 16 groups per generation and per batch, token leaves ``tokens`` int32
and ``logprobs`` float32, max_length 256. Sequence lengths (prompt + response) are long-tailed: a lognormal of median
60 tokens (sigma 0.75), at least the group's prompt (8..32 tokens) + 1, clipped to 256 (mean ~77, ~2.6% at 256);
rewards graded in quarters (0, 0.25, ..., 1). A pool of generations is drawn once from a fixed seed, before any
contender is built; every contender gets the same generations in the same order, in the form its users hold them:
the generator's padded host arrays ``[16, G, 256]`` with lengths (Conduit, Flashbax, TorchRL, cpprb), or Python lists
of per-sequence NumPy arrays (the NumPy peers), prepared outside the timing.

Timed call (``ingest_deliver_g16``): ingest one generation, then produce one batch of those 16 groups on the JAX
device, ready (blocked on): ``tokens``, ``logprobs``, ``segment_ids`` (0 on padding, else the sequence's index in the
batch + 1), ``positions``, ``loss_mask`` (the response tokens) and ``advantages`` ((reward - group mean) /
(group std ddof=1 + 1e-6), exactly 0 for a group whose rewards are all equal, on the sequence's tokens). The ingest and
deliver parts of the same calls are also reported apart (``ingest_part``, ``deliver_part``: perf_counter stamps inside
each call; Conduit's ingest only stages on the host, its deliver kernel writes the staged groups first). Rate: useful
(sequence) tokens per second; "% of memcpy": the token leaves' raw bytes of the sequences (8 B per useful token) per
call over memcpy. ``packing`` records: useful tokens / computed tokens (the batch's positions) of each contender's
batches over the pool.

Before timing, every contender's batch of every pool generation is checked against the generation itself (each
sequence's tokens, logprobs, positions and loss mask exactly, advantages to float32 rounding): the contenders
compute the same thing. The packed budget is ``[rows, 512]`` with ``rows`` the fewest that hold every generation of
the pool whole under the packing rule (first fit, longest first within a group), so the batch holds the 16 groups.

Contenders:
  * ``conduit[packed]``: ``RolloutPlane(spec, token_capacity, group_capacity, 16, rollouts.packed(rows, 512),
    schedule=schedule.staged())``; ``plane.ingest(Groups)`` stages the generation on the host, ``plane.deliver()``
    plans on the host and runs one kernel that writes the staged groups into the token ring and lays the batch out;
  * ``conduit[padded]``: the same plane with ``rollouts.padded()`` ([128, 256]);
  * ``numpy+device_put`` (the path a user writes first): groups kept in a deque as Python lists of per-sequence
    arrays; a batch popped, padded to [128, 256] with one slice copy per sequence and leaf, advantages in NumPy,
    one ``jax.device_put`` of the fields;
  * ``numpy-packed+device_put`` (the strongest host peer): the same deque; the batch placed by first fit (Python, the
    same rule as Conduit's) into [rows, 512], filled by one concatenate and one scatter per field, ``device_put``;
  * ``flashbax``: ``make_item_buffer(max_length=group_capacity, add_sequences=True)`` whose item is one group padded
    to [G, 256] (+ lengths, prompt lengths, rewards); ``add`` jitted with the state donated; the 16 newest groups read
    from the state's ring (its sampler draws at random) by a jitted function that also computes the mask, segment
    ids, positions and advantages: a padded batch [128, 256];
  * ``torchrl``: ``ReplayBuffer(storage=LazyTensorStorage(group_capacity))`` of groups padded to [G, 256];
    ``extend`` returns the indices it wrote and ``rb[indices]`` reads those groups back (its samplers draw at random
    or in storage order over the whole storage, not the newest groups); mask and advantages in torch (1 thread),
    each field handed to JAX with ``jax.dlpack.from_dlpack`` (no copy);
  * ``cpprb``: ``ReplayBuffer(16, env_dict)`` of groups padded to [G, 256], its on-policy use: ``add`` the generation,
    ``get_all_transitions()``, ``clear()`` (cpprb reads the newest n items only as a random sample or all stored
    ones); mask and advantages in NumPy, ``device_put``.
The fixed-shape peers (Flashbax, TorchRL, cpprb) cannot hold ragged sequences: each stores a group padded to
max_length, so their batches are padded ([128, 256]) as ``conduit[padded]``'s and the naive path's.

    python -m benchmarks.bench_w8 [--quick] [--capacity TOKENS] [--rounds R]
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import os
import time
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from benchmarks import common, peers

GROUP_SIZE, GROUPS, MAX_LENGTH = 8, 16, 256
ROW_LENGTH = 512
LEAVES = {"tokens": np.int32, "logprobs": np.float32}
FIELDS = ("tokens", "logprobs", "segment_ids", "positions", "loss_mask", "advantages")
MEDIAN_LENGTH, LENGTH_SIGMA = 60, 0.75
PROMPT_LENGTHS = (8, 32)
VOCAB = 32_000
ADVANTAGE_EPS = 1e-6
RAW_TOKEN_BYTES = sum(np.dtype(d).itemsize for d in LEAVES.values())  # 8 B: tokens + logprobs
METRIC = f"ingest_deliver_g{GROUPS}"
PARTS = ("ingest_part", "deliver_part")
WARMUP = 3  # common.interleaved's untimed calls per contender


@dataclass(frozen=True)
class Config:
    """Sizes of one W8 run: the token ring, group slots, the packed budget and the batch's shape."""

    token_capacity: int
    group_capacity: int
    rows: int
    row_length: int = ROW_LENGTH
    group_size: int = GROUP_SIZE
    groups: int = GROUPS
    max_length: int = MAX_LENGTH


def settings_for(quick: bool, capacity=None, rounds=None) -> common.Settings:
    """``capacity``: the token ring (tokens); ``chunk``: groups per generation; ``sample_reps``: calls per contender
    per round; ``pool``: generations drawn (cycled through by every contender)."""
    if quick:
        s = common.Settings(capacity=1 << 16, batch_size=GROUPS, chunk=GROUPS, rounds=2, sample_reps=8, quick=True)
        s.pool = 3
    else:
        s = common.Settings(capacity=1 << 20, batch_size=GROUPS, chunk=GROUPS, rounds=30, sample_reps=40)
        s.pool = 8
    if capacity is not None:
        s.capacity = capacity
    if rounds is not None:
        s.rounds = rounds
    if s.capacity < 2 * GROUPS * GROUP_SIZE * MAX_LENGTH:
        raise SystemExit(f"w8: --capacity must hold two generations at max_length "
                         f"({2 * GROUPS * GROUP_SIZE * MAX_LENGTH:,} tokens)")
    return s


# ------------------------------------------------------------------------------------------------------------------
# The workload's data
# ------------------------------------------------------------------------------------------------------------------
def generation(rng: np.random.Generator, groups: int = GROUPS, group_size: int = GROUP_SIZE,
               max_length: int = MAX_LENGTH) -> dict[str, np.ndarray]:
    """One generation as a generator hands it over: padded host arrays ``tokens`` / ``logprobs`` [k, G, max_length]
    (zero past each sequence's end), ``lengths``, ``prompt_lengths`` int32 [k, G], ``rewards`` float32 [k, G]."""
    prompts = rng.integers(PROMPT_LENGTHS[0], PROMPT_LENGTHS[1] + 1, groups)
    drawn = np.rint(rng.lognormal(np.log(MEDIAN_LENGTH), LENGTH_SIGMA, (groups, group_size)))
    lengths = np.clip(drawn, prompts[:, None] + 1, max_length).astype(np.int32)
    steps = np.arange(max_length)
    inside = steps < lengths[..., None]
    response = inside & (steps >= prompts[:, None, None])
    tokens = np.where(inside, rng.integers(3, VOCAB, (groups, group_size, max_length)), 0).astype(np.int32)
    logprobs = np.where(response, -rng.exponential(1.0, (groups, group_size, max_length)), 0).astype(np.float32)
    return {"tokens": tokens, "logprobs": logprobs, "lengths": lengths,
            "prompt_lengths": np.broadcast_to(prompts[:, None], (groups, group_size)).astype(np.int32),
            "rewards": (rng.integers(0, 5, (groups, group_size)) / 4).astype(np.float32)}


def as_lists(gen: dict) -> list[dict]:
    """The generation as Python lists of per-sequence arrays (own copies), one dict per group."""
    out = []
    for i, lengths in enumerate(gen["lengths"].tolist()):
        out.append({"tokens": [gen["tokens"][i, j, :n].copy() for j, n in enumerate(lengths)],
                    "logprobs": [gen["logprobs"][i, j, :n].copy() for j, n in enumerate(lengths)],
                    "rewards": gen["rewards"][i].tolist(), "prompt_lengths": gen["prompt_lengths"][i].tolist()})
    return out


def group_advantages(rewards: np.ndarray) -> np.ndarray:
    """float32 [k, G]: (reward - group mean) / (group std ddof=1 + eps); 0 where a group's rewards are all equal."""
    rewards = np.asarray(rewards, np.float32)
    same = np.all(rewards == rewards[:, :1], axis=1, keepdims=True)
    centred = rewards - rewards.mean(axis=1, keepdims=True)
    scaled = centred / (rewards.std(axis=1, ddof=1, keepdims=True) + np.float32(ADVANTAGE_EPS))
    return np.where(same, np.float32(0), scaled).astype(np.float32)


def first_fit(group_lengths: list, rows: int, row_length: int) -> list:
    """Per group (in order), the (row, column) of each member's first token, or None when the group does not fit
    whole into what the groups placed before it left: members longest first (stable), each into the first row with
    room; Conduit's packing rule."""
    fill = [0] * rows
    out = []
    for lengths in group_lengths:
        trial, places = list(fill), [None] * len(lengths)
        for member in sorted(range(len(lengths)), key=lengths.__getitem__, reverse=True):
            n = lengths[member]
            row = next((r for r, used in enumerate(trial) if used + n <= row_length), None)
            if row is None:
                places = None
                break
            places[member] = (row, trial[row])
            trial[row] += n
        if places is not None:
            fill = trial
        out.append(places)
    return out


def rows_for(pool: list[dict], row_length: int = ROW_LENGTH, max_length: int = MAX_LENGTH) -> int:
    """The fewest rows of ``row_length`` tokens that hold every generation of the pool whole (first fit), and at
    least one group of sequences at ``max_length`` (``make_rollout_buffer``'s condition)."""
    longest = max(int(gen["lengths"].sum()) for gen in pool)
    group_size = pool[0]["lengths"].shape[1]
    rows = max(-(-longest // row_length), -(-group_size // (row_length // max_length)))
    while not all(all(p is not None for p in first_fit(gen["lengths"].tolist(), rows, row_length)) for gen in pool):
        rows += 1
    return rows


def padded_fields_numpy(tokens, logprobs, lengths, prompts, rewards) -> dict[str, np.ndarray]:
    """A padded batch [k * G, max_length] of padded groups [k, G, max_length], in NumPy (vectorised)."""
    k, size, width = tokens.shape
    steps = np.arange(width, dtype=np.int32)
    inside = steps < lengths[..., None]
    sequence = np.arange(1, k * size + 1, dtype=np.int32).reshape(k, size)
    advantages = group_advantages(rewards)
    out = {"tokens": np.where(inside, tokens, 0), "logprobs": np.where(inside, logprobs, np.float32(0)),
           "segment_ids": np.where(inside, sequence[..., None], 0), "positions": np.where(inside, steps, 0),
           "loss_mask": inside & (steps >= prompts[..., None]),
           "advantages": np.where(inside, advantages[..., None], np.float32(0))}
    return {name: value.reshape(k * size, width) for name, value in out.items()}


# ------------------------------------------------------------------------------------------------------------------
# Contenders
# ------------------------------------------------------------------------------------------------------------------
class RolloutContender:
    """``prepare(gen)`` the input its users hold (outside the timing), ``ingest(prepared)``, ``deliver()`` -> dict of
    ``FIELDS`` (JAX arrays, ready). ``step()`` is one timed call: the next generation of the pool in, a batch out."""

    name = "contender"
    is_jax = False

    def __init__(self, config: Config):
        self.config = config
        self.pool: list = []
        self.calls = 0  # steps so far: the next one ingests pool[calls % len(pool)]
        self.split: list[tuple[float, float]] = []  # (ingest s, deliver s) of each step

    def load(self, pool: list[dict]) -> None:
        self.pool = [self.prepare(gen) for gen in pool]

    def prepare(self, gen: dict):
        return gen

    def step(self) -> dict:
        prepared = self.pool[self.calls % len(self.pool)]
        self.calls += 1
        start = time.perf_counter()
        self.ingest(prepared)
        middle = time.perf_counter()
        batch = self.deliver()
        self.split.append((middle - start, time.perf_counter() - middle))
        return batch

    def jit_cache_entries(self) -> Optional[int]:
        return None

    def release(self) -> None:
        """As ``peers.Contender.release``: a ``state`` holding JAX arrays is deleted, every attribute dropped."""
        peers.delete_jax_arrays(self.__dict__.get("state"))
        self.__dict__.clear()


class ConduitRollouts(RolloutContender):
    """``RolloutPlane`` on ``schedule.staged()``: ``ingest`` stages the Groups, ``deliver`` runs one kernel."""

    is_jax = True

    def __init__(self, config: Config, layout: str):
        super().__init__(config)
        import jax

        import conduit_jax as cj
        from conduit_jax import rollouts

        self._jax, self._rollouts = jax, rollouts
        spec = rollouts.RolloutSpec(config.group_size, config.max_length, LEAVES)
        shape = rollouts.packed(config.rows, config.row_length) if layout == "packed" else rollouts.padded()
        self.plane = cj.RolloutPlane(spec, config.token_capacity, config.group_capacity, config.groups, shape,
                                     schedule=cj.schedule.staged())

    def prepare(self, gen: dict):
        return self._rollouts.Groups({name: gen[name] for name in LEAVES}, gen["lengths"], gen["rewards"],
                                     gen["prompt_lengths"], np.zeros(gen["lengths"].shape[0], np.int32))

    def ingest(self, groups) -> None:
        self.plane.ingest(groups)

    def deliver(self) -> dict:
        batch = self._jax.block_until_ready(self.plane.deliver())
        return {"tokens": batch.leaves["tokens"], "logprobs": batch.leaves["logprobs"],
                "segment_ids": batch.segment_ids, "positions": batch.positions, "loss_mask": batch.loss_mask,
                "advantages": batch.advantages}

    def jit_cache_entries(self) -> Optional[int]:
        return sum(self.plane.engine.compiles.values())

    def release(self) -> None:
        self.plane.close()
        peers.delete_jax_arrays(self.plane.engine.state)
        super().release()


class NumpyLists(RolloutContender):
    """Groups as Python lists of per-sequence arrays in a deque; a batch popped, padded to [k * G, max_length] one
    slice copy per sequence and leaf, advantages in NumPy, one ``jax.device_put``."""

    def __init__(self, config: Config):
        super().__init__(config)
        import jax

        self._jax = jax
        self.queue: collections.deque = collections.deque()

    def prepare(self, gen: dict):
        return as_lists(gen)

    def ingest(self, groups: list) -> None:
        self.queue.extend(groups)

    def pop(self) -> list:
        return [self.queue.popleft() for _ in range(min(self.config.groups, len(self.queue)))]

    def deliver(self) -> dict:
        groups = self.pop()
        c = self.config
        rows, width = c.groups * c.group_size, c.max_length
        tokens = np.zeros((rows, width), np.int32)
        logprobs = np.zeros((rows, width), np.float32)
        segment_ids = np.zeros((rows, width), np.int32)
        loss_mask = np.zeros((rows, width), bool)
        advantages = np.zeros((rows, width), np.float32)
        group_adv = group_advantages(np.asarray([g["rewards"] for g in groups], np.float32))
        row = 0
        for g, group in enumerate(groups):
            for j, sequence in enumerate(group["tokens"]):
                n = len(sequence)
                tokens[row, :n] = sequence
                logprobs[row, :n] = group["logprobs"][j]
                segment_ids[row, :n] = row + 1
                loss_mask[row, group["prompt_lengths"][j]:n] = True
                advantages[row, :n] = group_adv[g, j]
                row += 1
        positions = np.where(segment_ids > 0, np.arange(width, dtype=np.int32), 0)
        out = self._jax.device_put({"tokens": tokens, "logprobs": logprobs, "segment_ids": segment_ids,
                                    "positions": positions, "loss_mask": loss_mask, "advantages": advantages})
        return self._jax.block_until_ready(out)


class NumpyPacked(NumpyLists):
    """The same deque; the batch placed by first fit into [rows, row_length] (a group that does not fit waits at the
    queue's head, as in Conduit), filled by one concatenate + one scatter per field, one ``jax.device_put``."""

    def deliver(self) -> dict:
        groups = self.pop()
        c = self.config
        size = c.group_size
        lengths = [[len(s) for s in g["tokens"]] for g in groups]
        places = first_fit(lengths, c.rows, c.row_length)
        for group, place in reversed(list(zip(groups, places))):
            if place is None:
                self.queue.appendleft(group)
        window = [i for i, place in enumerate(places) if place is not None]  # positions in the popped window
        taken = [groups[i] for i in window]
        n = np.asarray([lengths[i] for i in window], np.int64).reshape(-1)
        starts = np.asarray([r * c.row_length + col for i in window for r, col in places[i]], np.int64)
        sequence = (np.asarray(window, np.int32)[:, None] * size + np.arange(size, dtype=np.int32)).reshape(-1)
        advantages = group_advantages(np.asarray([g["rewards"] for g in taken], np.float32)).reshape(-1)
        prompts = np.asarray([g["prompt_lengths"] for g in taken], np.int32).reshape(-1)
        offsets = np.cumsum(n) - n
        within = (np.arange(int(n.sum()), dtype=np.int32) - np.repeat(offsets, n)).astype(np.int32)
        target = np.repeat(starts, n) + within
        total = c.rows * c.row_length
        out = {}
        for name, dtype, values in (
                ("tokens", np.int32, np.concatenate([s for g in taken for s in g["tokens"]])),
                ("logprobs", np.float32, np.concatenate([s for g in taken for s in g["logprobs"]])),
                ("segment_ids", np.int32, np.repeat(sequence + 1, n)),
                ("positions", np.int32, within),
                ("loss_mask", bool, within >= np.repeat(prompts, n)),
                ("advantages", np.float32, np.repeat(advantages, n))):
            flat = np.zeros(total, dtype)
            flat[target] = values
            out[name] = flat.reshape(c.rows, c.row_length)
        return self._jax.block_until_ready(self._jax.device_put(out))


def _item_shapes(config: Config) -> dict[str, tuple[tuple, Any]]:
    """One stored item of the fixed-shape peers: a group padded to [G, max_length]."""
    size, width = config.group_size, config.max_length
    return {"tokens": ((size, width), np.int32), "logprobs": ((size, width), np.float32),
            "lengths": ((size,), np.int32), "prompt_lengths": ((size,), np.int32), "rewards": ((size,), np.float32)}


def _padded_groups(gen: dict) -> dict[str, np.ndarray]:
    return {name: gen[name] for name in ("tokens", "logprobs", "lengths", "prompt_lengths", "rewards")}


class FlashbaxGroups(RolloutContender):
    """``fbx.make_item_buffer`` of padded groups; ``add`` jitted (state donated); the newest groups read from the
    state's ring and laid out as a padded batch by one jitted function."""

    is_jax = True

    def __init__(self, config: Config):
        super().__init__(config)
        try:
            import flashbax as fbx
            import jax
            import jax.numpy as jnp
        except ImportError as exc:
            raise peers.Unavailable(f"flashbax is not installed ({exc})") from None
        self._jax = jax
        buffer = fbx.make_item_buffer(max_length=config.group_capacity, min_length=1,
                                      sample_batch_size=config.groups, add_sequences=True)
        item = {name: jnp.zeros(shape, dtype) for name, (shape, dtype) in _item_shapes(config).items()}
        self.state = buffer.init(item)
        self._add = jax.jit(buffer.add, donate_argnums=0)
        k, capacity = config.groups, config.group_capacity

        def newest(state):
            slots = (state.current_index - k + jnp.arange(k)) % capacity
            items = {name: leaf[0, slots] for name, leaf in state.experience.items()}  # leaves [1, capacity, ...]
            lengths, rewards = items["lengths"], items["rewards"]
            size, width = items["tokens"].shape[1:]
            steps = jnp.arange(width, dtype=jnp.int32)
            inside = steps < lengths[..., None]
            sequence = jnp.arange(1, k * size + 1, dtype=jnp.int32).reshape(k, size)
            same = jnp.all(rewards == rewards[:, :1], axis=1, keepdims=True)
            scaled = (rewards - jnp.mean(rewards, axis=1, keepdims=True)) / (
                jnp.std(rewards, axis=1, ddof=1, keepdims=True) + ADVANTAGE_EPS)
            advantages = jnp.where(same, 0.0, scaled)
            out = {"tokens": jnp.where(inside, items["tokens"], 0),
                   "logprobs": jnp.where(inside, items["logprobs"], 0.0),
                   "segment_ids": jnp.where(inside, sequence[..., None], 0), "positions": jnp.where(inside, steps, 0),
                   "loss_mask": inside & (steps >= items["prompt_lengths"][..., None]),
                   "advantages": jnp.where(inside, advantages[..., None], 0.0)}
            return {name: value.reshape(k * size, width) for name, value in out.items()}

        self._newest = jax.jit(newest)

    def prepare(self, gen: dict):
        return _padded_groups(gen)

    def ingest(self, items: dict) -> None:
        self.state = self._jax.block_until_ready(self._add(self.state, items))

    def deliver(self) -> dict:
        return self._jax.block_until_ready(self._newest(self.state))

    def jit_cache_entries(self) -> Optional[int]:
        return peers.jit_cache_size(self._add, self._newest)


class TorchRLGroups(RolloutContender):
    """``ReplayBuffer(storage=LazyTensorStorage(group_capacity))`` of padded groups; ``rb[indices extend returned]``;
    mask and advantages in torch; each field to JAX by ``jax.dlpack.from_dlpack``."""

    def __init__(self, config: Config):
        super().__init__(config)
        self._torch, self._TensorDict, data = peers.start_torchrl(seed=0)
        import jax

        self._jax = jax
        self.rb = data.ReplayBuffer(storage=data.LazyTensorStorage(config.group_capacity))
        self.index = None

    def prepare(self, gen: dict):
        # a torch user holds tensors already: zero-copy from the generation's arrays, outside the timing
        items = _padded_groups(gen)
        return self._TensorDict({name: self._torch.from_numpy(np.ascontiguousarray(value))
                                 for name, value in items.items()}, batch_size=[gen["lengths"].shape[0]])

    def ingest(self, td) -> None:
        self.index = self.rb.extend(td)

    def deliver(self) -> dict:
        torch = self._torch
        td = self.rb[self.index]
        tokens, logprobs = td["tokens"], td["logprobs"]
        lengths, prompts, rewards = td["lengths"], td["prompt_lengths"], td["rewards"]
        k, size, width = tokens.shape
        steps = torch.arange(width, dtype=torch.int32)
        inside = steps < lengths[..., None]
        sequence = torch.arange(1, k * size + 1, dtype=torch.int32).reshape(k, size)
        same = (rewards == rewards[:, :1]).all(dim=1, keepdim=True)
        scaled = (rewards - rewards.mean(dim=1, keepdim=True)) / (
            rewards.std(dim=1, keepdim=True, correction=1) + ADVANTAGE_EPS)
        advantages = torch.where(same, torch.zeros_like(scaled), scaled)
        out = {"tokens": torch.where(inside, tokens, 0), "logprobs": torch.where(inside, logprobs, 0.0),
               "segment_ids": torch.where(inside, sequence[..., None], 0), "positions": torch.where(inside, steps, 0),
               "loss_mask": inside & (steps >= prompts[..., None]),
               "advantages": torch.where(inside, advantages[..., None], 0.0)}
        from_dlpack = self._jax.dlpack.from_dlpack
        return self._jax.block_until_ready({name: from_dlpack(value.reshape(k * size, width).contiguous())
                                            for name, value in out.items()})


class CpprbGroups(RolloutContender):
    """``cpprb.ReplayBuffer(groups_per_batch, env_dict)`` of padded groups: add, ``get_all_transitions()``,
    ``clear()``; mask and advantages in NumPy; ``jax.device_put``."""

    def __init__(self, config: Config):
        super().__init__(config)
        try:
            import cpprb
        except ImportError as exc:
            raise peers.Unavailable(f"cpprb is not installed ({exc})") from None
        import jax

        self._jax = jax
        self.rb = cpprb.ReplayBuffer(config.groups, {name: {"shape": shape, "dtype": np.dtype(dtype)}
                                                     for name, (shape, dtype) in _item_shapes(config).items()})

    def prepare(self, gen: dict):
        return _padded_groups(gen)

    def ingest(self, items: dict) -> None:
        self.rb.add(**items)

    def deliver(self) -> dict:
        stored = self.rb.get_all_transitions()
        self.rb.clear()
        out = padded_fields_numpy(stored["tokens"], stored["logprobs"], stored["lengths"], stored["prompt_lengths"],
                                  stored["rewards"])
        return self._jax.block_until_ready(self._jax.device_put(out))


def contenders(config: Config) -> list[tuple[str, Any]]:
    """(label, constructor) of every contender, the headline Conduit row first (the baseline of every ratio)."""
    return [
        ("conduit[packed]", lambda: ConduitRollouts(config, "packed")),
        ("conduit[padded]", lambda: ConduitRollouts(config, "padded")),
        ("numpy+device_put", lambda: NumpyLists(config)),
        ("numpy-packed+device_put", lambda: NumpyPacked(config)),
        ("flashbax", lambda: FlashbaxGroups(config)),
        ("torchrl", lambda: TorchRLGroups(config)),
        ("cpprb", lambda: CpprbGroups(config)),
    ]


# ------------------------------------------------------------------------------------------------------------------
# The cross-check: every batch holds the generation's sequences
# ------------------------------------------------------------------------------------------------------------------
def by_sequence(batch: dict) -> dict[str, np.ndarray]:
    """The batch's tokens in (segment, position) order, padding left out: every field flat, plus ``counts`` (tokens
    per segment 1..n) and per-segment ``advantage`` (its first token's); padding's loss mask and advantages too."""
    host = {name: np.asarray(value).reshape(-1) for name, value in batch.items()}
    segments = host["segment_ids"]
    keep = np.flatnonzero(segments > 0)
    order = keep[np.argsort(segments[keep], kind="stable")]
    out = {name: host[name][order] for name in FIELDS}
    counts = np.bincount(segments[keep])[1:]
    out["counts"] = counts
    out["advantage"] = out["advantages"][np.cumsum(counts) - counts]
    out["padding_loss_mask"] = host["loss_mask"][segments == 0]
    out["padding_advantages"] = host["advantages"][segments == 0]
    return out


def expected(gen: dict) -> dict[str, np.ndarray]:
    """What every batch of ``gen`` must hold, in ``by_sequence``'s form (every group delivered, in order)."""
    return by_sequence(padded_fields_numpy(gen["tokens"], gen["logprobs"], gen["lengths"], gen["prompt_lengths"],
                                           gen["rewards"]))


def mismatch(got: dict, want: dict) -> Optional[str]:
    """Why ``got`` (by_sequence of a contender's batch) differs from ``want``, or None."""
    if got["counts"].shape != want["counts"].shape or not np.array_equal(got["counts"], want["counts"]):
        return f"sequence lengths differ: {got['counts'][:8]}... vs {want['counts'][:8]}..."
    for name in ("tokens", "logprobs", "segment_ids", "positions", "loss_mask"):
        if got[name].dtype != want[name].dtype or not np.array_equal(got[name], want[name]):
            return f"{name} differ ({got[name].dtype} vs {want[name].dtype})"
    if not np.allclose(got["advantage"], want["advantage"], rtol=1e-5, atol=1e-6):
        return f"advantages differ by up to {np.max(np.abs(got['advantage'] - want['advantage'])):.3g}"
    if not np.array_equal(got["advantages"], np.repeat(got["advantage"], got["counts"])):
        return "a sequence's advantage is not constant over its tokens"
    if got["padding_loss_mask"].any() or np.any(got["padding_advantages"] != 0):
        return "padding carries loss mask or advantages"
    return None


def packing(batch: dict) -> tuple[int, int, int, int, int]:
    """(useful tokens, computed tokens, bytes of the batch's fields, rows, row length) of one batch."""
    segments = np.asarray(batch["segment_ids"])
    return (int(np.count_nonzero(segments)), int(segments.size),
            int(sum(np.asarray(batch[name]).nbytes for name in FIELDS)), *segments.shape)


# ------------------------------------------------------------------------------------------------------------------
# The run
# ------------------------------------------------------------------------------------------------------------------
GOALS = [
    common.Goal("W8 ingest + deliver one batch, packed <= 1.0x NumPy packing + device_put", "ratio", METRIC, 1.0,
                peer="numpy-packed+device_put"),
    common.Goal("W8 zero recompiles after warm-up", "recompiles", METRIC, 0),
]
PACKING_GOAL = ("W8 packing efficiency (useful / computed tokens) of conduit[packed] >= 0.9", "conduit[packed]", 0.9)


def packing_goal(records: list[dict]) -> dict:
    text, contender, target = PACKING_GOAL
    rec = next((r for r in records if r.get("record") == "packing" and r["contender"] == contender), None)
    if rec is None:
        return {"record": "goal", "workload": "w8", "goal": text, "kind": "packing", "value": None,
                "target": target, "met": None, "detail": "not measured in this run"}
    value = rec["efficiency"]
    return {"record": "goal", "workload": "w8", "goal": text, "kind": "packing", "metric": METRIC, "peer": None,
            "value": value, "target": target, "met": value >= target, "by": target / value if value > 0 else None,
            "detail": f"{rec['useful_tokens']:,} useful of {rec['computed_tokens']:,} computed tokens over "
                      f"{rec['batches']} batches ({rec['batch_shape'][0]} x {rec['batch_shape'][1]})"}


def goal_text(goal_records: list[dict]) -> str:
    lines = []
    for g in goal_records:
        if g["kind"] != "packing" or g["met"] is None:
            lines.append(common.goal_lines([g]))
            continue
        margin = "" if g["met"] else f" (missed by {(g['target'] - g['value']) * 100:.1f} points)"
        lines.append(f"  [{'MET ' if g['met'] else 'MISS'}] {g['goal']}: {g['value']:.3f}{margin}; {g['detail']}")
    return "\n".join(lines)


def packing_table(records: list[dict]) -> str:
    rows = [r for r in records if r.get("record") == "packing"]
    header = f"{'contender':<34} {'batch shape':>12} {'useful tokens':>14} {'computed':>10} {'efficiency':>10} " \
             f"{'batch bytes':>12}"
    lines = ["w8 packing efficiency over the pool's batches (useful tokens / computed tokens)", header,
             "-" * len(header)]
    for r in rows:
        shape = f"{r['batch_shape'][0]}x{r['batch_shape'][1]}"
        lines.append(f"{r['contender']:<34} {shape:>12} {r['useful_tokens']:>14,} {r['computed_tokens']:>10,} "
                     f"{r['efficiency']:>10.3f} {r['batch_bytes_per_call']:>12,.0f}")
    return "\n".join(lines)


def build(config: Config, pool: list[dict], log: Optional[common.CompileLog] = None,
          only: Optional[list[str]] = None) -> tuple[dict, dict]:
    """({label: contender} built and loaded with the pool, {label: why unavailable})."""
    built, unavailable = {}, {}
    for label, make in contenders(config):
        if only is not None and label not in only:
            continue
        try:
            with (log.phase(label, "construct") if log is not None else contextlib.nullcontext()):
                c = make()
        except peers.Unavailable as exc:
            unavailable[label] = str(exc)
            continue
        c.name = label
        c.load(pool)
        built[label] = c
    return built, unavailable


def check(built: dict, pool: list[dict]) -> dict[str, list[tuple]]:
    """One step of every contender per pool generation (the contenders in step): each batch checked against the
    generation. Returns each contender's ``packing(batch)`` per batch. Raises on the first mismatch."""
    calls = {label: c.calls for label, c in built.items()}
    if len(set(calls.values())) > 1:
        raise RuntimeError(f"w8: contenders out of step before the check: {calls}")
    start = next(iter(calls.values()), 0)
    out: dict[str, list] = {label: [] for label in built}
    for k in range(len(pool)):
        gen = pool[(start + k) % len(pool)]
        want = expected(gen)
        for label, c in built.items():
            batch = c.step()
            why = mismatch(by_sequence(batch), want)
            if why is not None:
                raise RuntimeError(f"w8: {label}'s batch of generation {(start + k) % len(pool)} does not hold the "
                                   f"generation's sequences: {why}")
            out[label].append(packing(batch))
    return out


def split_timings(c: RolloutContender, timings: common.Timings, reps: int) -> dict[str, common.Timings]:
    """The ingest and deliver parts of the timed calls (their perf_counter stamps), by round; page faults are the
    whole call's."""
    calls = c.split[WARMUP:]
    if len(calls) != reps * len(timings.rounds):
        raise RuntimeError(f"w8: {c.name} recorded {len(calls)} timed calls, expected {reps * len(timings.rounds)}")
    parts = np.asarray(calls).reshape(len(timings.rounds), reps, 2)
    return {name: common.Timings([parts[r, :, i] for r in range(len(timings.rounds))], list(timings.faults))
            for i, name in enumerate(PARTS)}


def run(settings: common.Settings) -> list[dict]:
    common.configure_runtime("w8")
    common.warm_runtimes()
    load_start = list(os.getloadavg())
    rng = np.random.default_rng(8)
    pool = [generation(rng) for _ in range(settings.pool)]
    useful = np.asarray([int(gen["lengths"].sum()) for gen in pool])
    config = Config(token_capacity=settings.capacity,
                    group_capacity=max(2 * GROUPS, min(1024, settings.capacity // (GROUP_SIZE * MEDIAN_LENGTH))),
                    rows=rows_for(pool))
    meter = common.MemcpyMeter(64 << 20 if settings.quick else 256 << 20)
    meter.measure(3 if settings.quick else 5)
    log = common.CompileLog()
    description = (f"{GROUPS} groups of {GROUP_SIZE} ragged sequences (max {MAX_LENGTH}) per generation: ingest + "
                   f"deliver one batch; token ring {config.token_capacity:,}, packed {config.rows} x "
                   f"{config.row_length}")
    common.log_line(f"== w8: {description}")
    common.log_line(f"   pool of {len(pool)} generations, {useful.mean():,.0f} useful tokens each ({useful.min():,}-"
                    f"{useful.max():,}); group slots {config.group_capacity}; memcpy {meter.bytes_per_s / 1e9:.2f} "
                    f"GB/s; rounds {settings.rounds} x {settings.sample_reps} calls")
    built, unavailable = build(config, pool, log)
    for label, why in unavailable.items():
        common.log_line(f"   {label}: UNAVAILABLE: {why}")
    first_phase, steady_phase = f"{METRIC}/first", f"{METRIC}/steady"
    first = {label: common.time_first_call(c.step, log, label, first_phase) for label, c in built.items()}
    common.log_line("   first calls: " + ", ".join(f"{n} {s:.3f} s" for n, s in first.items()))
    packed_batches = check(built, pool)
    common.log_line(f"   checked: every contender's batch of each of the {len(pool)} generations holds its sequences")
    if not settings.quick:
        meter.measure(3)
    for c in built.values():
        c.split.clear()
    ops = {label: c.step for label, c in built.items()}
    common.log_line(f"   timing {METRIC}: {len(ops)} contenders x {settings.rounds} rounds x {settings.sample_reps} "
                    f"calls")
    timings = common.interleaved(ops, rounds=settings.rounds, reps=settings.sample_reps, warmup=WARMUP, log=log,
                                 phase=steady_phase)
    meter.measure(3)
    bps = meter.bytes_per_s
    items = float(useful.mean())
    titles = {METRIC: f"ingest {GROUPS} groups + deliver one batch of them (ready)",
              "ingest_part": "the ingest part of the same calls", "deliver_part": "the deliver part of the same calls"}
    records: list[dict] = []
    for label, t in timings.items():
        c = built[label]
        compiled = log.get(label, first_phase)
        steady = log.get(label, steady_phase, steady_phase + "-warmup")
        useful_tokens, computed, nbytes = np.asarray(packed_batches[label])[:, :3].sum(axis=0)
        extra = dict(first_call_s=first[label], compile_s=compiled.seconds if c.is_jax else None,
                     compiles=compiled.compiles if c.is_jax else None,
                     recompiles=steady.compiles if c.is_jax else None, jit_cache_entries=c.jit_cache_entries(),
                     rate_unit="tokens/s", groups=GROUPS, packing_efficiency=useful_tokens / computed,
                     batch_bytes_per_call=nbytes / len(pool), bytes_note="raw token-leaf bytes of the useful tokens "
                     f"({RAW_TOKEN_BYTES} B each)")
        parts = split_timings(c, t, settings.sample_reps)
        for metric, timing in ((METRIC, t), *parts.items()):
            records.append(common.timing_record("w8", metric, label, timing, items_per_call=round(items),
                                                bytes_per_call=round(items * RAW_TOKEN_BYTES), memcpy_bps=bps,
                                                **extra))
    for label, batches in packed_batches.items():
        arrays = np.asarray(batches)
        records.append({"record": "packing", "workload": "w8", "contender": label, "batches": len(batches),
                        "batch_shape": [int(n) for n in arrays[0, 3:]], "useful_tokens": int(arrays[:, 0].sum()),
                        "computed_tokens": int(arrays[:, 1].sum()),
                        "efficiency": float(arrays[:, 0].sum() / arrays[:, 1].sum()),
                        "per_batch_efficiency": (arrays[:, 0] / arrays[:, 1]).tolist(),
                        "batch_bytes_per_call": float(arrays[:, 2].mean())})
    for label, why in unavailable.items():
        records.append({"record": "unavailable", "workload": "w8", "contender": label, "reason": why})
    common.add_ratios(records)
    goal_records = common.evaluate_goals(records, GOALS, "w8") + [packing_goal(records)]
    records += goal_records
    common.release_all(list(built.values()))

    notes = {
        "pool": f"{len(pool)} generations drawn once (seed 8), cycled through by every contender in the same order",
        "lengths": f"lognormal(median {MEDIAN_LENGTH}, sigma {LENGTH_SIGMA}), at least prompt + 1 (prompts "
                   f"{PROMPT_LENGTHS[0]}..{PROMPT_LENGTHS[1]} per group), clipped to {MAX_LENGTH}",
        "packed_rows": f"{config.rows} x {config.row_length}: the fewest rows holding every pool generation whole "
                       f"(first fit, longest first within a group)",
        "check": "before timing, every contender's batch of every pool generation was checked against the "
                 "generation (tokens, logprobs, positions, loss mask exact; advantages to float32 rounding)",
        "parts": "ingest_part / deliver_part: perf_counter stamps inside the same timed calls (their page faults "
                 "and bytes are the whole call's); Conduit's ingest stages on the host, its deliver kernel writes the "
                 "staged groups, then lays the batch out",
        "capacity": f"token ring {config.token_capacity:,} tokens (Conduit), {config.group_capacity} group slots "
                    f"(Conduit, and the Flashbax and TorchRL rings of padded groups)",
        "frac_memcpy": f"raw bytes of the useful tokens' leaves ({RAW_TOKEN_BYTES} B per token) per call over memcpy",
        "flashbax": "item = one group padded to [G, max_length]; the newest groups read from the state's ring (its "
                    "sampler draws at random)",
        "torchrl": "rb[indices extend() returned]; fields to JAX by jax.dlpack.from_dlpack; "
                   + peers.torchrl_status()["torchrl"],
        "cpprb": f"ReplayBuffer({GROUPS}) per batch: add, get_all_transitions(), clear() (on-policy use)",
    }
    env = common.environment(meter.record(), {"workload": "w8", "description": description, "settings": vars(settings),
                                              "notes": notes, "layout": dataclasses.asdict(config)})
    env["load_average_end"], env["load_average"] = env["load_average"], load_start
    path = common.RESULTS_DIR / ("w8.quick.jsonl" if settings.quick else "w8.jsonl")
    common.write_jsonl(path, env, records)

    print()
    for metric in (METRIC, *PARTS):
        print(common.timing_table(records, metric, f"w8 {titles[metric]}  (memcpy {bps / 1e9:.2f} GB/s; x/conduit = "
                                  f"contender time / conduit[packed] time)", "tokens/s") + "\n")
    print(packing_table(records) + "\n")
    for label, why in unavailable.items():
        print(f"{label}: {why}")
    for key, value in notes.items():
        print(f"note {key}: {value}")
    print(f"w8 goals:\n{goal_text(goal_records)}")
    print(f"load average start {env['load_average']} end {env['load_average_end']}; results: {path}")
    return records


def main(argv=None):
    parser = common.workload_parser(__doc__)
    args = parser.parse_args(argv)
    run(settings_for(args.quick, args.capacity, args.rounds))


if __name__ == "__main__":
    main()
