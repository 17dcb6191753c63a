"""DQN with prioritized replay (and optional n-step returns) on a pure-JAX environment, fed by an ExperienceDataPlane.

The experience path, as a user wires it:
  * actors: ``num_envs`` environments stepped in JAX (vmapped, ``rollout_steps`` steps per iteration in one jitted
    scan) with an epsilon-greedy policy; the transitions stay on the device as JAX arrays;
  * ``plane.ingest(transitions)``: one call per iteration, time-major (``rollout_steps * num_envs`` items);
  * ``plane.deliver()``: the batch under the plane's schedule (sync | overlap | deferred | adaptive);
  * a jitted flax/optax double-DQN step on ``delivery.data`` weighted by ``delivery.weights`` (PER importance
    weights), then ``plane.update_priorities(delivery.ids, |td|)``.
With ``n_step > 1`` the plane samples prioritized windows (``samplers.sequences(..., pad=True)``) and the learner turns
them into n-step transitions with ``transforms.n_step`` inside its jit.

``make_train(config) -> train(rng) -> result`` (a JSON-friendly dict); ``python -m experiments.dqn --help``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from conduit_jax import ExperienceDataPlane, ExperienceSpec, default_mesh, samplers, transforms
from conduit_jax.demo import LearnerState, QNetwork
from experiments import SCHEDULES, IterationClock, envs, format_result, make_schedule


@dataclasses.dataclass(frozen=True)
class DQNConfig:
    env: str = "CartPole"
    num_envs: int = 8
    rollout_steps: int = 2  # env steps per environment per iteration: one ingest of rollout_steps * num_envs items
    updates_per_iteration: int = 1  # deliver() + learner step per iteration
    total_env_steps: int = 40_000
    learning_starts: int = 1_000  # env steps before the first learner step
    capacity: int = 16_384
    batch_size: int = 64
    hidden: int = 64
    learning_rate: float = 1e-3
    gamma: float = 0.99
    n_step: int = 1  # > 1: prioritized windows of n steps and n-step targets
    alpha: float = 0.6  # PER exponent
    beta: float = 0.4  # PER importance-weight exponent at the start, annealed linearly to 1
    target_period: int = 200  # learner steps between target-network copies
    epsilon_start: float = 1.0
    epsilon_end: float = 0.05
    epsilon_fraction: float = 0.3  # of total_env_steps over which epsilon decays linearly
    schedule: str = "sync"
    depth: int = 2  # prefetch depth of overlap / deferred (max depth of adaptive)
    defer: int = 2  # k of deferred (and adaptive)
    fused: bool = False  # sample inside the learner's jit with plane.sample_fn() instead of plane.deliver()
    devices: int = 1  # devices the plane shards over
    eval_envs: int = 16
    seed: int = 0
    progress: bool = False

    @property
    def items_per_iteration(self) -> int:
        return self.rollout_steps * self.num_envs

    @property
    def iterations(self) -> int:
        return self.total_env_steps // self.items_per_iteration


# the same Q-network and learner state as the `conduit demo` learner
Learner = LearnerState


class Actors(NamedTuple):
    obs: jax.Array  # float32[num_envs, obs_dim]
    env_state: Any
    rng: jax.Array


def example_transition(obs_dim: int) -> dict[str, np.ndarray]:
    """One item without the batch axis (``ExperienceSpec.from_example``)."""
    return {"obs": np.zeros(obs_dim, np.float32), "action": np.int32(0), "reward": np.float32(0.0),
            "terminated": np.bool_(False), "truncated": np.bool_(False), "next_obs": np.zeros(obs_dim, np.float32)}


def make_plane(config: DQNConfig, obs_dim: int) -> ExperienceDataPlane:
    if config.n_step > 1:
        # windows of n consecutive steps of one environment, prioritized on their first step; pad=True lets a window
        # run past an episode end and masks the steps after it (what transforms.n_step needs)
        sampler = samplers.sequences(config.batch_size, config.n_step, config.num_envs, pad=True, alpha=config.alpha,
                                     beta=_beta_schedule(config))
    else:
        sampler = samplers.prioritized(config.batch_size, alpha=config.alpha, beta=_beta_schedule(config))
    return ExperienceDataPlane(ExperienceSpec.from_example(example_transition(obs_dim)), config.capacity, sampler,
                               schedule=make_schedule(config.schedule, config.depth, config.defer),
                               mesh=default_mesh(config.devices), seed=config.seed)


def _beta_schedule(config: DQNConfig):
    steps = max(1, (config.total_env_steps - config.learning_starts) // config.items_per_iteration
                * config.updates_per_iteration)
    return optax.linear_schedule(config.beta, 1.0, steps)


def double_dqn_step(network, optimizer: optax.GradientTransformation, learner: Learner, data, weights, discount,
                    target_period: int):
    """One double-DQN learner step (traceable): the online network picks the next action, the target network values
    it; the loss is the mean of ``weights * huber(td)``; the target network copies the online one every
    ``target_period`` steps. ``data`` holds ``obs, action, reward, next_obs`` (leading [B] axis), ``weights`` the
    importance weights [B] (ones without priorities), ``discount`` the per-row bootstrap discount [B] (e.g.
    ``gamma * (1 - terminated)``, or an n-step one). Returns ``(learner, |td|, loss)``."""
    next_action = jnp.argmax(network.apply(learner.params, data["next_obs"]), axis=-1)
    q_next = jnp.take_along_axis(network.apply(learner.target_params, data["next_obs"]), next_action[:, None],
                                 axis=1)[:, 0]
    target = jax.lax.stop_gradient(data["reward"] + discount * q_next)

    def loss_fn(params):
        q = network.apply(params, data["obs"])
        q_taken = jnp.take_along_axis(q, data["action"][:, None], axis=1)[:, 0]
        td = q_taken - target
        return jnp.mean(weights * optax.huber_loss(td)), td

    (loss, td), grads = jax.value_and_grad(loss_fn, has_aux=True)(learner.params)
    updates, opt_state = optimizer.update(grads, learner.opt_state, learner.params)
    params = optax.apply_updates(learner.params, updates)
    step = learner.step + 1
    target_params = optax.periodic_update(params, learner.target_params, step, target_period)
    return Learner(params, target_params, opt_state, step), jnp.abs(td), loss


def make_train(config: DQNConfig):
    """``train(rng) -> result``: the whole run (a Python loop around jitted pieces: the plane is a host-side shell)."""
    env = envs.make(config.env)
    if env.num_actions == 0:
        raise ValueError(f"DQN needs a discrete action space; {config.env} is continuous (use experiments.sac)")
    if config.schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {config.schedule!r}; use one of {', '.join(SCHEDULES)}")
    venv = envs.vectorize(env)
    network = QNetwork(env.num_actions, config.hidden)
    optimizer = optax.chain(optax.clip_by_global_norm(10.0), optax.adam(config.learning_rate))
    n, T = config.num_envs, config.rollout_steps

    def init_learner(rng) -> Learner:
        params = network.init(rng, jnp.zeros((1, env.obs_dim), jnp.float32))
        return Learner(params, jax.tree_util.tree_map(jnp.copy, params), optimizer.init(params),
                       jnp.zeros((), jnp.int32))

    def init_actors(rng) -> Actors:
        rng, reset_rng = jax.random.split(rng)
        obs, env_state = venv.reset(jax.random.split(reset_rng, n))
        return Actors(obs, env_state, rng)

    def rollout(actors: Actors, params, epsilon):
        """``T`` epsilon-greedy steps of every env; transitions time-major ([T * n] items, env e at t * n + e)."""

        def one_step(actors: Actors, _):
            rng, explore_rng, action_rng, env_rng = jax.random.split(actors.rng, 4)
            greedy = jnp.argmax(network.apply(params, actors.obs), axis=-1).astype(jnp.int32)
            random = jax.random.randint(action_rng, (n,), 0, env.num_actions, jnp.int32)
            action = jnp.where(jax.random.uniform(explore_rng, (n,)) < epsilon, random, greedy)
            obs, env_state, reward, terminated, truncated, info = venv.step(jax.random.split(env_rng, n),
                                                                            actors.env_state, action)
            item = {"obs": actors.obs, "action": action, "reward": reward, "terminated": terminated,
                    "truncated": truncated, "next_obs": info["final_obs"]}
            return Actors(obs, env_state, rng), (item, info["episode_return"], info["episode_done"])

        actors, (items, returns, done) = jax.lax.scan(one_step, actors, None, T)
        items = jax.tree_util.tree_map(lambda x: x.reshape((T * n,) + x.shape[2:]), items)
        return actors, items, (jnp.sum(returns), jnp.sum(done))

    def learner_step(learner: Learner, data, weights, mask):
        if config.n_step > 1:
            data = transforms.n_step(data, mask, config.gamma)  # reward = G, discount = gamma^m (1 - terminated)
            discount = data["discount"]
        else:
            discount = config.gamma * (1.0 - data["terminated"].astype(jnp.float32))
        return double_dqn_step(network, optimizer, learner, data, weights, discount, config.target_period)

    def evaluate(params, rng):
        return greedy_return(venv, lambda obs: jnp.argmax(network.apply(params, obs), axis=-1).astype(jnp.int32),
                             config.eval_envs, rng)

    def train(rng) -> dict[str, Any]:
        start = time.perf_counter()
        plane = make_plane(config, env.obs_dim)
        replicated = NamedSharding(plane.mesh, P())  # learner and actors on every device of the plane's mesh
        learner_rng, actor_rng, eval_rng = jax.random.split(rng, 3)
        learner = jax.jit(init_learner, out_shardings=replicated)(learner_rng)
        actors = jax.jit(init_actors, out_shardings=replicated)(actor_rng)
        rollout_jit = jax.jit(rollout, donate_argnums=(0,))
        step_jit = jax.jit(learner_step, donate_argnums=(0,))
        sample = plane.sample_fn()

        def fused_step(learner, plane_state):
            """The fused path: the plane's sampling step inside the learner's own jit (no dispatch of its own)."""
            plane_state, delivery = sample(plane_state)
            learner, td, loss = learner_step(learner, delivery.data, delivery.weights, delivery.mask)
            return learner, plane_state, delivery, td, loss

        fused_jit = jax.jit(fused_step, donate_argnums=(0, 1))
        clock = IterationClock()
        episode_stats, losses = [], []
        decay_steps = max(1.0, config.epsilon_fraction * config.total_env_steps)
        progress = progress_bar(config.progress, config.iterations, f"DQN {config.schedule}")
        for iteration in range(config.iterations):
            env_steps = iteration * config.items_per_iteration
            epsilon = config.epsilon_start + (config.epsilon_end - config.epsilon_start) * min(1.0, env_steps /
                                                                                                  decay_steps)
            actors, items, stats = rollout_jit(actors, learner.params, np.float32(epsilon))
            plane.ingest(items)
            episode_stats.append(stats)  # device scalars; read once at the end (no extra host sync per step)
            if env_steps + config.items_per_iteration < config.learning_starts:
                continue
            for _ in range(config.updates_per_iteration):
                if config.fused:
                    learner, plane.state, delivery, td, loss = fused_jit(learner, plane.state)
                else:
                    delivery = plane.deliver()
                    learner, td, loss = step_jit(learner, delivery.data, delivery.weights, delivery.mask)
                plane.update_priorities(delivery.ids, td)
                losses.append(loss)
            clock.tick()
            if progress is not None:
                progress.update(1)
        if progress is not None:
            progress.close()
        jax.block_until_ready(learner)
        wall = time.perf_counter() - start
        curve = return_curve(jax.device_get(episode_stats), config.items_per_iteration)
        result = {
            "algorithm": "DQN" + (f" ({config.n_step}-step)" if config.n_step > 1 else "") + " + PER"
                         + (" (fused sampling)" if config.fused else ""),
            "config": dataclasses.asdict(config),
            "env_steps": config.iterations * config.items_per_iteration,
            "learner_steps": len(losses),
            "curve": curve,  # [env steps, mean return of the episodes that ended in that stretch]
            "train_return": last_return(jax.device_get(episode_stats)),
            "eval_return": float(evaluate(learner.params, eval_rng)),
            "loss_last": float(np.mean(jax.device_get(losses[-20:]))) if losses else None,
            "iteration_us": clock.median_us(),
            "learner_compute_us": learner_compute_us(step_jit, learner, delivery) if losses else None,
            "stages": plane.stats()["stages"],
            "plane_stats": {k: v for k, v in plane.stats().items() if k != "stages"},
            "wall_s": wall,
        }
        train.plane = plane  # the caller may export plane.timeline.chrome_trace(path)
        return result

    return train


# ------------------------------------------------------------------------------------------------------------------
# helpers shared with ppo.py / sac.py
# ------------------------------------------------------------------------------------------------------------------
def greedy_return(venv: envs.Env, policy, num_envs: int, rng, max_steps: int = 500):
    """Mean return of the first episode of ``num_envs`` environments under ``policy(obs) -> action`` (jitted scan)."""

    @jax.jit
    def run(rng):
        reset_rng, rng = jax.random.split(rng)
        obs, env_state = venv.reset(jax.random.split(reset_rng, num_envs))

        def one_step(carry, _):
            obs, env_state, rng, total, alive = carry
            rng, step_rng = jax.random.split(rng)
            obs, env_state, reward, terminated, truncated, _ = venv.step(jax.random.split(step_rng, num_envs),
                                                                         env_state, policy(obs))
            total = total + jnp.where(alive, reward, 0.0)
            alive = alive & ~(terminated | truncated)
            return (obs, env_state, rng, total, alive), None

        init = (obs, env_state, rng, jnp.zeros(num_envs), jnp.ones(num_envs, bool))
        (_, _, _, total, _), _ = jax.lax.scan(one_step, init, None, max_steps)
        return jnp.mean(total)

    return run(rng)


def learner_compute_us(step_jit, learner, delivery, reps: int = 20) -> float:
    """The learner step's own time on a ready batch (compiled, blocked): what an overlapped sample can hide behind."""
    args = (delivery.data, delivery.weights, delivery.mask)
    learner = jax.tree_util.tree_map(jnp.copy, learner)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        learner, td, _ = step_jit(learner, *args)
        jax.block_until_ready(td)
        times.append(time.perf_counter() - t0)
    return float(np.median(times) * 1e6)


