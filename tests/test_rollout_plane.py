"""The rollout plane: a GRPO-style loop through the public API (generator thread, learner thread, a schedule), the
staged ingest, back-pressure, staleness at delivery and the learner's placement."""

import threading

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

from conduit_jax import RolloutPlane, placement, rollouts, schedule
from conduit_jax.errors import CapacityError, ConfigError, NotEnoughDataError

GROUP = 4


def make_groups(rng, count, version, first_uid, longest=12):
    """``count`` groups whose token t of sequence ``uid`` is ``uid * 100 + t`` (every token names its sequence and
    place), with rewards and prompt lengths; returns the Groups and {uid: (tokens, reward, prompt, version, group)}."""
    tokens, rewards, prompts, known = [], [], [], {}
    for g in range(count):
        group = []
        for j in range(GROUP):
            uid = first_uid + g * GROUP + j
            sequence = [uid * 100 + t for t in range(int(rng.integers(1, longest + 1)))]
            group.append(sequence)
            known[uid] = (sequence, float(rng.integers(0, 3)), int(rng.integers(0, len(sequence) + 1)), version,
                          first_uid + g * GROUP)
        tokens.append(group)
        rewards.append([known[first_uid + g * GROUP + j][1] for j in range(GROUP)])
        prompts.append([known[first_uid + g * GROUP + j][2] for j in range(GROUP)])
    spec = rollouts.RolloutSpec(GROUP, longest, {"tokens": np.int32})
    return rollouts.groups_from_lists(spec, tokens=tokens, rewards=rewards, prompt_lengths=prompts,
                                      policy_version=version), known


def same_length_groups(spec, length, count=1):
    """``count`` groups of GROUP responses of ``length`` tokens each (no prompt, reward 0, version 0)."""
    return rollouts.groups_from_lists(spec, tokens=[[[1] * length] * GROUP] * count, rewards=[[0.0] * GROUP] * count,
                                      prompt_lengths=[[0] * GROUP] * count, policy_version=0)


def check_delivered(batch, known, seen, version, eta):
    """Every token is its sequence's, in order, within one segment of one row; groups whole and once; advantages as
    NumPy computes them; nothing older than the bound in the loss. Returns the groups delivered."""
    tokens, segments = np.asarray(batch.leaves["tokens"]), np.asarray(batch.segment_ids)
    positions, loss, advantages = (np.asarray(batch.positions), np.asarray(batch.loss_mask),
                                   np.asarray(batch.advantages))
    uids = {}
    for segment in np.unique(segments[segments > 0]):
        rows, columns = np.nonzero(segments == segment)
        assert len(set(rows)) == 1 and np.all(np.diff(columns) == 1), "a segment crosses rows or has holes"
        uid = int(tokens[rows[0], columns[0]]) // 100
        sequence, reward, prompt, produced, group = known[uid]
        np.testing.assert_array_equal(tokens[rows, columns], sequence)
        np.testing.assert_array_equal(positions[rows, columns], np.arange(len(sequence)))
        uids[uid] = (rows[0], columns, prompt, produced, group)
    groups = {}
    for uid, (_, _, _, _, group) in uids.items():
        groups.setdefault(group, []).append(uid)
    for group, members in groups.items():
        assert sorted(members) == list(range(group, group + GROUP)), "a group arrived in part"
        assert group not in seen, "a group arrived twice"
        seen.add(group)
        rewards = np.array([known[uid][1] for uid in members], np.float64)
        expected = np.zeros(GROUP) if np.all(rewards == rewards[0]) else \
            (rewards - rewards.mean()) / (rewards.std(ddof=1) + rollouts.ADVANTAGE_EPS)
        for uid, advantage in zip(members, expected):
            row, columns, prompt, produced, _ = uids[uid]
            fresh = eta is None or produced >= version - eta
            np.testing.assert_array_equal(loss[row, columns], (np.arange(len(columns)) >= prompt) & fresh)
            np.testing.assert_allclose(advantages[row, columns], advantage if fresh else 0.0, rtol=1e-4, atol=1e-5)
    return len(groups)


