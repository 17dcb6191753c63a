"""Rollout buffer (LLM-RL): ragged token sequences in groups, packed delivery, staleness, against a NumPy reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conduit_jax import rollouts
from conduit_jax.errors import ConfigError, SpecError
from conduit_jax import default_mesh

LEAVES = {"tokens": np.int32, "logprobs": np.float32}


def random_groups(rng, spec, count, version, min_length=1):
    """``count`` groups of ragged rollouts (host lists) and the Groups built from them."""
    size, longest = spec.group_size, spec.max_length
    tokens = [[rng.integers(1, 50, rng.integers(min_length, longest + 1)).tolist() for _ in range(size)]
              for _ in range(count)]
    logprobs = [[(-rng.random(len(sequence))).astype(np.float32).tolist() for sequence in group] for group in tokens]
    rewards = rng.integers(0, 3, (count, size)).astype(np.float32)
    prompts = [[int(rng.integers(0, len(sequence) + 1)) for sequence in group] for group in tokens]
    leaves = {"tokens": tokens, "logprobs": logprobs} if "logprobs" in spec.token_leaves else {"tokens": tokens}
    groups = rollouts.groups_from_lists(spec, **leaves, rewards=rewards, prompt_lengths=prompts,
                                        policy_version=version)
    return groups, [dict(tokens=t, logprobs=l, rewards=r, prompts=p, version=version)
                    for t, l, r, p in zip(tokens, logprobs, rewards, prompts)]


class Reference:
    """The rollout buffer's contract in plain Python: a token ring of contiguous group regions (wrapping to 0), a
    group table of slots, a queue of groups delivered oldest first, each once, first fit decreasing into the rows
    (a group of the window that does not fit waits for the next batch; later ones that fit are taken)."""

    def __init__(self, spec, token_capacity, group_capacity, per_batch, layout, max_staleness, scale):
        self.spec, self.tokens, self.slots = spec, token_capacity, group_capacity
        self.per_batch, self.layout, self.eta, self.scale = per_batch, layout, max_staleness, scale
        self.cursor, self.queue, self.version = 0, [], 0  # queue: [group, region, slot, live]
        self.stale = self.overwritten = self.written = self.skipped = 0

    def ingest(self, groups):
        for group in groups:
            total = sum(len(sequence) for sequence in group["tokens"])
            begin = 0 if self.cursor + total > self.tokens else self.cursor
            region, slot = (begin, begin + total), self.written % self.slots
            for entry in self.queue:
                if entry[3] and (entry[1][0] < region[1] and region[0] < entry[1][1] or entry[2] == slot):
                    entry[3] = False
                    self.overwritten += 1
            self.queue = [entry for entry in self.queue if entry[3]]
            self.queue.append([group, region, slot, True])
            self.cursor, self.written = begin + total, self.written + 1

    def sample(self):
        """The rows of the batch ([rows][columns] of (tokens, logprob, segment, position, loss, advantage) or None),
        and the groups delivered."""
        if self.layout.name == "packed":
            rows, width = self.layout.rows, self.layout.row_length
        else:
            rows, width = self.per_batch * self.spec.group_size, self.spec.max_length
        grid = [[None] * width for _ in range(rows)]
        fill, taken, window = [0] * rows, [], 0

        def fresh(group):
            return self.eta is None or group["version"] >= self.version - self.eta

        for entry in list(self.queue):  # the window: the first per_batch fresh groups, each taken if it fits
            group = entry[0]
            if not fresh(group):
                continue
            if window == self.per_batch:
                break
            window += 1
            lengths = [len(sequence) for sequence in group["tokens"]]
            if self.layout.name == "packed":
                trial, places = list(fill), {}
                for member in sorted(range(len(lengths)), key=lambda j: -lengths[j]):  # stable: longest first
                    row = next((r for r in range(rows) if trial[r] + lengths[member] <= width), None)
                    if row is None:
                        break
                    places[member] = (row, trial[row])
                    trial[row] += lengths[member]
                if len(places) < len(lengths):
                    self.skipped += 1
                    continue  # left for the next batch (its first)
                fill = trial
            else:
                base = len(taken) * len(lengths)
                places = {member: (base + member, 0) for member in range(len(lengths))}
            rewards = np.asarray(group["rewards"], np.float32)
            advantages = rewards - rewards.mean()
            if self.scale:
                advantages = advantages / (rewards.std(ddof=1) + rollouts.ADVANTAGE_EPS)
            slot = window - 1
            for member, (row, column) in places.items():
                segment = slot * len(lengths) + member + 1
                for t, token in enumerate(group["tokens"][member]):
                    grid[row][column + t] = (token, group["logprobs"][member][t], segment, t,
                                             t >= group["prompts"][member], advantages[member])
            taken.append(group)
            self.queue.remove(entry)
        # the stale groups before the first fresh one left behind are dropped now
        while self.queue and not fresh(self.queue[0][0]):
            self.queue.pop(0)
            self.stale += 1
        return grid, taken


def check_batch(batch, grid, taken, spec):
    """The batch holds exactly the reference's cells, padding elsewhere."""
    tokens, logprobs = np.asarray(batch.leaves["tokens"]), np.asarray(batch.leaves["logprobs"])
    segments, positions = np.asarray(batch.segment_ids), np.asarray(batch.positions)
    loss, advantages = np.asarray(batch.loss_mask), np.asarray(batch.advantages)
    assert tokens.shape == (len(grid), len(grid[0]))
    for r, row in enumerate(grid):
        for c, cell in enumerate(row):
            if cell is None:
                assert segments[r, c] == 0 and not loss[r, c] and tokens[r, c] == 0 and advantages[r, c] == 0
            else:
                token, logprob, segment, position, in_loss, advantage = cell
                assert (tokens[r, c], segments[r, c], positions[r, c], bool(loss[r, c])) == (
                    token, segment, position, in_loss), (r, c)
                assert logprobs[r, c] == np.float32(logprob)
                np.testing.assert_allclose(advantages[r, c], advantage, rtol=1e-5, atol=1e-5)
    assert int(batch.groups) == len(taken) and bool(batch.valid) == bool(taken)
    assert int(np.sum(batch.sequence_mask)) == len(taken) * spec.group_size


