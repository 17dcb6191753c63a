"""Native RLlib vs the Conduit path on the same seeds (CartPole, Pendulum): where an iteration goes, and convergence.

Up to three configurations of RLlib 2.60 (new API stack, torch learner, local learner and env runner) per algorithm
(``--paths``; DQN and SAC run all three, PPO the first two):

DQN with prioritized replay on CartPole-v1 (``--algo dqn``, the default):

* ``native``: ``PrioritizedEpisodeReplayBuffer`` (episodes in a Python deque, segment trees) and RLlib's learner
  connector pipeline turning the sampled 1-step episodes into a torch batch.
* ``conduit``: ``conduit_rllib.ConduitPrioritizedEpisodeReplayBuffer`` with ``deliver="torch"`` (steps in Conduit's
  functional core, n-step and PER by its kernels, RLlib's buffer contract) and ``ConduitDQNTorchLearner`` (the batch
  reaches torch through DLPack), ``schedule="sync"``.
* ``conduit_scheduled``: the same with ``schedule=--schedule`` (default ``overlap``: the next batch is drawn right
  after each priority update, while RLlib's training step samples the env and adds; RLlib's code is unchanged).
* ``type_swap`` (only with ``--paths``; also for SAC): nothing changed but the buffer's type string,
  ``conduit_rllib.ConduitPrioritizedEpisodeReplayBuffer`` with its defaults (``deliver="episodes"``,
  ``schedule="sync"``), and RLlib's own learner and connector pipeline (SAC: in ``ConduitSACConfig``, whose
  validation accepts the Conduit type).

PPO on CartPole-v1 (``--algo ppo``):

* ``native``: RLlib's learner connector pipeline with its NumPy GAE piece, then ``MiniBatchCyclicIterator``.
* ``conduit``: ``ConduitPPOTorchLearner``: GAE in JAX, epoch minibatches delivered by a plane through DLPack.

SAC on Pendulum-v1 (``--algo sac``):

* ``native``: RLlib's ``SACConfig`` with its default replay buffer, ``PrioritizedEpisodeReplayBuffer`` (alpha 0.6,
  beta 0.4), and RLlib's learner connector pipeline.
* ``conduit``: ``conduit_rllib.ConduitSACConfig`` with ``ConduitPrioritizedEpisodeReplayBuffer`` (same alpha, beta,
  ``deliver="torch"``) and ``ConduitSACTorchLearner``.

Both SAC paths share every other setting (RLlib's defaults except: 128x128 networks, batch 128, 3-step returns,
critic / alpha learning rates 8e-4 / 9e-4 as in RLlib's tuned Pendulum example and actor 3e-4, rollout fragments of
4 steps and ``training_intensity`` 64, i.e. one update per 2 env steps, learning from step 1000).

All paths use ``metrics_num_episodes_for_smoothing=10`` (``--smoothing``) so the returns follow learning closely.

Each iteration (one ``algo.train()``) is split, from counters read before and after it, into:

* ``buffer_add``, ``buffer_sample``, ``priority_update``: the replay buffer's calls (RLlib's own timers cover the same
  calls; these are exact sums per iteration, not RLlib's smoothed values);
* ``to_batch``: the learner turning what it was given into its torch train batch (RLlib: the learner connector
  pipeline, PPO's GAE included; Conduit DQN / SAC: DLPack; Conduit PPO: RLlib's pieces + GAE in JAX);
* ``minibatching``: building and running the minibatch iterator (RLlib: slicing, shuffling, concatenating; Conduit
  PPO: ingest into the plane, epoch deliveries, DLPack);
* ``learner_update``: forward, loss, backward and optimizer step (``Learner._update``);
* ``other``: the rest of the iteration (env runner sampling, weight sync, metrics, RLlib bookkeeping).

The experience path is ``buffer_add + buffer_sample + priority_update + to_batch + minibatching``; its share of the
iteration time is reported per configuration. Every part is timed on the training thread, so it is the exposed
experience path: with ``conduit_scheduled`` the prefetched batch's kernel runs outside these calls, and what stays
in them is dispatch and any wait for that batch. Runs alternate between the
two configurations (same seed, one Ray session) to share the machine's noise; the first ``--warmup`` iterations
(compilation, learning start) are not in the breakdown (their returns are in the learning curves).

Convergence: every iteration records ``episode_return_mean`` (RLlib's mean over the last ``--smoothing`` episodes)
and ``num_env_steps_sampled_lifetime``. ``summary.convergence`` has, per path, each seed's final return (the mean of
the last ``--final-iterations`` iterations' returns), their mean and sample standard deviation, a Welch t-test
(t, Welch-Satterthwaite dof, two-sided p) native vs conduit, and every run's learning curve.

Output: ``--out FILE`` (default ``experiments/results/rllib_compare_<algo>.json``, ``..._<algo>_quick.json`` with
``--quick``; quick files are git-ignored) and a PNG next to it (learning curves, mean over seeds with the min-max
band, against env steps; the median per-part breakdown as stacked bars; the command line in the caption). One
progress line per iteration. ``--from-json FILE`` re-summarizes and re-plots a saved result.

``--quick`` runs 1 seed of both paths. Each result file records its run's wall time (``wall_s``; ``conduit
experiment --list`` shows it). The full results in ``experiments/results/rllib_compare_<algo>.json|png|log`` came
from (PPO: 3 seeds x 2 paths; SAC: 5 seeds x 3 paths; DQN: 5 seeds x 4 paths)

* ``python -m experiments.rllib_compare --algo sac --seeds 0 1 2 3 4 --schedule adaptive``: 12 x 1000 env steps per
  run (500 updates of 128 per iteration);
* ``python -m experiments.rllib_compare --algo dqn --seeds 0 1 2 3 4 --iterations 14 --schedule adaptive --paths
  native conduit conduit_scheduled type_swap``: 16 x 1000 env steps per run (250 updates of 32);
* ``python -m experiments.rllib_compare --algo ppo``: 18 x 4000 env steps per run (10 epochs of 128-row
  minibatches).

What they measured is in ``experiments/REPORT.md`` (``python -m experiments.report``), from those files.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# conduit: schedule "sync"; conduit_scheduled: --schedule; type_swap (DQN / SAC, only with --paths): RLlib's learner
PATHS = ("native", "conduit", "conduit_scheduled", "type_swap")
DEFAULT_PATHS = PATHS[:3]
CONDUIT_PATHS = PATHS[1:]
# what the paper reports on 8x A100 (issue #6): experience-path share of the iteration, and the DQN iteration latency
PAPER = {"experience_path_share": {"dqn": 0.502, "ppo": 0.262}, "iteration_latency_change": {"dqn": -0.38}}
PARTS = ("buffer_add", "buffer_sample", "priority_update", "to_batch", "minibatching", "learner_update", "other")
EXPERIENCE = ("buffer_add", "buffer_sample", "priority_update", "to_batch", "minibatching")
ENVS = {"dqn": "CartPole-v1", "ppo": "CartPole-v1", "sac": "Pendulum-v1"}
RESULTS = Path(__file__).resolve().parent / "results"


def _timed_classes():
    """Buffer and learner subclasses that add up the seconds of the calls the breakdown needs."""
    from conduit_rllib import (
        ConduitDQNTorchLearner,
        ConduitPPOTorchLearner,
        ConduitSACTorchLearner,
    )
    from ray.rllib.algorithms.dqn.torch.dqn_torch_learner import DQNTorchLearner
    from ray.rllib.algorithms.ppo.torch.ppo_torch_learner import PPOTorchLearner
    from ray.rllib.algorithms.sac import SACConfig
    from ray.rllib.algorithms.sac.torch.sac_torch_learner import SACTorchLearner
    from ray.rllib.utils.replay_buffers.prioritized_episode_buffer import (
        PrioritizedEpisodeReplayBuffer,
    )

    class TimedPrioritizedEpisodeReplayBuffer(PrioritizedEpisodeReplayBuffer):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.timings = {"add": 0.0, "sample": 0.0, "update_priorities": 0.0}

        def _timed(self, name, fn, *args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.timings[name] += time.perf_counter() - start

        def add(self, *args, **kwargs):
            return self._timed("add", super().add, *args, **kwargs)

        def sample(self, *args, **kwargs):
            return self._timed("sample", super().sample, *args, **kwargs)

        def update_priorities(self, *args, **kwargs):
            return self._timed("update_priorities", super().update_priorities, *args, **kwargs)

    class TimedBufferSACConfig(SACConfig):
        """RLlib's ``SACConfig`` (builds RLlib's ``SAC``); its validation accepts only RLlib's four episode buffer
        names, so the timed buffer is validated as the ``PrioritizedEpisodeReplayBuffer`` it is."""

        def validate(self) -> None:
            kind = self.replay_buffer_config["type"]
            self.replay_buffer_config["type"] = "PrioritizedEpisodeReplayBuffer"
            try:
                super().validate()
            finally:
                self.replay_buffer_config["type"] = kind

    def timed_learner(base):
        class Timed(base):
            def build(self):
                super().build()
                self.seconds = {"to_batch": 0.0, "minibatching": 0.0, "learner_update": 0.0}

            def _create_iterator_if_necessary(self, **kwargs):
                start, before = time.perf_counter(), self.seconds["to_batch"]
                iterator = super()._create_iterator_if_necessary(**kwargs)
                self.seconds["minibatching"] += time.perf_counter() - start - (self.seconds["to_batch"] - before)
                return self._timed_iterator(iter(iterator))

            def _timed_iterator(self, iterator):
                while True:
                    start = time.perf_counter()
                    try:
                        item = next(iterator)
                    except StopIteration:
                        return
                    finally:
                        self.seconds["minibatching"] += time.perf_counter() - start
                    yield item

            def _make_batch_if_necessary(self, training_data):
                start = time.perf_counter()
                try:
                    return super()._make_batch_if_necessary(training_data)
                finally:
                    self.seconds["to_batch"] += time.perf_counter() - start

            def _update(self, batch, **kwargs):
                start = time.perf_counter()
                try:
                    return super()._update(batch, **kwargs)
                finally:
                    self.seconds["learner_update"] += time.perf_counter() - start

        Timed.__name__ = Timed.__qualname__ = f"Timed{base.__name__}"
        return Timed

    return {"TimedPrioritizedEpisodeReplayBuffer": TimedPrioritizedEpisodeReplayBuffer,
            "TimedBufferSACConfig": TimedBufferSACConfig,
            "TimedDQNTorchLearner": timed_learner(DQNTorchLearner),
            "TimedConduitDQNTorchLearner": timed_learner(ConduitDQNTorchLearner),
            "TimedPPOTorchLearner": timed_learner(PPOTorchLearner),
            "TimedConduitPPOTorchLearner": timed_learner(ConduitPPOTorchLearner),
            "TimedSACTorchLearner": timed_learner(SACTorchLearner),
            "TimedConduitSACTorchLearner": timed_learner(ConduitSACTorchLearner)}


_CLASSES: dict[str, Any] = {}


def __getattr__(name):  # RLlib resolves the native buffer by import string: experiments.rllib_compare.<name>
    if not _CLASSES:
        _CLASSES.update(_timed_classes())
    if name in _CLASSES:
        return _CLASSES[name]
    raise AttributeError(name)


def _schedule(path: str, args) -> str:
    return args.schedule if path == "conduit_scheduled" else "sync"


def dqn_config(path: str, seed: int, args):
    from ray.rllib.algorithms.dqn import DQNConfig

    module = sys.modules[__name__]
    common = {"capacity": args.capacity, "alpha": 0.6, "beta": 0.4}
    if path == "native":
        buffer = {"type": "experiments.rllib_compare.TimedPrioritizedEpisodeReplayBuffer", **common}
        learner = module.TimedDQNTorchLearner
    elif path == "type_swap":
        buffer = {"type": "conduit_rllib.ConduitPrioritizedEpisodeReplayBuffer", **common}
        learner = module.TimedDQNTorchLearner
    else:
        buffer = {"type": "conduit_rllib.ConduitPrioritizedEpisodeReplayBuffer", **common, "n_step": args.n_step,
                  "deliver": "torch", "schedule": _schedule(path, args), "seed": seed}
        learner = module.TimedConduitDQNTorchLearner
    config = (DQNConfig()
              .environment(ENVS["dqn"])
              .env_runners(num_env_runners=0, rollout_fragment_length=args.rollout_fragment_length)
              .learners(learner_class=learner)
              .training(train_batch_size=args.train_batch_size, n_step=args.n_step,
                        num_steps_sampled_before_learning_starts=args.learning_starts, replay_buffer_config=buffer)
              .reporting(min_sample_timesteps_per_iteration=args.steps_per_iteration,
                         metrics_num_episodes_for_smoothing=args.smoothing)
              .debugging(seed=seed))
    if args.training_intensity:
        config.training(training_intensity=args.training_intensity)
    return config


def ppo_config(path: str, seed: int, args):
    from ray.rllib.algorithms.ppo import PPOConfig

    module = sys.modules[__name__]
    learner = module.TimedPPOTorchLearner if path == "native" else module.TimedConduitPPOTorchLearner
    return (PPOConfig()
            .environment(ENVS["ppo"])
            .env_runners(num_env_runners=0, rollout_fragment_length="auto")
            .learners(learner_class=learner)
            .training(train_batch_size=args.ppo_batch_size, minibatch_size=args.ppo_minibatch_size,
                      num_epochs=args.ppo_epochs)
            .reporting(metrics_num_episodes_for_smoothing=args.smoothing)
            .debugging(seed=seed))


def sac_config(path: str, seed: int, args):
    from conduit_rllib import ConduitSACConfig
    from ray.rllib.core.rl_module.default_model_config import DefaultModelConfig

    module = sys.modules[__name__]
    common = {"capacity": args.capacity, "alpha": 0.6, "beta": 0.4}  # RLlib's SACConfig default buffer: PER 0.6 / 0.4
    if path == "native":
        config = module.TimedBufferSACConfig()
        buffer = {"type": "experiments.rllib_compare.TimedPrioritizedEpisodeReplayBuffer", **common}
        learner = module.TimedSACTorchLearner
    elif path == "type_swap":
        config = ConduitSACConfig()
        buffer = {"type": "conduit_rllib.ConduitPrioritizedEpisodeReplayBuffer", **common}
        learner = module.TimedSACTorchLearner
    else:
        config = ConduitSACConfig()
        buffer = {"type": "conduit_rllib.ConduitPrioritizedEpisodeReplayBuffer", **common, "n_step": args.n_step,
                  "deliver": "torch", "schedule": _schedule(path, args), "seed": seed}
        learner = module.TimedConduitSACTorchLearner
    return (config
            .environment(ENVS["sac"])
            .env_runners(num_env_runners=0, rollout_fragment_length=args.rollout_fragment_length)
            .learners(learner_class=learner)
            .training(train_batch_size=args.train_batch_size, n_step=args.n_step,
                      actor_lr=args.actor_lr, critic_lr=args.critic_lr, alpha_lr=args.alpha_lr,
                      training_intensity=args.training_intensity,
                      num_steps_sampled_before_learning_starts=args.learning_starts, replay_buffer_config=buffer)
            .rl_module(model_config=DefaultModelConfig(fcnet_hiddens=list(args.fcnet_hiddens)))
            .reporting(min_sample_timesteps_per_iteration=args.steps_per_iteration,
                       metrics_num_episodes_for_smoothing=args.smoothing)
            .debugging(seed=seed))


CONFIGS = {"dqn": dqn_config, "ppo": ppo_config, "sac": sac_config}


def _counters(algo) -> dict[str, float]:
    buffer = algo.local_replay_buffer
    learner = algo.learner_group._learner
    timings = buffer.timings if buffer is not None else {}
    return {"buffer_add": timings.get("add", 0.0), "buffer_sample": timings.get("sample", 0.0),
            "priority_update": timings.get("update_priorities", 0.0), **learner.seconds}


def _number(value) -> float | None:
    """A finite float, or None (RLlib reports NaN before the first episode ends)."""
    try:
        value = float(value)
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) else None


def run(path: str, seed: int, args) -> dict:
    algo = CONFIGS[args.algo](path, seed, args).build_algo()
    iterations, returns, env_steps = [], [], []
    total_iterations = args.warmup + args.iterations
    rows_per_update = args.ppo_minibatch_size if args.algo == "ppo" else args.train_batch_size
    try:
        for i in range(total_iterations):
            before = _counters(algo)
            start = time.perf_counter()
            result = algo.train()
            total = time.perf_counter() - start
            after = _counters(algo)
            returns.append(_number(result["env_runners"].get("episode_return_mean")))
            steps = result.get("num_env_steps_sampled_lifetime",
                               result["env_runners"].get("num_env_steps_sampled_lifetime"))
            env_steps.append(int(steps) if _number(steps) is not None else None)
            shown = "n/a" if returns[-1] is None else f"{returns[-1]:.1f}"
            phase = "warmup" if i < args.warmup else "it"
            print(f"seed {seed} {path} {phase} {i + 1}/{total_iterations} return {shown} env steps {env_steps[-1]} "
                  f"iter {total:.1f}s", flush=True)
            if i < args.warmup:
                continue
            parts = {k: after[k] - before[k] for k in after}
            parts["other"] = total - sum(parts.values())
            parts["iteration"] = total
            parts["updates"] = int(result["learners"]["default_policy"]["num_module_steps_trained"]) // rows_per_update
            iterations.append(parts)
    finally:
        algo.stop()
    return {"path": path, "seed": seed, "iterations": iterations, "returns": returns, "env_steps": env_steps}


# ----------------------------------------------------------------------------------------------------------------------
# statistics (pure Python: the experiment needs no SciPy)
# ----------------------------------------------------------------------------------------------------------------------
def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction of the regularized incomplete beta function (modified Lentz)."""
    tiny, eps = 1e-300, 1e-15
    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 1000):
        m2 = 2 * m
        for aa in (m * (b - m) * x / ((qam + m2) * (a + m2)), -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))):
            d = 1.0 + aa * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + aa / c
            c = c if abs(c) > tiny else tiny
            delta = d * c
            h *= delta
        if abs(delta - 1.0) < eps:
            break
    return h