@pytest.mark.parametrize("policy", [schedule.staged(), schedule.overlap(2)], ids=lambda s: s.name)
def test_a_grpo_loop_gets_whole_fresh_groups_once_in_order(policy):
    """A generator thread ingests groups of ragged rollouts (waiting for room), the learner delivers packed
    batches and moves its policy version on; every delivered token checks out against what was generated."""
    spec = rollouts.RolloutSpec(GROUP, 12, {"tokens": np.int32})
    eta, steps = 1, 30
    plane = RolloutPlane(spec, token_capacity=512, group_capacity=16, groups_per_batch=3,
                         layout=rollouts.packed(4, 24), max_staleness=eta, schedule=policy)
    known, done = {}, threading.Event()
    lock = threading.Lock()

    def generate():
        rng, uid = np.random.default_rng(5), 0
        while not done.is_set():
            version = plane.stats()["policy_version"]
            groups, new = make_groups(rng, 2, version, uid)
            uid += 2 * GROUP
            with lock:  # known before the ingest returns: the learner checks what it gets against it
                known.update(new)
            try:  # not under the lock: waiting for room, this thread must not keep the learner from making it
                plane.ingest(groups, timeout=0.5)
            except CapacityError:
                with lock:
                    for uid_refused in new:
                        del known[uid_refused]

    producer = threading.Thread(target=generate)
    producer.start()
    seen, delivered = set(), 0
    try:
        for step in range(steps):
            batch = plane.deliver(timeout=30.0)
            with lock:
                delivered += check_delivered(batch, dict(known), seen, step, eta)
            plane.set_policy_version(step + 1)
    finally:
        done.set()
        producer.join()
        plane.close()
    stats, prefetched = plane.stats(), sum(int(batch.groups) for batch in plane.in_flight())
    assert stats["groups_drawn"] == delivered + prefetched and delivered >= steps
    # back-pressure, not loss: every group still fresh at the end was delivered or is waiting to be
    fresh = {group for _, _, _, produced, group in known.values() if produced >= steps - eta}
    assert len(fresh - seen) <= stats["undelivered"] + prefetched
    assert stats["groups_ingested"] == (stats["groups_drawn"] + stats["dropped_stale"] + stats["undelivered"] +
                                        stats["dropped_overwritten"])
    assert stats["exposed_path"]["batches"] == steps


def test_staged_ingest_dispatches_nothing_and_one_kernel_delivers():
    spec = rollouts.RolloutSpec(GROUP, 12, {"tokens": np.int32})
    plane = RolloutPlane(spec, 512, 16, 2, rollouts.packed(4, 24), min_fill=0.0)
    rng = np.random.default_rng(0)
    plane.ingest(make_groups(rng, 2, 0, 0)[0])
    plane.ingest(make_groups(rng, 1, 0, 100)[0])
    assert plane.stats()["dispatches"] == {} and len(plane) == 3
    batch = plane.deliver()
    assert int(batch.groups) == 2 and plane.stats()["dispatches"] == {"staged+deliver": 1}
    plane.deliver()
    assert plane.stats()["dispatches"] == {"staged+deliver": 1, "deliver": 1} and len(plane) == 0
    with pytest.raises(NotEnoughDataError, match="no group is deliverable"):
        plane.deliver()
    state = plane.state
    assert int(state.delivered) == 3 and int(state.written) == 3


