"""Claim 2, the ablation: baseline / + placement / + scheduling / full, on the JAX learners (DQN + PER, PPO).

Each variant is the same learner run (``experiments/dqn.py``, ``experiments/ppo.py``; same config and seed) with the
plane's placement and delivery schedule switched, one at a time:

  * placement ``host`` (the baseline): the ring and the priority index in host memory (``unpinned_host``; on a GPU
    ``experiments/gpu.py`` uses ``pinned_host``, ``--host-kind``) of the
    learner's device, where a host-side replay buffer (RLlib's Python deque) keeps its experience; each batch is
    gathered there and handed to the learner;
  * placement ``planner``: ``placement.plan(spec, capacity, Topology.detect(), workload)`` for this learner (its
    sampler, batch and ingest per step; the learner's data-parallel axis over every device of the process), applied
    with ``plane.replan(plan)`` right after the learner builds its plane. On this 2-core host the planner picks one
    shard (the emulated mesh costs more per call than parallel gathers save) in ``device`` memory;
  * schedule ``sync`` (the baseline) or the learner's scheduled policy: ``deferred`` (prefetch 2, priority updates
    coalesced and applied 2 steps late) for DQN, ``overlap`` (prefetch 2) for PPO, which has no priorities.

Variants: baseline = host + sync; + placement = planner + sync; + scheduling = host + scheduled; full = planner +
scheduled. All four keep the learner on the same device. On XLA:CPU every memory kind is the same DRAM, so the
placement step is expected to make no measurable difference here: the JSON and the report say so when it does not
(a GPU, where host memory sits behind PCIe, is where it matters: ``experiments/gpu.py``).

One more run, ``default_mesh``, is the plane without any plan (``ExperienceDataPlane(...)`` shards over every device:
8 emulated CPU devices, device memory), the alternative the planner actually rejects on this host. It is reported
apart and not used as a baseline: the learners here replicate their networks over the plane's mesh, so that run also
moves the learner step onto 8 emulated devices (its learner-step column shows the cost); its exposed latency (the wait
for the batch only) is the placement's own effect.

What is measured per run (as in ``experiments/scheduling.py``, whose runner this reuses): exposed latency (the
learner thread's ingest + deliver + priority update per batch), iteration latency (median wall time per learner step), the learner step alone on a
ready batch, and a per-step breakdown of the plane's stages. Runs are repeated in interleaved rounds (round r uses
seed + r) and every timing is the median over rounds. The learner step is the same program in the four variants, so
its median change across them is this host's measurement noise: a change smaller than that (or than 5%, or than the
median spread between rounds) is reported as no measurable difference.

Writes ``experiments/results/ablation.json`` and ``ablation.png`` (``--quick``: ``ablation_quick.*``).
``--quick`` makes short runs of 1 round; the full run has 3 rounds of longer runs (``--rounds``; the JSON records its
wall time, ``wall_s``). ``conduit experiment ablation [--quick]`` runs the same.
"""

from __future__ import annotations

import os

_FLAG = "--xla_force_host_platform_device_count"
if _FLAG not in os.environ.get("XLA_FLAGS", "") and "JAX_NUM_CPU_DEVICES" not in os.environ:
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" {_FLAG}=8").strip()

import argparse
import contextlib
import dataclasses
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from experiments.report import RESULTS, caption_text, command_line, learner_breakdown, write_result

VARIANTS = {  # name: (placement, scheduled?)
    "baseline": ("host", False),
    "+placement": ("planner", False),
    "+scheduling": ("host", True),
    "full": ("planner", True),
}
EXTRA = {"default_mesh": ("default", False)}
SCHEDULED = {"dqn": "deferred", "ppo": "overlap"}
HOST_KIND = "unpinned_host"  # the baseline's host memory (experiments/gpu.py uses pinned_host on a GPU)
TIMED = ("exposed_us", "deliver_p99_us", "iteration_us", "learner_compute_us", "sample_dispatch_us", "ingest_us",
         "update_us")
