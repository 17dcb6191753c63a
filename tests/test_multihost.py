"""One ExperienceDataPlane over a mesh spanning 2 processes (conduit_jax/distributed/multihost.py): each process has 2
CPU devices and gloo collectives, ``jax.distributed.initialize`` on a loopback coordinator, 4 devices in the global
mesh. Both processes run ``plane_worker`` (SPMD); each returns the draws its own devices received, the test adds them
up and checks the sampled distribution (chi-square) for uniform and prioritized sampling, the importance weights, and
that every delivered row is the item its id names."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

SPEC = {"x": jax.ShapeDtypeStruct((), jnp.int32), "v": jax.ShapeDtypeStruct((2,), jnp.float32)}
ITEMS, CAPACITY, BATCH, ALPHA, BETA = 40, 64, 16, 0.8, 0.5
P_MIN = 1e-3


def batch(start, n):
    g = np.arange(start, start + n, dtype=np.int32)
    return {"x": g, "v": np.stack([g * 0.5, -g], 1).astype(np.float32)}


def priority_of(x):
    return 0.25 + (np.asarray(x) % 5).astype(np.float32)


def listening_on(port: int) -> list[str]:
    """Local addresses (hex, as /proc/net/tcp{,6} writes them) of this process's host listening on ``port``."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                address, hex_port = local.rsplit(":", 1)
                if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                    found.append(address)
    return found


def plane_worker(process_id, num_processes, batches=120):
    """Runs in each process of the mesh (after jax.distributed.initialize)."""
    from conduit_jax import ExperienceDataPlane, samplers
    from conduit_jax.distributed import multihost

    mesh = multihost.global_mesh()
    out = {"process": jax.process_index(), "devices": jax.device_count(), "local_devices": jax.local_device_count(),
           "coordinator_listens_on": listening_on(int(os.environ[multihost.ENV_COORDINATOR].rsplit(":", 1)[1]))}
    shards = mesh.devices.size
    shard_capacity = CAPACITY // shards
    for kind in ("uniform", "prioritized"):
        sampler = samplers.uniform(BATCH) if kind == "uniform" else samplers.prioritized(BATCH, alpha=ALPHA,
                                                                                            beta=BETA)
        plane = ExperienceDataPlane(SPEC, CAPACITY, sampler, mesh=mesh, seed=5)
        plane.ingest(batch(0, 24))  # every process ingests the same batches (SPMD)
        plane.ingest(batch(24, ITEMS - 24))
        g = np.arange(ITEMS)
        rows = (g % shards) * shard_capacity + g // shards  # round-robin dealing: item g -> shard g % S, slot g // S
        if kind == "prioritized":
            plane.update_priorities(np.stack([rows, np.ones(ITEMS)], 1).astype(np.int32), priority_of(g))
        counts = np.zeros(ITEMS, np.int64)
        local = 0
        for step in range(batches):
            d = plane.sample()
            x = multihost.local_rows(d.data["x"])
            ids = multihost.local_rows(d.ids)
            assert (multihost.local_rows(d.data["v"]) == np.stack([x * 0.5, -x], 1)).all()
            assert (ids[:, 0] == rows[x]).all() and (ids[:, 1] == 1).all()
            counts += np.bincount(x, minlength=ITEMS)
            local += x.shape[0]
            if kind == "prioritized" and step == 0:  # the whole batch on every process: weights (N P)^-beta / max
                every = multihost.gather({"x": d.data["x"], "w": d.weights})
                mass = (priority_of(np.arange(ITEMS)).astype(np.float64) + 1e-6) ** ALPHA
                w = (ITEMS * mass[every["x"]] / mass.sum()) ** -BETA
                out["weight_error"] = float(np.max(np.abs(every["w"] - w / w.max())))
        out[kind] = counts.tolist()
        out[f"{kind}_local_rows_per_batch"] = local // batches
        out[f"{kind}_stats"] = multihost.stats(plane)
        out[f"{kind}_len"] = len(plane)
    return out


@pytest.fixture(scope="module")
def results():
    from conduit_jax.distributed import multihost

    return multihost.launch(f"{os.path.abspath(__file__)}:plane_worker", 2, local_cpu_devices=2, timeout=240)


def test_two_processes_form_one_mesh(results):
    assert [r["process"] for r in results] == [0, 1]
    assert all(r["devices"] == 4 and r["local_devices"] == 2 for r in results)
    for r in results:
        for kind in ("uniform", "prioritized"):
            assert r[f"{kind}_local_rows_per_batch"] == BATCH // 2  # each process holds its devices' rows
            assert r[f"{kind}_len"] == ITEMS
            assert r[f"{kind}_stats"]["items_inserted"] == ITEMS and r[f"{kind}_stats"]["num_shards"] == 4


def test_the_coordinator_listens_on_loopback_only(results):
    """launch() puts the coordinator on 127.0.0.1 and it binds that address, not every interface (JAX's default)."""
    listening = results[0]["coordinator_listens_on"]
    # 127.0.0.1, ::1 and ::ffff:127.0.0.1, as /proc writes them (JAX binds an IPv6 socket, "[::]" by default)
    loopback = {"0100007F", "00000000000000000000000001000000", "0000000000000000FFFF00000100007F"}
    assert listening and set(listening) <= loopback, listening


def test_uniform_distribution_over_the_global_mesh(results):
    from scipy import stats

    counts = np.sum([r["uniform"] for r in results], axis=0)
    assert counts.sum() == 120 * BATCH
    assert stats.chisquare(counts).pvalue > P_MIN, counts


def test_prioritized_distribution_and_weights_over_the_global_mesh(results):
    from scipy import stats

    counts = np.sum([r["prioritized"] for r in results], axis=0)
    mass = (priority_of(np.arange(ITEMS)).astype(np.float64) + 1e-6) ** ALPHA
    assert stats.chisquare(counts, counts.sum() * mass / mass.sum()).pvalue > P_MIN, counts
    assert all(r["weight_error"] < 1e-5 for r in results)


@pytest.mark.slow
def test_launch_with_ray(tmp_path_factory):
    """The same two-process mesh, launched as Ray actors (one per node; here both on this one)."""
    import tempfile

    os.environ["RAY_AUTH_MODE"] = "disabled"
    ray = pytest.importorskip("ray")
    from conduit_jax.distributed import multihost

    started = not ray.is_initialized()  # else another module's session: use it, leave it running
    if started:
        ray.init(num_cpus=2, include_dashboard=False, _temp_dir=tempfile.mkdtemp(prefix="ray", dir="/tmp"),
                 log_to_driver=False)
    try:
        out = multihost.launch_with_ray(f"{os.path.abspath(__file__)}:plane_worker", 2, kwargs={"batches": 40},
                                        timeout=240)
    finally:
        if started:
            ray.shutdown()
    assert [r["devices"] for r in out] == [4, 4]
    assert np.sum([r["uniform"] for r in out], axis=0).sum() == 40 * BATCH