@pytest.mark.parametrize("layout,per_batch,staleness,scale", [(rollouts.packed(2, 16), 3, None, True),
                                                              (rollouts.padded(), 2, 1, False),
                                                              (rollouts.packed(3, 12), 3, 0, True)])
def test_matches_the_reference_through_wraps_overwrites_and_staleness(layout, per_batch, staleness, scale):
    """Random ragged groups, ingested and sampled in a random interleaving (through jit) on a small ring that wraps
    and overwrites: every batch is the reference's, cell for cell (tokens in order, segments never crossing,
    groups whole and once, advantages, loss mask), and the drop counters agree."""
    spec = rollouts.RolloutSpec(group_size=3, max_length=8, token_leaves=LEAVES)
    buffer = rollouts.make_rollout_buffer(spec, token_capacity=96, group_capacity=6, groups_per_batch=per_batch,
                                          layout=layout, max_staleness=staleness, scale_advantages=scale)
    reference = Reference(spec, 96, 6, per_batch, layout, staleness, scale)
    ingest, sample = jax.jit(buffer.ingest), jax.jit(buffer.sample)
    set_version, can_sample = jax.jit(buffer.set_policy_version), jax.jit(buffer.can_sample)
    plan, can_ingest = jax.jit(buffer.plan), jax.jit(buffer.can_ingest)
    host = rollouts.HostQueue(buffer.config)  # the host's bookkeeping follows along
    rng = np.random.default_rng(7)
    state, version, delivered = buffer.init(), 0, 0
    for step in range(80):
        actions = ["ingest", "version", "sample", "sample"] if staleness is not None else ["ingest", "sample"]
        action = rng.choice(actions)
        if action == "ingest":
            groups, plain = random_groups(rng, spec, 2, version)  # one ingest shape: one compile
            assert (host.retires_undelivered(groups.lengths) == 0) == bool(can_ingest(state, groups))
            state = ingest(state, groups)
            reference.ingest(plain)
            host.ingest(groups.lengths, groups.policy_version)
        elif action == "version":
            version += int(rng.integers(1, 3))  # a jump of 2 leaves queued groups stale at once
            state = set_version(state, version)
            reference.version = version
            host.set_policy_version(version)
        else:
            assert bool(buffer.can_sample(state)) == any(
                staleness is None or g[0]["version"] >= version - staleness for g in reference.queue)
            expected, planned = host.plan(), jax.tree.map(np.asarray, plan(state))
            taken = planned.taken
            np.testing.assert_array_equal(expected.taken, taken)
            for field in ("slots", "rows", "columns"):
                np.testing.assert_array_equal(getattr(expected, field)[taken], getattr(planned, field)[taken])
            assert (expected.advance, expected.dropped_stale) == (planned.advance, planned.dropped_stale)
            assert (host.deliverable() > 0) == bool(can_sample(state))
            host.commit(expected)
            state, batch = sample(state)
            grid, taken = reference.sample()
            check_batch(batch, grid, taken, spec)
            delivered += len(taken)
    assert (int(state.delivered), int(state.dropped_stale), int(state.dropped_overwritten)) == (
        delivered, reference.stale, reference.overwritten) == (host.delivered, host.dropped_stale,
                                                              host.dropped_overwritten)
    assert delivered > 10 and reference.overwritten > 0 and (staleness is None or reference.stale > 0)
    assert layout.name == "padded" or reference.skipped > 0  # later groups filled what a longer one left


