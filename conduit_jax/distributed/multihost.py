"""Multi-host JAX: one ``ExperienceDataPlane`` sharded over a mesh that spans several processes (hosts).

Every process runs the same program (SPMD): it calls ``initialize`` before any other JAX call, builds the plane on
``global_mesh()``, and makes the same plane calls with the same arguments (ingest the same batch, sample, update the
same ids). Each process then holds the rows of a delivered batch that live on its own devices
(``local_rows(delivery.data)``); ``gather`` brings a global array to every process.

What works (checked on CPU with gloo collectives, 2 processes x 2 devices): ingest, sample (uniform and prioritized:
global draws, the one all-gather of shard masses spans the processes), update_priorities, ``len(plane)``.
What does not, in the plane itself: ``plane.stats()`` reads the per-shard cursors with ``jax.device_get`` and fails on
arrays that span processes (use ``stats(plane)`` here), and ``conduit_jax.checkpoint`` is single-process.

Launching. ``launch(target, num_processes)`` starts the processes on this machine (loopback coordinator on a free
port) and ``launch_with_ray(target, num_processes)`` starts them as Ray actors, one per node of the cluster when it has
that many (``SPREAD``); ``target`` is ``"package.module:function"`` or ``"/path/file.py:function"``, called as
``function(process_id, num_processes, **kwargs)`` after ``initialize``; what it returns (JSON-serialisable) comes back
per process. On the CPU backend each process gets ``local_cpu_devices`` devices and gloo collectives.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import socket
import subprocess
import sys
import time
from typing import Any, Optional

ENV_COORDINATOR = "CONDUIT_COORDINATOR"
ENV_NUM_PROCESSES = "CONDUIT_NUM_PROCESSES"
ENV_PROCESS_ID = "CONDUIT_PROCESS_ID"
ENV_LOCAL_DEVICES = "CONDUIT_LOCAL_CPU_DEVICES"
RESULT_PREFIX = "CONDUIT_RESULT "


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now (the coordinator binds it moments later)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def configure_cpu(local_devices: int = 2) -> None:
    """CPU backend settings for a multi-process mesh: gloo cross-process collectives and ``local_devices`` devices
    per process. Call before JAX initialises its backends (before any array is created)."""
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.config.update("jax_num_cpu_devices", int(local_devices))


def initialize(coordinator_address: str, num_processes: int, process_id: int, *,
               local_cpu_devices: Optional[int] = None, timeout_s: int = 120,
               bind_address: Optional[str] = None) -> None:
    """``jax.distributed.initialize`` for one process of the mesh (``local_cpu_devices``: configure the CPU backend
    first, see ``configure_cpu``). Process 0 runs the coordinator service; it listens on ``bind_address`` (default:
    ``coordinator_address`` itself, so a loopback coordinator is reachable from this machine only and a cluster
    one on that interface only; JAX's own default is every interface). Pass ``"[::]:PORT"`` to listen everywhere."""
    import jax

    if local_cpu_devices:
        configure_cpu(local_cpu_devices)
    jax.distributed.initialize(coordinator_address=coordinator_address, num_processes=int(num_processes),
                               process_id=int(process_id), initialization_timeout=timeout_s,
                               coordinator_bind_address=bind_address or coordinator_address)


def global_mesh(axis: str = "shard"):
    """A 1-D mesh over every device of every process, axis type Auto (what ``ExperienceDataPlane`` expects)."""
    import jax
    from jax.sharding import AxisType

    devices = jax.devices()
    return jax.make_mesh((len(devices),), (axis,), axis_types=(AxisType.Auto,), devices=devices)


def gather(x):
    """A global array (or pytree of them) as NumPy on every process (a collective: every process must call it)."""
    from jax.experimental import multihost_utils

    return multihost_utils.process_allgather(x, tiled=True)


def local_rows(x):
    """This process's rows of a batch sharded over the mesh's first axis: the concatenation of its addressable shards
    in index order (NumPy; no communication)."""
    import jax
    import numpy as np

    def one(leaf):
        shards = sorted(leaf.addressable_shards, key=lambda s: s.index[0].start or 0)
        seen, parts = set(), []
        for shard in shards:  # replicated leaves have one shard per device with the same index
            key = (shard.index[0].start, shard.index[0].stop)
            if key not in seen:
                seen.add(key)
                parts.append(np.asarray(shard.data))
        return np.concatenate(parts)

    return jax.tree_util.tree_map(one, x)


def stats(plane) -> dict:
    """The counters of ``plane.stats()`` that work on a mesh spanning processes (collective: call on every process)."""
    cursor, laps = gather((plane.state.storage.cursor, plane.state.storage.laps))
    cap = plane.config.shard_capacity
    inserted = int(sum(int(lap) * cap + int(c) for c, lap in zip(cursor, laps)))
    size = len(plane)
    return {"size": size, "capacity": plane.capacity, "num_shards": plane.num_shards, "items_inserted": inserted,
            "items_overwritten": inserted - size, "sampler": plane.sampler.name}


# ------------------------------------------------------------------------------------------------------------------
# Launching the processes
# ------------------------------------------------------------------------------------------------------------------
def _resolve(target: str):
    module, _, name = target.rpartition(":")
    if not module or not name:
        raise ValueError(f"target must be 'package.module:function' or '/path/file.py:function', got {target!r}")
    if module.endswith(".py"):
        spec = importlib.util.spec_from_file_location(f"_conduit_target_{abs(hash(module))}", module)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    else:
        mod = importlib.import_module(module)
    return getattr(mod, name)


def run_worker(target: str, process_id: int, num_processes: int, coordinator: str, local_cpu_devices: int,
               kwargs: Optional[dict] = None) -> Any:
    """One process of a launch: initialise the mesh, call the target, shut the distributed runtime down."""
    import jax

    initialize(coordinator, num_processes, process_id, local_cpu_devices=local_cpu_devices)
    try:
        return _resolve(target)(process_id, num_processes, **(kwargs or {}))
    finally:
        jax.distributed.shutdown()


def launch(target: str, num_processes: int = 2, *, local_cpu_devices: int = 2, kwargs: Optional[dict] = None,
           timeout: float = 300.0, env: Optional[dict] = None) -> list:
    """Run ``target`` in ``num_processes`` local Python processes forming one mesh (coordinator on 127.0.0.1);
    returns each process's result, process order. Raises ``RuntimeError`` with the processes' output tails when one
    fails or the launch runs past ``timeout``."""
    coordinator = f"127.0.0.1:{free_port()}"
    base = {**os.environ, **(env or {})}
    base.setdefault("JAX_PLATFORMS", "cpu")
    base.pop("XLA_FLAGS", None)  # an emulated device count would fight jax_num_cpu_devices
    procs = []
    for i in range(num_processes):
        cmd = [sys.executable, "-c", "import sys; from conduit_jax.distributed.multihost import process_main; "
               "sys.exit(process_main(sys.argv[1:]))", target, json.dumps(kwargs or {})]
        proc_env = {**base, ENV_COORDINATOR: coordinator, ENV_NUM_PROCESSES: str(num_processes),
                    ENV_PROCESS_ID: str(i), ENV_LOCAL_DEVICES: str(local_cpu_devices)}
        procs.append(subprocess.Popen(cmd, env=proc_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    deadline = time.monotonic() + timeout
    outputs = []
    failed = False
    for proc in procs:
        try:
            out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            out, err = proc.communicate()
            failed = True
        outputs.append((proc.returncode, out, err))
        failed |= proc.returncode != 0
    if failed:
        tails = "\n".join(f"--- process {i} (rc={rc}) ---\n{out[-2000:]}\n{err[-3000:]}"
                          for i, (rc, out, err) in enumerate(outputs))
        raise RuntimeError(f"launch({target!r}, {num_processes}): a process failed or timed out\n{tails}")
    results = []
    for _, out, _ in outputs:
        lines = [line for line in out.splitlines() if line.startswith(RESULT_PREFIX)]
        results.append(json.loads(lines[-1][len(RESULT_PREFIX):]) if lines else None)
    return results


class _MeshProcess:
    """A Ray actor body: one process of a multi-host mesh."""

    def address(self) -> str:
        import ray

        return ray.util.get_node_ip_address()

    def port(self) -> int:
        import ray

        return free_port(ray.util.get_node_ip_address())  # the coordinator binds this address only

    def run(self, target: str, process_id: int, num_processes: int, coordinator: str, local_cpu_devices: int,
            kwargs: Optional[dict]):
        return run_worker(target, process_id, num_processes, coordinator, local_cpu_devices, kwargs)


def launch_with_ray(target: str, num_processes: int = 2, *, local_cpu_devices: int = 2,
                    kwargs: Optional[dict] = None, timeout: float = 300.0, actor_options: Optional[dict] = None,
                    strategy: str = "SPREAD") -> list:
    """Like ``launch`` with the processes as Ray actors (a placement group of ``num_processes`` bundles, spread over
    the nodes): the first one's node hosts the coordinator. Each actor is a fresh process, so JAX is configured
    before its backends start. Needs ``ray.init`` first."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    options = {"num_cpus": 0.5, **(actor_options or {})}
    bundle = {"CPU": options["num_cpus"]}
    group = placement_group([dict(bundle) for _ in range(num_processes)], strategy=strategy)
    ray.get(group.ready(), timeout=timeout)
    env = {"JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu"), "XLA_FLAGS": ""}
    actors = [ray.remote(_MeshProcess).options(
        **options, scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=i),
        runtime_env={"env_vars": env}).remote() for i in range(num_processes)]
    try:
        host = ray.get(actors[0].address.remote(), timeout=timeout)
        port = ray.get(actors[0].port.remote(), timeout=timeout)
        coordinator = f"{host}:{port}"
        refs = [a.run.remote(target, i, num_processes, coordinator, local_cpu_devices, kwargs)
                for i, a in enumerate(actors)]
        return ray.get(refs, timeout=timeout)
    finally:
        for a in actors:
            ray.kill(a)
        remove_placement_group(group)


def process_main(argv: list[str]) -> int:
    target, kwargs = argv[0], json.loads(argv[1]) if len(argv) > 1 else {}
    result = run_worker(target, int(os.environ[ENV_PROCESS_ID]), int(os.environ[ENV_NUM_PROCESSES]),
                        os.environ[ENV_COORDINATOR], int(os.environ.get(ENV_LOCAL_DEVICES, "2")), kwargs)
    print(RESULT_PREFIX + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(process_main(sys.argv[1:]))