NOISE_FLOOR = 0.05  # changes smaller than this (or than the rounds' own spread) are called "no measurable difference"


def workloads(quick: bool) -> dict[str, tuple[Any, Any]]:
    """name -> (learner module, config); ``--quick`` shortens the runs, never the shapes."""
    from experiments import dqn, ppo

    dqn_steps, ppo_steps = (3_000, 4_096) if quick else (16_000, 16_384)
    return {"dqn": (dqn, dqn.DQNConfig(total_env_steps=dqn_steps)),
            "ppo": (ppo, ppo.PPOConfig(total_env_steps=ppo_steps))}


def planner_workload(name: str, module, config, device_ids, step_time: float = 1e-3):
    """The learner's plane as the planner sees it: (spec, capacity, Workload). ``ingest_rate * step_time`` is the
    items ingested per learner step (the nominal step time cancels out)."""
    from conduit_jax import ExperienceSpec
    from conduit_jax import placement as pl
    from experiments import envs

    obs_dim = envs.make(config.env).obs_dim
    if name == "dqn":
        spec = ExperienceSpec.from_example(module.example_transition(obs_dim))
        sampler = "prioritized" if config.n_step == 1 else "sequences"
        items_per_step = config.items_per_iteration / config.updates_per_iteration
        work = pl.Workload(batch_size=config.batch_size, sampler=sampler, window=max(1, config.n_step),
                           ingest_rate=items_per_step / step_time, step_time=step_time,
                           learner_devices=tuple(device_ids))
        return spec, config.capacity, work
    spec = ExperienceSpec.from_example(module.example_item(obs_dim))
    items_per_step = config.rollout_size / (config.epochs * config.num_minibatches)
    work = pl.Workload(batch_size=config.minibatch_size, sampler="epochs", ingest_rate=items_per_step / step_time,
                       step_time=step_time, learner_devices=tuple(device_ids))
    return spec, config.rollout_size, work


def make_plans(name: str, module, config) -> dict[str, Any]:
    """{'planner': the plan, 'host': the same shards with the storage and the index in ``HOST_KIND`` memory}."""
    import jax

    from conduit_jax import placement as pl

    topology = pl.Topology.detect()
    spec, capacity, work = planner_workload(name, module, config, [d.id for d in jax.devices()])
    plan = pl.plan(spec, capacity, topology, work)
    host = dataclasses.replace(plan, placement=dataclasses.replace(plan.placement, storage=HOST_KIND,
                                                                   index=HOST_KIND))
    return {"planner": plan, "host": host}


def describe(placement: str, plan, devices: int) -> str:
    if placement == "default":
        return f"{devices} shards (no plan: every device), device memory"
    kinds = plan.memory
    return (f"{plan.num_shards} shard{'s' if plan.num_shards > 1 else ''}{' (planner)' if placement == 'planner' else ''}"
            f", storage {kinds['storage']}, index {kinds['index']}")


@contextlib.contextmanager
def planned(module, plan, applied: dict):
    """While active, ``module.make_plane`` (the learner's own plane factory) builds the plane as before and then
    applies ``plan`` with ``plane.replan(plan)``; ``applied`` receives the memory kinds the state really has."""
    if plan is None:
        yield
        return
    original = module.make_plane

    def make_plane(config, obs_dim):
        plane = original(config, obs_dim)
        plane.replan(plan)
        applied["storage_kind"] = plane.state.storage.rows.sharding.memory_kind
        applied["shards"] = plane.num_shards
        return plane

    module.make_plane = make_plane
    try:
        yield
    finally:
        module.make_plane = original


def run_variant(name: str, module, base, placement: str, schedule: str, plans: dict, seed: int) -> dict:
    """One learner run under (placement, schedule); the row of ``scheduling._one_run`` plus the breakdown."""
    import jax

    from experiments import scheduling

    plan = plans.get(placement)
    devices = jax.device_count() if placement == "default" else plan.num_shards
    applied: dict = {}
    with planned(module, plan, applied):
        row = scheduling._one_run(name, module.make_train, dataclasses.replace(base, devices=devices), schedule, seed,
                                  None)
    row["placement"] = placement
    row["placement_label"] = describe(placement, plan, devices)
    row["shards"] = devices
    row["applied"] = applied
    row["breakdown"] = learner_breakdown(row)
    return row