def test_packing_fills_the_budget_and_the_padded_layout_costs_the_maximum():
    """Sequences of 1..32 tokens: packed rows of 64 hold them with little padding; padded rows cost 32 each."""
    spec = rollouts.RolloutSpec(group_size=4, max_length=32, token_leaves={"tokens": np.int32})
    rng = np.random.default_rng(3)
    tokens = [[rng.integers(1, 9, rng.integers(1, 33)).tolist() for _ in range(4)] for _ in range(64)]
    groups = rollouts.groups_from_lists(spec, tokens=tokens, rewards=np.zeros((64, 4)),
                                        prompt_lengths=np.zeros((64, 4), int), policy_version=0)
    efficiency = {}
    for layout, per_batch in ((rollouts.packed(8, 64), 16), (rollouts.padded(), 4)):
        buffer = rollouts.make_rollout_buffer(spec, 8192, 64, per_batch, layout)
        state, sample = jax.jit(buffer.ingest)(buffer.init(), groups), jax.jit(buffer.sample)
        useful = computed = 0
        for _ in range(4):
            state, batch = sample(state)
            useful += int(np.sum(np.asarray(batch.segment_ids) > 0))
            computed += batch.segment_ids.size
        efficiency[layout.name] = useful / computed
    assert efficiency["packed"] > 0.85 > 0.6 > efficiency["padded"]


def test_a_mesh_gives_the_same_batches_as_one_device():
    """The token rings split over 8 devices: the same ingests and draws give the same batches."""
    spec = rollouts.RolloutSpec(group_size=2, max_length=8, token_leaves=LEAVES)
    results = []
    for devices in (1, 8):
        buffer = rollouts.make_rollout_buffer(spec, 64, 8, 2, rollouts.packed(2, 16), mesh=default_mesh(devices))
        state = buffer.init()
        assert len(state.leaves["tokens"].sharding.device_set) == devices
        rng, batches = np.random.default_rng(1), []
        for _ in range(6):
            state = jax.jit(buffer.ingest)(state, random_groups(rng, spec, 2, 0)[0])
            state, batch = jax.jit(buffer.sample)(state)
            batches.append(jax.tree.map(np.asarray, batch))
        results.append(batches)
    jax.tree.map(np.testing.assert_array_equal, results[0], results[1])