def return_curve(stats, items_per_iteration: int, points: int = 40) -> list[list[float]]:
    """Episode returns binned over training: [env steps at the bin's end, mean return of episodes ended in it]."""
    sums = np.array([float(s) for s, _ in stats])
    counts = np.array([int(c) for _, c in stats])
    edges = np.linspace(0, len(stats), points + 1).astype(int)
    out = []
    for lo, hi in zip(edges[:-1], edges[1:]):
        if hi > lo and counts[lo:hi].sum():
            out.append([int(hi * items_per_iteration), float(sums[lo:hi].sum() / counts[lo:hi].sum())])
    return out


def last_return(stats, episodes: int = 20) -> float:
    """Mean return of (about) the last ``episodes`` episodes that ended during training."""
    total = count = 0.0
    for s, c in reversed(stats):
        total, count = total + float(s), count + int(c)
        if count >= episodes:
            break
    return total / count if count else float("nan")


def progress_bar(enabled: bool, total: int, desc: str):
    if not enabled:
        return None
    from tqdm.auto import tqdm
    return tqdm(total=total, desc=desc, unit="it", leave=False)


def add_common_arguments(parser: argparse.ArgumentParser, defaults) -> None:
    parser.add_argument("--schedule", choices=SCHEDULES, default=defaults.schedule)
    parser.add_argument("--env", default=defaults.env)
    parser.add_argument("--total-env-steps", type=int, default=defaults.total_env_steps)
    parser.add_argument("--depth", type=int, default=defaults.depth)
    parser.add_argument("--defer", type=int, default=defaults.defer)
    parser.add_argument("--devices", type=int, default=defaults.devices)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--trace", default=None, help="write a Chrome trace of the plane's stages here")
    parser.add_argument("--json", default=None, help="write the result JSON here")
    parser.add_argument("--progress", action="store_true")


def run_cli(defaults, make_train_fn, args) -> dict:
    """Run one learner from the command line: ``defaults`` with every field the arguments name (argument names are
    the config's field names), then print, trace and write the result as asked."""
    fields = {field.name for field in dataclasses.fields(defaults)}
    config = dataclasses.replace(defaults, **{name: value for name, value in vars(args).items() if name in fields})
    train = make_train_fn(config)
    result = train(jax.random.key(config.seed))
    print(format_result(result))
    if args.trace:
        train.plane.timeline.chrome_trace(args.trace)
        print(f"  trace written to {args.trace}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


def main(argv: Optional[list[str]] = None) -> None:
    defaults = DQNConfig()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_arguments(parser, defaults)
    parser.add_argument("--n-step", type=int, default=defaults.n_step)
    parser.add_argument("--hidden", type=int, default=defaults.hidden)
    parser.add_argument("--batch-size", type=int, default=defaults.batch_size)
    parser.add_argument("--fused", action="store_true", help="sample inside the learner's jit (plane.sample_fn())")
    run_cli(defaults, make_train, parser.parse_args(argv))


if __name__ == "__main__":
    main()
