"""What a durable shard's write-ahead log costs an ingest: ``ShardServer.ingest`` (the call a ``DistributedPlane``
shard serves) with ``durable=False``, ``True`` (logged, survives the process) and ``"fsync"`` (flushed to the disk,
survives the host), side by side in interleaved rounds in one process, without Ray in the way (the shard object is
built directly). SAC-sized transitions, batches of 32 and 256. The fsync figure depends on the disk under the
temp folder. Writes benchmarks/results/wal.json.

    python -m benchmarks.bench_wal [--rounds 5] [--reps 200]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

import numpy as np

from benchmarks.common import configure_runtime, environment, interleaved, memcpy_bandwidth

RESULTS = Path(__file__).parent / "results" / "wal.json"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--reps", type=int, default=200)
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args(argv)
    runtime = configure_runtime()
    from conduit_jax import samplers
    from conduit_jax.distributed.ray_plane import ShardServer
    from conduit_jax.spec import ExperienceSpec

    rng = np.random.default_rng(0)

    def transitions(n):
        return {"obs": rng.standard_normal((n, 17), np.float32), "action": rng.standard_normal((n, 6), np.float32),
                "reward": rng.standard_normal(n).astype(np.float32), "done": rng.random(n) < 0.01,
                "next_obs": rng.standard_normal((n, 17), np.float32)}

    spec = ExperienceSpec.from_example({k: v[0] for k, v in transitions(1).items()}).structs
    rows = []
    with tempfile.TemporaryDirectory(prefix="conduit-wal-bench-") as scratch:
        for n in (32, 256):
            batch = transitions(n)
            shards = {durable: ShardServer(0, spec, 1 << 20, samplers.uniform(256), devices=1, durable=durable,
                                           directory=os.path.join(scratch, f"{n}-{durable}"))
                      for durable in (False, True, "fsync")}
            ops = {f"durable={durable}": (lambda s=shard: s.ingest(batch)) for durable, shard in shards.items()}
            timings = interleaved(ops, rounds=args.rounds, reps=args.reps)
            plain, logged, flushed = (timings[f"durable={d}"].summary() for d in (False, True, "fsync"))
            log_bytes = shards[True].log.appended_bytes / (shards[True].inserted // n)
            rows.append({"batch": n, "plain": plain, "durable": logged, "fsync": flushed,
                         "ratio_median": logged["median_s"] / plain["median_s"],
                         "extra_us_median": (logged["median_s"] - plain["median_s"]) * 1e6,
                         "fsync_ratio_median": flushed["median_s"] / plain["median_s"],
                         "fsync_extra_us_median": (flushed["median_s"] - plain["median_s"]) * 1e6,
                         "log_bytes_per_call": log_bytes})
            print(f"batch {n:>4}: ingest {plain['median_s'] * 1e6:7.1f} us plain, {logged['median_s'] * 1e6:7.1f} us "
                  f"durable ({logged['median_s'] / plain['median_s']:.2f}x, {rows[-1]['extra_us_median']:+.1f} us), "
                  f"{flushed['median_s'] * 1e6:7.1f} us fsync ({rows[-1]['fsync_ratio_median']:.2f}x, "
                  f"{rows[-1]['fsync_extra_us_median']:+.1f} us); {log_bytes:,.0f} B logged per call")
    out = {"benchmark": "wal", "environment": environment(memcpy_bandwidth(), {"runtime": runtime}),
           "rounds": args.rounds, "reps": args.reps, "rows": rows}
    Path(args.out).write_text(json.dumps(out, indent=1, default=str))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