def betainc(a: float, b: float, x: float) -> float:
    """The regularized incomplete beta function I_x(a, b)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _betacf(a, b, x) / a
    return 1.0 - front * _betacf(b, a, 1.0 - x) / b


def t_two_sided_p(t: float, dof: float) -> float:
    """P(|T| >= |t|) for Student's t with ``dof`` degrees of freedom (any real dof > 0)."""
    if math.isinf(t):
        return 0.0
    return betainc(dof / 2.0, 0.5, dof / (dof + t * t))


def welch_t_test(a, b) -> dict:
    """Welch's unequal-variance t-test of mean(a) - mean(b): t, the Welch-Satterthwaite dof and the two-sided p.
    None where undefined (fewer than 2 values per side, or no variance on either side with different means gives
    t = +-inf, p = 0)."""
    a, b = [float(x) for x in a], [float(x) for x in b]
    if len(a) < 2 or len(b) < 2:
        return {"t": None, "dof": None, "p": None, "n": [len(a), len(b)]}
    va, vb = statistics.variance(a) / len(a), statistics.variance(b) / len(b)
    diff = statistics.fmean(a) - statistics.fmean(b)
    se2 = va + vb
    if se2 == 0.0:
        equal = diff == 0.0
        return {"t": 0.0 if equal else math.copysign(math.inf, diff), "dof": None, "p": 1.0 if equal else 0.0,
                "n": [len(a), len(b)]}
    t = diff / math.sqrt(se2)
    dof = se2 ** 2 / (va ** 2 / (len(a) - 1) + vb ** 2 / (len(b) - 1))
    return {"t": t, "dof": dof, "p": t_two_sided_p(t, dof), "n": [len(a), len(b)]}


