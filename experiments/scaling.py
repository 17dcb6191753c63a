"""Claim: the experience data plane scales beyond one machine.

Three series, one figure:
  * measured here, emulated devices: one ``ExperienceDataPlane`` sharded over ``default_mesh(n)`` for n = 1, 2, 4, 8
    XLA:CPU devices (uniform sampler, batch 256, the same per-item spec as the Ray half): ingest items/s (1,000-item
    batches, pipelined calls) and synchronous ``sample()`` batches/s and latency. JAX reads the device count only when
    it starts, so this half runs in a subprocess started with ``XLA_FLAGS=--xla_force_host_platform_device_count=8``
    (``benchmarks/bench_w6.py``'s flag and device counts), before Ray starts. The 8 devices share this host's cores:
    the curve shows what sharding costs there, not speed-up. The cost model prices the same configurations
    (``placement.emulated_cpu(n)``, global draws, replicated ingest) beside them.
  * measured here, Ray: a ``DistributedPlane`` with 1, 2 and 4 shard actors on a local Ray cluster (this host's CPU
    cores, shared by every actor and the driver): ingest items/s (1,000-item batches, pipelined calls), sampled
    batches/s (synchronous ``sample()`` and prefetching ``deliver()``), delivery latency (``sample()``: request to a
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
the full results); the JSON's ``emulated_devices`` holds the device half (``measured`` and ``predicted`` rows keyed by
``devices``), ``measured`` the Ray rows, ``predicted`` the GPU rows, ``command`` and ``wall_s`` the run. The figure's
caption is the exact command. ``python -m experiments.scaling --quick`` took 125 s on 2 busy CPU cores (1.5 s per
measured phase); the full run (4 s per phase) took 216 s (3.6 min; the device half 35 s of it), load average ~5.
``--actors`` / ``--devices`` with no counts skip that half. The measured numbers move with the host's load (the JSON
records the load average): this machine's 2 cores are shared.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.bench_w6 import DEVICES, FLAG
from conduit_jax import ExperienceDataPlane, default_mesh, placement, samplers
from conduit_jax.replay import DEFAULT_AXIS

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


def measure_local(sampler_name: str, seconds: float, devices: int = 1) -> dict:
    """One ``ExperienceDataPlane`` sharded over ``default_mesh(devices)``: ingest items/s (pipelined 1,000-item calls,
    then a wait for the last) and synchronous ``sample()`` batches/s and latency (each batch blocked on)."""
    sampler = samplers.uniform(BATCH) if sampler_name == "uniform" else samplers.prioritized(BATCH)
    plane = ExperienceDataPlane(SPEC, CAPACITY, sampler, mesh=default_mesh(devices))
    data = make_batch(INGEST_BATCH)
    plane.ingest(data)
    jax.block_until_ready(plane.sample())
    start = time.perf_counter()
    calls, _, _ = _timed_loop(lambda: plane.ingest(data), seconds)
    plane.block_until_ready()
    ingest_rate = calls * INGEST_BATCH / (time.perf_counter() - start)
    calls, elapsed, lat = _timed_loop(lambda: jax.block_until_ready(plane.sample()), seconds)
    return {"ingest_items_per_s": ingest_rate, "sample_batches_per_s": calls / elapsed, "sample_latency": _ms(lat)}


def measure_devices(counts, seconds: float) -> list[dict]:
    """``measure_local`` (uniform) on 1, 2, 4, 8 devices of this process: it must have been started with
    ``XLA_FLAGS=--xla_force_host_platform_device_count=8`` (``run_devices`` does that)."""
    have = jax.device_count()
    if have < max(counts):
        raise SystemExit(f"scaling: this process has {have} JAX device(s), {max(counts)} are needed: start it with "
                         f"XLA_FLAGS={FLAG} (python -m experiments.scaling does, in a subprocess)")
    rows = []
    for n in counts:
        row = {"devices": n, "sampler": "uniform", **measure_local("uniform", seconds, devices=n)}
        rows.append(row)
        print(f"{n} emulated device(s) uniform: ingest {row['ingest_items_per_s']:,.0f} items/s, sample "
              f"{row['sample_batches_per_s']:.0f} batches/s ({row['sample_latency']['median_ms']:.2f} ms)", flush=True)
    return rows


def run_devices(counts, seconds: float) -> dict:
    """The emulated-device half, in a subprocess started with ``XLA_FLAGS=--xla_force_host_platform_device_count=8``
    (JAX reads the flag only when it starts; the Ray half keeps this process's setting)."""
    root = Path(__file__).resolve().parent.parent
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + FLAG).strip()
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = str(root) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    with tempfile.TemporaryDirectory(prefix="conduit-scaling-devices-") as tmp:
        path = Path(tmp) / "devices.json"
        cmd = [sys.executable, "-m", "experiments.scaling", "--devices-worker", str(path), "--phase-s", str(seconds),
               "--devices", *map(str, counts)]
        print(f"emulated devices: `python {' '.join(cmd[1:])}` with XLA_FLAGS={FLAG} in a subprocess", flush=True)
        started = time.perf_counter()
        subprocess.run(cmd, env=env, cwd=root, check=True)
        measured = json.loads(path.read_text())
    return {"sampler": "uniform", "batch_size": BATCH, "ingest_batch": INGEST_BATCH, "counts": list(counts),
            "xla_flags": FLAG, "phase_s": seconds, "wall_s": time.perf_counter() - started,
            "measured": measured, "predicted": predicted_devices(counts)}