def test_an_overwritten_group_is_never_delivered_and_can_ingest_says_so_first():
    spec = rollouts.RolloutSpec(group_size=2, max_length=4, token_leaves={"tokens": np.int32})
    buffer = rollouts.make_rollout_buffer(spec, 16, 4, 1, rollouts.padded())
    buffer = buffer._replace(ingest=jax.jit(buffer.ingest), sample=jax.jit(buffer.sample),
                             can_ingest=jax.jit(buffer.can_ingest), can_sample=jax.jit(buffer.can_sample))
    full = rollouts.Groups({"tokens": np.ones((1, 2, 4), np.int32)}, np.full((1, 2), 4, np.int32),
                           np.zeros((1, 2), np.float32), np.zeros((1, 2), np.int32), np.zeros(1, np.int32))
    state = buffer.ingest(buffer.init(), full)
    state = buffer.ingest(state, full._replace(leaves={"tokens": np.full((1, 2, 4), 2, np.int32)}))
    assert int(buffer.size(state)) == 2 and not bool(buffer.can_ingest(state, full))  # the ring (16 tokens) is full
    state = buffer.ingest(state, full._replace(leaves={"tokens": np.full((1, 2, 4), 3, np.int32)}))
    assert int(state.dropped_overwritten) == 1 and int(buffer.size(state)) == 2
    state, batch = buffer.sample(state)
    assert set(np.asarray(batch.leaves["tokens"]).ravel()) == {2}  # the first group is gone whole
    state, batch = buffer.sample(state)
    assert set(np.asarray(batch.leaves["tokens"]).ravel()) == {3}
    assert not bool(buffer.can_sample(state)) and bool(buffer.can_ingest(state, full))


def test_ids_name_slot_and_generation_and_sampling_does_not_recompile():
    spec = rollouts.RolloutSpec(group_size=2, max_length=4, token_leaves={"tokens": np.int32})
    buffer = rollouts.make_rollout_buffer(spec, 64, 2, 1, rollouts.packed(1, 8))
    sample = jax.jit(buffer.sample)
    state, rng, seen = buffer.init(), np.random.default_rng(0), []
    for _ in range(3):
        state = jax.jit(buffer.ingest)(state, random_groups(rng, spec, 1, 0)[0])
        state, batch = sample(state)
        seen.append(tuple(np.asarray(batch.ids)[0]))
    assert seen == [(0, 1), (1, 1), (0, 2)]
    assert sample._cache_size() == 1


@pytest.mark.parametrize("change,message", [
    (dict(tokens=[[[1, 2], [1] * 9]]), "leaf 'tokens', prompt 0, response 1: expected a 1-D sequence of 1..8"),
    (dict(tokens=[[[1, 2], []]]), "prompt 0, response 1"),
    (dict(logprobs=[[[-1.0], [-1.0]]]), "leaf 'logprobs', prompt 0, response 0: 1 tokens, but leaf 'tokens' has 2"),
    (dict(tokens=[[[1, 2]]], logprobs=[[[-1.0, -1.0]]]), "a group holds group_size=2 responses, got 1"),
    (dict(tokens=[], logprobs=[]), "no groups given"),
    (dict(rewards=[[1.0, float("nan")]]), "rewards of prompt 0, response 1 is nan"),
    (dict(prompt_lengths=[[3, 0]]), "prompt_lengths of prompt 0, response 0 is 3, expected 0..the sequence's length"),
    (dict(rewards=[[1.0]]), "rewards has shape (1, 1), expected (1, 2)"),
])
def test_bad_rollouts_are_refused_naming_the_leaf_and_the_item(change, message):
    spec = rollouts.RolloutSpec(group_size=2, max_length=8, token_leaves=LEAVES)
    given = dict(tokens=[[[1, 2], [3]]], logprobs=[[[-1.0, -1.0], [-1.0]]], rewards=[[1.0, 0.0]],
                 prompt_lengths=[[1, 0]], policy_version=0)
    given.update(change)
    with pytest.raises(SpecError, match=message.replace("(", r"\(").replace(")", r"\)")):
        rollouts.groups_from_lists(spec, **given)


