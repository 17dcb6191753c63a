"""Placement sweep: delivery latency per memory kind and shard count on this machine, beside the cost model.

For each shard count S in 1/2/4/8 (emulated CPU devices) and each memory kind of the ring (device, pinned_host,
unpinned_host), one jitted call draws a batch and gathers its rows from a ring ``uint32[capacity, row_words]`` sharded
over S devices, in two patterns:
  * ``global``: the pattern of ``replay.sample`` for uniform / prioritized / epochs: every shard hashes the same
    ``B`` global draws, gathers the rows it owns (all B slots, masked), and one ``psum_scatter`` deals the blocks
    (rows travel with two id words, as in the plane);
  * ``shard-local``: each shard draws ``B / S`` of its own rows (the FIFO pattern, with random rows); no exchange.
A ``pinned_host`` ring is moved to ``device`` inside the jitted function (XLA:CPU cannot gather from pinned_host; the
move is elided in the compiled HLO). The prediction is ``cost.estimate(...).delivery_latency`` for the same placement,
from ``Topology.detect()`` (probed in this process) and from the static ``emulated_cpu`` preset.

Then the planning time of the 1,024-GPU ``cluster()`` preset (128 x DGX H100).

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m benchmarks.bench_placement [--quick]

(the flag is set here when absent, before JAX is imported). JSON lines go to ``benchmarks/results/placement.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

_FLAG = "--xla_force_host_platform_device_count"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" {_FLAG}=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np

from benchmarks import common

KINDS = ("device", "pinned_host", "unpinned_host")
PATTERNS = ("global", "shard-local")
ROW_WORDS = 24  # 96 B rows (W1's 333 B item is 84 words; 24 keeps 1M rows at 96 MB, 3x this host's L3)


def _kernel(mesh, kind: str, pattern: str, batch: int, capacity: int):
    import jax
    import jax.numpy as jnp
    from jax import lax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from conduit_jax.samplers import mix32

    shards = mesh.devices.size
    shard_capacity = capacity // shards
    on_device = NamedSharding(mesh, P("s"), memory_kind="device")

    def hashed(counter, n, salt):
        bits = mix32(mix32(counter ^ jnp.uint32(0x9E3779B9)) + salt + lax.iota(jnp.uint32, n) * jnp.uint32(0x632BE5AB))
        return bits

    def per_shard(rows, counter):
        me = lax.axis_index("s") if shards > 1 else jnp.int32(0)
        if pattern == "global":
            rank = (hashed(counter, batch, jnp.uint32(0)) % jnp.uint32(capacity)).astype(jnp.int32)
            owner, slot = rank % shards, rank // shards
            got = rows.at[slot].get(mode="promise_in_bounds")
            ids = jnp.stack([rank, jnp.zeros_like(rank)], axis=1)
            packed = jnp.concatenate([got, lax.bitcast_convert_type(ids, jnp.uint32)], axis=1)
            if shards > 1:
                packed = jnp.where((owner == me)[:, None], packed, jnp.uint32(0))
                packed = lax.psum_scatter(packed, "s", scatter_dimension=0, tiled=True)
            return packed
        n = batch // shards
        slot = (hashed(counter, n, me.astype(jnp.uint32) * jnp.uint32(7919)) % jnp.uint32(shard_capacity))
        return rows.at[slot.astype(jnp.int32)].get(mode="promise_in_bounds")

    def call(rows, counter):
        if kind == "pinned_host":  # XLA:CPU gathers only from 'device': move inside the jitted function
            rows = jax.device_put(rows, on_device)
        return jax.shard_map(per_shard, mesh=mesh, in_specs=(P("s"), P()), out_specs=P("s"), check_vma=False)(
            rows, counter)

    return jax.jit(call, out_shardings=on_device)


def sweep(capacity: int, batch: int, rounds: int, reps: int, shard_counts, topo_detected, topo_preset):
    import jax
    import jax.numpy as jnp
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    from conduit_jax import placement as pl

    rng = np.random.default_rng(0)
    host_rows = rng.integers(0, 2**32, size=(capacity, ROW_WORDS), dtype=np.uint32)  # random: no zero pages
    records = []
    for shards in shard_counts:
        if shards > jax.device_count():
            print(f"  skipping {shards} shards: only {jax.device_count()} devices", file=sys.stderr)
            continue
        mesh = jax.make_mesh((shards,), ("s",), axis_types=(AxisType.Auto,), devices=jax.devices()[:shards])
        rings = {kind: jax.device_put(host_rows, NamedSharding(mesh, P("s"), memory_kind=kind)) for kind in KINDS}
        ops, compile_s = {}, {}
        for kind in KINDS:
            for pattern in PATTERNS:
                fn = _kernel(mesh, kind, pattern, batch, capacity)
                ring = rings[kind]
                counter = iter(range(1, 1 << 30))
                counters = [jnp.uint32(i) for i in range(64)]  # committed scalars: no host transfer in the loop

                def op(fn=fn, ring=ring, counter=counter, counters=counters):
                    jax.block_until_ready(fn(ring, counters[next(counter) % 64]))

                name = f"{kind}/{pattern}"
                start = time.perf_counter()
                out = fn(ring, counters[0])
                jax.block_until_ready(out)
                compile_s[name] = time.perf_counter() - start
                assert out.sharding.memory_kind == "device" and out.shape[0] == batch, (name, out.shape)
                ops[name] = op
        timings = common.interleaved(ops, rounds=rounds, reps=reps, warmup=5)
        ids = tuple(d.id for d in mesh.devices.flat)
        for name, t in timings.items():
            kind, pattern = name.split("/")
            placement = pl.Placement(ids, (shards,), ("s",), storage=kind, sample_route=pattern)
            work = pl.Workload(batch_size=batch, sampler="uniform", learner_devices=ids)
            predicted = pl.estimate(topo_detected, work, placement, ROW_WORDS * 4, capacity).delivery_latency
            preset = pl.estimate(topo_preset, work, placement, ROW_WORDS * 4, capacity).delivery_latency
            summary = t.summary()
            measured = summary["median_s"]
            records.append({
                "record": "placement_sweep", "shards": shards, "memory_kind": kind, "pattern": pattern,
                "capacity": capacity, "batch": batch, "row_bytes": ROW_WORDS * 4,
                "measured_median_s": measured, "measured_p99_s": summary["p99_s"],
                "round_medians_s": summary["round_medians_s"], "compile_s": compile_s[name],
                "predicted_s": predicted, "rel_error": (predicted - measured) / measured,
                "predicted_preset_s": preset, "rel_error_preset": (preset - measured) / measured,
            })
        del rings
        common.trim_memory()
    return records


def ingest_sweep(capacity: int, chunk: int, rounds: int, reps: int, shard_counts, topo_detected, topo_preset):
    """``replay.ingest`` of ``chunk`` host-packed rows (donated state) into a ring in each memory kind: a plan's
    shardings applied to a real plane's state. A pinned_host state is moved to 'device' at the jitted call's entry
    and back by its out_shardings (the recipe the plane needs for pinned_host; unpinned_host works as it is)."""
    import dataclasses

    import jax
    import jax.numpy as jnp

    from conduit_jax import ExperienceDataPlane, replay, samplers
    from conduit_jax import placement as pl

    spec = {"obs": jax.ShapeDtypeStruct((ROW_WORDS - 1,), jnp.float32), "act": jax.ShapeDtypeStruct((), jnp.int32)}
    leaves = jax.tree_util.tree_leaves({"obs": np.ones((chunk, ROW_WORDS - 1), np.float32),
                                        "act": np.arange(chunk, dtype=np.int32)})
    base = pl.plan(spec, capacity, topo_preset, pl.Workload(batch_size=8, learner_devices=(0,)))
    records = []
    for shards in shard_counts:
        if shards > jax.device_count():
            continue
        ids = tuple(d.id for d in jax.devices()[:shards])
        work = pl.Workload(batch_size=shards, learner_devices=ids, ingest_rate=chunk / 0.01, step_time=0.01)
        at = dataclasses.replace(base, placement=pl.Placement(ids, (shards,), ("shard",)))
        plane = ExperienceDataPlane(spec, capacity, samplers.uniform(shards), mesh=at.mesh())
        config, host_state = plane.config, jax.device_get(plane.state)
        # as plane.ingest does: NumPy leaves packed on the host into one uint32 block, replicated to every shard
        batch = config.layout.pack_host(leaves, 0, chunk, chunk)
        del plane
        ops, states, kernels = {}, {}, {}
        for kind in KINDS:
            plan = dataclasses.replace(at, placement=dataclasses.replace(at.placement, storage=kind))
            shardings = plan.shardings(config)
            to_device = jax.tree_util.tree_map(lambda s: s.with_memory_kind("device"), shardings)

            def ingest(state, batch, n, config=config, to_device=to_device, move=kind == "pinned_host"):
                if move:
                    state = jax.device_put(state, to_device)
                return replay.ingest(config, state, batch, n, packed=True)

            kernels[kind] = jax.jit(ingest, donate_argnums=(0,), out_shardings=shardings)
            states[kind] = jax.device_put(host_state, shardings)

            def op(kind=kind, states=states, kernels=kernels, batch=batch):
                states[kind] = kernels[kind](states[kind], batch, np.int32(chunk))
                jax.block_until_ready(states[kind])

            op()
            assert states[kind].storage.rows.sharding.memory_kind == kind
            ops[kind] = op
        timings = common.interleaved(ops, rounds=rounds, reps=reps, warmup=3)
        for kind, t in timings.items():
            placement = dataclasses.replace(at.placement, storage=kind)
            predicted = pl.estimate(topo_detected, work, placement, ROW_WORDS * 4, capacity).ingest
            preset = pl.estimate(topo_preset, work, placement, ROW_WORDS * 4, capacity).ingest
            measured = t.summary()["median_s"]
            records.append({"record": "ingest_sweep", "shards": shards, "memory_kind": kind, "chunk": chunk,
                            "capacity": capacity, "measured_median_s": measured, "predicted_s": predicted,
                            "rel_error": (predicted - measured) / measured, "predicted_preset_s": preset,
                            "rel_error_preset": (preset - measured) / measured})
        states.clear()
        common.trim_memory()
    return records


def planning_time(repeats: int):
    from conduit_jax import placement as pl

    start = time.perf_counter()
    topo = pl.cluster(128, "dgx_h100", 3200)
    build = time.perf_counter() - start
    work = pl.Workload(batch_size=1024 * 256, sampler="prioritized", ingest_rate=1e7, device_reserve=40 * 10**9)
    times, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = pl.plan(400, 1024 * 1_000_000, topo, work)
        times.append(time.perf_counter() - start)
    return {"record": "planning_time", "topology": topo.name, "devices": len(topo.devices),
            "memories": len(topo.memories), "topology_build_s": build, "plan_median_s": float(np.median(times)),
            "plan_max_s": float(np.max(times)), "repeats": repeats, "candidates": result.considered,
            "chosen": {"mesh": list(result.mesh_shape), "memory": result.memory,
                       "sample_route": result.placement.sample_route, "ingest_route": result.placement.ingest_route,
                       "predicted_total_s": result.costs.total}}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds (CI smoke run)")
    parser.add_argument("--capacity", type=int, default=1 << 20)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--reps", type=int, default=None)
    parser.add_argument("--shards", default="1,2,4,8")
    parser.add_argument("--out", default=None,
                        help="JSON lines (default: benchmarks/results/placement.jsonl, placement.quick.jsonl with "
                             "--quick)")
    args = parser.parse_args(argv)
    rounds = args.rounds or (3 if args.quick else 7)
    reps = args.reps or (10 if args.quick else 25)
    out = args.out or str(common.RESULTS_DIR / ("placement.quick.jsonl" if args.quick else "placement.jsonl"))

    common.configure_runtime()
    from conduit_jax import placement as pl

    start = time.perf_counter()
    detected = pl.Topology.detect()
    detect_s = time.perf_counter() - start
    preset = pl.emulated_cpu(8)
    memcpy = common.memcpy_bandwidth(64 << 20, reps=3)
    env = common.environment(memcpy, {"workload": "placement", "detect_s": detect_s, "probe": dict(detected.probe),
                                      "settings": {"capacity": args.capacity, "batch": args.batch, "rounds": rounds,
                                                   "reps": reps, "row_bytes": ROW_WORDS * 4}})
    print(f"detect(): {detect_s * 1e3:.0f} ms ({detected.source}); probe: "
          + ", ".join(f"{k}={v:.3g}" for k, v in detected.probe))
    shard_counts = [int(s) for s in args.shards.split(",")]
    records = sweep(args.capacity, args.batch, rounds, reps, shard_counts, detected, preset)
    ingests = ingest_sweep(args.capacity, 1024, rounds, max(5, reps // 3),
                           [s for s in shard_counts if s in (1, 8)], detected, preset)
    plan_rec = planning_time(5)

    print(f"\nDelivery latency: batch {args.batch} x {ROW_WORDS * 4} B rows, ring of {args.capacity:,} rows "
          f"({args.capacity * ROW_WORDS * 4 / 1e6:.0f} MB), medians of {rounds} x {reps} interleaved calls")
    print(f"{'shards':>6} {'memory':<14} {'pattern':<12} {'measured':>10} {'model':>10} {'err':>6} "
          f"{'preset':>10} {'err':>6}")
    for r in records:
        print(f"{r['shards']:>6} {r['memory_kind']:<14} {r['pattern']:<12} {r['measured_median_s'] * 1e6:>8.1f}us "
              f"{r['predicted_s'] * 1e6:>8.1f}us {100 * r['rel_error']:>+5.0f}% "
              f"{r['predicted_preset_s'] * 1e6:>8.1f}us "
              f"{100 * r['rel_error_preset']:>+5.0f}%")
    errors = np.abs([r["rel_error"] for r in records])
    preset_errors = np.abs([r["rel_error_preset"] for r in records])
    summary = {"record": "summary", "configs": len(records), "load_average_end": list(os.getloadavg()),
               "within_30pct": int(np.sum(errors <= 0.30)), "median_abs_error": float(np.median(errors)),
               "max_abs_error": float(np.max(errors)),
               "preset_within_30pct": int(np.sum(preset_errors <= 0.30)),
               "preset_median_abs_error": float(np.median(preset_errors))}
    print(f"model (detected): {summary['within_30pct']}/{len(records)} within 30%, median |error| "
          f"{100 * summary['median_abs_error']:.0f}%, max {100 * summary['max_abs_error']:.0f}%; preset: "
          f"{summary['preset_within_30pct']}/{len(records)} within 30%")
    print(f"\nIngest of 1,024 rows (replay.ingest, donated): {'shards':>6} {'memory':<14} measured / model")
    for r in ingests:
        print(f"  {r['shards']:>6} {r['memory_kind']:<14} {r['measured_median_s'] * 1e6:>8.1f}us "
              f"{r['predicted_s'] * 1e6:>8.1f}us {100 * r['rel_error']:>+5.0f}% (preset "
              f"{100 * r['rel_error_preset']:>+4.0f}%)")
    print(f"\nPlanning {plan_rec['topology']} ({plan_rec['devices']} GPUs, {plan_rec['candidates']} candidates): "
          f"median {plan_rec['plan_median_s'] * 1e3:.1f} ms, max {plan_rec['plan_max_s'] * 1e3:.1f} ms "
          f"(topology built in {plan_rec['topology_build_s'] * 1e3:.1f} ms); chose mesh {plan_rec['chosen']['mesh']} "
          f"{plan_rec['chosen']['memory']}")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        f.writelines(json.dumps(rec) + "\n" for rec in [env, *records, *ingests, plan_rec, summary])
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