def run(quick: bool, seed: int, rounds: int, only: list[str] | None, extra: bool, progress: bool) -> dict:
    import jax

    loads = {k: v for k, v in workloads(quick).items() if not only or k in only}
    variants = dict(VARIANTS, **(EXTRA if extra else {}))
    runs: dict[tuple[str, str], list[dict]] = {}
    plans = {name: make_plans(name, module, base) for name, (module, base) in loads.items()}
    bar = None
    if progress:
        from tqdm.auto import tqdm
        bar = tqdm(total=rounds * len(loads) * len(variants), desc="ablation", unit="run")
    for r in range(rounds):
        for name, (module, base) in loads.items():
            for variant, (placement, scheduled) in variants.items():
                schedule = SCHEDULED[name] if scheduled else "sync"
                row = run_variant(name, module, base, placement, schedule, plans[name], seed + r)
                row["variant"] = variant
                runs.setdefault((name, variant), []).append(row)
                msg = (f"round {r} {name:<4} {variant:<12} exposed {row['exposed_us'] or float('nan'):>7.0f} us  "
                       f"iteration {row['iteration_us']:>7.0f} us  learner {row['learner_compute_us']:>6.0f} us  "
                       f"({row['wall_s']:.1f} s)")
                if bar is not None:
                    bar.update(1)
                    bar.write(msg)
                else:
                    print(msg, flush=True)
    if bar is not None:
        bar.close()
    from experiments import scheduling

    rows = []
    for per_round in runs.values():
        row = scheduling.median_over_rounds(per_round, TIMED)
        for i, kept in enumerate(row["rounds"]):
            kept["seed"] = seed + i
        row["breakdown"] = learner_breakdown(row)
        rows.append(row)
    from benchmarks.common import environment

    definitions = {v: {"placement": "the planner's plan (Topology.detect())" if p == "planner" else
                       f"host memory: the planner's shards, storage + index in {HOST_KIND}" if p == "host" else
                       f"no plan: every device ({jax.device_count()} shards), device memory (reported apart)",
                       "schedule": " / ".join(f"{w}: {SCHEDULED[w]}" for w in loads) if s else "sync"}
                   for v, (p, s) in variants.items()}
    return {"claim": "exposed and iteration latency: baseline / + placement / + scheduling / full",
            "quick": quick, "seeds": [seed + r for r in range(rounds)], "rounds": rounds,
            "environment": environment({}), "definitions": definitions,
            "plans": {name: {k: {"shards": p.num_shards, "device_ids": list(p.device_ids), "memory": p.memory,
                                 "predicted_total_s": p.costs.total, "reasons": [list(x) for x in p.reasons]}
                             for k, p in ps.items()} for name, ps in plans.items()},
            "rows": rows}


def summarize(report: dict) -> dict:
    """Changes against the baseline, this host's noise, and the verdict."""
    rows = report["rows"]
    for row in rows:
        base = next(r for r in rows if r["workload"] == row["workload"] and r["variant"] == "baseline")
        for key, out in (("exposed_us", "exposed_change"), ("iteration_us", "iteration_change"),
                         ("learner_compute_us", "learner_change")):
            row[out] = None if not row.get(key) or not base.get(key) else row[key] / base[key] - 1.0
    spreads = []
    for row in rows:
        for key in ("exposed_us", "iteration_us"):
            values = [x[key] for x in row.get("rounds", []) if x.get(key)]
            if len(values) > 1:
                spreads.append((max(values) - min(values)) / float(np.median(values)))
    # the learner step is one program in the four variants (same device): its spread is measurement noise
    learner = [abs(r["learner_change"]) for r in rows if r["variant"] in VARIANTS and r["variant"] != "baseline"
               and r.get("learner_change") is not None]
    rounds_noise = float(np.median(spreads)) if spreads else 0.0
    learner_noise = float(np.median(learner)) if learner else 0.0
    report["noise"] = {"threshold": max(NOISE_FLOOR, rounds_noise, learner_noise), "floor": NOISE_FLOOR,
                       "between_rounds": rounds_noise if spreads else None, "learner_step_spread": learner_noise,
                       "what": "a change smaller than this relative threshold counts as no measurable difference: "
                               "the largest of 5%, the median spread between rounds of one variant, and the median "
                               "change of the learner step alone against the baseline (the same program on the same "
                               "device in the four variants)"}
    report["verdict"] = verdict(report)
    return report


