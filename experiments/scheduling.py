"""Claim: latency-aware delivery hides the experience path behind the learner step.

For each workload (a learner from experiments/ with fixed settings and seed) the same run is repeated under every
delivery policy (sync, overlap, deferred, adaptive); from each run we take
  * exposed latency: the whole experience path on the learner's thread per delivered batch: its time in
    ``plane.ingest``, ``plane.deliver()`` and ``plane.update_priorities`` (``plane.stats()['exposed_path']``, wall
    clock around each call), median per batch; the wait in ``deliver()`` alone (median) stays as a detail
    (``deliver_us``);
  * iteration latency: the median wall time of one learner iteration (deliver + learner step + whatever the loop does
    between: acting, ingest, priority updates), measured between iterations without extra blocking;
  * the reduction of exposed latency against ``sync`` in %;
  * the paper's condition for its 97% headline: is the learner step (its own compute, blocked, on a ready batch) at
    least as long as the experience path (the exposed latency under ``sync``: everything deliver() puts on the
    critical path when nothing overlaps)?
Workloads: DQN + PER as configured in dqn.py (small network: the learner step is short), the same DQN with a learner
large enough that its step outlasts the experience path (the condition holds), and PPO (epochs of minibatches).

Writes experiments/results/scheduling.json, scheduling.png and scheduling_trace.json (a Chrome / Perfetto trace of
the plane's stages during the large-learner DQN run under ``overlap``); ``--quick`` writes scheduling_quick.* so it
never replaces the full run's results. ``python -m experiments.scheduling --quick``
takes a couple of minutes on 2 CPU cores; without ``--quick`` the runs are long enough to learn.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import time
from pathlib import Path
from typing import Any, Callable, Optional

import jax
import numpy as np

from experiments import SCHEDULES, dqn, ppo

RESULTS = Path(__file__).resolve().parent / "results"
GOAL = 95.0  # % reduction of the exposed path vs sync (issue 39: the whole path, ingest + deliver + update)
GOALS = {"dqn": 95.0, "dqn_large_learner": 95.0, "ppo": 95.0}
ITERATION_GOAL = 0.9  # issue 23: the iteration shorter than sync's by at least this fraction of sync's exposed time


def workloads(quick: bool) -> dict[str, tuple[Callable, Any]]:
    """name -> (make_train, config) of each workload; --quick shortens the runs, never the shapes."""
    dqn_steps, ppo_steps = (4_000, 4_096) if quick else (40_000, 60_000)
    small = dqn.DQNConfig(total_env_steps=dqn_steps)
    # a learner whose step outlasts the experience path on this CPU: 3x wider layers and a 4x larger batch
    large = dataclasses.replace(small, hidden=512, batch_size=256)
    return {
        "dqn": (dqn.make_train, small),
        "dqn_large_learner": (dqn.make_train, large),
        "ppo": (ppo.make_train, ppo.PPOConfig(total_env_steps=ppo_steps)),
    }


TIMED = ("exposed_us", "deliver_us", "deliver_p99_us", "deliver_mean_us", "exposed_first_us", "iteration_us",
         "learner_compute_us", "sample_dispatch_us", "ingest_us", "update_us", "learner_span_us")


def _one_run(name: str, make_train, base, policy: str, seed: int, trace: Optional[Path]) -> dict:
    if policy == "fused":  # sampling inside the learner's jit: plane.sample_fn(), no deliver() at all
        config = dataclasses.replace(base, schedule="sync", fused=True, seed=seed)
    else:
        config = dataclasses.replace(base, schedule=policy, seed=seed)
    train = make_train(config)
    result = train(jax.random.key(seed))
    train.plane.close()  # stops a prefetching schedule's delivery worker before the next run
    if trace is not None:
        trace.parent.mkdir(parents=True, exist_ok=True)
        train.plane.timeline.chrome_trace(str(trace))
    stages = result["stages"]
    deliver = stages.get("exposed", {})  # none for the fused path: sampling is part of the learner step
    path = result["plane_stats"]["exposed_path"]  # ingest + deliver + update on the learner's thread
    return {
        "workload": name, "schedule": policy,
        "exposed_us": path["median_us"] if deliver else None,
        "deliver_us": deliver.get("median_us"), "deliver_p99_us": deliver.get("p99_us"),
        "deliver_mean_us": deliver.get("mean_us"), "exposed_first_us": _first_after_rollout(train.plane, config),
        "iteration_us": result["iteration_us"], "learner_compute_us": result["learner_compute_us"],
        # host time of one sample() call: dispatching a batch, which deliver() does for the refill
        "sample_dispatch_us": stages.get("sample", {}).get("median_us"),
        "ingest_us": stages["ingest"]["median_us"], "update_us": stages.get("update", {}).get("median_us"),
        "learner_span_us": stages.get("learner", {}).get("median_us"),
        "learner_steps": result["learner_steps"], "train_return": result["train_return"],
        "eval_return": result["eval_return"], "prefetch_depth_final": result["plane_stats"]["prefetch_depth"],
        "wall_s": result["wall_s"], "curve": result["curve"], "stages": stages,
    }


def _first_after_rollout(plane, config) -> Optional[float]:
    """PPO: the median exposed time of the first deliver() after each rollout's ingest (the one no prefetch of the
    previous epoch can cover), the first rollout (compilation) left out; None for other learners."""
    per_rollout = getattr(config, "epochs", 0) * getattr(config, "num_minibatches", 0)
    if not per_rollout:
        return None
    spans = [e["dur"] for e in plane.timeline.chrome_trace()["traceEvents"] if e["name"] == "exposed"]
    first = spans[per_rollout::per_rollout]
    return float(np.median(first)) if first else None


def run(quick: bool, seed: int = 0, rounds: int = 1, trace_path: Optional[Path] = None,
        trace_run: tuple[str, str] = ("dqn_large_learner", "overlap")) -> dict:
    """Every (workload, policy) run ``rounds`` times, rounds interleaved (the host is shared: a busy minute then hits
    every policy alike); each timing is the median over rounds, every round's values are kept in ``rounds``."""
    runs: dict[tuple[str, str], list[dict]] = {}
    for round_index in range(rounds):
        for name, (make_train, base) in workloads(quick).items():
            fused = ("fused",) if hasattr(base, "fused") else ()
            for policy in SCHEDULES + fused:
                trace = trace_path if round_index == 0 and (name, policy) == trace_run else None
                row = _one_run(name, make_train, base, policy, seed, trace)
                runs.setdefault((name, policy), []).append(row)
                print(f"  round {round_index}  {name:<18} {policy:<9} exposed {_us(row['exposed_us']):>7} us  "
                      f"iteration {row['iteration_us']:>7.0f} us  return {row['train_return']:>6.1f}  "
                      f"({row['wall_s']:.1f} s)", flush=True)
    rows = [median_over_rounds(per_round, TIMED) for per_round in runs.values()]
    report = {"claim": "exposed experience path (ingest + deliver + update) >= 95% lower than sync when the learner step >= the "
                       "experience path", "quick": quick, "seed": seed, "rounds": rounds,
              "environment": _environment(), "rows": rows}
    return summarize(report)