def final_return(returns: list, k: int) -> float | None:
    """The mean of the last ``k`` iterations' returns (iterations without a return yet are skipped)."""
    tail = [r for r in returns[-k:] if r is not None]
    return statistics.fmean(tail) if tail else None


def convergence(runs: list[dict], final_iterations: int) -> dict:
    """Per path: each seed's final return, mean and sample std over seeds, every run's learning curve; Welch's test."""
    out: dict[str, Any] = {"final_iterations": final_iterations,
                           "final_return": f"mean of episode_return_mean over the last {final_iterations} iterations",
                           "std": "sample standard deviation over seeds (ddof=1)"}
    finals = {}
    for path in PATHS:
        mine = [r for r in runs if r["path"] == path]
        if not mine:
            continue
        per_seed = {str(r["seed"]): final_return(r["returns"], final_iterations) for r in mine}
        values = [v for v in per_seed.values() if v is not None]
        finals[path] = values
        out[path] = {
            "final_return_per_seed": per_seed,
            "mean": statistics.fmean(values) if values else None,
            "std": statistics.stdev(values) if len(values) > 1 else None,
            "min": min(values) if values else None,
            "max": max(values) if values else None,
            "curves": [{"seed": r["seed"], "iteration": list(range(len(r["returns"]))),
                        "env_steps": r.get("env_steps") or [None] * len(r["returns"]), "return": r["returns"]}
                       for r in mine],
        }
    for path in CONDUIT_PATHS:
        if "native" in finals and path in finals:
            out[f"welch_native_vs_{path}"] = welch_t_test(finals["native"], finals[path])
    return out


