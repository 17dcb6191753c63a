"""SAC (twin critics, tanh-Gaussian actor, learned temperature) on pure-JAX Pendulum, fed by an ExperienceDataPlane.

The experience path, as a user wires it: ``num_envs`` vmapped Pendulums stepped in one jitted scan with actions drawn
from the current actor; the transitions go to ``plane.ingest`` as JAX arrays; every iteration makes
``updates_per_iteration`` calls of ``plane.deliver()`` (uniform replay) under the plane's schedule, each followed by a
jitted flax/optax SAC step on ``delivery.data``.

``make_train(config) -> train(rng) -> result``; ``python -m experiments.sac --help``. Random play on Pendulum returns
about -1200 per episode; a learned policy about -150 to -250.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from typing import Any, NamedTuple, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from conduit_jax import ExperienceDataPlane, ExperienceSpec, default_mesh, samplers
from experiments import SCHEDULES, IterationClock, envs, make_schedule
from experiments.dqn import add_common_arguments, greedy_return, last_return, learner_compute_us, progress_bar, \
    return_curve, run_cli


@dataclasses.dataclass(frozen=True)
class SACConfig:
    env: str = "Pendulum"
    num_envs: int = 4
    rollout_steps: int = 1
    updates_per_iteration: int = 4  # one learner step per environment step
    total_env_steps: int = 16_000
    learning_starts: int = 1_000
    capacity: int = 32_768
    batch_size: int = 128
    hidden: int = 128
    learning_rate: float = 1e-3
    gamma: float = 0.99
    tau: float = 0.005  # polyak step of the target critics
    schedule: str = "sync"
    depth: int = 2
    defer: int = 2
    devices: int = 1
    eval_envs: int = 16
    seed: int = 0
    progress: bool = False

    @property
    def items_per_iteration(self) -> int:
        return self.num_envs * self.rollout_steps

    @property
    def iterations(self) -> int:
        return self.total_env_steps // self.items_per_iteration


class Actor(nn.Module):
    action_dim: int
    hidden: int

    @nn.compact
    def __call__(self, obs):
        x = nn.relu(nn.Dense(self.hidden)(obs))
        x = nn.relu(nn.Dense(self.hidden)(x))
        mean = nn.Dense(self.action_dim)(x)
        log_std = jnp.clip(nn.Dense(self.action_dim)(x), -5.0, 2.0)
        return mean, log_std


class TwinCritic(nn.Module):
    hidden: int

    @nn.compact
    def __call__(self, obs, action):
        x = jnp.concatenate([obs, action], axis=-1)
        qs = []
        for _ in range(2):
            h = nn.relu(nn.Dense(self.hidden)(x))
            h = nn.relu(nn.Dense(self.hidden)(h))
            qs.append(nn.Dense(1)(h)[..., 0])
        return jnp.stack(qs)  # [2, B]


class Learner(NamedTuple):
    actor: Any
    critic: Any
    target_critic: Any
    log_alpha: jax.Array
    actor_opt: Any
    critic_opt: Any
    alpha_opt: Any


class Actors(NamedTuple):
    obs: jax.Array
    env_state: Any
    rng: jax.Array


def example_transition(obs_dim: int, action_dim: int) -> dict[str, np.ndarray]:
    return {"obs": np.zeros(obs_dim, np.float32), "action": np.zeros(action_dim, np.float32),
            "reward": np.float32(0.0), "terminated": np.bool_(False), "next_obs": np.zeros(obs_dim, np.float32)}


def make_train(config: SACConfig):
    env = envs.make(config.env)
    if env.num_actions:
        raise ValueError(f"this SAC is for continuous actions; {config.env} is discrete (use experiments.dqn)")
    if config.schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {config.schedule!r}; use one of {', '.join(SCHEDULES)}")
    venv = envs.vectorize(env)
    actor_net, critic_net = Actor(env.action_dim, config.hidden), TwinCritic(config.hidden)
    actor_tx, critic_tx, alpha_tx = (optax.adam(config.learning_rate) for _ in range(3))
    scale = (env.action_high - env.action_low) / 2.0
    shift = (env.action_high + env.action_low) / 2.0
    target_entropy = -float(env.action_dim)
    n, T = config.num_envs, config.rollout_steps

    def policy(actor_params, obs, rng):
        """A tanh-squashed Gaussian action in the env's range and its log-probability."""
        mean, log_std = actor_net.apply(actor_params, obs)
        std = jnp.exp(log_std)
        raw = mean + std * jax.random.normal(rng, mean.shape)
        squashed = jnp.tanh(raw)
        log_prob = jnp.sum(-0.5 * ((raw - mean) / std) ** 2 - log_std - 0.5 * jnp.log(2 * jnp.pi)
                           - jnp.log(scale * (1 - squashed**2) + 1e-6), axis=-1)
        return squashed * scale + shift, log_prob

    def init_learner(rng) -> Learner:
        actor_rng, critic_rng = jax.random.split(rng)
        obs, action = jnp.zeros((1, env.obs_dim)), jnp.zeros((1, env.action_dim))
        actor = actor_net.init(actor_rng, obs)
        critic = critic_net.init(critic_rng, obs, action)
        log_alpha = jnp.zeros((), jnp.float32)
        return Learner(actor, critic, jax.tree_util.tree_map(jnp.copy, critic), log_alpha, actor_tx.init(actor),
                       critic_tx.init(critic), alpha_tx.init(log_alpha))

    def init_actors(rng) -> Actors:
        rng, reset_rng = jax.random.split(rng)
        obs, env_state = venv.reset(jax.random.split(reset_rng, n))
        return Actors(obs, env_state, rng)

    def rollout(actors: Actors, actor_params, uniform):
        def one_step(actors: Actors, _):
            rng, action_rng, env_rng = jax.random.split(actors.rng, 3)
            action, _ = policy(actor_params, actors.obs, action_rng)
            random = jax.random.uniform(action_rng, action.shape, minval=env.action_low, maxval=env.action_high)
            action = jnp.where(uniform, random, action)
            obs, env_state, reward, terminated, _, info = venv.step(jax.random.split(env_rng, n),
                                                                    actors.env_state, action)
            item = {"obs": actors.obs, "action": action, "reward": reward, "terminated": terminated,
                    "next_obs": info["final_obs"]}
            return Actors(obs, env_state, rng), (item, info["episode_return"], info["episode_done"])

        actors, (items, returns, done) = jax.lax.scan(one_step, actors, None, T)
        items = jax.tree_util.tree_map(lambda x: x.reshape((T * n,) + x.shape[2:]), items)
        return actors, items, (jnp.sum(returns), jnp.sum(done))

    def learner_step(learner: Learner, data, weights, mask, rng):
        del weights, mask  # uniform replay: no importance weights, no padding
        next_rng, actor_rng = jax.random.split(rng)
        alpha = jnp.exp(learner.log_alpha)
        next_action, next_log_prob = policy(learner.actor, data["next_obs"], next_rng)
        next_q = jnp.min(critic_net.apply(learner.target_critic, data["next_obs"], next_action), axis=0)
        not_done = 1.0 - data["terminated"].astype(jnp.float32)
        target = jax.lax.stop_gradient(data["reward"] + config.gamma * not_done * (next_q - alpha * next_log_prob))

        def critic_loss(critic):
            q = critic_net.apply(critic, data["obs"], data["action"])
            return jnp.mean((q - target[None]) ** 2)

        critic_value, critic_grads = jax.value_and_grad(critic_loss)(learner.critic)
        updates, critic_opt = critic_tx.update(critic_grads, learner.critic_opt, learner.critic)
        critic = optax.apply_updates(learner.critic, updates)

        def actor_loss(actor):
            action, log_prob = policy(actor, data["obs"], actor_rng)
            q = jnp.min(critic_net.apply(critic, data["obs"], action), axis=0)
            return jnp.mean(alpha * log_prob - q), log_prob

        (actor_value, log_prob), actor_grads = jax.value_and_grad(actor_loss, has_aux=True)(learner.actor)
        updates, actor_opt = actor_tx.update(actor_grads, learner.actor_opt, learner.actor)
        actor = optax.apply_updates(learner.actor, updates)

        entropy_gap = jax.lax.stop_gradient(-log_prob - target_entropy)
        alpha_grad = jax.grad(lambda log_alpha: jnp.mean(log_alpha * entropy_gap))(learner.log_alpha)
        updates, alpha_opt = alpha_tx.update(alpha_grad, learner.alpha_opt, learner.log_alpha)
        log_alpha = optax.apply_updates(learner.log_alpha, updates)
        target_critic = optax.incremental_update(critic, learner.target_critic, config.tau)
        return (Learner(actor, critic, target_critic, log_alpha, actor_opt, critic_opt, alpha_opt),
                critic_value, actor_value)

    def evaluate(actor_params, rng):
        def deterministic(obs):
            mean, _ = actor_net.apply(actor_params, obs)
            return jnp.tanh(mean) * scale + shift
        return greedy_return(venv, deterministic, config.eval_envs, rng, max_steps=200)

    def train(rng) -> dict[str, Any]:
        start = time.perf_counter()
        spec = ExperienceSpec.from_example(example_transition(env.obs_dim, env.action_dim))
        plane = ExperienceDataPlane(spec, config.capacity, samplers.uniform(config.batch_size),
                                    schedule=make_schedule(config.schedule, config.depth, config.defer),
                                    mesh=default_mesh(config.devices), seed=config.seed)
        replicated = NamedSharding(plane.mesh, P())
        learner_rng, actor_rng, eval_rng, step_rng = jax.random.split(rng, 4)
        learner = jax.jit(init_learner, out_shardings=replicated)(learner_rng)
        actors = jax.jit(init_actors, out_shardings=replicated)(actor_rng)
        rollout_jit = jax.jit(rollout, donate_argnums=(0,))
        step_jit = jax.jit(learner_step, donate_argnums=(0,))
        clock = IterationClock()
        episode_stats, losses = [], []
        progress = progress_bar(config.progress, config.iterations, f"SAC {config.schedule}")
        for iteration in range(config.iterations):
            env_steps = iteration * config.items_per_iteration
            actors, items, stats = rollout_jit(actors, learner.actor, env_steps < config.learning_starts)
            plane.ingest(items)
            episode_stats.append(stats)
            if env_steps + config.items_per_iteration < config.learning_starts:
                continue
            for _ in range(config.updates_per_iteration):
                delivery = plane.deliver()
                learner, critic_loss, _ = step_jit(learner, delivery.data, delivery.weights, delivery.mask,
                                                   jax.random.fold_in(step_rng, len(losses)))
                losses.append(critic_loss)
                clock.tick()
            if progress is not None:
                progress.update(1)
        if progress is not None:
            progress.close()
        jax.block_until_ready(learner)
        wall = time.perf_counter() - start
        stats_host = jax.device_get(episode_stats)
        stats = plane.stats()

        def step_with_rng(learner, data, weights, mask):
            return step_jit(learner, data, weights, mask, step_rng)

        result = {
            "algorithm": "SAC",
            "config": dataclasses.asdict(config),
            "env_steps": config.iterations * config.items_per_iteration,
            "learner_steps": len(losses),
            "curve": return_curve(stats_host, config.items_per_iteration),
            "train_return": last_return(stats_host, episodes=8),
            "eval_return": float(evaluate(learner.actor, eval_rng)),
            "loss_last": float(np.mean(jax.device_get(losses[-20:]))),
            "iteration_us": clock.median_us(),
            "learner_compute_us": learner_compute_us(step_with_rng, learner, delivery),
            "stages": stats["stages"],
            "plane_stats": {k: v for k, v in stats.items() if k != "stages"},
            "wall_s": wall,
        }
        train.plane = plane
        return result

    return train


def main(argv: Optional[list[str]] = None) -> None:
    defaults = SACConfig()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_arguments(parser, defaults)
    parser.add_argument("--hidden", type=int, default=defaults.hidden)
    run_cli(defaults, make_train, parser.parse_args(argv))


if __name__ == "__main__":
    main()
