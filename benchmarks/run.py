"""Run the benchmark suite: ``python -m benchmarks.run [--quick] [--only w1,w2] [--emulated-mesh]``.

  --quick          small capacity (20,000) and few rounds: a CI smoke run, well under a minute on this host; writes
                   benchmarks/results/<workload>.quick.jsonl so it never replaces a full run's results
  --only w1,w2     the workloads to run (default: all)
  --emulated-mesh  give the process 8 emulated CPU devices (XLA_FLAGS) so Conduit also runs on the 8-device mesh:
                   a correctness configuration, slower on a 2-core host; the headline row stays on 1 device
  --capacity N, --rounds R   override the sizes

Each workload prints its tables and writes benchmarks/results/<workload>.jsonl (environment line first).
The exit status is non-zero when a workload fails (a contender that cannot run here is reported, not a failure).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback

WORKLOADS = ("w1", "w2")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--only", default=",".join(WORKLOADS), help="comma-separated workloads (w1,w2)")
    parser.add_argument("--emulated-mesh", action="store_true")
    parser.add_argument("--capacity", type=int)
    parser.add_argument("--rounds", type=int)
    args = parser.parse_args(argv)
    only = [w.strip().lower() for w in args.only.split(",") if w.strip()]
    unknown = [w for w in only if w not in WORKLOADS]
    if unknown:
        parser.error(f"--only: unknown workload(s) {unknown}; choose from {', '.join(WORKLOADS)}")

    if args.emulated_mesh:  # before JAX initialises its backends (nothing above imports jax)
        if "jax" in sys.modules:
            parser.error("--emulated-mesh must be applied before JAX is imported")
        flag = "--xla_force_host_platform_device_count=8"
        if flag not in os.environ.get("XLA_FLAGS", ""):
            os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + flag).strip()

    from benchmarks import bench_w1, bench_w2, common

    common.configure_runtime()
    settings = common.Settings.for_run(args.quick, args.capacity, args.rounds)
    runners = {"w1": bench_w1.run, "w2": bench_w2.run}
    failed = []
    start = time.perf_counter()
    for name in only:
        try:
            runners[name](settings)
        except Exception:
            traceback.print_exc()
            failed.append(name)
        print()
    print(f"suite {'(quick) ' if args.quick else ''}finished in {time.perf_counter() - start:.1f} s"
          + (f"; FAILED: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
