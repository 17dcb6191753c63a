"""Claim 3: the placement planner picks where the ring lives; its predicted delivery cost sits beside the measured one.

Delivery latency (one jitted draw + gather of a batch, ready on the device) against batch bytes, for every memory kind
of the ring (``device``, ``pinned_host``, ``unpinned_host``) and shard count (1/2/4/8 emulated CPU devices here, the
devices there are on a GPU host), in both draw patterns of ``benchmarks/bench_placement.py`` (``global``: what
``replay.sample`` does; ``shard-local``: each shard draws its own B/S rows). The measurement and the cost model's
prediction for each configuration are ``benchmarks.bench_placement.sweep`` (imported, not copied), run once per batch
size; the prediction is ``placement.estimate(...).delivery_latency`` for a learner co-located with the shards.

Then the planner (``placement.plan`` on ``Topology.detect()``, uniform sampler, the learner's data-parallel axis over
every device of this process, global draws as ``replay.sample`` does them) chooses shards and memory kind for each
batch size. Its choice is measured the way the plan routes the batch: the same kernel on the chosen shards, then the
batch moved to the learner devices when they are not the shards (``jax.device_put`` to the learners' sharding).
That measured time is set beside the plan's own predicted delivery latency, and beside the fastest configuration that
also delivers to every learner device (the ``S = all devices`` points of the grid), so a wrong choice shows as regret.

Writes ``experiments/results/placement_sweep.json`` and ``.png`` (``--quick``: ``placement_sweep_quick.*``; ``--out``
for another stem, e.g. the GPU script's). ``python -m experiments.placement_sweep --quick`` takes about a minute on 2
CPU cores; the full run (capacity 1 Mi rows, 6 batch sizes, 7 x 25 interleaved calls per point) one to two minutes.
``conduit experiment placement [--quick]`` runs the same.
"""

from __future__ import annotations

import os

_FLAG = "--xla_force_host_platform_device_count"
if _FLAG not in os.environ.get("XLA_FLAGS", "") and "JAX_NUM_CPU_DEVICES" not in os.environ:
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" {_FLAG}=8").strip()

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks import bench_placement, common
from experiments.report import RESULTS, caption_text, command_line, write_result

FULL = {"capacity": 1 << 20, "batches": (16, 64, 256, 1024, 4096, 16384), "shards": (1, 2, 4, 8), "rounds": 7,
        "reps": 25}
QUICK = {"capacity": 1 << 16, "batches": (64, 1024), "shards": (1, 8), "rounds": 2, "reps": 5}
MODEL_TOLERANCE = 0.30  # a prediction within 30% of the measurement counts as right (benchmarks/bench_placement.py)


def _learners():
    import jax
    from jax.sharding import AxisType

    devices = jax.devices()[:8]
    return devices, jax.make_mesh((len(devices),), ("s",), axis_types=(AxisType.Auto,), devices=devices)


def plan_for(batch: int, capacity: int, topology, learner_ids) -> Any:
    """The planner's placement for this batch: uniform draws, learners on ``learner_ids``, no ingest load."""
    from conduit_jax import placement as pl

    work = pl.Workload(batch_size=batch, sampler="uniform", learner_devices=tuple(learner_ids))
    return pl.plan(bench_placement.ROW_WORDS * 4, capacity, topology, work)