def median_over_rounds(per_round: list[dict], timed: tuple[str, ...]) -> dict:
    """One row for the repeated runs of a configuration: the first run's fields, each ``timed`` field replaced by its
    median over the runs that measured it (None if none did), and each run's timed fields and returns in ``rounds``."""
    row = dict(per_round[0])
    for key in timed:
        values = [r[key] for r in per_round if r[key] is not None]
        row[key] = float(np.median(values)) if values else None
    row["rounds"] = [{key: r[key] for key in (*timed, "train_return", "eval_return", "wall_s")} for r in per_round]
    return row


def summarize(report: dict) -> dict:
    """Derived columns: reductions against sync, the paper's condition, whether the goal is reached, a verdict."""
    rows = report["rows"]
    for row in rows:
        same = [r for r in rows if r["workload"] == row["workload"]]
        sync = next(r for r in same if r["schedule"] == "sync")
        # the learner step is the same program under every policy: its median over all of them is the best estimate
        # on a shared host (one 20-step measurement can catch a busy moment)
        learner = float(np.median([r["learner_compute_us"] for r in same]))
        row["learner_step_us"] = learner
        row["experience_path_us"] = sync["exposed_us"]
        row["exposed_reduction_pct"] = None if row["exposed_us"] is None else \
            100.0 * (1.0 - row["exposed_us"] / sync["exposed_us"])
        row["iteration_reduction_pct"] = 100.0 * (1.0 - row["iteration_us"] / sync["iteration_us"])
        row["learner_ge_experience_path"] = bool(learner >= sync["exposed_us"])
        goal = GOALS.get(row["workload"], GOAL)
        row["goal_pct"] = goal
        row["goal_reached"] = None if row["exposed_reduction_pct"] is None else \
            row["schedule"] == "sync" or row["exposed_reduction_pct"] >= goal
        # issue 23: what the iteration gains, in units of what sync exposes (goal: >= ITERATION_GOAL)
        row["iteration_gain_of_sync_exposed"] = (sync["iteration_us"] - row["iteration_us"]) / sync["exposed_us"]
    report["verdict"] = verdict(report)
    return report