def summarize(runs: list[dict], final_iterations: int = 5) -> dict:
    out = {}
    for path in PATHS:
        rows = [it for r in runs if r["path"] == path for it in r["iterations"]]
        if not rows:
            continue
        median = {k: statistics.median(row[k] for row in rows) for k in (*PARTS, "iteration")}
        mean = {k: statistics.fmean(row[k] for row in rows) for k in (*PARTS, "iteration")}
        experience = [sum(row[k] for k in EXPERIENCE) for row in rows]
        shares = [e / row["iteration"] for e, row in zip(experience, rows)]
        updates = statistics.median(row["updates"] for row in rows)
        out[path] = {
            "iterations_measured": len(rows),
            "updates_per_iteration": updates,
            "median_s": median,
            "mean_s": mean,
            "experience_path_s": {"median": statistics.median(experience), "mean": statistics.fmean(experience)},
            "experience_path_share": {"median": statistics.median(shares), "mean": statistics.fmean(shares)},
            # every part is timed on the training thread: a prefetched batch's kernel runs outside these calls, so
            # the timed experience path is what stays exposed (waiting for a prefetched batch included)
            "exposed_experience_path_s": {"median": statistics.median(experience), "mean": statistics.fmean(experience)},
            "experience_path_us_per_update": 1e6 * statistics.median(experience) / max(updates, 1),
        }
    for path in CONDUIT_PATHS:
        if "native" in out and path in out:
            n, c = out["native"], out[path]
            out[f"{path}_vs_native"] = {
                "iteration_latency_change": c["median_s"]["iteration"] / n["median_s"]["iteration"] - 1,
                "experience_path_change": c["experience_path_s"]["median"] / n["experience_path_s"]["median"] - 1,
            }
    out["convergence"] = convergence(runs, final_iterations)
    return out


