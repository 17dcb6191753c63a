"""The data plane on Ray actors (conduit_jax/distributed/ray_plane.py): the split of a batch over shards, ingest
routing, sampling distributions over 1-4 actors against one local plane (chi-square), importance weights with the
global N and mass, priority-update routing by actor id, save/restore, and a shard actor killed mid-run (sampling
continues on the survivors, the restarted shard holds exactly its checkpointed items, lost items and priority updates
for the lost generation are counted).

One local Ray cluster per module (``ray.init(num_cpus=2)``, token auth off, temp dir under the test's tmp path)."""

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conduit_jax import ExperienceDataPlane, PriorityError, default_mesh, samplers, schedule
from conduit_jax.distributed import ray_plane
from conduit_jax.distributed.ray_plane import route, split_counts

stats_lib = pytest.importorskip("scipy.stats")

SPEC = {"x": jax.ShapeDtypeStruct((), jnp.int32), "v": jax.ShapeDtypeStruct((2,), jnp.float32),
        "done": jax.ShapeDtypeStruct((), jnp.bool_)}
P_MIN = 1e-3  # chi-square tests fail below this p-value (false alarm 1 in 1,000 per test)


def batch(start, n):
    g = np.arange(start, start + n, dtype=np.int32)
    return {"x": g, "v": np.stack([g * 0.5, -g], 1).astype(np.float32), "done": g % 3 == 0}


def check_rows(delivery):
    """Every delivered row is a consistent item (its leaves agree with its x)."""
    x = np.asarray(delivery.data["x"])
    np.testing.assert_array_equal(np.asarray(delivery.data["v"]), np.stack([x * 0.5, -x], 1).astype(np.float32))
    np.testing.assert_array_equal(np.asarray(delivery.data["done"]), x % 3 == 0)
    return x


def priority_of(x):
    return 0.25 + (np.asarray(x) % 5).astype(np.float32)