def test_a_state_assigned_back_delivers_again_what_it_held_and_a_foreign_one_is_refused():
    """plane.state = an earlier state: the host's bookkeeping is rebuilt from it (groups staged meanwhile go into the
    state replaced), so the same batches come again; a state of another size is refused, naming the leaf."""
    spec = rollouts.RolloutSpec(GROUP, 12, {"tokens": np.int32})
    plane = RolloutPlane(spec, 512, 16, 2, rollouts.packed(4, 24), min_fill=0.0)
    rng = np.random.default_rng(3)
    plane.ingest(make_groups(rng, 3, 0, 0)[0])
    snapshot = jax.tree.map(jax.numpy.copy, plane.state)  # a kernel donates the plane's own state
    first = plane.deliver()
    plane.ingest(make_groups(rng, 1, 0, 100)[0])
    plane.state = snapshot
    assert len(plane) == 3 and plane.stats()["groups_ingested"] == 3
    again = plane.deliver()
    for got, want in zip(jax.tree.leaves(again), jax.tree.leaves(first)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    smaller = RolloutPlane(spec, 256, 16, 2, rollouts.packed(4, 24))
    refused = r"RolloutPlane.state: leaf .*tokens.* must be int32\[512\], got int32\[256\]"
    with pytest.raises(ConfigError, match=refused):
        plane.state = smaller.state
    assert len(plane) == 1 and int(plane.deliver().groups) == 1


def test_an_ingest_that_would_overwrite_undelivered_groups_waits_or_is_refused():
    spec = rollouts.RolloutSpec(GROUP, 12, {"tokens": np.int32})
    plane = RolloutPlane(spec, 512, 4, 2, rollouts.padded())
    rng = np.random.default_rng(1)
    plane.ingest(make_groups(rng, 4, 0, 0)[0])
    extra = make_groups(rng, 1, 0, 100)[0]
    with pytest.raises(CapacityError, match="would overwrite 1 of the 4 undelivered groups"):
        plane.ingest(extra)
    assert len(plane) == 4 and plane.stats()["groups_ingested"] == 4  # nothing written
    learner = threading.Timer(0.2, plane.deliver)
    learner.start()
    plane.ingest(extra, timeout=10.0)  # room made by the learner's deliver()
    learner.join()
    assert len(plane) == 3 and plane.stats()["dropped_overwritten"] == 0


def test_a_prefetched_batch_gone_stale_is_masked_when_delivered():
    """Drawn ahead at version 0, delivered after the learner moved to version 2 (bound 1): its sequences carry no
    loss and are counted; nothing older reaches the learner."""
    spec = rollouts.RolloutSpec(GROUP, 12, {"tokens": np.int32})
    plane = RolloutPlane(spec, 512, 16, 1, rollouts.packed(4, 24), max_staleness=1, schedule=schedule.overlap(1))
    try:
        rng = np.random.default_rng(2)
        plane.ingest(make_groups(rng, 2, 0, 0)[0])
        plane.deliver(timeout=10.0)
        assert len(plane.in_flight()) == 1  # the worker drew the second group ahead, at version 0
        plane.set_policy_version(2)
        batch = plane.deliver(timeout=10.0)
        assert int(batch.groups) == 1 and not np.any(np.asarray(batch.loss_mask))
        assert plane.stats()["masked_stale"] == GROUP
    finally:
        plane.close()


def test_after_a_version_switch_the_ingest_lays_out_the_next_batch_and_a_fresh_one_is_handed_over_as_drawn():
    """Under overlap the generator's ingest right after a switch draws the learner's next batch and returns once it
    is computed, so deliver() waits for nothing; a batch drawn before a switch that leaves it within the bound is
    handed over as it was drawn (nothing masked, no kernel)."""
    spec = rollouts.RolloutSpec(GROUP, 12, {"tokens": np.int32})
    plane = RolloutPlane(spec, 512, 16, 1, rollouts.packed(4, 24), max_staleness=1, schedule=schedule.overlap(1))
    try:
        rng = np.random.default_rng(3)
        plane.ingest(make_groups(rng, 2, 0, 0)[0])
        plane.deliver(timeout=10.0)
        (ahead,) = plane.in_flight()  # the worker drew the second group ahead, at version 0
        plane.set_policy_version(1)
        dispatched = sum(plane.stats()["dispatches"].values())
        assert plane.deliver(timeout=10.0) is ahead and plane.stats()["masked_stale"] == 0
        assert np.any(np.asarray(ahead.loss_mask)) and sum(plane.stats()["dispatches"].values()) == dispatched
        plane.set_policy_version(2)
        plane.ingest(make_groups(rng, 1, 2, 100)[0])
        (drawn,) = plane.in_flight()
        assert all(leaf.is_ready() for leaf in jax.tree_util.tree_leaves(drawn))  # computed before ingest returned
        assert plane.deliver(timeout=10.0) is drawn and int(drawn.groups) == 1
        plane.set_policy_version(3)  # nothing staged: the state still says what the learner said
        assert int(plane.state.policy_version) == 3
    finally:
        plane.close()


def test_batches_land_on_the_learners_devices():
    """Generation's half of the mesh holds the buffer; the learner's half receives the batches."""
    devices = np.array(jax.devices()[:8])
    generation, learner = Mesh(devices[:4], ("data",)), Mesh(devices[4:], ("data",))
    spec = rollouts.RolloutSpec(GROUP, 12, {"tokens": np.int32})
    plane = RolloutPlane(spec, 512, 16, 2, rollouts.packed(4, 24), mesh=generation,
                         learner_mesh=learner)
    plane.ingest(make_groups(np.random.default_rng(3), 2, 0, 0)[0])
    batch = plane.deliver()
    assert batch.leaves["tokens"].sharding.device_set == set(devices[4:])
    assert plane.state.leaves["tokens"].sharding.device_set == set(devices[:4])
    # the planner prices the move: each learner device receives a quarter of the batch over the peer link
    topology = placement.emulated_cpu(8)
    cost = plane.move_cost(topology)
    nbytes = sum(leaf.nbytes for leaf in jax.tree_util.tree_leaves(batch))
    assert cost["batch_bytes"] == nbytes
    assert cost["seconds"] == pytest.approx(topology.link_class("peer").transfer_time(nbytes / 4, 4))
    # trimmed batches of other row counts (some not divisible by the learner's 4 devices) move as well
    trimmed = RolloutPlane(spec, 512, 16, 2, rollouts.packed(4, 24), mesh=generation, learner_mesh=learner,
                           trim_rows=True, min_fill=0.0)
    rows = []
    for count, length in ((2, 12), (1, 1)):  # 4 rows first (split over the 4 devices), then one (replicated)
        trimmed.ingest(same_length_groups(spec, length, count))
        batch = trimmed.deliver()
        rows.append(batch.segment_ids.shape[0])
        assert batch.leaves["tokens"].sharding.device_set == set(devices[4:])
    assert rows == [4, 1]
    assert placement.reshard_time(topology, nbytes, [0, 1], [0, 1]) == 0.0  # already where the learner is


def test_bad_configurations_are_named():
    spec = rollouts.RolloutSpec(GROUP, 12, {"tokens": np.int32})
    with pytest.raises(ConfigError, match="defers priority updates"):
        RolloutPlane(spec, 512, 16, 2, schedule=schedule.deferred(2, 2))
    plane = RolloutPlane(spec, 512, 16, 2)
    plane.set_policy_version(3)
    with pytest.raises(ConfigError, match="versions only move forward; the plane is at 3, got 2"):
        plane.set_policy_version(2)


def test_device_groups_are_checked_by_value_and_a_refused_ingest_stages_nothing():
    """A generator's device arrays are read and checked like host lists: a length over max_length is refused by
    name and nothing is staged."""
    import jax.numpy as jnp

    from conduit_jax.errors import SpecError

    spec = rollouts.RolloutSpec(GROUP, 12, {"tokens": np.int32})
    plane = RolloutPlane(spec, 512, 16, 2, min_fill=0.0)
    groups, _ = make_groups(np.random.default_rng(6), 1, 0, 0)
    bad = jax.tree.map(jnp.asarray, groups._replace(lengths=np.where(np.arange(GROUP) == 2, 13, groups.lengths)))
    with pytest.raises(SpecError, match=r"lengths of prompt 0, response 2 is 13, expected 1..12"):
        plane.ingest(bad)
    assert len(plane) == 0 and plane.stats()["groups_ingested"] == 0
    plane.ingest(jax.tree.map(jnp.asarray, groups))
    assert int(plane.deliver().groups) == 1


@pytest.mark.parametrize("layout", [rollouts.packed(4, 24), rollouts.padded()], ids=["packed", "padded"])
def test_trimmed_batches_are_the_whole_batches_first_rows(layout):
    """trim_rows: a batch holds only the rows its sequences fill, in one of row_counts()'s shapes, and equals there
    the batch a plane without it delivers, whose other rows are padding. The functional deliver() refuses rows that
    would cut the plan's sequences."""
    spec = rollouts.RolloutSpec(GROUP, 12, {"tokens": np.int32})
    whole = RolloutPlane(spec, 512, 16, 3, layout, min_fill=0.0)
    trimmed = RolloutPlane(spec, 512, 16, 3, layout, min_fill=0.0, trim_rows=True)
    full = 4 if layout.name == "packed" else 3 * GROUP
    assert whole.row_counts() == (full,) and trimmed.row_counts() == tuple(range(1, full + 1))
    rng, seen, shapes = np.random.default_rng(8), set(), set()
    for count in (1, 3, 2):
        groups, known = make_groups(rng, count, 0, 1000 * count)
        whole.ingest(groups)
        trimmed.ingest(groups)
        while whole.can_sample():
            plan = whole.queue.plan()
            if count == 3:  # the functional step, given the plan the plane is about to use
                needed = rollouts.rows_needed(plan)
                for rows, why in ((needed - 1, "would cut sequences"), (full + 1, "exceeds the layout's")):
                    if rows:
                        with pytest.raises(ConfigError, match=why):
                            whole.buffer.deliver(whole.state, plan, rows=rows)
            ours, theirs = whole.deliver(), trimmed.deliver()
            rows = theirs.segment_ids.shape[0]
            assert rows == rollouts.rows_needed(plan) and rows in trimmed.row_counts()
            shapes.add(rows)
            check_delivered(theirs, known, seen, 0, None)
            for field in ("segment_ids", "positions", "loss_mask", "advantages"):
                np.testing.assert_array_equal(np.asarray(getattr(ours, field))[:rows], getattr(theirs, field))
            np.testing.assert_array_equal(np.asarray(ours.leaves["tokens"])[:rows], theirs.leaves["tokens"])
            assert not np.any(np.asarray(ours.segment_ids)[rows:])  # the rows trimmed off held nothing
            for field in ("ids", "rewards", "lengths", "versions", "sequence_mask", "groups", "valid"):
                np.testing.assert_array_equal(getattr(ours, field), getattr(theirs, field))
    assert len(shapes) > 1 and len(seen) == 6 and len(trimmed) == 0
    with pytest.raises(ConfigError, match="trim_rows must be a bool"):
        RolloutPlane(spec, 512, 16, 3, trim_rows="yes")


def test_a_batch_waits_until_it_is_full_or_filled_enough():
    """min_fill=1 (the default): a batch is drawn once its window of groups is there or a group did not fit; a
    lower min_fill draws once the sequences fill that share of the token budget."""
    spec = rollouts.RolloutSpec(GROUP, 12, {"tokens": np.int32})
    rng = np.random.default_rng(7)
    plane = RolloutPlane(spec, 1024, 16, 3, rollouts.packed(8, 24))
    plane.ingest(make_groups(rng, 2, 0, 0)[0])
    assert not plane.can_sample()
    with pytest.raises(NotEnoughDataError, match=r"2 deliverable groups fill \d+% of a batch, min_fill is 100%"):
        plane.deliver()
    plane.ingest(make_groups(rng, 1, 0, 100)[0])  # the window's third group
    assert int(plane.deliver().groups) == 3
    lenient = RolloutPlane(spec, 1024, 16, 3, rollouts.packed(2, 24), min_fill=0.3)

    lenient.ingest(same_length_groups(spec, 1))  # 4 tokens of a 48-token budget: 8%
    assert not lenient.can_sample()
    lenient.ingest(same_length_groups(spec, 3))  # 16 of 48: 33%
    assert lenient.can_sample() and int(lenient.deliver().groups) == 2
    with pytest.raises(ConfigError, match="min_fill must be a number in"):
        RolloutPlane(spec, 1024, 16, 3, min_fill=1.5)