def _fmt(value, spec: str = ".1f") -> str:
    return "n/a" if value is None else format(value, spec)


def _table(summary: dict) -> str:
    paths = [p for p in PATHS if p in summary]
    width = max(12, *(len(p) + 2 for p in paths))

    def row(label: str, values, spec: str) -> str:
        return f"{label:30s}" + "".join(f"{v:{width}{spec}}" for v in values)

    lines = [f"{'part (median s / iteration)':30s}" + "".join(f"{p:>{width}s}" for p in paths)]
    for key in (*PARTS, "iteration"):
        lines.append(row(key, [summary[p]["median_s"][key] for p in paths], ".4f"))
    lines.append(row("experience path", [summary[p]["experience_path_s"]["median"] for p in paths], ".4f"))
    lines.append(row("experience-path share", [summary[p]["experience_path_share"]["median"] for p in paths], ".1%"))
    lines.append(row("exp. path us / update", [summary[p]["experience_path_us_per_update"] for p in paths], ".0f"))
    lines.append(row("updates / iteration", [summary[p]["updates_per_iteration"] for p in paths], ".0f"))
    for path in CONDUIT_PATHS:
        if f"{path}_vs_native" in summary:
            change = summary[f"{path}_vs_native"]
            lines.append(f"{path} vs native: iteration latency {change['iteration_latency_change']:+.1%}, "
                         f"experience path {change['experience_path_change']:+.1%}")
    conv = summary.get("convergence", {})
    for path in PATHS:
        if path in conv:
            c = conv[path]
            per_seed = ", ".join(f"{seed}: {_fmt(v)}" for seed, v in c["final_return_per_seed"].items())
            lines.append(f"final return ({conv['final_iterations']} last iterations) {path:17s} "
                         f"{_fmt(c['mean'])} +- {_fmt(c['std'])} (seeds {per_seed})")
    for path in CONDUIT_PATHS:
        if f"welch_native_vs_{path}" in conv:
            w = conv[f"welch_native_vs_{path}"]
            lines.append(f"Welch t-test native vs {path}: t {_fmt(w['t'], '.3f')}, dof {_fmt(w['dof'], '.2f')}, "
                         f"p {_fmt(w['p'], '.3f')}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------------------------
# figure
# ----------------------------------------------------------------------------------------------------------------------
COLORS = {"native": "tab:blue", "conduit": "tab:orange", "conduit_scheduled": "tab:green", "type_swap": "tab:red"}


def _mean_curve(curves: list[dict]):
    """Per iteration index: mean env steps, mean / min / max return over the runs that have a return there."""
    import numpy as np

    length = max(len(c["return"]) for c in curves)
    x, mean, low, high = [], [], [], []
    for i in range(length):
        steps = [c["env_steps"][i] for c in curves if i < len(c["env_steps"]) and c["env_steps"][i] is not None]
        values = [c["return"][i] for c in curves if i < len(c["return"]) and c["return"][i] is not None]
        x.append(statistics.fmean(steps) if steps else float(i))
        mean.append(statistics.fmean(values) if values else np.nan)
        low.append(min(values) if values else np.nan)
        high.append(max(values) if values else np.nan)
    return np.asarray(x), np.asarray(mean), np.asarray(low), np.asarray(high)


def plot(result: dict, path) -> None:
    """Learning curves (left) and the median per-part breakdown (right); the command line in the caption."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary, config = result["summary"], result["config"]
    algo = config.get("algo", "?")
    conv = summary.get("convergence", {})
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5.2), gridspec_kw={"width_ratios": [1.6, 1]})
    for p in PATHS:
        if p not in conv or not conv[p]["curves"]:
            continue
        x, mean, low, high = _mean_curve(conv[p]["curves"])
        seeds = len(conv[p]["curves"])
        label = f"{p} (mean of {seeds} seed{'s' if seeds != 1 else ''}; final {_fmt(conv[p]['mean'])}"
        label += f" ± {_fmt(conv[p]['std'])})" if conv[p]["std"] is not None else ")"
        left.plot(x, mean, color=COLORS[p], label=label)
        left.fill_between(x, low, high, color=COLORS[p], alpha=0.2, linewidth=0)
    title = f"{algo.upper()} on {ENVS.get(algo, '?')}: episode return (band: min-max over seeds)"
    for name in CONDUIT_PATHS:
        welch = conv.get(f"welch_native_vs_{name}")
        if welch and welch["p"] is not None:
            title += f"\nfinal returns native vs {name}, Welch: t = {welch['t']:.2f}, " \
                     f"dof = {_fmt(welch['dof'], '.1f')}, p = {welch['p']:.3f}"
    left.set_title(title, fontsize=10)
    left.set_xlabel("env steps sampled")
    left.set_ylabel(f"episode_return_mean (last {config.get('smoothing', '?')} episodes)")
    left.grid(alpha=0.3)
    left.legend(fontsize=8, loc="best")

    paths = [p for p in PATHS if p in summary and "median_s" in summary[p]]
    bottoms = [0.0] * len(paths)
    cmap = plt.get_cmap("tab10")
    for j, part in enumerate(PARTS):
        heights = [summary[p]["median_s"][part] for p in paths]
        right.bar(paths, heights, bottom=bottoms, color=cmap(j), label=part,
                  hatch="//" if part in EXPERIENCE else None, edgecolor="white")
        bottoms = [b + h for b, h in zip(bottoms, heights)]
    for i, p in enumerate(paths):
        s = summary[p]
        right.text(i, bottoms[i], f"{s['median_s']['iteration']:.2f} s / it\nexp. path "
                   f"{s['experience_path_share']['median']:.0%}", ha="center", va="bottom", fontsize=8)
    title = "median seconds per iteration by part (hatched: experience path)"
    for name in CONDUIT_PATHS:
        change = summary.get(f"{name}_vs_native")
        if change:
            title += f"\n{name} vs native: iteration {change['iteration_latency_change']:+.1%}, experience path " \
                     f"{change['experience_path_change']:+.1%}"
    right.set_title(title, fontsize=10)
    right.set_ylabel("s")
    right.set_ylim(0, max(bottoms or [1.0]) * 1.5)
    right.legend(fontsize=7, loc="upper center", ncol=4)
    caption = result.get("command", "python -m experiments.rllib_compare")
    seeds = config.get("seeds")
    fig.text(0.01, 0.01, f"{caption}   (seeds {seeds}, {'quick' if config.get('quick') else 'full'} run, "
             f"ray {result.get('versions', {}).get('ray', '?')})", fontsize=8, family="monospace")
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ----------------------------------------------------------------------------------------------------------------------
# command line
# ----------------------------------------------------------------------------------------------------------------------
# per-algorithm defaults (full run, --quick run) for the options left unset
DEFAULTS = {
    "dqn": {"iterations": (28, 4), "steps_per_iteration": (1000, 200), "learning_starts": (1000, 100),
            "train_batch_size": (32, 32), "rollout_fragment_length": (4, 4), "n_step": (3, 3),
            "training_intensity": (None, None), "fcnet_hiddens": (None, None)},
    "ppo": {"iterations": (16, 4), "ppo_batch_size": (4000, 512), "ppo_epochs": (10, 4)},
    "sac": {"iterations": (10, 4), "steps_per_iteration": (1000, 250), "learning_starts": (1000, 250),
            "train_batch_size": (128, 128), "rollout_fragment_length": (4, 4), "n_step": (3, 3),
            "training_intensity": (64, 64), "fcnet_hiddens": ([128, 128], [128, 128])},
}


def parse_args(argv) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="1 seed, short iterations (a minute or two)")
    parser.add_argument("--algo", default="dqn", choices=tuple(CONFIGS))
    parser.add_argument("--seeds", type=int, nargs="*", default=None, help="default 0 1 2 (--quick: 0)")
    parser.add_argument("--iterations", type=int, default=None, help="measured iterations per run (after warmup)")
    parser.add_argument("--warmup", type=int, default=None, help="iterations per run left out of the breakdown")
    parser.add_argument("--steps-per-iteration", type=int, default=None, help="DQN / SAC: min env steps per iteration")
    parser.add_argument("--train-batch-size", type=int, default=None, help="DQN / SAC (default 32 / 128)")
    parser.add_argument("--rollout-fragment-length", type=int, default=None)
    parser.add_argument("--training-intensity", type=float, default=None,
                        help="DQN / SAC: replayed / sampled steps (SAC default 64: one update of 128 per 2 env steps)")
    parser.add_argument("--n-step", type=int, default=None, help="DQN / SAC (default 3 / 3)")
    parser.add_argument("--capacity", type=int, default=50_000)
    parser.add_argument("--learning-starts", type=int, default=None)
    parser.add_argument("--fcnet-hiddens", type=int, nargs="+", default=None, help="SAC (default 128 128)")
    parser.add_argument("--actor-lr", type=float, default=3e-4, help="SAC")
    parser.add_argument("--critic-lr", type=float, default=8e-4, help="SAC")
    parser.add_argument("--alpha-lr", type=float, default=9e-4, help="SAC")
    parser.add_argument("--paths", nargs="+", default=None, choices=PATHS,
                        help="what to run (default: all three for DQN / SAC; native and conduit for PPO)")
    parser.add_argument("--schedule", default="overlap", choices=("overlap", "deferred", "adaptive"),
                        help="DQN / SAC: the conduit_scheduled path's delivery schedule")
    parser.add_argument("--ppo-batch-size", type=int, default=None)
    parser.add_argument("--ppo-minibatch-size", type=int, default=128)
    parser.add_argument("--ppo-epochs", type=int, default=None)
    parser.add_argument("--smoothing", type=int, default=10,
                        help="episodes in RLlib's episode_return_mean (metrics_num_episodes_for_smoothing)")
    parser.add_argument("--final-iterations", type=int, default=None,
                        help="the final return is the mean of the last this many iterations' returns (default 5, "
                             "--quick 2)")
    parser.add_argument("--jax-sync-dispatch", action="store_true",
                        help="jax_cpu_enable_async_dispatch=False (each JAX call's time lands in the call that made it)")
    parser.add_argument("--xla-threads", default="1",
                        help="XLA:CPU's intra-op pool for Conduit's kernels, set with conduit_jax.runtime.configure_cpu "
                             "as the README asks of a program using Conduit (default 1; 'default': XLA's own, one per "
                             "CPU, as runs before this option)")
    parser.add_argument("--out", default=None, help="the JSON result (default experiments/results/rllib_compare_"
                                                    "<algo>[_quick].json); the PNG goes next to it")
    parser.add_argument("--from-json", default=None, help="re-summarize and re-plot a saved result, then exit")
    args = parser.parse_args(argv)
    quick = args.quick
    args.seeds = args.seeds or ([0] if quick else [0, 1, 2])
    args.paths = args.paths or list(DEFAULT_PATHS if args.algo != "ppo" else PATHS[:2])
    if args.algo == "ppo" and not set(args.paths) <= set(PATHS[:2]):
        parser.error(f"--paths: PPO runs native and conduit, got {args.paths}")
    args.warmup = args.warmup if args.warmup is not None else 2
    args.final_iterations = args.final_iterations or (2 if quick else 5)
    for name, (full, short) in DEFAULTS[args.algo].items():
        if getattr(args, name, None) is None:
            setattr(args, name, short if quick else full)
    for name, value in (("steps_per_iteration", 1000), ("learning_starts", 1000), ("train_batch_size", 32),
                        ("rollout_fragment_length", 4), ("n_step", 3), ("ppo_batch_size", 4000), ("ppo_epochs", 10)):
        if getattr(args, name) is None:  # options the algorithm does not use, recorded with RLlib-like values
            setattr(args, name, value)
    return args


def default_out(algo: str, quick: bool) -> Path:
    return RESULTS / f"rllib_compare_{algo}{'_quick' if quick else ''}.json"


def write(result: dict, out) -> Path:
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=1, default=float)
    png = out.with_suffix(".png")
    plot(result, png)
    return png


def main(argv=None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.from_json:
        with open(args.from_json) as f:
            result = json.load(f)
        final = args.final_iterations if "--final-iterations" in argv else \
            result["config"].get("final_iterations", args.final_iterations)
        result["summary"] = summarize(result["runs"], final)
        result.setdefault("paper_reference_8xA100", PAPER)
        result["config"]["final_iterations"] = final
        out = Path(args.out or args.from_json)
        png = write(result, out)
        print(_table(result["summary"]))
        print(f"wrote {out} and {png}")
        return result
    from conduit_jax import runtime

    # the process's JAX settings, made before anything starts JAX (RLlib's native path does not use JAX); a second
    # run in one process (conduit experiment breakdown: DQN, then SAC) keeps the first one's
    xla = runtime.configure_cpu(None if args.xla_threads == "default" else int(args.xla_threads),
                                async_dispatch=not args.jax_sync_dispatch) if not runtime.backend_started() else \
        "set by an earlier run in this process"

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import torch

    torch.set_num_threads(1)
    import ray

    command = "python -m experiments.rllib_compare" + (" " + shlex.join(argv) if argv else "")
    print(command, flush=True)
    started_all = time.perf_counter()
    temp_dir = tempfile.mkdtemp(prefix="rllib_compare_")
    ray.init(num_cpus=2, include_dashboard=False, _temp_dir=temp_dir, log_to_driver=False, configure_logging=False)
    runs = []
    try:
        for seed in args.seeds:
            for path in args.paths:
                started = time.perf_counter()
                runs.append(run(path, seed, args))
                runs[-1]["wall_s"] = time.perf_counter() - started
                print(f"seed {seed} {path:8s} done in {runs[-1]['wall_s']:.1f} s", flush=True)
    finally:
        ray.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)
    summary = summarize(runs, args.final_iterations)
    result = {"command": command, "environment": ENVS[args.algo], "paper_reference_8xA100": PAPER,
              "config": {k: v for k, v in vars(args).items() if k not in ("out", "from_json")},
              "summary": summary, "runs": runs, "wall_s": time.perf_counter() - started_all,
              "versions": _versions(), "runtime": xla,
              "machine": {"cpu_count": os.cpu_count(), "load_average": list(os.getloadavg())}}
    print(_table(summary))
    out = Path(args.out) if args.out else default_out(args.algo, args.quick)
    png = write(result, out)
    print(f"wrote {out} and {png} ({result['wall_s']:.0f} s)", flush=True)
    return result


def _versions() -> dict:
    import importlib.metadata as md

    return {name: md.version(name) for name in ("ray", "torch", "jax", "jaxlib")}


if __name__ == "__main__":
    main()