# ------------------------------------------------------------------------------------------------------------------
# No ray needed
# ------------------------------------------------------------------------------------------------------------------
def test_import_does_not_import_ray():
    code = ("import json, sys; import conduit_jax; import conduit_jax.distributed; "
            "from conduit_jax.distributed import DistributedPlane, multihost; "
            "print(json.dumps('ray' in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.strip().splitlines()[-1]) is False


@pytest.mark.parametrize("method", ["stratified", "multinomial"])
def test_split_counts_is_unbiased(method):
    rng = np.random.default_rng(0)
    masses = np.array([3.0, 0.0, 1.0, 12.5, 0.5])
    draws = np.stack([split_counts(64, masses, rng, method) for _ in range(4000)])
    assert (draws.sum(1) == 64).all() and (draws[:, 1] == 0).all()
    expected = 64 * masses / masses.sum()
    np.testing.assert_allclose(draws.mean(0), expected, atol=0.1)
    if method == "stratified":  # a shard's range only partly covers its first and last strata
        assert (np.abs(draws - expected) < 2).all()


def test_split_counts_refuses_no_mass():
    from conduit_jax import NotEnoughDataError

    with pytest.raises(NotEnoughDataError):
        split_counts(8, [0.0, 0.0], np.random.default_rng(0))


def test_route_prefers_the_producers_node():
    nodes = ["a", "b", "a", "c"]
    alive = [True, True, True, True]
    assert [route("a", nodes, alive, t) for t in range(4)] == [0, 2, 0, 2]
    assert [route("c", nodes, alive, t) for t in range(2)] == [3, 3]
    assert [route("zzz", nodes, alive, t) for t in range(4)] == [0, 1, 2, 3]  # no shard there: round robin
    assert [route(None, nodes, alive, t) for t in range(2)] == [0, 1]
    assert [route("a", nodes, [False, True, True, True], t) for t in range(2)] == [2, 2]  # a live local shard
    assert [route("c", nodes, [True, True, True, False], t) for t in range(3)] == [0, 1, 2]  # local one down
    with pytest.raises(ray_plane.ShardUnavailableError):
        route("a", nodes, [False] * 4, 0)


def test_a_plane_on_a_ray_without_token_authentication_warns(monkeypatch):
    from conduit_jax.errors import ConduitWarning

    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    with pytest.warns(ConduitWarning, match="token authentication is off .* listen on every interface"):
        ray_plane.warn_if_unauthenticated()
    for mode in ("token", None):
        if mode is None:
            monkeypatch.delenv("RAY_AUTH_MODE")
        else:
            monkeypatch.setenv("RAY_AUTH_MODE", mode)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            ray_plane.warn_if_unauthenticated()


def test_an_fsync_shard_flushes_its_log_and_replays_it_after_a_restart(tmp_path):
    """durable='fsync': the shard (built directly, without Ray) flushes each logged batch; a shard restarted on the
    same directory holds every acknowledged item; any other value of durable is refused by name."""
    from conduit_jax import ConfigError
    from conduit_jax.distributed import DistributedPlane

    with pytest.raises(ConfigError, match="durable must be True, False or 'fsync', got 'yes'"):
        DistributedPlane(SPEC, 64, samplers.uniform(8), durable="yes")
    # the request schedule is the core's vocabulary (prefetch=k: overlap(k)); what shards cannot do is refused
    with pytest.raises(ConfigError, match="the deferred schedule is not supported across shards"):
        DistributedPlane(SPEC, 64, samplers.uniform(8), schedule=schedule.deferred(2, 2))
    with pytest.raises(ConfigError, match="pass schedule= or prefetch=, not both"):
        DistributedPlane(SPEC, 64, samplers.uniform(8), schedule=schedule.overlap(2), prefetch=2)
    shard = ray_plane.ShardServer(0, SPEC, 64, samplers.uniform(8), directory=str(tmp_path), devices=1,
                                  durable="fsync")
    assert shard.log.fsync and shard.ingest(batch(0, 5))["durable"]
    shard.ingest(batch(5, 4))
    again = ray_plane.ShardServer(0, SPEC, 64, samplers.uniform(8), directory=str(tmp_path), devices=1,
                                  durable="fsync")
    assert again.replayed == 9 and sorted(again.items()["data"]["x"].tolist()) == list(range(9))


# ------------------------------------------------------------------------------------------------------------------
# On a local Ray cluster
# ------------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory):
    os.environ["RAY_AUTH_MODE"] = "disabled"
    ray = pytest.importorskip("ray")
    if ray.is_initialized():  # another module's session (e.g. the RLlib tests'): use it, leave it running
        yield ray
        return
    temp = str(tmp_path_factory.mktemp("ray"))
    if len(temp) > 40:  # Ray puts unix sockets under the temp dir: their paths must stay under 107 bytes
        temp = tempfile.mkdtemp(prefix="ray", dir="/tmp")
    ray.init(num_cpus=2, include_dashboard=False, _temp_dir=temp, log_to_driver=False,
             runtime_env={"env_vars": {"JAX_PLATFORMS": "cpu"}})
    yield ray
    ray.shutdown()
    shutil.rmtree(temp, ignore_errors=True)


def make(ray_cluster, tmp_path, sampler, actors, capacity=192, **kwargs):
    from conduit_jax.distributed import DistributedPlane

    kwargs.setdefault("checkpoint_every_s", None)
    return DistributedPlane(SPEC, capacity, sampler, num_actors=actors, devices_per_actor=1,
                            checkpoint_dir=str(tmp_path / "shards"), **kwargs)


def ingest_uneven(plane, items):
    """Batches of 9, 14, 12, 10, 15 items round robin over the actors: shard sizes differ, and every batch size falls
    in one compiled ingest bucket (16 rows)."""
    start = 0
    for size in (9, 14, 12, 10, 15):
        if start == items:
            break
        assert start + size <= items, "items must be a prefix sum of the batch sizes: 9, 23, 35, 45, 60"
        plane.ingest(batch(start, size))
        start += size
    return items


def local_counts(sampler, items, batches, seed=1, priorities=None):
    plane = ExperienceDataPlane(SPEC, 192, sampler, mesh=default_mesh(1), seed=seed)
    plane.ingest(batch(0, items))
    if priorities is not None:
        ids = np.stack([np.arange(items), np.ones(items)], 1).astype(np.int32)
        plane.update_priorities(ids, priorities)
    counts = np.zeros(items, np.int64)
    for _ in range(batches):
        counts += np.bincount(np.asarray(plane.sample().data["x"]), minlength=items)
    return counts


# the default suite runs 1 actor (several actors: test_prioritized_matches_one_local_plane on 3, the same routing of
# draws and ids); 2 and 4 actors (14 s and 24 s on 2 cores) run under -m slow
@pytest.mark.parametrize("actors", [1] + [pytest.param(n, marks=pytest.mark.slow) for n in (2, 4)])
def test_uniform_matches_one_local_plane(ray_cluster, tmp_path, actors):
    items, batches = 60, 150
    with make(ray_cluster, tmp_path, samplers.uniform(32), actors, seed=100 + actors) as plane:
        ingest_uneven(plane, items)
        compiled = plane.warmup()  # sample kernels for the share sizes each shard will see
        assert sorted(compiled) == list(range(actors)) and all(compiled.values())
        first = plane.sample()
        assert first.ids.shape == (32, 4) and first.weights is None
        counts = np.zeros(items, np.int64)
        for _ in range(batches):
            d = plane.deliver()
            x = check_rows(d)
            counts += np.bincount(x, minlength=items)
        stats = plane.stats()
        sizes = [s["size"] for s in stats["shards"]]
        assert stats["size"] == items and sum(sizes) == items and not stats["degraded"]
        if actors > 1:
            assert len(set(sizes)) > 1, "the uneven ingest should leave shards of different sizes"
        assert stats["in_flight"] == plane.prefetch
        assert stats["exposed"]["count"] == batches
        # ids name the actor and the row the item lives in there
        ids = np.asarray(d.ids)
        for a in set(ids[:, 0].tolist()):
            held = plane.shard_items(a)
            by_row = dict(zip(held["rows"].tolist(), held["data"]["x"].tolist()))
            for (actor, inc, row, gen), x in zip(ids.tolist(), np.asarray(d.data["x"]).tolist()):
                if actor == a:
                    assert inc == 0 and gen == 1 and by_row[row] == x
    total = counts.sum()
    assert total == 32 * batches
    assert stats_lib.chisquare(counts).pvalue > P_MIN, counts
    local = local_counts(samplers.uniform(32), items, batches)
    assert stats_lib.chi2_contingency(np.stack([counts, local])).pvalue > P_MIN


@pytest.mark.parametrize("actors", [pytest.param(1, marks=pytest.mark.slow), pytest.param(3, marks=pytest.mark.slow)])
def test_prioritized_matches_one_local_plane(ray_cluster, tmp_path, actors):
    items, batches, alpha, beta = 45, 120, 0.7, 0.5
    sampler = samplers.prioritized(32, alpha=alpha, beta=beta)
    with make(ray_cluster, tmp_path, sampler, actors, seed=10 + actors) as plane:
        ingest_uneven(plane, items)
        plane.flush()
        # set every item's priority by routing (actor, incarnation, row, generation) ids
        for a in range(actors):
            held = plane.shard_items(a)
            n = held["rows"].shape[0]
            ids = np.stack([np.full(n, a), np.zeros(n), held["rows"], held["generations"]], 1).astype(np.int32)
            plane.update_priorities(ids, priority_of(held["data"]["x"]))
        mass = (priority_of(np.arange(items)).astype(np.float64) + 1e-6) ** alpha
        probability = mass / mass.sum()
        counts = np.zeros(items, np.int64)
        for step in range(batches):
            d = plane.sample() if step == 0 else plane.deliver()
            x = check_rows(d)
            counts += np.bincount(x, minlength=items)
            expected = (items * probability[x]) ** -beta
            np.testing.assert_allclose(np.asarray(d.weights), expected / expected.max(), rtol=2e-4)
        assert plane.stats()["priority_updates_ignored"] == 0
    assert stats_lib.chisquare(counts, counts.sum() * probability).pvalue > P_MIN, counts
    local = local_counts(sampler, items, batches, priorities=priority_of(np.arange(items)))
    assert stats_lib.chi2_contingency(np.stack([counts, local])).pvalue > P_MIN


@pytest.mark.slow
def test_priority_updates_route_to_their_actor(ray_cluster, tmp_path):
    sampler = samplers.prioritized(16, alpha=1.0, beta=0.4)
    with make(ray_cluster, tmp_path, sampler, 2, capacity=64, placement="PACK") as plane:
        plane.ingest(batch(0, 10))
        ray = ray_cluster
        ray.get(plane.shard_for().ingest.remote(batch(10, 10)))  # a producer writing to its shard directly
        assert plane.stats()["size"] == 20  # the shard's next reply carries its new mass
        d = plane.sample()
        ids = np.asarray(d.ids)
        assert set(ids[:, 0].tolist()) == {0, 1}
        # almost all mass on one item of actor 1: it must dominate the next batches
        target = ids[ids[:, 0] == 1][0]
        others = np.array([i for i in ids.tolist() if i != target.tolist()])
        plane.update_priorities(np.concatenate([target[None], others]),
                                np.concatenate([[1e4], np.full(len(others), 1e-4)]).astype(np.float32))
        hits = sum(int((np.asarray(plane.sample().ids) == target).all(1).sum()) for _ in range(5))
        assert hits > 40, hits  # the 18 untouched items keep priority 1 (mass ~18 of ~10018)
        with pytest.raises(PriorityError):
            plane.update_priorities(np.array([[5, 0, 0, 1]]), np.array([1.0]))  # no actor 5
        with pytest.raises(PriorityError):
            plane.update_priorities(ids[:1], np.array([np.nan]))
        with pytest.raises(PriorityError):
            plane.update_priorities(ids[:, 1:], np.ones(16))  # (row, generation) ids of a local plane


def test_save_and_restore(ray_cluster, tmp_path):
    from conduit_jax.distributed import DistributedPlane

    sampler = samplers.prioritized(8, alpha=0.6, beta=0.4)
    with make(ray_cluster, tmp_path, sampler, 2, capacity=64) as plane:
        plane.ingest(batch(0, 10))
        plane.ingest(batch(10, 11))
        before = [plane.shard_items(a) for a in range(2)]
        steps = plane.save(str(tmp_path / "saved"))
        assert set(steps) == {0, 1}
    with DistributedPlane.restore(str(tmp_path / "saved"), devices_per_actor=1, checkpoint_every_s=None,
                                  checkpoint_dir=str(tmp_path / "again")) as restored:
        assert restored.spec == plane.spec and restored.capacity == 64 and restored.num_actors == 2
        for a in range(2):
            after = restored.shard_items(a)
            np.testing.assert_array_equal(after["data"]["x"], before[a]["data"]["x"])
            np.testing.assert_array_equal(after["rows"], before[a]["rows"])
        assert len(restored) == 21
        check_rows(restored.sample())


@pytest.mark.slow
def test_a_killed_actor_restarts_from_its_checkpoint(ray_cluster, tmp_path):
    ray = ray_cluster
    sampler = samplers.prioritized(16, alpha=0.6, beta=0.4)
    with make(ray_cluster, tmp_path, sampler, 2, capacity=128, max_restarts=2, prefetch=2, durable=False) as plane:
        for i in range(6):  # round robin: 30 items on each shard
            plane.ingest(batch(10 * i, 10))
        plane.flush()
        plane.save()  # every shard's checkpoint now holds its 30 items
        saved = plane.shard_items(0)
        assert saved["rows"].shape[0] == 30
        late = {0: 0, 1: 0}
        for i in range(6, 9):  # after the checkpoint: 2 batches to one shard, 1 to the other
            late[plane.ingest(batch(10 * i, 10))] += 10
        plane.flush()
        for _ in range(3):
            plane.deliver()
        old = plane.sample()
        old_ids = np.asarray(old.ids)
        assert (old_ids[:, 0] == 0).any()

        ray.kill(plane.actors[0], no_restart=False)
        # sampling goes on from the surviving shard while shard 0 restarts (ray.kill takes effect asynchronously)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            check_rows(plane.deliver())
            stats = plane.stats()
            if stats["degraded"]:
                break
        assert stats["degraded"] and stats["down"] == [0] and stats["alive"] == 1
        assert stats["items_at_risk"] == late[0]
        for _ in range(plane.prefetch + 1):  # requests issued before the failure was seen
            check_rows(plane.deliver())
        fresh = []
        for _ in range(3):
            d = plane.deliver()
            check_rows(d)
            fresh.append(np.asarray(d.ids))
        if plane.stats()["degraded"]:  # (unless shard 0 is already back)
            assert all(set(ids[:, 0].tolist()) == {1} for ids in fresh)
        # an ingest while shard 0 is down (or restarting) lands somewhere alive
        plane.ingest(batch(1000, 4), block=True)

        assert plane.wait_for_shards(timeout=90), plane.stats()
        stats = plane.stats()
        assert not stats["degraded"] and stats["restarts"] == 1
        assert stats["shards"][0]["incarnation"] == 1
        assert stats["items_lost"] == late[0]
        restored = plane.shard_items(0)
        got = set(restored["data"]["x"].tolist())
        assert set(saved["data"]["x"].tolist()) <= got
        assert len(got - set(saved["data"]["x"].tolist())) in (0, 4)  # at most the batch sent while it was down
        # ids of the lost generation are ignored and counted, never applied to the restored items
        lost_before = stats["priority_updates_lost_shard"]
        mine = old_ids[old_ids[:, 0] == 0]
        plane.update_priorities(old_ids, np.full(len(old_ids), 7.0, np.float32))
        plane.flush()
        assert plane.stats()["priority_updates_lost_shard"] == lost_before + len(mine)
        # and the restored shard is sampled again
        actors = set()
        for _ in range(10):
            actors |= set(np.asarray(plane.sample().ids)[:, 0].tolist())
        assert actors == {0, 1}


def _kill_and_wait(ray, plane, shard: int) -> None:
    """Kill shard ``shard``'s process and wait until the restarted actor answers."""
    before = plane.stats()["restarts"]
    ray.kill(plane.actors[shard], no_restart=False)
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        try:
            plane.sample()
        except ray_plane.ShardUnavailableError:
            pass
        if plane.stats()["restarts"] > before and plane.wait_for_shards(timeout=90):
            return
        time.sleep(0.05)
    raise AssertionError(f"shard {shard} did not come back: {plane.stats()}")


@pytest.mark.parametrize("kills", [1, pytest.param(10, marks=pytest.mark.slow)])
def test_a_durable_shard_loses_no_acknowledged_item_when_killed(ray_cluster, tmp_path, kills):
    """durable=True (the default): every batch a shard acknowledged is back after its process is killed, from its
    last snapshot plus its write-ahead log, each item once; a snapshot taken meanwhile truncates the log."""
    ray = ray_cluster
    with make(ray_cluster, tmp_path, samplers.uniform(8), 1, capacity=512, checkpoint_every_items=50,
              max_restarts=kills) as plane:
        sent = 0
        for kill in range(kills):
            for _ in range(4):  # 28 items per round, a snapshot every 50: some rounds end mid-interval
                plane.ingest(batch(sent, 7), block=True)  # block: acknowledged by the shard
                sent += 7
            _kill_and_wait(ray, plane, 0)
            stats = plane.stats()
            assert stats["items_lost"] == 0 and stats["items_inserted"] == sent, stats
            held = sorted(plane.shard_items(0)["data"]["x"].tolist())
            assert held == list(range(sent)), f"after kill {kill + 1}: {len(held)} items, {sent} acknowledged"
        check_rows(plane.sample())
        logs = os.listdir(tmp_path / "shards" / "actor_0" / ray_plane.WAL_DIR)
        assert len(logs) <= 3, logs  # segments a finished snapshot covers are gone


@pytest.mark.slow
def test_periodic_checkpoints_bound_the_loss(ray_cluster, tmp_path):
    ray = ray_cluster
    with make(ray_cluster, tmp_path, samplers.uniform(8), 1, capacity=64, checkpoint_every_items=20,
              max_restarts=1, durable=False) as plane:
        for i in range(3):
            plane.ingest(batch(7 * i, 7), block=True)  # the third crosses 20 items: a snapshot of 21 starts
        deadline = time.monotonic() + 60
        while plane.stats()["shards"][0]["checkpointed"] < 21 and time.monotonic() < deadline:
            time.sleep(0.1)  # snapshots are written in the background
        assert plane.stats()["shards"][0]["checkpointed"] == 21
        for i in range(3, 5):
            plane.ingest(batch(7 * i, 7), block=True)  # 14 more: below the next snapshot's threshold
        ray.kill(plane.actors[0], no_restart=False)
        deadline = time.monotonic() + 60
        with pytest.raises(ray_plane.ShardUnavailableError):
            while time.monotonic() < deadline:  # once the kill lands the only shard is down: nothing to sample
                plane.sample()
                time.sleep(0.01)
        x = check_rows(plane.sample(timeout=90))  # waits for the restarted shard
        assert set(x.tolist()) <= set(range(21))
        stats = plane.stats()
        assert stats["items_lost"] == 14 and stats["size"] == 21 and stats["items_inserted"] == 21
        assert sorted(plane.shard_items(0)["data"]["x"].tolist()) == list(range(21))