def measure_choice(plan, batch: int, capacity: int, rounds: int, reps: int, seed: int) -> dict:
    """The chosen placement measured as the plan routes it: bench_placement's kernel on the plan's shards (ring in
    the plan's storage kind), then the batch moved to the learners' sharding if the learners are other devices."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    learners, learner_mesh = _learners()
    by_id = {d.id: d for d in jax.devices()}
    shards = [by_id[i] for i in plan.device_ids]
    mesh = jax.make_mesh((len(shards),), ("s",), axis_types=(AxisType.Auto,), devices=shards)
    kind = plan.memory["storage"]
    rows = np.random.default_rng(seed).integers(0, 2**32, size=(capacity, bench_placement.ROW_WORDS), dtype=np.uint32)
    ring = jax.device_put(rows, NamedSharding(mesh, P("s"), memory_kind=kind))
    del rows
    fn = bench_placement._kernel(mesh, kind, plan.placement.sample_route, batch, capacity)
    to_learners = NamedSharding(learner_mesh, P("s"), memory_kind="device")
    spread = [d.id for d in shards] != [d.id for d in learners]
    counters = [jnp.uint32(i) for i in range(64)]
    calls = iter(range(1, 1 << 30))

    def op():
        out = fn(ring, counters[next(calls) % 64])
        if spread:
            out = jax.device_put(out, to_learners)
        jax.block_until_ready(out)

    start = time.perf_counter()
    op()
    first_s = time.perf_counter() - start
    timings = common.interleaved({"choice": op}, rounds=rounds, reps=reps, warmup=5)["choice"].summary()
    return {"measured_median_s": timings["median_s"], "measured_p99_s": timings["p99_s"],
            "round_medians_s": timings["round_medians_s"], "first_call_s": first_s, "moved_to_learners": spread}


def summarize(report: dict) -> dict:
    """Model accuracy over the grid, the planner's regret per batch size, and the verdict lines."""
    records = report["records"]
    errors = np.abs([r["rel_error"] for r in records]) if records else np.zeros(0)
    report["model"] = {
        "configs": len(records),
        "within_30pct": int(np.sum(errors <= MODEL_TOLERANCE)),
        "median_abs_error": float(np.median(errors)) if errors.size else None,
        "max_abs_error": float(np.max(errors)) if errors.size else None,
    }
    n_learners = report["settings"]["learner_devices"]
    for row in report["planner"]:
        # what also delivers to every learner: the grid's S = n_learners points (batch lands sharded over them), and
        # the chosen placement as measured (moved to the learners when needed)
        rivals = [r for r in records if r["batch"] == row["batch"] and r["shards"] == n_learners
                  and r["pattern"] == "global"]
        label = row["choice"]["label"] + " (planner)"
        options = [(f"{r['shards']} shard(s), {r['memory_kind']}", r["measured_median_s"]) for r in rivals
                   if f"{r['shards']} shard(s), {r['memory_kind']}" != row["choice"]["label"]]
        options.append((label, row["measured_median_s"]))
        best_label, best_s = min(options, key=lambda x: x[1])
        row["best_for_learners"] = {"label": best_label, "measured_median_s": best_s}
        row["regret"] = row["measured_median_s"] / best_s - 1.0
        row["prediction_error"] = row["predicted_delivery_s"] / row["measured_median_s"] - 1.0
        colocated = [r for r in records if r["batch"] == row["batch"] and r["pattern"] == "global"]
        fastest = min(colocated, key=lambda r: r["measured_median_s"]) if colocated else None
        row["fastest_colocated"] = None if fastest is None else {
            "shards": fastest["shards"], "memory_kind": fastest["memory_kind"],
            "measured_median_s": fastest["measured_median_s"]}
    report["verdict"] = verdict(report)
    return report


def verdict(report: dict) -> list[str]:
    out = []
    m = report["model"]
    if m["configs"]:
        out.append(f"cost model (Topology.detect()): {m['within_30pct']}/{m['configs']} configurations predicted "
                   f"within 30%; median |error| {100 * m['median_abs_error']:.0f}%, max {100 * m['max_abs_error']:.0f}%")
    for row in report["planner"]:
        ok = row["regret"] <= 0.10
        out.append(f"batch {row['batch']} ({row['batch_bytes'] / 1024:.1f} KiB): planner chose {row['choice']['label']}; "
                   f"predicted {row['predicted_delivery_s'] * 1e6:.0f} us, measured {row['measured_median_s'] * 1e6:.0f} us "
                   f"({100 * row['prediction_error']:+.0f}%); fastest option delivering to the "
                   f"{report['settings']['learner_devices']} learner device(s): {row['best_for_learners']['label']} at "
                   f"{row['best_for_learners']['measured_median_s'] * 1e6:.0f} us -> "
                   + ("the choice is the best (within 10%)" if ok else f"regret {100 * row['regret']:+.0f}%"))
    kinds = {}
    for r in report["records"]:
        if r["pattern"] == "global":
            kinds.setdefault((r["batch"], r["shards"]), {})[r["memory_kind"]] = r["measured_median_s"]
    spreads = [max(v.values()) / min(v.values()) - 1 for v in kinds.values() if len(v) > 1]
    if spreads and report.get("environment", {}).get("jax_backend") == "cpu":
        out.append(f"memory kinds on XLA:CPU are one DRAM: across kinds the same (batch, shards) point differs by a "
                   f"median {100 * float(np.median(spreads)):.0f}% (max {100 * float(np.max(spreads)):.0f}%); a "
                   f"memory-kind decision only matters where host and device memory differ (a GPU)")
    return out


