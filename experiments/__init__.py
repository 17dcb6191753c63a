"""Experiments: one file per claim, each writing JSON and PNG figures to ``experiments/results/``.

JAX learners that use ``conduit_jax`` the way a user would: ``dqn``, ``ppo``, ``sac`` (on ``envs``, host-driven,
through the plane) and ``jitted`` (DQN, DQN + PER and PPO whose env step, add, sample, priority update and learner
step run in one ``lax.scan`` over the functional ``make_buffer``; Conduit's or Flashbax's buffer, timed by
``benchmarks/bench_w7.py``). The claims:

  * ``rllib_compare``: native RLlib vs Conduit, per-stage breakdown and convergence (claims 1, 2, 5; ``rllib`` extra);
  * ``scheduling``: delivery policies on the JAX learners (claim 2);
  * ``ablation``: baseline / + placement / + scheduling / full on the JAX learners (claim 2);
  * ``placement_sweep``: delivery latency per memory kind and shard count, the planner's choice (claim 3);
  * ``scaling``: 1 -> 8 emulated devices and 1 -> 4 Ray shard actors measured, the cost model up to 1,024 GPUs
    (claim 4);
  * ``gpu``: the breakdown and the placement sweep on one NVIDIA GPU (claim 6);
  * ``report``: ``experiments/REPORT.md``, every result beside the paper's number, from the JSON files.

Run each as ``python -m experiments.<name> --help``, or ``conduit experiment NAME [--quick]`` (``--list`` lists them);
``catalogue.py`` is that list: every experiment's name, script, claim, run times and needs.

The few helpers every learner shares (the ``--schedule`` flag and the latency report) live here.
"""

from __future__ import annotations

import time
from typing import Any, Optional

import numpy as np

from conduit_jax import schedule as schedule_lib

SCHEDULES = ("sync", "staged", "overlap", "deferred", "adaptive")


def make_schedule(name: str, depth: int = 2, k: int = 2) -> schedule_lib.Schedule:
    """The policy behind ``--schedule``: sync | staged | overlap(depth) | deferred(k, depth) | adaptive(max_depth,
    k)."""
    if name == "sync":
        return schedule_lib.sync()
    if name == "staged":
        return schedule_lib.staged()
    if name == "overlap":
        return schedule_lib.overlap(depth)
    if name == "deferred":
        return schedule_lib.deferred(k, depth)
    if name == "adaptive":
        return schedule_lib.adaptive(max(depth, 2), k)
    raise ValueError(f"unknown schedule {name!r}; use one of {', '.join(SCHEDULES)}")


class IterationClock:
    """Wall time per learner iteration, from outside everything (no extra blocking): the time between consecutive
    ``tick()`` calls, kept only once ``warmup`` ticks (compilation) have passed."""

    def __init__(self, warmup: int = 5):
        self.warmup, self.ticks, self.last, self.durations = warmup, 0, None, []

    def tick(self) -> None:
        now = time.perf_counter()
        if self.last is not None and self.ticks > self.warmup:
            self.durations.append(now - self.last)
        self.last, self.ticks = now, self.ticks + 1

    def median_us(self) -> Optional[float]:
        return float(np.median(self.durations) * 1e6) if self.durations else None


def format_stages(stages: dict[str, dict[str, float]]) -> str:
    """``plane.stats()['stages']`` as a small table (microseconds)."""
    lines = [f"    {'stage':<9} {'calls':>7} {'median':>9} {'p99':>9} {'total s':>8}"]
    for stage in ("ingest", "sample", "update", "exposed", "learner"):
        if stage in stages:
            s = stages[stage]
            lines.append(f"    {stage:<9} {s['calls']:>7} {s['median_us']:>9.0f} {s['p99_us']:>9.0f} "
                         f"{s['total_s']:>8.2f}")
    return "\n".join(lines)


def format_result(result: dict[str, Any]) -> str:
    c = result["config"]
    lines = [f"{result['algorithm']} on {c['env']} with schedule={c['schedule']}: {result['env_steps']} env steps, "
             f"{result['learner_steps']} learner steps, {result['wall_s']:.1f} s",
             f"  training return (last episodes) {result['train_return']:.1f}; greedy evaluation "
             f"{result['eval_return']:.1f}",
             f"  iteration latency median {result['iteration_us']:.0f} us; exposed experience-path latency median "
             f"{result['stages'].get('exposed', {}).get('median_us', float('nan')):.0f} us",
             "  plane.stats()['stages'] (us):",
             format_stages(result["stages"])]
    return "\n".join(lines)
