"""Claim: the experience data plane scales beyond one machine.

Two halves, one figure:
  * measured here: a ``DistributedPlane`` with 1, 2 and 4 shard actors on a local Ray cluster (this host's CPU cores,
    shared by every actor and the driver): ingest items/s (1,000-item batches, pipelined calls), sampled batches/s
    (synchronous ``sample()`` and prefetching ``deliver()``), delivery latency (``sample()``: request to a
    device-ready batch) and the latency a learner sees inside ``deliver()`` when its step (modelled as a 5 ms sleep,
    a learner on an accelerator leaves the host cores free) overlaps the shard round trips (prefetch 2 vs none). One
    local ``ExperienceDataPlane`` on one device is the reference.
  * predicted at scale: the placement planner and cost model (``placement.cluster`` preset: DGX H100 nodes, 8 GPUs
    each, 3.2 Tb/s fabric) price one learner iteration's experience path from 8 to 1,024 GPUs under weak scaling
    (per GPU: batch 256, 2,000 items/s ingested, 128 Ki items of capacity), for the planner's best placement (which
    at more than one node picks node-local-first sampling and producer-local ingest: the split DistributedPlane
    implements, each node drawing its share of the batch) and, for contrast, global draws with replicated ingest
    on the same shards (what one sharded ExperienceDataPlane over the whole cluster would do).

Writes experiments/results/scaling.json and scaling.png (``--quick``: scaling_quick.*, so a quick run never replaces
the full results). ``python -m experiments.scaling --quick`` takes ~2 minutes on 2 busy CPU cores (1.5 s per measured
phase); without ``--quick`` each phase runs 4 s (~3-4 minutes). The measured numbers move with the host's load (the
JSON records the load average): this machine's 2 cores are shared.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from conduit_jax import ExperienceDataPlane, default_mesh, placement, samplers

RESULTS = Path(__file__).resolve().parent / "results"
SPEC = {"obs": jax.ShapeDtypeStruct((32,), jnp.float32), "next_obs": jax.ShapeDtypeStruct((32,), jnp.float32),
        "action": jax.ShapeDtypeStruct((), jnp.int32), "reward": jax.ShapeDtypeStruct((), jnp.float32),
        "done": jax.ShapeDtypeStruct((), jnp.bool_)}
CAPACITY = 1 << 16
BATCH = 256
INGEST_BATCH = 1000
LEARNER_STEP_S = 0.005
GPUS = (8, 16, 32, 64, 128, 256, 512, 1024)


def make_batch(n: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    return {"obs": rng.standard_normal((n, 32), np.float32), "next_obs": rng.standard_normal((n, 32), np.float32),
            "action": rng.integers(0, 6, n).astype(np.int32), "reward": rng.standard_normal(n).astype(np.float32),
            "done": rng.random(n) < 0.01}


def _ms(values) -> dict:
    values = np.asarray(values, np.float64) * 1e3
    if values.size == 0:
        return {"median_ms": float("nan"), "p90_ms": float("nan"), "p99_ms": float("nan"), "count": 0}
    return {"median_ms": float(np.median(values)), "p90_ms": float(np.percentile(values, 90)),
            "p99_ms": float(np.percentile(values, 99)), "count": int(values.size)}


def _timed_loop(fn, seconds: float) -> tuple[int, float, list]:
    """Call fn until ``seconds`` pass; returns (calls, elapsed, per-call latencies)."""
    latencies = []
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        t = time.perf_counter()
        fn()
        latencies.append(time.perf_counter() - t)
    return len(latencies), time.perf_counter() - start, latencies


def measure_local(sampler_name: str, seconds: float) -> dict:
    sampler = samplers.uniform(BATCH) if sampler_name == "uniform" else samplers.prioritized(BATCH)
    plane = ExperienceDataPlane(SPEC, CAPACITY, sampler, mesh=default_mesh(1))
    data = make_batch(INGEST_BATCH)
    plane.ingest(data)
    jax.block_until_ready(plane.sample())
    start = time.perf_counter()
    calls, _, _ = _timed_loop(lambda: plane.ingest(data), seconds)
    jax.block_until_ready(plane.state)
    ingest_rate = calls * INGEST_BATCH / (time.perf_counter() - start)
    calls, elapsed, lat = _timed_loop(lambda: jax.block_until_ready(plane.sample()), seconds)
    return {"ingest_items_per_s": ingest_rate, "sample_batches_per_s": calls / elapsed, "sample_latency": _ms(lat)}


def measure_actors(actors: int, sampler_name: str, seconds: float, checkpoint_root: str) -> dict:
    from conduit_jax.distributed import DistributedPlane

    sampler = samplers.uniform(BATCH) if sampler_name == "uniform" else samplers.prioritized(BATCH)
    started = time.perf_counter()
    plane = DistributedPlane(SPEC, CAPACITY, sampler, num_actors=actors, devices_per_actor=1, prefetch=2,
                             checkpoint_every_s=None, actor_options={"num_cpus": 0.01},
                             checkpoint_dir=os.path.join(checkpoint_root, f"{sampler_name}-{actors}"))
    out = {"actors": actors, "sampler": sampler_name, "startup_s": time.perf_counter() - started}
    try:
        data = make_batch(INGEST_BATCH)
        for _ in range(actors):  # warm up: every shard compiles its ingest kernel and a few sample buckets
            plane.ingest(data)
        plane.flush()
        plane.warmup()  # each shard compiles its sample kernels for the share sizes it will see
        rng = np.random.default_rng(0)
        for _ in range(20):  # and its priority-update kernels (one per power-of-two id count)
            d = plane.sample()
            if d.weights is not None:
                plane.update_priorities(np.asarray(d.ids), rng.random(BATCH).astype(np.float32) + 0.1)
        plane.flush()
        # ingest: pipelined calls, then wait for the last one
        start = time.perf_counter()
        calls, _, _ = _timed_loop(lambda: plane.ingest(data), seconds)
        plane.flush()
        out["ingest_items_per_s"] = calls * INGEST_BATCH / (time.perf_counter() - start)
        # synchronous sample(): one round trip to the shards per batch
        calls, elapsed, lat = _timed_loop(plane.sample, seconds)
        out["sample_batches_per_s"] = calls / elapsed
        out["sample_latency"] = _ms(lat)
        # deliver() with prefetch 2 and no learner: the pipelined rate
        calls, elapsed, _ = _timed_loop(plane.deliver, seconds)
        out["deliver_batches_per_s"] = calls / elapsed
        # a learner step of LEARNER_STEP_S between deliveries: exposed latency with and without prefetch
        for depth in (0, 2):
            plane.prefetch = depth
            plane._in_flight.clear()
            exposed = []

            def step(exposed=exposed):
                t = time.perf_counter()
                d = plane.deliver()
                exposed.append(time.perf_counter() - t)
                if d.weights is not None:
                    plane.update_priorities(np.asarray(d.ids), rng.random(BATCH).astype(np.float32) + 0.1)
                time.sleep(LEARNER_STEP_S)

            calls, elapsed, _ = _timed_loop(step, seconds)
            settled = exposed[2:] if len(exposed) > 4 else exposed  # the first calls compile / fill the pipeline
            out[f"learner_loop_prefetch{depth}"] = {"exposed": _ms(settled), "iterations_per_s": calls / elapsed}
        stats = plane.stats()
        out["shard_sizes"] = [s["size"] for s in stats["shards"]]
        out["sample_calls_per_request"] = stats["counters"]["sample_calls"] / stats["counters"]["requests"]
    finally:
        plane.close()
    return out


def predicted(sampler_name: str) -> list[dict]:
    rows = []
    for gpus in GPUS:
        nodes = gpus // 8
        topo = placement.cluster(nodes)
        work = placement.Workload(batch_size=BATCH * gpus, ingest_rate=2000.0 * gpus, step_time=0.01,
                                  sampler=sampler_name)
        capacity = (1 << 17) * gpus
        best = placement.plan(SPEC, capacity, topo, work)
        p = best.placement
        glob = placement.Placement(p.device_ids, p.mesh_shape, p.axis_names, storage=p.storage, index=p.index,
                                   sample_route="global", ingest_route="replicated")
        global_costs = placement.estimate(topo, work, glob, best.row_bytes, capacity)
        rows.append({"gpus": gpus, "nodes": nodes, "batch_size": BATCH * gpus, "capacity": capacity,
                     "best": {"shards": p.num_shards, "mesh": list(p.mesh_shape), "storage": p.storage,
                              "index": p.index, "sample_route": p.sample_route, "ingest_route": p.ingest_route,
                              **best.costs.to_dict()},
                     "global_replicated": global_costs.to_dict()})
    return rows


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.6))
    series = {"uniform": ("o", "-"), "prioritized": ("s", "--")}  # marker and line per sampler, color per metric
    panels = (
        (axes[0], (("ingest_items_per_s", 1e-3, "ingest (k items/s)", "C0"),
                   ("sample_batches_per_s", 1.0, "sample() (batches/s)", "C1"),
                   ("deliver_batches_per_s", 1.0, "deliver(), prefetch 2 (batches/s)", "C2")),
         "measured throughput", "items or batches per s"),
        (axes[1], (("sample_latency", None, "sample() latency", "C1"),
                   ("learner_loop_prefetch0", None, "exposed in deliver(), no prefetch", "C3"),
                   ("learner_loop_prefetch2", None, "exposed in deliver(), prefetch 2", "C2")),
         f"delivery latency (learner step {LEARNER_STEP_S * 1e3:g} ms)", "ms (median)"),
    )
    for ax, metrics, title, ylabel in panels:
        for name, (marker, line) in series.items():
            rows = [r for r in results["measured"] if r["sampler"] == name]
            if not rows:
                continue
            a = [r["actors"] for r in rows]
            for key, scale, label, color in metrics:
                if scale is None:
                    values = [(r[key]["exposed"] if "exposed" in r[key] else r[key])["median_ms"] for r in rows]
                else:
                    values = [r[key] * scale for r in rows]
                ax.plot(a, values, marker=marker, linestyle=line, color=color, label=f"{label}, {name}")
        ax.set_xlabel("shard actors (one host: 2 CPU cores shared by actors and driver)")
        ax.set_xticks([1, 2, 4])
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)

    ax = axes[2]
    for name, color in (("prioritized", "C0"), ("uniform", "C1")):
        rows = results["predicted"].get(name)
        if not rows:
            continue
        g = [r["gpus"] for r in rows]
        ax.plot(g, [r["best"]["total_s"] * 1e6 for r in rows], marker="o", color=color,
                label=f"{name}: planner's best (node-local-first)")
        ax.plot(g, [r["global_replicated"]["total_s"] * 1e6 for r in rows], marker="x", linestyle="--",
                color=color, label=f"{name}: global draws, replicated ingest")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("GPUs (DGX H100 nodes x 8, weak scaling: batch 256 per GPU)")
    ax.set_ylabel("predicted experience path per iteration (us)")
    ax.set_title("cost model, placement.cluster preset")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1.5 s per measured phase instead of 4 s")
    parser.add_argument("--actors", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--samplers", nargs="+", default=["uniform", "prioritized"])
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args(argv)
    seconds = 1.5 if args.quick else 4.0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    import ray

    temp = tempfile.mkdtemp(prefix="ray", dir="/tmp")
    ray.init(num_cpus=max(2, os.cpu_count() or 2), include_dashboard=False, _temp_dir=temp, log_to_driver=False,
             runtime_env={"env_vars": {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}})
    results = {"host": {"platform": platform.platform(), "cpus": os.cpu_count(), "jax": jax.__version__,
                        "ray": ray.__version__, "load_average": os.getloadavg()},
               "settings": {"capacity": CAPACITY, "batch_size": BATCH, "ingest_batch": INGEST_BATCH,
                            "row_bytes": placement.planner.row_bytes_of(SPEC), "phase_s": seconds,
                            "learner_step_s": LEARNER_STEP_S},
               "local": {}, "measured": [], "predicted": {}}
    try:
        with tempfile.TemporaryDirectory(prefix="conduit-scaling-") as root:
            for name in args.samplers:
                results["local"][name] = measure_local(name, seconds)
                print(f"local {name}: {json.dumps(results['local'][name])}", flush=True)
                for actors in args.actors:
                    row = measure_actors(actors, name, seconds, root)
                    results["measured"].append(row)
                    print(f"{actors} actors {name}: ingest {row['ingest_items_per_s']:,.0f} items/s, sample "
                          f"{row['sample_batches_per_s']:.0f} batches/s ({row['sample_latency']['median_ms']:.2f} "
                          f"ms), deliver {row['deliver_batches_per_s']:.0f} batches/s, exposed "
                          f"{row['learner_loop_prefetch0']['exposed']['median_ms']:.2f} -> "
                          f"{row['learner_loop_prefetch2']['exposed']['median_ms']:.2f} ms with prefetch", flush=True)
    finally:
        ray.shutdown()
    for name in args.samplers:
        results["predicted"][name] = predicted(name)
        for r in results["predicted"][name]:
            print(f"predicted {name} {r['gpus']:5d} GPUs: best {r['best']['total_s'] * 1e6:8.1f} us "
                  f"({r['best']['sample_route']}, {r['best']['shards']} shards), global/replicated "
                  f"{r['global_replicated']['total_s'] * 1e6:8.1f} us", flush=True)
    results["host"]["load_average_end"] = os.getloadavg()
    results["settings"]["quick"] = args.quick
    stem = "scaling_quick" if args.quick else "scaling"
    (out / f"{stem}.json").write_text(json.dumps(results, indent=1))
    plot(results, out / f"{stem}.png")
    print(f"wrote {out / (stem + '.json')} and {out / (stem + '.png')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