def _measurable(change: float | None, noise: float) -> bool:
    return change is not None and abs(change) >= noise


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:+.0f}%"


def verdict(report: dict) -> list[str]:
    noise = report["noise"]["threshold"]
    cpu = (report.get("environment") or {}).get("jax_backend", "cpu") == "cpu"
    out = [f"noise on this host: changes within {100 * noise:.0f}% are not measurable (see noise.what)"]
    for workload in dict.fromkeys(r["workload"] for r in report["rows"]):
        by = {r["variant"]: r for r in report["rows"] if r["workload"] == workload}
        base = by["baseline"]
        parts = [(f"{workload}: baseline ({base['placement_label']}, sync) exposed {base['exposed_us']:.0f} us, "
                 f"iteration {base['iteration_us']:.0f} us")]
        for v in ("+placement", "+scheduling", "full"):
            r = by.get(v)
            if r is not None:
                parts.append(f"{v} exposed {_pct(r['exposed_change'])}, iteration {_pct(r['iteration_change'])}")
        out.append("; ".join(parts))
        p = by.get("+placement")
        if p is not None:
            same = p["placement_label"].split(" (planner)")[0] == base["placement_label"]
            if not _measurable(p["exposed_change"], noise) and not _measurable(p["iteration_change"], noise):
                out.append(f"{workload}: placement makes no measurable difference here: the planner's "
                           f"{p['placement_label']} vs the baseline's host memory: exposed {_pct(p['exposed_change'])}"
                           f", iteration {_pct(p['iteration_change'])}, within the noise"
                           + ("; on XLA:CPU host and device memory are the same DRAM" if cpu else "")
                           + (" (and the planner chose the baseline's placement)" if same else ""))
            else:
                out.append(f"{workload}: the planner's placement changes exposed latency by "
                           f"{_pct(p['exposed_change'])} and iteration latency by {_pct(p['iteration_change'])} "
                           f"against host memory (noise {100 * noise:.0f}%)")
        sc, f = by.get("+scheduling"), by.get("full")
        if sc is not None:
            out.append(f"{workload}: scheduling ({sc['schedule']}) "
                       + (f"changes exposed latency by {_pct(sc['exposed_change'])} and iteration latency by "
                          f"{_pct(sc['iteration_change'])}" if _measurable(sc["exposed_change"], noise) or
                          _measurable(sc["iteration_change"], noise) else
                          f"makes no measurable difference (exposed {_pct(sc['exposed_change'])}, iteration "
                          f"{_pct(sc['iteration_change'])})"))
        if f is not None:
            out.append(f"{workload}: full vs baseline: exposed {_pct(f['exposed_change'])} (paper: up to -97%), "
                       f"iteration {_pct(f['iteration_change'])} (paper: up to -38%)")
        d, pl_ = by.get("default_mesh"), by.get("+placement")
        if d is not None and pl_ is not None and d.get("exposed_us") and pl_.get("exposed_us"):
            out.append(f"{workload}: without a plan the plane shards over every device ({d['placement_label']}): "
                       f"exposed {d['exposed_us']:.0f} us vs {pl_['exposed_us']:.0f} us with the planner's plan "
                       f"({pl_['exposed_us'] / d['exposed_us'] - 1:+.0%}); this is the decision the planner makes on "
                       "this host (the emulated mesh adds per-device dispatch work on 2 cores). Not a baseline: the "
                       f"learner moves with the plane (its step {d['learner_compute_us']:.0f} us vs "
                       f"{pl_['learner_compute_us']:.0f} us)")
    return out