def _environment() -> dict:
    try:
        from benchmarks.common import environment  # the benchmark harness's record (versions, CPU, load, commit)
        return environment({})
    except Exception:  # noqa: BLE001 - the record is informative only
        return {"python": platform.python_version(), "jax": jax.__version__, "devices": [str(d) for d in jax.devices()],
                "cpu_count": os.cpu_count(), "load_average": list(os.getloadavg()),
                "jax_cpu_enable_async_dispatch": bool(jax.config.read("jax_cpu_enable_async_dispatch"))}


def _us(value) -> str:
    return "n/a" if value is None else f"{value:.0f}"


def _pct(value) -> str:
    return "n/a" if value is None else f"{value:.1f}%"


def format_table(report: dict) -> str:
    lines = [f"{'workload':<18} {'schedule':<9} {'exposed us':>10} {'vs sync':>8} {'dispatch us':>11} {'iter us':>8} "
             f"{'vs sync':>8} {'learner us':>10} {'exp.path us':>11} {'learner>=path':>13} {'goal':>8} "
             f"{'iter gain/exp':>13}"]
    for r in report["rows"]:
        goal = "-" if r["schedule"] == "sync" or r["goal_reached"] is None else ("yes" if r["goal_reached"] else "no")
        lines.append(f"{r['workload']:<18} {r['schedule']:<9} {_us(r['exposed_us']):>10} "
                     f"{_pct(r['exposed_reduction_pct']):>8} {_us(r['sample_dispatch_us']):>11} "
                     f"{r['iteration_us']:>8.0f} {_pct(r['iteration_reduction_pct']):>8} "
                     f"{r['learner_step_us']:>10.0f} {r['experience_path_us']:>11.0f} "
                     f"{'yes' if r['learner_ge_experience_path'] else 'no':>13} "
                     f"{goal + ' ' + str(int(r.get('goal_pct', GOAL))) + '%' if goal != '-' else '-':>8} "
                     f"{r.get('iteration_gain_of_sync_exposed', 0.0):>13.2f}")
    lines.append("exposed: the learner thread's ingest + deliver() + update_priorities per batch (median); dispatch: host "
                 "time of one sample() call (deliver() makes one for "
                 "the refill, on the critical path); learner: the learner step alone on a ready batch "
                 "(median over the workload's runs); exp.path: "
                 "exposed under sync; fused: plane.sample_fn() inside the learner's jit (no deliver(), so no "
                 "exposed time of its own: compare iteration latency); iter gain/exp: (sync iteration - this "
                 f"iteration) / sync exposed, goal >= {ITERATION_GOAL}")
    return "\n".join(lines)


def verdict(report: dict) -> list[str]:
    """Plain statements of where the goals are and are not reached (exposed cut; iteration gain), and why."""
    out = []
    for workload in dict.fromkeys(r["workload"] for r in report["rows"]):
        rows = [r for r in report["rows"] if r["workload"] == workload]
        sync = next(r for r in rows if r["schedule"] == "sync")
        scheduled = [r for r in rows if r["schedule"] not in ("sync", "fused")]
        best = max(scheduled, key=lambda r: r["exposed_reduction_pct"])
        fastest = max(scheduled, key=lambda r: r["iteration_gain_of_sync_exposed"])
        goal = GOALS.get(workload, GOAL)
        both = [r["schedule"] for r in scheduled
                if r["exposed_reduction_pct"] >= goal and r["iteration_gain_of_sync_exposed"] >= ITERATION_GOAL]
        first = "" if best.get("exposed_first_us") is None else \
            (f"; the first deliver() after a rollout exposes {best['exposed_first_us']:.0f} us (sync "
             f"{sync['exposed_first_us']:.0f} us)")
        out.append(f"{workload}: sync exposes {sync['exposed_us']:.0f} us per batch (ingest + deliver + update; learner step "
                   f"{rows[0]['learner_step_us']:.0f} us); best exposed cut {best['schedule']} "
                   f"{best['exposed_reduction_pct']:.1f}% ({best['exposed_us']:.1f} us left; goal {goal:.0f}% "
                   f"{'reached' if best['exposed_reduction_pct'] >= goal else 'NOT reached'}){first}; best iteration "
                   f"{fastest['schedule']} {fastest['iteration_us']:.0f} us vs sync {sync['iteration_us']:.0f} us = "
                   f"{fastest['iteration_gain_of_sync_exposed']:.2f}x sync's exposed time (goal >= {ITERATION_GOAL}: "
                   f"{'reached' if fastest['iteration_gain_of_sync_exposed'] >= ITERATION_GOAL else 'NOT reached'}); "
                   f"both goals by one policy: {', '.join(both) if both else 'none'}"
                   + "".join(f"; fused sampling: iteration {r['iteration_us']:.0f} us" for r in rows
                             if r["schedule"] == "fused"))
    cores = report["environment"].get("cpu_count", "?")
    out.append(
        f"Why the iteration gains less than the exposed cut: the delivery worker (conduit_jax/delivery.py) dispatches, checks and waits for every "
        f"prefetched batch on its own thread, so deliver() is a queue pop. The iteration gains only what runs in "
        f"parallel: on {cores} shared CPU cores XLA:CPU computes a small sample kernel inside its dispatch (on the "
        f"worker's thread, holding the plane's lock the learner's ingest also needs) and the worker's Python shares "
        f"one GIL with the learner's, so the time sync exposed is partly moved, not removed; how much is hidden "
        f"depends on a core being free, which the other processes of this shared host take.")
    return out


