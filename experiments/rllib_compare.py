"""Native RLlib vs the Conduit path on the same seeds (CartPole): where an iteration goes.

Two configurations of RLlib 2.60 (new API stack, torch learner, local learner and env runner) per algorithm:

DQN with prioritized replay (``--algo dqn``, the default):

* ``native``: ``PrioritizedEpisodeReplayBuffer`` (episodes in a Python deque, segment trees) and RLlib's learner
  connector pipeline turning the sampled 1-step episodes into a torch batch.
* ``conduit``: ``conduit_rllib.ConduitPrioritizedEpisodeReplayBuffer`` with ``deliver="torch"`` (columns in a plane,
  n-step and PER by the plane's kernels) and ``ConduitDQNTorchLearner`` (the batch reaches torch through DLPack).

PPO (``--algo ppo``):

* ``native``: RLlib's learner connector pipeline with its NumPy GAE piece, then ``MiniBatchCyclicIterator``.
* ``conduit``: ``ConduitPPOTorchLearner``: GAE in JAX, epoch minibatches delivered by a plane through DLPack.

Each iteration (one ``algo.train()``) is split, from counters read before and after it, into:

* ``buffer_add``, ``buffer_sample``, ``priority_update``: the replay buffer's calls (RLlib's own timers cover the same
  calls; these are exact sums per iteration, not RLlib's smoothed values);
* ``to_batch``: the learner turning what it was given into its torch train batch (RLlib: the learner connector
  pipeline, PPO's GAE included; Conduit DQN: DLPack; Conduit PPO: RLlib's pieces + GAE in JAX);
* ``minibatching``: building and running the minibatch iterator (RLlib: slicing, shuffling, concatenating; Conduit
  PPO: ingest into the plane, epoch deliveries, DLPack);
* ``learner_update``: forward, loss, backward and optimizer step (``Learner._update``);
* ``other``: the rest of the iteration (env runner sampling, weight sync, metrics, RLlib bookkeeping).

The experience path is ``buffer_add + buffer_sample + priority_update + to_batch + minibatching``; its share of the
iteration time is reported per configuration. Everything runs on the critical path in both configurations here (``schedule="sync"``),
so the exposed experience-path latency equals the experience path. Runs alternate between the two configurations
(same seed, one Ray session) to share the machine's noise; the first ``--warmup`` iterations (compilation, learning
start) are not measured.

``python -m experiments.rllib_compare --quick [--algo ppo]`` takes about a minute on 2 cores; without ``--quick`` it
runs 3 seeds with longer iterations; every run records its episode returns per iteration (a convergence check over the
seeds). ``--out FILE`` writes the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

PATHS = ("native", "conduit")
PARTS = ("buffer_add", "buffer_sample", "priority_update", "to_batch", "minibatching", "learner_update", "other")
EXPERIENCE = ("buffer_add", "buffer_sample", "priority_update", "to_batch", "minibatching")


def _timed_classes():
    """Buffer and learner subclasses that add up the seconds of the calls the breakdown needs."""
    from ray.rllib.algorithms.dqn.torch.dqn_torch_learner import DQNTorchLearner
    from ray.rllib.algorithms.ppo.torch.ppo_torch_learner import PPOTorchLearner
    from ray.rllib.utils.replay_buffers.prioritized_episode_buffer import PrioritizedEpisodeReplayBuffer

    from conduit_rllib import ConduitDQNTorchLearner, ConduitPPOTorchLearner

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
            "TimedDQNTorchLearner": timed_learner(DQNTorchLearner),
            "TimedConduitDQNTorchLearner": timed_learner(ConduitDQNTorchLearner),
            "TimedPPOTorchLearner": timed_learner(PPOTorchLearner),
            "TimedConduitPPOTorchLearner": timed_learner(ConduitPPOTorchLearner)}


_CLASSES: dict[str, Any] = {}


def __getattr__(name):  # RLlib resolves the native buffer by import string: experiments.rllib_compare.<name>
    if not _CLASSES:
        _CLASSES.update(_timed_classes())
    if name in _CLASSES:
        return _CLASSES[name]
    raise AttributeError(name)


def dqn_config(path: str, seed: int, args):
    from ray.rllib.algorithms.dqn import DQNConfig

    module = sys.modules[__name__]
    common = {"capacity": args.capacity, "alpha": 0.6, "beta": 0.4}
    if path == "native":
        buffer = {"type": "experiments.rllib_compare.TimedPrioritizedEpisodeReplayBuffer", **common}
        learner = module.TimedDQNTorchLearner
    else:
        buffer = {"type": "conduit_rllib.ConduitPrioritizedEpisodeReplayBuffer", **common, "n_step": args.n_step,
                  "deliver": "torch", "schedule": args.schedule, "seed": seed}
        learner = module.TimedConduitDQNTorchLearner
    return (DQNConfig()
            .environment("CartPole-v1")
            .env_runners(num_env_runners=0, rollout_fragment_length=args.rollout_fragment_length)
            .training(train_batch_size=args.train_batch_size, n_step=args.n_step, learner_class=learner,
                      num_steps_sampled_before_learning_starts=args.learning_starts, replay_buffer_config=buffer)
            .reporting(min_sample_timesteps_per_iteration=args.steps_per_iteration)
            .debugging(seed=seed))


def ppo_config(path: str, seed: int, args):
    from ray.rllib.algorithms.ppo import PPOConfig

    module = sys.modules[__name__]
    learner = module.TimedPPOTorchLearner if path == "native" else module.TimedConduitPPOTorchLearner
    return (PPOConfig()
            .environment("CartPole-v1")
            .env_runners(num_env_runners=0, rollout_fragment_length="auto")
            .training(train_batch_size=args.ppo_batch_size, minibatch_size=args.ppo_minibatch_size,
                      num_epochs=args.ppo_epochs, learner_class=learner)
            .debugging(seed=seed))


def _counters(algo) -> dict[str, float]:
    buffer = algo.local_replay_buffer
    learner = algo.learner_group._learner
    timings = buffer.timings if buffer is not None else {}
    return {"buffer_add": timings.get("add", 0.0), "buffer_sample": timings.get("sample", 0.0),
            "priority_update": timings.get("update_priorities", 0.0), **learner.seconds}


def run(path: str, seed: int, args) -> dict:
    algo = (dqn_config if args.algo == "dqn" else ppo_config)(path, seed, args).build_algo()
    iterations, returns = [], []
    try:
        for i in range(args.warmup + args.iterations):
            before = _counters(algo)
            start = time.perf_counter()
            result = algo.train()
            total = time.perf_counter() - start
            after = _counters(algo)
            returns.append(result["env_runners"].get("episode_return_mean"))
            if i < args.warmup:
                continue
            parts = {k: after[k] - before[k] for k in after}
            parts["other"] = total - sum(parts.values())
            parts["iteration"] = total
            parts["updates"] = int(result["learners"]["default_policy"]["num_module_steps_trained"]) // \
                (args.train_batch_size if args.algo == "dqn" else args.ppo_minibatch_size)
            iterations.append(parts)
    finally:
        algo.stop()
    return {"path": path, "seed": seed, "iterations": iterations, "returns": returns}


def summarize(runs: list[dict]) -> dict:
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
            "experience_path_us_per_update": 1e6 * statistics.median(experience) / max(updates, 1),
        }
    if set(out) == set(PATHS):
        n, c = out["native"], out["conduit"]
        out["conduit_vs_native"] = {
            "iteration_latency_change": c["median_s"]["iteration"] / n["median_s"]["iteration"] - 1,
            "experience_path_change": c["experience_path_s"]["median"] / n["experience_path_s"]["median"] - 1,
        }
    return out


def _table(summary: dict) -> str:
    lines = [f"{'part (median s / iteration)':30s}" + "".join(f"{p:>12s}" for p in PATHS if p in summary)]
    for key in (*PARTS, "iteration"):
        lines.append(f"{key:30s}" + "".join(f"{summary[p]['median_s'][key]:12.4f}" for p in PATHS if p in summary))
    lines.append(f"{'experience path':30s}" + "".join(f"{summary[p]['experience_path_s']['median']:12.4f}"
                                                       for p in PATHS if p in summary))
    lines.append(f"{'experience-path share':30s}" + "".join(f"{summary[p]['experience_path_share']['median']:12.1%}"
                                                             for p in PATHS if p in summary))
    lines.append(f"{'exp. path us / update':30s}" + "".join(f"{summary[p]['experience_path_us_per_update']:12.0f}"
                                                             for p in PATHS if p in summary))
    lines.append(f"{'updates / iteration':30s}" + "".join(f"{summary[p]['updates_per_iteration']:12.0f}"
                                                           for p in PATHS if p in summary))
    if "conduit_vs_native" in summary:
        change = summary["conduit_vs_native"]
        lines.append(f"conduit vs native: iteration latency {change['iteration_latency_change']:+.1%}, "
                     f"experience path {change['experience_path_change']:+.1%}")
    return "\n".join(lines)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="1 seed, short iterations (about a minute)")
    parser.add_argument("--algo", default="dqn", choices=("dqn", "ppo"))
    parser.add_argument("--seeds", type=int, nargs="*", default=None)
    parser.add_argument("--iterations", type=int, default=None, help="measured iterations per run")
    parser.add_argument("--warmup", type=int, default=None, help="unmeasured iterations per run")
    parser.add_argument("--steps-per-iteration", type=int, default=None, help="min env steps per iteration")
    parser.add_argument("--train-batch-size", type=int, default=32)
    parser.add_argument("--rollout-fragment-length", type=int, default=4)
    parser.add_argument("--n-step", type=int, default=3)
    parser.add_argument("--capacity", type=int, default=50_000)
    parser.add_argument("--learning-starts", type=int, default=None)
    parser.add_argument("--schedule", default="sync", choices=("sync", "overlap", "deferred", "adaptive"),
                        help="DQN: the Conduit buffer's delivery schedule")
    parser.add_argument("--ppo-batch-size", type=int, default=None)
    parser.add_argument("--ppo-minibatch-size", type=int, default=128)
    parser.add_argument("--ppo-epochs", type=int, default=None)
    parser.add_argument("--jax-sync-dispatch", action="store_true",
                        help="jax_cpu_enable_async_dispatch=False (each JAX call's time lands in the call that made it)")
    parser.add_argument("--out", default=None, help="write the JSON result here")
    args = parser.parse_args(argv)
    quick = args.quick
    args.seeds = args.seeds or ([0] if quick else [0, 1, 2])
    args.iterations = args.iterations or (4 if quick else 20)
    args.warmup = args.warmup if args.warmup is not None else 2
    args.steps_per_iteration = args.steps_per_iteration or (200 if quick else 1000)
    args.learning_starts = args.learning_starts if args.learning_starts is not None else (100 if quick else 1000)
    args.ppo_batch_size = args.ppo_batch_size or (512 if quick else 4000)
    args.ppo_epochs = args.ppo_epochs or (4 if quick else 10)
    if args.jax_sync_dispatch:
        import jax

        jax.config.update("jax_cpu_enable_async_dispatch", False)

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import torch

    torch.set_num_threads(1)
    import ray

    temp_dir = tempfile.mkdtemp(prefix="rllib_compare_")
    ray.init(num_cpus=2, include_dashboard=False, _temp_dir=temp_dir, log_to_driver=False, configure_logging=False)
    runs = []
    try:
        for seed in args.seeds:
            for path in PATHS:
                started = time.perf_counter()
                runs.append(run(path, seed, args))
                print(f"seed {seed} {path:8s} done in {time.perf_counter() - started:.1f} s", flush=True)
    finally:
        ray.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)
    summary = summarize(runs)
    result = {"config": {k: v for k, v in vars(args).items() if k != "out"}, "summary": summary, "runs": runs,
              "versions": _versions()}
    print(_table(summary))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1, default=float)
        print(f"wrote {args.out}")
    return result


def _versions() -> dict:
    import importlib.metadata as md

    return {name: md.version(name) for name in ("ray", "torch", "jax", "jaxlib")}


if __name__ == "__main__":
    main()