def predicted_devices(counts) -> list[dict]:
    """The cost model's price of the measured device configurations: the ``placement.emulated_cpu(n)`` preset, one
    plane sharded over all n devices (ring and index in device memory, global draws, replicated ingest: what
    ``ExperienceDataPlane`` on ``default_mesh(n)`` does), the batch delivered over the same n devices. One iteration
    ingests one 1,000-item call, so ``ingest_s`` prices one measured ingest call and ``delivery_latency`` one
    ``sample()``."""
    rows = []
    for n in counts:
        topo = placement.emulated_cpu(n)
        ids = tuple(d.id for d in topo.devices)[:n]
        work = placement.Workload(batch_size=BATCH, ingest_rate=INGEST_BATCH / 0.01, step_time=0.01,
                                  sampler="uniform", learner_devices=ids)
        where = placement.Placement(ids, (n,), (DEFAULT_AXIS,), storage="device", index="device",
                                    sample_route="global", ingest_route="replicated")
        costs = placement.estimate(topo, work, where, placement.planner.row_bytes_of(SPEC), CAPACITY)
        rows.append({"devices": n, "topology": topo.name, "ingest_items_per_s": INGEST_BATCH / costs.ingest,
                     "sample_batches_per_s": 1.0 / costs.delivery_latency,
                     "sample_latency_ms": costs.delivery_latency * 1e3, "costs": costs.to_dict()})
    return rows


def device_series(devices: dict | None) -> dict:
    """The emulated-device points as plot series, x = device count: measured ingest (k items/s), sample batches/s and
    median sample latency (ms), and the cost model's sample latency and ingest for the same counts. Empty lists when
    the JSON has no device half."""
    devices = devices or {}
    measured = sorted(devices.get("measured") or [], key=lambda r: r["devices"])
    pred = sorted(devices.get("predicted") or [], key=lambda r: r["devices"])
    return {"x": [r["devices"] for r in measured],
            "ingest_k_items_per_s": [r["ingest_items_per_s"] * 1e-3 for r in measured],
            "sample_batches_per_s": [r["sample_batches_per_s"] for r in measured],
            "sample_latency_ms": [r["sample_latency"]["median_ms"] for r in measured],
            "predicted_x": [r["devices"] for r in pred],
            "predicted_ingest_k_items_per_s": [r["ingest_items_per_s"] * 1e-3 for r in pred],
            "predicted_sample_latency_ms": [r["sample_latency_ms"] for r in pred]}


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
            plane.discard_prefetched()
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