def plot(report: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(r["workload"] for r in report["rows"]))
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.6))
    width = 0.16
    for i, policy in enumerate(SCHEDULES + ("fused",)):
        rows = [next((r for r in report["rows"] if r["workload"] == n and r["schedule"] == policy), None)
                for n in names]
        x = np.arange(len(names)) + (i - 2) * width
        axes[0].bar(x, [np.nan if r is None or r["exposed_us"] is None else r["exposed_us"] for r in rows], width,
                    label=policy)
        axes[1].bar(x, [np.nan if r is None else r["iteration_us"] for r in rows], width, label=policy)
    for ax, title in zip(axes[:2], ("exposed experience-path latency (median)", "iteration latency (median)")):
        ax.set_xticks(np.arange(len(names)), names)
        ax.set_ylabel("us")
        ax.set_yscale("log")
        ax.set_title(title)
    axes[0].legend()
    learners = [r for r in report["rows"] if r["workload"] == names[0]]
    for r in learners:
        if r["curve"]:
            curve = np.asarray(r["curve"])
            axes[2].plot(curve[:, 0], curve[:, 1], label=f"{names[0]} {r['schedule']}")
    for r in report["rows"]:
        if r["workload"] == "ppo" and r["curve"]:
            curve = np.asarray(r["curve"])
            axes[2].plot(curve[:, 0], curve[:, 1], "--", label=f"ppo {r['schedule']}")
    axes[2].set_xlabel("env steps")
    axes[2].set_ylabel("episode return")
    axes[2].set_title("learning curves (CartPole; the PPO curves coincide:\nevery policy delivers the same "
                      "minibatches)", fontsize=9)
    axes[2].legend(fontsize=7)
    fig.suptitle(f"Delivery policies on {report['environment'].get('cpu_count', '?')} CPU cores "
                 f"({'quick' if report['quick'] else 'full'} run, seed {report['seed']})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="short runs (a couple of minutes)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=None, help="interleaved repetitions (default 1 quick, 2 full)")
    parser.add_argument("--out", default=str(RESULTS), help="directory for the results")
    parser.add_argument("--from-json", default=None, help="re-summarize and re-plot a saved scheduling.json")
    args = parser.parse_args(argv)
    out = Path(args.out)
    stem = "scheduling_quick" if args.quick else "scheduling"
    start = time.perf_counter()
    if args.from_json:
        with open(args.from_json) as f:
            report = summarize(json.load(f))
    else:
        report = run(args.quick, args.seed, args.rounds or (1 if args.quick else 2), out / f"{stem}_trace.json")
        report["wall_s"] = time.perf_counter() - start
    out.mkdir(parents=True, exist_ok=True)
    with open(out / f"{stem}.json", "w") as f:
        json.dump(report, f, indent=1)
    plot(report, out / f"{stem}.png")
    print()
    print(format_table(report))
    print()
    for line in report["verdict"]:
        print(line)
    print(f"\nwrote {out / stem}.json, .png and _trace.json ({report.get('wall_s', 0):.0f} s)")


if __name__ == "__main__":
    main()