def test_a_refused_ingest_leaves_the_state_and_bad_configurations_are_named():
    spec = rollouts.RolloutSpec(group_size=2, max_length=8, token_leaves={"tokens": np.int32})
    buffer = rollouts.make_rollout_buffer(spec, 64, 4, 2, rollouts.packed(2, 8))
    state = buffer.init()
    bad = rollouts.Groups({"tokens": np.ones((1, 2, 8), np.int32)}, np.array([[9, 1]], np.int32),
                          np.zeros((1, 2), np.float32), np.zeros((1, 2), np.int32), np.zeros(1, np.int32))
    with pytest.raises(SpecError, match=r"lengths of prompt 0, response 0 is 9, expected 1..8"):
        buffer.ingest(state, bad)
    assert int(state.written) == 0 and not bool(buffer.can_sample(state))
    with pytest.raises(ConfigError, match="row_length=4 is shorter than max_length=8"):
        rollouts.make_rollout_buffer(spec, 64, 4, 2, rollouts.packed(2, 4))
    with pytest.raises(ConfigError, match="may not hold one group of 2 sequences"):
        rollouts.make_rollout_buffer(spec, 64, 4, 2, rollouts.packed(1, 12))
    with pytest.raises(ConfigError, match="group_size must be an int >= 2"):
        rollouts.RolloutSpec(1, 8, {"tokens": np.int32}).check()
    with pytest.raises(ConfigError, match="token_capacity must be an int >= 16"):
        rollouts.make_rollout_buffer(spec, 8, 4, 2)


def test_inside_a_users_jit_with_device_arrays():
    """Groups built on device (a generator's padded output) are ingested and sampled in one jitted step."""
    spec = rollouts.RolloutSpec(group_size=2, max_length=4, token_leaves={"tokens": np.int32})
    buffer = rollouts.make_rollout_buffer(spec, 64, 4, 1, rollouts.packed(1, 8))

    @jax.jit
    def step(state, tokens, lengths):
        groups = rollouts.Groups({"tokens": tokens}, lengths, jnp.array([[1.0, 0.0]]), jnp.zeros((1, 2), jnp.int32),
                                 jnp.zeros((1,), jnp.int32))
        return buffer.sample(buffer.ingest(state, groups))

    tokens = jnp.arange(8, dtype=jnp.int32).reshape(1, 2, 4) + 1
    state, batch = step(buffer.init(), tokens, jnp.array([[3, 2]], jnp.int32))
    np.testing.assert_array_equal(np.asarray(batch.leaves["tokens"]), [[1, 2, 3, 5, 6, 0, 0, 0]])
    np.testing.assert_array_equal(np.asarray(batch.segment_ids), [[1, 1, 1, 2, 2, 0, 0, 0]])
    np.testing.assert_allclose(np.asarray(batch.advantages)[0, :5], [0.7071] * 3 + [-0.7071] * 2, atol=1e-3)


def test_absent_groups_pad_an_ingest_and_write_nothing():
    """A step compiled for 4 groups takes 1 real group and 3 absent ones (all lengths 0): the same state as the
    1-group ingest, whatever the cursor (a wrapped ring whose oldest group spans the cursor keeps it)."""
    spec = rollouts.RolloutSpec(group_size=2, max_length=4, token_leaves={"tokens": np.int32})
    buffer = rollouts.make_rollout_buffer(spec, 24, 8, 2, rollouts.padded())
    rng = np.random.default_rng(9)
    one, padded_one = jax.jit(buffer.ingest), jax.jit(buffer.ingest)
    a = b = buffer.init()
    for _ in range(5):
        groups = random_groups(rng, spec, 1, 0)[0]
        pad = rollouts.Groups({"tokens": np.concatenate([groups.leaves["tokens"], np.zeros((3, 2, 4), np.int32)])},
                              np.concatenate([groups.lengths, np.zeros((3, 2), np.int32)]),
                              np.concatenate([groups.rewards, np.zeros((3, 2), np.float32)]),
                              np.concatenate([groups.prompt_lengths, np.zeros((3, 2), np.int32)]),
                              np.concatenate([groups.policy_version, np.zeros(3, np.int32)]))
        a, b = one(a, groups), padded_one(b, jax.tree.map(lambda x: x, pad))
        jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, a), jax.tree.map(np.asarray, b))
    assert int(b.written) == 5