def plot(report: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    records = report["records"]
    kinds = [k for k in bench_placement.KINDS if any(r["memory_kind"] == k for r in records)]
    patterns = [p for p in bench_placement.PATTERNS if any(r["pattern"] == p for r in records)]
    shard_counts = sorted({r["shards"] for r in records})
    fig, axes = plt.subplots(len(patterns), len(kinds), figsize=(5.2 * len(kinds), 3.9 * len(patterns) + 0.9),
                             squeeze=False, sharey=True)
    colors = {s: f"C{i}" for i, s in enumerate(shard_counts)}
    for i, pattern in enumerate(patterns):
        for j, kind in enumerate(kinds):
            ax = axes[i][j]
            for s in shard_counts:
                rows = sorted((r for r in records if r["memory_kind"] == kind and r["pattern"] == pattern
                               and r["shards"] == s), key=lambda r: r["batch"])
                if not rows:
                    continue
                x = [r["batch_bytes"] for r in rows]
                ax.plot(x, [r["measured_median_s"] * 1e6 for r in rows], "o-", color=colors[s], label=f"{s} shard(s)")
                ax.plot(x, [r["predicted_s"] * 1e6 for r in rows], "--", color=colors[s], alpha=0.6)
            if pattern == "global":
                for row in report["planner"]:
                    if row["choice"]["storage"] != kind:
                        continue
                    ax.plot(row["batch_bytes"], row["measured_median_s"] * 1e6, "*", color="k", markersize=14,
                            label="planner's choice (measured)" if row is report["planner"][0] else None)
                    ax.plot(row["batch_bytes"], row["predicted_delivery_s"] * 1e6, "x", color="k", markersize=9,
                            label="planner's choice (predicted)" if row is report["planner"][0] else None)
            ax.set_xscale("log", base=2)
            ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v / 1024:g} KiB"))
            ax.set_yscale("log")
            ax.grid(alpha=0.3, which="both")
            ax.set_title(f"ring in {kind}, {pattern} draws", fontsize=10)
            if i == len(patterns) - 1:
                ax.set_xlabel(f"batch bytes (rows of {bench_placement.ROW_WORDS * 4} B)")
            if j == 0:
                ax.set_ylabel("delivery latency (us, median)")
            ax.legend(fontsize=7)
    gpu = " [GPU figure]" if report.get("gpu") else ""
    fig.suptitle(f"Placement sweep{gpu}: solid = measured, dashed = cost model; stars = the planner's choice delivered "
                 f"to {report['settings']['learner_devices']} learner device(s)", fontsize=11)
    fig.text(0.01, 0.01, caption_text(report), fontsize=7, family="monospace", va="bottom")
    fig.tight_layout(rect=(0, 0.06, 1, 0.96))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(settings: dict, seed: int, progress: bool) -> dict:
    import jax

    from conduit_jax import placement as pl

    common.configure_runtime()
    start = time.perf_counter()
    detected = pl.Topology.detect()
    detect_s = time.perf_counter() - start
    gpu = jax.default_backend() == "gpu"
    preset = pl.h200() if gpu else pl.emulated_cpu(jax.device_count())
    learners, _ = _learners()
    learner_ids = [d.id for d in learners]
    shard_counts = [s for s in settings["shards"] if s <= jax.device_count()]
    env = common.environment({}, {"detect_s": detect_s, "probe": dict(detected.probe), "topology": detected.name,
                                  "preset": preset.name})
    records, planner = [], []
    bar = None
    if progress:
        from tqdm.auto import tqdm
        bar = tqdm(total=len(settings["batches"]), desc="placement sweep", unit="batch")
    for batch in settings["batches"]:
        grid = bench_placement.sweep(settings["capacity"], batch, settings["rounds"], settings["reps"], shard_counts,
                                     detected, preset)
        for r in grid:
            r["batch_bytes"] = batch * r["row_bytes"]
        records.extend(grid)
        plan = plan_for(batch, settings["capacity"], detected, learner_ids)
        same = [r for r in grid if r["shards"] == plan.num_shards and r["memory_kind"] == plan.memory["storage"]
                and r["pattern"] == plan.placement.sample_route]
        if list(plan.device_ids) == learner_ids and same:
            # the plan is a grid point already delivering to the learners: its measurement, interleaved with the rivals
            measured = {"measured_median_s": same[0]["measured_median_s"], "measured_p99_s": same[0]["measured_p99_s"],
                        "round_medians_s": same[0]["round_medians_s"], "moved_to_learners": False,
                        "measured_in": "the grid"}
        else:
            measured = measure_choice(plan, batch, settings["capacity"], settings["rounds"], settings["reps"], seed)
            measured["measured_in"] = "a run of its own (the grid kernel on the plan's shards + the move to the learners)"
        choice = {"shards": plan.num_shards, "device_ids": list(plan.device_ids), "storage": plan.memory["storage"],
                  "route": plan.placement.sample_route,
                  "label": f"{plan.num_shards} shard(s), {plan.memory['storage']}"}
        planner.append({"batch": batch, "batch_bytes": batch * bench_placement.ROW_WORDS * 4, "choice": choice,
                        "predicted_delivery_s": plan.costs.delivery_latency, "predicted_total_s": plan.costs.total,
                        "costs": plan.costs.to_dict(), "alternatives": [list(a) for a in plan.alternatives],
                        "reasons": [list(r) for r in plan.reasons], **measured})
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    return {"claim": "the placement planner's choice and its predicted delivery cost, beside the measured delivery "
                     "latency of every memory kind and shard count",
            "gpu": gpu, "seed": seed, "environment": env,
            "settings": {**{k: list(v) if isinstance(v, tuple) else v for k, v in settings.items()},
                         "row_bytes": bench_placement.ROW_WORDS * 4, "learner_devices": len(learner_ids),
                         "kinds": list(bench_placement.KINDS), "shards_measured": shard_counts},
            "records": records, "planner": planner}


