"""Checkpoint figures for a ~1 GB plane: save time, how long the plane is blocked, ingest+sample while a save runs,
incremental saves and restore (same shard count and onto 8 shards). Writes benchmarks/results/checkpoint.jsonl.

    python -m benchmarks.bench_checkpoint [--rows 3000000] [--dir /tmp/conduit-ckpt-bench]

Needs ~3x the plane's size in RAM and ~2x on disk; the checkpoint directory is deleted afterwards.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import numpy as np  # noqa: E402

import conduit_jax as cj  # noqa: E402
from conduit_jax import checkpoint  # noqa: E402

RESULTS = os.path.join(os.path.dirname(__file__), "results", "checkpoint.jsonl")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=3_000_000)
    parser.add_argument("--dir", default="/tmp/conduit-ckpt-bench")
    args = parser.parse_args(argv)
    rng = np.random.default_rng(0)

    def rows(n):
        return {"obs": rng.standard_normal((n, 39), np.float32), "act": rng.standard_normal((n, 4), np.float32),
                "rew": rng.standard_normal(n).astype(np.float32), "done": rng.random(n) < 0.01,
                "next_obs": rng.standard_normal((n, 39), np.float32)}

    spec = cj.ExperienceSpec.from_example({k: v[0] for k, v in rows(1).items()})
    plane = cj.ExperienceDataPlane(spec, args.rows, cj.samplers.uniform(256), mesh=cj.default_mesh(1))
    for _ in range(args.rows // 100_000):
        plane.ingest(rows(100_000))
    small = rows(1000)
    plane.sample()
    gb = plane.state.storage.rows.nbytes / 1e9
    records = []

    def record(label, handle, **extra):
        row = {"what": label, "plane_gb": round(gb, 3), "blocked_ms": round(handle.blocked_s * 1e3, 2),
               "total_s": round(handle.total_s, 3), "mb_written": round(handle.bytes / 1e6, 1), **extra}
        records.append(row)
        print(json.dumps(row))

    try:
        record("full save, cold", checkpoint.save(plane, args.dir, max_to_keep=2, block=True))
        record("full save, warm", checkpoint.save(plane, args.dir, max_to_keep=2, block=True))
        idle = []
        for _ in range(50):
            t = time.perf_counter()
            plane.ingest(small)
            jax.block_until_ready(plane.sample())
            idle.append(time.perf_counter() - t)
        handle, cycles = checkpoint.save(plane, args.dir, max_to_keep=2), []
        while not handle.done():
            t = time.perf_counter()
            plane.ingest(small)
            jax.block_until_ready(plane.sample())
            cycles.append(time.perf_counter() - t)
            time.sleep(0.002)
        record("full save while ingest(1000)+sample run", handle.wait(), cycles=len(cycles),
               cycle_median_ms=round(float(np.median(cycles)) * 1e3, 3),
               cycle_max_ms=round(max(cycles) * 1e3, 1), cycle_median_ms_without_save=round(
                   float(np.median(idle)) * 1e3, 3))
        checkpoint.save(plane, args.dir, max_to_keep=4, block=True)
        for _ in range(10):
            plane.ingest(small)
        record("incremental save, 10k new rows",
               checkpoint.save(plane, args.dir, max_to_keep=4, incremental=True, block=True))
        del plane
        for shards in (1, 8):
            timings = {}
            start = time.perf_counter()
            restored = cj.ExperienceDataPlane.restore(args.dir, mesh=cj.default_mesh(shards), timings=timings)
            row = {"what": f"restore onto {shards} shard(s)", "plane_gb": round(gb, 3),
                   "total_s": round(time.perf_counter() - start, 3),
                   **{k: round(v, 3) for k, v in timings.items()}}
            records.append(row)
            print(json.dumps(row))
            del restored
    finally:
        shutil.rmtree(args.dir, ignore_errors=True)
    env = {"date": time.strftime("%Y-%m-%dT%H:%M"), "jax": jax.__version__, "load_average": os.getloadavg()}
    with open(RESULTS, "w") as f:
        for row in records:
            f.write(json.dumps({**row, "env": env}) + "\n")
    print(f"results: {RESULTS}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
