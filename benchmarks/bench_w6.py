"""W6: W1 (SAC transitions, capacity 1,000,000, uniform sample of 256, add chunks of 1,000) on a plane sharded over
1, 2, 4 and 8 devices: a scaling table.

THIS IS A CORRECTNESS CONFIGURATION ON THIS HOST. The devices are XLA:CPU devices emulated with
``XLA_FLAGS=--xla_force_host_platform_device_count=8`` on a 2-core machine: every "device" shares the same two cores
and the same DRAM, so a sharded plane only adds work (per-shard kernels, the all-gather of shard sizes, the
reduce-scatter that deals the batch) and no parallelism. The table measures that overhead, not how Conduit scales on
real multi-device hosts; ARCHITECTURE.md expects sampling on 8 emulated devices to be several times slower.

The device count must be set before JAX starts: ``run()`` re-runs this module in a subprocess with the flag when the
current process has fewer than 8 devices (``python -m benchmarks.run --only w6`` sets it in-process instead).

    python -m benchmarks.bench_w6 [--quick] [--capacity N] [--rounds R]
"""

from __future__ import annotations

import os
import sys

DEVICES = (1, 2, 4, 8)
FLAG = "--xla_force_host_platform_device_count=8"


def _label(n: int) -> str:
    return "conduit[1dev]" if n == 1 else f"conduit[{n}dev-emulated]"


def entries(settings):
    from benchmarks import common, peers
    from benchmarks.bench_w1 import W1_SPEC

    spec, cap, b = W1_SPEC, settings.capacity, settings.batch_size
    out = [common.Entry(_label(n), lambda n=n: peers.Conduit(spec, cap, b, devices=n, chunk=settings.chunk))
           for n in DEVICES]
    out.append(common.Entry("numpy", lambda: peers.NumpyRing(spec, cap, b)))
    return out


def scaling_table(records: list[dict]) -> str:
    timings = {(r["metric"], r["contender"]): r for r in records if r.get("record") == "timing"}
    metrics = sorted({m for m, _ in timings}, key=lambda m: (not m.startswith("sample"), m))
    header = f"{'devices':>7} " + " ".join(f"{m + ' median us':>24} {'vs 1 dev':>9}" for m in metrics)
    lines = ["w6 scaling (emulated CPU devices on 2 cores: a correctness configuration, not a speed one)", header,
             "-" * len(header)]
    for n in DEVICES:
        cells = []
        for m in metrics:
            r, base = timings.get((m, _label(n))), timings.get((m, _label(1)))
            median = "" if r is None else f"{r['median_s'] * 1e6:.1f}"
            ratio = "" if r is None or base is None else f"{r['median_s'] / base['median_s']:.2f}x"
            cells.append(f"{median:>24} {ratio:>9}")
        lines.append(f"{n:>7} " + " ".join(cells))
    for m in metrics:
        r = timings.get((m, "numpy"))
        if r is not None:
            lines.append(f"  numpy {m}: {r['median_s'] * 1e6:.1f} us (reference, same run)")
    return "\n".join(lines)


def _in_subprocess(settings) -> list[dict]:
    from benchmarks import common

    flags = (os.environ.get("XLA_FLAGS", "") + " " + FLAG).strip()
    common.run_workload_module("w6", ["--capacity", str(settings.capacity), "--rounds", str(settings.rounds)]
                               + (["--quick"] if settings.quick else []),
                               f"this process has fewer than 8 JAX devices; XLA_FLAGS={FLAG}", {"XLA_FLAGS": flags})
    path = common.RESULTS_DIR / ("w6.quick.jsonl" if settings.quick else "w6.jsonl")
    return common.read_jsonl(path)[1]


def run(settings) -> list[dict]:
    import jax

    from benchmarks import common, peers
    from benchmarks.bench_w1 import W1_SPEC, add_op

    common.configure_runtime("w6")  # before the device count below starts the backend
    if jax.device_count() < max(DEVICES):
        return _in_subprocess(settings)
    import numpy as np

    rng = np.random.default_rng(6)
    pools = {"chunks": [peers.random_batch(W1_SPEC, settings.chunk, rng) for _ in range(16)]}
    b = settings.batch_size
    metrics = [
        common.Metric(f"sample_b{b}", f"uniform sample, batch {b} (ready)", "samples/s", b,
                      lambda c, pools: (lambda: c.sample(b)), reps=settings.sample_reps),
        common.Metric(f"add_chunk{settings.chunk}", f"add, chunks of {settings.chunk:,} items", "items/s",
                      settings.chunk, add_op, reps=settings.add_reps, first_from_fill=True),
    ]
    goals = [common.Goal("W6 zero recompiles after warm-up (1-device sample)", "recompiles", f"sample_b{b}", 0)]
    notes = {
        "correctness_configuration": "emulated XLA:CPU devices on a 2-core host share the cores and the DRAM: the "
                                     "sharded rows measure the overhead of sharding, not multi-device scaling",
        "x/conduit": "contender time / conduit[1dev] time = slowdown against one device",
    }
    records = common.run_workload(
        "w6", f"W1 on 1/2/4/8 emulated devices, capacity {settings.capacity:,}, batch {b}", W1_SPEC, settings,
        entries(settings), metrics, pools=pools, notes=notes, goals=goals,
        env_extra={"correctness_configuration": True})
    print()
    print(scaling_table(records))
    return records


def main(argv=None):
    if FLAG.split("=")[0] not in os.environ.get("XLA_FLAGS", "") and "jax" not in sys.modules:
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + FLAG).strip()
    from benchmarks import common

    parser = common.workload_parser(__doc__)
    args = parser.parse_args(argv)
    settings = common.Settings.for_run(args.quick, args.capacity, args.rounds)
    if settings.capacity % max(DEVICES):
        parser.error(f"--capacity must be a multiple of {max(DEVICES)} (the 8-device mesh)")
    run(settings)


if __name__ == "__main__":
    main()