def plot(report: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(r["workload"] for r in report["rows"]))
    variants = list(dict.fromkeys(r["variant"] for r in report["rows"]))
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.9))
    width = 0.8 / len(variants)
    for i, v in enumerate(variants):
        rows = [next((r for r in report["rows"] if r["workload"] == n and r["variant"] == v), None) for n in names]
        x = np.arange(len(names)) + (i - (len(variants) - 1) / 2) * width
        for ax, key in zip(axes, ("exposed_us", "iteration_us", "learner_compute_us")):
            ax.bar(x, [np.nan if r is None or r[key] is None else r[key] for r in rows], width, label=v,
                   hatch="//" if v not in VARIANTS else None)
    titles = ("exposed experience-path latency (median wait in deliver())", "iteration latency (median)",
              "learner step alone on a ready batch")
    for ax, title in zip(axes, titles):
        ax.set_xticks(np.arange(len(names)), names)
        ax.set_ylabel("us")
        ax.set_yscale("log")
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3, axis="y", which="both")
    axes[0].legend(fontsize=8)
    fig.suptitle(f"Ablation on {report['environment'].get('cpu_count', '?')} CPU cores "
                 f"({'quick' if report['quick'] else 'full'} run): baseline = host memory + sync; + placement = "
                 "the planner's plan; + scheduling = deferred (DQN) / overlap (PPO); hatched: no plan (every device,"
                 " reported apart)", fontsize=10)
    fig.text(0.01, 0.01, caption_text(report), fontsize=7, family="monospace", va="bottom")
    fig.tight_layout(rect=(0, 0.05, 1, 0.95))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def format_table(report: dict) -> str:
    header = (f"{'workload':<5} {'variant':<12} {'placement':<52} {'schedule':<9} {'exposed':>8} {'change':>7} "
              f"{'iteration':>9} {'change':>7} {'learner':>8}")
    lines = [header]
    for r in report["rows"]:
        lines.append(f"{r['workload']:<5} {r['variant']:<12} {r['placement_label']:<52} {r['schedule']:<9} "
                     f"{r['exposed_us']:>6.0f}us {_pct(r['exposed_change']):>7} {r['iteration_us']:>7.0f}us "
                     f"{_pct(r['iteration_change']):>7} {r['learner_compute_us']:>6.0f}us")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    global HOST_KIND
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="short runs, 1 round (about a minute)")
    parser.add_argument("--seed", type=int, default=0, help="seed of round 0 (round r uses seed + r)")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved repetitions (default 1 quick, 3 full)")
    parser.add_argument("--only", default=None, help="comma-separated workloads (dqn,ppo)")
    parser.add_argument("--host-kind", default=HOST_KIND, choices=("unpinned_host", "pinned_host"),
                        help=f"the baseline's host memory kind (default {HOST_KIND})")
    parser.add_argument("--no-default-mesh", action="store_true",
                        help="skip the run without a plan (every device; slow on the emulated mesh)")
    parser.add_argument("--out", default=None, help="output stem (default experiments/results/ablation[_quick])")
    parser.add_argument("--no-plot", action="store_true")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    HOST_KIND = args.host_kind
    stem = Path(args.out) if args.out else RESULTS / ("ablation_quick" if args.quick else "ablation")
    start = time.perf_counter()
    report = run(args.quick, args.seed, args.rounds or (1 if args.quick else 3),
                 args.only.split(",") if args.only else None, not args.no_default_mesh, not args.no_progress)
    report.update({"command": command_line("experiments.ablation", argv), "wall_s": time.perf_counter() - start})
    summarize(report)
    write_result(report, stem, None if args.no_plot else plot, format_table(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