def caption(results: dict) -> str:
    """The figure's caption: the exact command, run time and machine (``report.caption_text``), and what the
    emulated-device points are."""
    from experiments.report import caption_text, environment_of

    line = caption_text({"command": results.get("command", "python -m experiments.scaling"),
                         "wall_s": results.get("wall_s"), "environment": environment_of(results)})
    devices = results.get("emulated_devices") or {}
    if devices.get("measured"):
        cpus = (results.get("host") or {}).get("cpus", "?")
        line += (f"\nemulated devices: {max(devices['counts'])} XLA:CPU devices ({devices['xla_flags']}) share this "
                 f"host's {cpus} CPU cores, so the measured device curve shows the sharding overhead, not speed-up; "
                 "the GPU points are cost-model predictions, not measurements")
    return line


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(17, 5.8))
    series = {"uniform": ("o", "-"), "prioritized": ("s", "--")}  # marker and line per sampler, color per metric
    dev = device_series(results.get("emulated_devices"))
    cpus = (results.get("host") or {}).get("cpus", "?")
    dev_style = {"marker": "D", "linestyle": ":"}  # measured on emulated devices
    pred_style = {"marker": "^", "linestyle": "-.", "alpha": 0.6}  # cost model, emulated devices
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
                ax.plot(a, values, marker=marker, linestyle=line, color=color, label=f"{label}, {name}, Ray actors")
        ax.set_xlabel(f"Ray shard actors, or emulated devices of one plane\n(one host: {cpus} CPU cores shared by all)")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks([1, 2, 4, 8], ["1", "2", "4", "8"])
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(alpha=0.3)
    if dev["x"]:
        axes[0].plot(dev["x"], dev["ingest_k_items_per_s"], color="C0", label="ingest (k items/s), uniform, "
                     "emulated devices", **dev_style)
        axes[0].plot(dev["x"], dev["sample_batches_per_s"], color="C1", label="sample() (batches/s), uniform, "
                     "emulated devices", **dev_style)
        axes[1].plot(dev["x"], dev["sample_latency_ms"], color="C1", label="sample() latency, uniform, emulated "
                     "devices", **dev_style)
    if dev["predicted_x"]:
        axes[1].plot(dev["predicted_x"], dev["predicted_sample_latency_ms"], color="C4",
                     label="sample() latency, emulated devices: cost model", **pred_style)
    for ax, room, where in ((axes[0], (1, 8), "upper right"), (axes[1], (8, 1), "lower right")):
        lo, hi = ax.get_ylim()  # log axes: room for the legend above (throughput) or below (latency) the curves
        ax.set_ylim(lo / room[0], hi * room[1])
        ax.legend(fontsize=6.5, loc=where)

    ax = axes[2]
    for name, color in (("prioritized", "C0"), ("uniform", "C1")):
        rows = results["predicted"].get(name)
        if not rows:
            continue
        g = [r["gpus"] for r in rows]
        ax.plot(g, [r["best"]["total_s"] * 1e6 for r in rows], marker="o", color=color,
                label=f"GPUs, {name}: planner's best (node-local-first)")
        ax.plot(g, [r["global_replicated"]["total_s"] * 1e6 for r in rows], marker="x", linestyle="--",
                color=color, label=f"GPUs, {name}: global draws, replicated ingest")
    if dev["x"]:
        ax.plot(dev["x"], [v * 1e3 for v in dev["sample_latency_ms"]], color="C2",
                label="emulated devices, uniform sample(): measured", **dev_style)
    if dev["predicted_x"]:
        ax.plot(dev["predicted_x"], [v * 1e3 for v in dev["predicted_sample_latency_ms"]], color="C4",
                label="emulated devices, uniform sample(): cost model", **pred_style)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("devices\n1-8: emulated CPU devices, measured + cost model (emulated_cpu preset)\n8-1,024: GPUs, "
                  "cost model (placement.cluster: 8 per node, batch 256 per GPU)", fontsize=8.5)
    ax.set_ylabel("us: experience path per iteration (GPUs),\none sample() (emulated devices)")
    ax.set_title("1 -> 8 devices measured, predicted to 1,024 GPUs")
    ax.legend(fontsize=6.5)
    ax.grid(alpha=0.3, which="both")
    fig.text(0.01, 0.01, caption(results), fontsize=7, family="monospace", va="bottom")
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    started = time.perf_counter()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1.5 s per measured phase instead of 4 s")
    parser.add_argument("--actors", type=int, nargs="*", default=[1, 2, 4],
                        help="Ray shard actor counts (default 1 2 4; none: skip the Ray half)")
    parser.add_argument("--devices", type=int, nargs="*", default=list(DEVICES),
                        help="emulated device counts, at most 8 (default 1 2 4 8; none: skip the device half)")
    parser.add_argument("--samplers", nargs="+", default=["uniform", "prioritized"])
    parser.add_argument("--out", default=str(RESULTS))
    parser.add_argument("--phase-s", type=float, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--devices-worker", default=None, help=argparse.SUPPRESS)  # the subprocess of run_devices
    args = parser.parse_args(argv)
    seconds = args.phase_s if args.phase_s is not None else 1.5 if args.quick else 4.0
    if args.devices_worker:
        Path(args.devices_worker).write_text(json.dumps(measure_devices(args.devices, seconds)))
        return 0
    if args.devices and max(args.devices) > 8:
        parser.error("--devices: at most 8 (the subprocess emulates 8 CPU devices)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    from experiments.report import command_line

    results = {"command": command_line("experiments.scaling", argv),
               "host": {"platform": platform.platform(), "cpus": os.cpu_count(), "jax": jax.__version__,
                        "load_average": os.getloadavg(),
                        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")},
               "settings": {"capacity": CAPACITY, "batch_size": BATCH, "ingest_batch": INGEST_BATCH,
                            "row_bytes": placement.planner.row_bytes_of(SPEC), "phase_s": seconds,
                            "learner_step_s": LEARNER_STEP_S},
               "local": {}, "emulated_devices": None, "measured": [], "predicted": {}}
    if args.devices:  # first, before Ray's processes start: a subprocess of its own with 8 emulated devices
        results["emulated_devices"] = run_devices(args.devices, seconds)
    for name in args.samplers:
        results["local"][name] = measure_local(name, seconds)
        print(f"local {name}: {json.dumps(results['local'][name])}", flush=True)
    if args.actors:
        import ray

        temp = tempfile.mkdtemp(prefix="ray", dir="/tmp")
        ray.init(num_cpus=max(2, os.cpu_count() or 2), include_dashboard=False, _temp_dir=temp, log_to_driver=False,
                 runtime_env={"env_vars": {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}})
        results["host"]["ray"] = ray.__version__
        try:
            with tempfile.TemporaryDirectory(prefix="conduit-scaling-") as root:
                for name in args.samplers:
                    for actors in args.actors:
                        row = measure_actors(actors, name, seconds, root)
                        results["measured"].append(row)
                        print(f"{actors} actors {name}: ingest {row['ingest_items_per_s']:,.0f} items/s, sample "
                              f"{row['sample_batches_per_s']:.0f} batches/s "
                              f"({row['sample_latency']['median_ms']:.2f} ms), deliver "
                              f"{row['deliver_batches_per_s']:.0f} batches/s, exposed "
                              f"{row['learner_loop_prefetch0']['exposed']['median_ms']:.2f} -> "
                              f"{row['learner_loop_prefetch2']['exposed']['median_ms']:.2f} ms with prefetch",
                              flush=True)
        finally:
            ray.shutdown()
    for name in args.samplers:
        results["predicted"][name] = predicted(name)
        for r in results["predicted"][name]:
            print(f"predicted {name} {r['gpus']:5d} GPUs: best {r['best']['total_s'] * 1e6:8.1f} us "
                  f"({r['best']['sample_route']}, {r['best']['shards']} shards), global/replicated "
                  f"{r['global_replicated']['total_s'] * 1e6:8.1f} us", flush=True)
    for r in (results["emulated_devices"] or {}).get("predicted", []):
        print(f"predicted {r['devices']} emulated device(s): ingest {r['ingest_items_per_s']:,.0f} items/s, "
              f"sample {r['sample_latency_ms']:.3f} ms", flush=True)
    results["host"]["load_average_end"] = os.getloadavg()
    results["settings"]["quick"] = args.quick
    results["wall_s"] = time.perf_counter() - started
    stem = "scaling_quick" if args.quick else "scaling"
    (out / f"{stem}.json").write_text(json.dumps(results, indent=1))
    plot(results, out / f"{stem}.png")
    print(f"wrote {out / (stem + '.json')} and {out / (stem + '.png')} ({results['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
