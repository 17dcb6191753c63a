"""Claim: inside RLlib's off-policy loop, a Conduit buffer's schedule hides the replay draw behind the learner.

RLlib's DQN / SAC ``training_step`` does, per round: sample ``rollout`` env steps and ``add`` them, then ``updates``
times ``sample()`` -> ``get_metrics()`` -> learner update -> ``update_priorities()``. This probe runs that loop through the buffers' public
API, in one process, with RLlib's native ``PrioritizedEpisodeReplayBuffer`` and with
``ConduitPrioritizedEpisodeReplayBuffer(deliver="torch")`` under each schedule (sync, overlap, deferred, adaptive),
and with only RLlib's buffer type swapped (``type_swap``: the Conduit class with its defaults, ``deliver="episodes"``
and ``schedule="sync"``, read by the learner off its episodes as RLlib's learner reads the native ones), in
interleaved rounds so every path sees the same machine noise:

* env: Pendulum-v1 from gymnasium with random actions, ``rollout`` steps per round, added as one RLlib
  ``SingleAgentEpisode`` chunk (RLlib's env runner adds chunks the same way);
* learner: a torch MLP (``--hidden``) forward / backward / Adam step on the batch's ``obs`` (one torch thread); the
  native and type_swap batches' obs are read off their episodes, the others' come through DLPack
  (``ConduitBatch.take_words`` + ``words_to_torch``);
* exposed: the time the loop spends in ``add()``, ``sample()``, ``get_metrics()`` and ``update_priorities()`` (+
  Conduit's DLPack hand-over), per update; ``iteration``: one round's wall time per update.

``updates`` = 1 leaves a whole env rollout between an update and the next ``sample()``, where overlap's draw runs;
``updates`` = 4 (a high ``training_intensity``) leaves nothing between back-to-back updates, where only deferred's
draw (during the learner update) is hidden; ``adaptive`` should match the better of the two in both.

``python -m experiments.rllib_schedules`` writes ``experiments/results/rllib_schedules.json`` (its run time in
``wall_s``); ``--quick`` writes ``rllib_schedules_quick.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

RESULTS = Path(__file__).resolve().parent / "results"
SCHEDULES = ("sync", "overlap", "deferred", "adaptive")
EPISODES = ("native", "type_swap")  # the paths whose sample() returns RLlib episodes


def _episode(env, obs, rollout: int, index: int):
    from ray.rllib.env.single_agent_episode import SingleAgentEpisode

    episode = SingleAgentEpisode(id_=str(index), observations=[obs], len_lookback_buffer=0)
    for _ in range(rollout):
        action = env.action_space.sample()
        obs, reward, terminated, truncated, _ = env.step(action)
        episode.add_env_step(observation=obs, action=action, reward=float(reward))
    episode.is_truncated = True
    episode.to_numpy()
    return episode, obs


def run(args) -> dict:
    import gymnasium as gym
    import torch

    import conduit_rllib
    from conduit_rllib.dlpack import words_to_torch
    from ray.rllib.utils.replay_buffers.prioritized_episode_buffer import PrioritizedEpisodeReplayBuffer

    torch.set_num_threads(1)
    torch.manual_seed(0)
    env = gym.make("Pendulum-v1")
    obs, _ = env.reset(seed=0)
    episodes = 0
    common = {"capacity": args.capacity, "alpha": 0.6}
    paths = {"native": PrioritizedEpisodeReplayBuffer(**common),
             "type_swap": conduit_rllib.ConduitPrioritizedEpisodeReplayBuffer(**common, seed=0)}
    for schedule in SCHEDULES:
        paths[schedule] = conduit_rllib.ConduitPrioritizedEpisodeReplayBuffer(**common, deliver="torch",
                                                                            schedule=schedule, seed=0)
    model = torch.nn.Sequential(torch.nn.Linear(3, args.hidden), torch.nn.ReLU(), torch.nn.Linear(args.hidden,
                                args.hidden), torch.nn.ReLU(), torch.nn.Linear(args.hidden, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)

    def learn(obs_batch) -> np.ndarray:
        loss = model(obs_batch).pow(2)
        optimizer.zero_grad()
        loss.mean().backward()
        optimizer.step()
        return loss.detach().reshape(-1).numpy()  # stands in for the TD errors

    while episodes * args.rollout < args.learning_starts:  # the same stored steps in every buffer
        episode, obs = _episode(env, obs, args.rollout, episodes)
        episodes += 1
        for buffer in paths.values():
            buffer.add([episode])  # Conduit copies the arrays; only the native buffer keeps the object

    def round_of(name: str, buffer, updates: int, record: dict) -> None:
        nonlocal obs, episodes
        start = time.perf_counter()
        episode, obs = _episode(env, obs, args.rollout, episodes)
        episodes += 1
        add = time.perf_counter()
        buffer.add([episode])
        exposed = time.perf_counter() - add
        for _ in range(updates):
            t = time.perf_counter()
            batch = buffer.sample(num_items=args.batch, n_step=args.n_step, beta=0.4)
            if name in EPISODES:
                obs_batch = torch.as_tensor(np.stack([e.get_observations(0) for e in batch]), dtype=torch.float32)
            else:
                obs_batch = words_to_torch(batch.take_words(), batch.layout, ("obs",))["obs"]
            buffer.get_metrics()  # RLlib's DQN reads the buffer's metrics after every sample()
            exposed += time.perf_counter() - t
            td = learn(obs_batch)
            t = time.perf_counter()
            buffer.update_priorities(td)
            exposed += time.perf_counter() - t
        record["exposed"].append(exposed / updates)
        record["iteration"].append((time.perf_counter() - start) / updates)

    result = {}
    for updates in args.updates:
        records = {name: {"exposed": [], "iteration": []} for name in paths}
        for r in range(args.rounds):
            order = list(paths)[r % len(paths):] + list(paths)[:r % len(paths)]
            for name in order:
                for _ in range(args.block):
                    round_of(name, paths[name], updates, records[name] if r >= args.warmup else
                             {"exposed": [], "iteration": []})
        summary = {}
        for name, record in records.items():
            summary[name] = {"exposed_us": float(np.median(record["exposed"]) * 1e6),
                             "exposed_mean_us": float(np.mean(record["exposed"]) * 1e6),
                             "iteration_us": float(np.median(record["iteration"]) * 1e6),
                             "rounds": len(record["exposed"])}
            if name not in EPISODES:
                summary[name]["stats"] = {k: v for k, v in paths[name].stats().items() if k.startswith("drawn_")}
        for name in paths:
            summary[name]["exposed_vs_native"] = summary[name]["exposed_us"] / summary["native"]["exposed_us"] - 1
            summary[name]["exposed_vs_sync"] = summary[name]["exposed_us"] / summary["sync"]["exposed_us"] - 1
        result[f"updates_{updates}"] = summary
        print(f"updates per env round: {updates} (rollout {args.rollout} steps, batch {args.batch}, n_step "
              f"{args.n_step}, hidden {args.hidden})")
        print(f"  {'path':10s} {'exposed us':>11s} {'mean us':>9s} {'vs native':>10s} {'vs sync':>8s} "
              f"{'iteration us':>13s}  drawn ahead (after update / after sample / waited)")
        for name, row in summary.items():
            stats = row.get("stats", {})
            drawn = (f"{stats['drawn_ahead_after_update']} / {stats['drawn_ahead_after_sample']} / "
                     f"{stats['drawn_ahead_waited']}") if stats else ""
            print(f"  {name:10s} {row['exposed_us']:11.0f} {row['exposed_mean_us']:9.0f} "
                  f"{row['exposed_vs_native']:+10.1%} {row['exposed_vs_sync']:+8.1%} {row['iteration_us']:13.0f}  "
                  f"{drawn}", flush=True)
    return result


def parse_args(argv) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds (about 30 s)")
    parser.add_argument("--updates", type=int, nargs="+", default=[1, 4], help="learner updates per env round")
    parser.add_argument("--rollout", type=int, default=4, help="env steps per round (RLlib's rollout fragment)")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--n-step", type=int, default=1, help="sample()'s n_step (RLlib's DQN default: 1)")
    parser.add_argument("--hidden", type=int, default=256, help="the learner MLP's width")
    parser.add_argument("--capacity", type=int, default=50_000)
    parser.add_argument("--learning-starts", type=int, default=2_000)
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 24, --quick 6)")
    parser.add_argument("--block", type=int, default=10, help="env rounds per path per interleaved round")
    parser.add_argument("--warmup", type=int, default=1, help="interleaved rounds left out (compilation)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    args.rounds = args.rounds or (6 if args.quick else 24)
    return args


def main(argv=None) -> dict:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    start = time.perf_counter()
    command = " ".join(["python -m experiments.rllib_schedules", *(sys.argv[1:] if argv is None else argv)])
    result = {"command": command,
              "config": vars(args), "results": run(args), "wall_s": time.perf_counter() - start,
              "machine": {"platform": platform.platform(), "cpus": os.cpu_count()}}
    out = Path(args.out or RESULTS / f"rllib_schedules{'_quick' if args.quick else ''}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out} ({result['wall_s']:.0f} s)")
    return result


if __name__ == "__main__":
    main()