def format_table(report: dict) -> str:
    header = (f"{'batch':>6} {'KiB':>7} {'planner choice':<26} {'predicted':>10} {'measured':>10} {'error':>7} "
              f"{'best for learners':<34} {'regret':>7}")
    lines = [header]
    for row in report["planner"]:
        lines.append(f"{row['batch']:>6} {row['batch_bytes'] / 1024:>7.1f} {row['choice']['label']:<26} "
                     f"{row['predicted_delivery_s'] * 1e6:>8.0f}us {row['measured_median_s'] * 1e6:>8.0f}us "
                     f"{100 * row['prediction_error']:>+6.0f}% {row['best_for_learners']['label']:<34} "
                     f"{100 * row['regret']:>+6.0f}%")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small ring, 2 batch sizes, 1 and 8 shards (~1 minute)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the ring's random rows (default 0)")
    parser.add_argument("--capacity", type=int, default=None)
    parser.add_argument("--batches", default=None, help="comma-separated batch sizes (items)")
    parser.add_argument("--shards", default=None, help="comma-separated shard counts")
    parser.add_argument("--kinds", default=None,
                        help="comma-separated memory kinds (default: device,pinned_host,unpinned_host)")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--reps", type=int, default=None)
    parser.add_argument("--out", default=None, help="output stem, without extension (default "
                                                    "experiments/results/placement_sweep[_quick])")
    parser.add_argument("--no-plot", action="store_true")
    parser.add_argument("--no-progress", action="store_true")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    settings = dict(QUICK if args.quick else FULL)
    for key in ("capacity", "rounds", "reps"):
        if getattr(args, key) is not None:
            settings[key] = getattr(args, key)
    if args.batches:
        settings["batches"] = tuple(int(b) for b in args.batches.split(","))
    if args.shards:
        settings["shards"] = tuple(int(s) for s in args.shards.split(","))
    if args.kinds:
        kinds = tuple(args.kinds.split(","))
        unknown = [k for k in kinds if k not in bench_placement.KINDS]
        if unknown:
            print(f"placement_sweep: error: unknown memory kinds {unknown}; use {bench_placement.KINDS}",
                  file=sys.stderr)
            return 2
        bench_placement.KINDS = kinds  # sweep() reads the module's KINDS; this process measures these only
    stem = Path(args.out) if args.out else RESULTS / ("placement_sweep_quick" if args.quick else "placement_sweep")
    start = time.perf_counter()
    report = run(settings, args.seed, progress=not args.no_progress)
    report.update({"quick": args.quick, "command": command_line("experiments.placement_sweep", argv),
                   "wall_s": time.perf_counter() - start})
    summarize(report)
    write_result(report, stem, None if args.no_plot else plot, format_table(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
