"""PPO (clipped objective, GAE) on a pure-JAX environment, with its minibatches delivered by an ExperienceDataPlane.

The experience path, as a user wires it:
  * a jitted rollout: ``num_envs`` vmapped environments, ``num_steps`` steps in one scan; GAE advantages and returns
    computed in JAX on the device before anything leaves the rollout;
  * ``plane.set_policy_version(v)`` then ``plane.ingest(rollout)``: every item carries the int32 ``policy_version``
    it was produced with; the plane (``capacity == num_envs * num_steps``, ``staleness=Staleness(0)``) never delivers
    an item of an older version;
  * ``epochs * num_minibatches`` calls of ``plane.deliver()`` on a ``samplers.epochs(minibatch_size)`` plane (each
    item once per epoch), each followed by a jitted flax/optax PPO step on ``delivery.data`` (rows weighted by
    ``delivery.mask``).
The plane's rate limiter is ``sample_to_insert_ratio(epochs, ...)``: it admits exactly ``epochs`` deliveries of every
item, so prefetch (overlap / deferred / adaptive) can never dispatch a minibatch past the end of the last epoch, where
it would be a batch of the previous rollout (masked as stale after the version switch, i.e. a wasted learner step).

``make_train(config) -> train(rng) -> result``; ``python -m experiments.ppo --help``.
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

from conduit_jax import ExperienceDataPlane, ExperienceSpec, default_mesh, limits, samplers
from experiments import SCHEDULES, IterationClock, envs, make_schedule
from experiments.dqn import add_common_arguments, greedy_return, last_return, learner_compute_us, progress_bar, \
    return_curve, run_cli


@dataclasses.dataclass(frozen=True)
class PPOConfig:
    env: str = "CartPole"
    num_envs: int = 8
    num_steps: int = 64  # rollout length per environment: one ingest of num_envs * num_steps items
    total_env_steps: int = 60_000
    epochs: int = 4
    num_minibatches: int = 4
    hidden: int = 64
    learning_rate: float = 2.5e-3
    anneal_lr: bool = True
    gamma: float = 0.99
    gae_lambda: float = 0.95
    clip_eps: float = 0.2
    entropy_coef: float = 0.01
    value_coef: float = 0.5
    max_grad_norm: float = 0.5
    schedule: str = "sync"
    depth: int = 2
    defer: int = 2  # unused by PPO (no priorities); kept so every learner takes the same flags
    devices: int = 1
    eval_envs: int = 16
    seed: int = 0
    progress: bool = False

    @property
    def rollout_size(self) -> int:
        return self.num_envs * self.num_steps

    @property
    def minibatch_size(self) -> int:
        return self.rollout_size // self.num_minibatches

    @property
    def iterations(self) -> int:
        return self.total_env_steps // self.rollout_size


class ActorCritic(nn.Module):
    num_actions: int
    hidden: int

    @nn.compact
    def __call__(self, obs):
        init = nn.initializers.orthogonal
        pi = nn.tanh(nn.Dense(self.hidden, kernel_init=init(np.sqrt(2)))(obs))
        pi = nn.tanh(nn.Dense(self.hidden, kernel_init=init(np.sqrt(2)))(pi))
        logits = nn.Dense(self.num_actions, kernel_init=init(0.01))(pi)
        v = nn.tanh(nn.Dense(self.hidden, kernel_init=init(np.sqrt(2)))(obs))
        v = nn.tanh(nn.Dense(self.hidden, kernel_init=init(np.sqrt(2)))(v))
        return logits, nn.Dense(1, kernel_init=init(1.0))(v)[..., 0]


class Learner(NamedTuple):
    params: Any
    opt_state: Any


class Actors(NamedTuple):
    obs: jax.Array
    env_state: Any
    rng: jax.Array


def collect_rollout(network: nn.Module, venv, params, actors: Actors, num_steps: int, gamma: float,
                    gae_lambda: float):
    """``num_steps`` steps of every env of ``venv`` under the categorical policy ``network.apply(params, obs) ->
    (logits, value)``, then GAE advantages and returns, all in JAX (traceable: call it inside a jit or a scan).

    ``actors`` is any NamedTuple with fields ``(obs, env_state, rng)``; the returned one has the same type. A truncation
    bootstraps through the value of the real last observation. Returns ``(actors, items, episode_return,
    episode_done)``: ``items`` the dict of ``obs, action, log_prob, value, advantage, ret`` with a leading
    [num_steps * num_envs] axis (time-major: env e of step t at t * num_envs + e); ``episode_return`` and
    ``episode_done`` the envs' per-step episode statistics, [num_steps, num_envs]."""
    n = actors.obs.shape[0]

    def one_step(actors, _):
        rng, action_rng, env_rng = jax.random.split(actors.rng, 3)
        logits, value = network.apply(params, actors.obs)
        action = jax.random.categorical(action_rng, logits).astype(jnp.int32)
        log_prob = jnp.take_along_axis(jax.nn.log_softmax(logits), action[:, None], axis=1)[:, 0]
        obs, env_state, reward, terminated, truncated, info = venv.step(jax.random.split(env_rng, n),
                                                                        actors.env_state, action)
        # bootstrap through a truncation with the value of the real last observation
        _, final_value = network.apply(params, info["final_obs"])
        reward = reward + gamma * jnp.where(truncated, final_value, 0.0)
        step = {"obs": actors.obs, "action": action, "log_prob": log_prob, "value": value, "reward": reward,
                "done": terminated | truncated}
        return actors._replace(obs=obs, env_state=env_state, rng=rng), (step, info["episode_return"],
                                                                        info["episode_done"])

    actors, (steps, returns, done) = jax.lax.scan(one_step, actors, None, num_steps)
    _, last_value = network.apply(params, actors.obs)

    def gae_step(carry, step):
        advantage, next_value = carry
        not_done = 1.0 - step["done"].astype(jnp.float32)
        delta = step["reward"] + gamma * next_value * not_done - step["value"]
        advantage = delta + gamma * gae_lambda * not_done * advantage
        return (advantage, step["value"]), advantage

    _, advantages = jax.lax.scan(gae_step, (jnp.zeros(n), last_value), steps, reverse=True)
    items = {"obs": steps["obs"], "action": steps["action"], "log_prob": steps["log_prob"],
             "value": steps["value"], "advantage": advantages, "ret": advantages + steps["value"]}
    items = jax.tree_util.tree_map(lambda x: x.reshape((num_steps * n,) + x.shape[2:]), items)
    return actors, items, returns, done


def example_item(obs_dim: int) -> dict[str, np.ndarray]:
    return {"obs": np.zeros(obs_dim, np.float32), "action": np.int32(0), "log_prob": np.float32(0.0),
            "value": np.float32(0.0), "advantage": np.float32(0.0), "ret": np.float32(0.0),
            "policy_version": np.int32(0)}


def make_plane(config: PPOConfig, obs_dim: int) -> ExperienceDataPlane:
    if config.rollout_size % config.num_minibatches:
        raise ValueError(f"PPO: rollout size {config.rollout_size} (num_envs x num_steps) must be a multiple of "
                         f"num_minibatches {config.num_minibatches}")
    batch = config.minibatch_size
    # exactly `epochs` deliveries per item: error = inserts * epochs - sampled items. An epoch's last minibatch takes
    # error from B to 0; one more needs 0 - B >= epochs - buffer, which buffer = (epochs + B) / 2 < epochs + B refuses
    limiter = limits.sample_to_insert_ratio(config.epochs, min_size=1, error_buffer=(config.epochs + batch) / 2)
    return ExperienceDataPlane(ExperienceSpec.from_example(example_item(obs_dim)), config.rollout_size,
                               samplers.epochs(batch), limiter=limiter,
                               staleness=limits.Staleness(0, "policy_version"),
                               schedule=make_schedule(config.schedule, config.depth, config.defer),
                               mesh=default_mesh(config.devices), seed=config.seed)


def make_train(config: PPOConfig):
    env = envs.make(config.env)
    if env.num_actions == 0:
        raise ValueError(f"this PPO has a categorical policy; {config.env} is continuous (use experiments.sac)")
    if config.schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {config.schedule!r}; use one of {', '.join(SCHEDULES)}")
    venv = envs.vectorize(env)
    network = ActorCritic(env.num_actions, config.hidden)
    n, T = config.num_envs, config.num_steps
    updates = config.iterations * config.epochs * config.num_minibatches
    lr = optax.linear_schedule(config.learning_rate, 0.0, updates) if config.anneal_lr else config.learning_rate
    optimizer = optax.chain(optax.clip_by_global_norm(config.max_grad_norm), optax.adam(lr, eps=1e-5))

    def init_learner(rng) -> Learner:
        params = network.init(rng, jnp.zeros((1, env.obs_dim), jnp.float32))
        return Learner(params, optimizer.init(params))

    def init_actors(rng) -> Actors:
        rng, reset_rng = jax.random.split(rng)
        obs, env_state = venv.reset(jax.random.split(reset_rng, n))
        return Actors(obs, env_state, rng)

    def rollout(actors: Actors, params, version):
        """``T`` steps of every env under the current policy, then GAE; returns [T * n] items (time-major)."""
        actors, items, returns, done = collect_rollout(network, venv, params, actors, T, config.gamma,
                                                       config.gae_lambda)
        items["policy_version"] = jnp.full((T * n,), version, jnp.int32)
        return actors, items, (jnp.sum(returns), jnp.sum(done))

    def learner_step(learner: Learner, data, weights, mask):
        del weights  # the epochs sampler has no importance weights
        rows = jnp.ones(data["action"].shape, jnp.float32) if mask is None else mask.astype(jnp.float32)
        count = jnp.maximum(jnp.sum(rows), 1.0)

        def mean(x):  # masked rows count for nothing
            return jnp.sum(x * rows) / count

        advantage = data["advantage"]
        advantage = (advantage - mean(advantage)) / (jnp.sqrt(mean((advantage - mean(advantage)) ** 2)) + 1e-8)

        def loss_fn(params):
            logits, value = network.apply(params, data["obs"])
            log_probs = jax.nn.log_softmax(logits)
            log_prob = jnp.take_along_axis(log_probs, data["action"][:, None], axis=1)[:, 0]
            ratio = jnp.exp(log_prob - data["log_prob"])
            policy_loss = -mean(jnp.minimum(ratio * advantage,
                                            jnp.clip(ratio, 1 - config.clip_eps, 1 + config.clip_eps) * advantage))
            value_clipped = data["value"] + jnp.clip(value - data["value"], -config.clip_eps, config.clip_eps)
            value_loss = 0.5 * mean(jnp.maximum((value - data["ret"]) ** 2, (value_clipped - data["ret"]) ** 2))
            entropy = mean(-jnp.sum(jnp.exp(log_probs) * log_probs, axis=-1))
            return policy_loss + config.value_coef * value_loss - config.entropy_coef * entropy

        loss, grads = jax.value_and_grad(loss_fn)(learner.params)
        updates, opt_state = optimizer.update(grads, learner.opt_state, learner.params)
        return Learner(optax.apply_updates(learner.params, updates), opt_state), jnp.sum(rows), loss

    def evaluate(params, rng):
        return greedy_return(venv, lambda obs: jnp.argmax(network.apply(params, obs)[0], axis=-1).astype(jnp.int32),
                             config.eval_envs, rng)

    def train(rng) -> dict[str, Any]:
        start = time.perf_counter()
        plane = make_plane(config, env.obs_dim)
        replicated = NamedSharding(plane.mesh, P())
        learner_rng, actor_rng, eval_rng = jax.random.split(rng, 3)
        learner = jax.jit(init_learner, out_shardings=replicated)(learner_rng)
        actors = jax.jit(init_actors, out_shardings=replicated)(actor_rng)
        rollout_jit = jax.jit(rollout, donate_argnums=(0,))
        step_jit = jax.jit(learner_step, donate_argnums=(0,))
        clock = IterationClock()
        episode_stats, losses, rows_used = [], [], []
        progress = progress_bar(config.progress, config.iterations, f"PPO {config.schedule}")
        for version in range(config.iterations):
            actors, items, stats = rollout_jit(actors, learner.params, np.int32(version))
            episode_stats.append(stats)
            plane.set_policy_version(version)  # the learner's policy is now the one that produced `items`
            plane.ingest(items)
            for _ in range(config.epochs * config.num_minibatches):
                delivery = plane.deliver()
                learner, used, loss = step_jit(learner, delivery.data, delivery.weights, delivery.mask)
                losses.append(loss)
                rows_used.append(used)
                clock.tick()
            if progress is not None:
                progress.update(1)
        if progress is not None:
            progress.close()
        jax.block_until_ready(learner)
        wall = time.perf_counter() - start
        stats_host = jax.device_get(episode_stats)
        rows_used = np.asarray(jax.device_get(rows_used))
        stats = plane.stats()
        result = {
            "algorithm": "PPO",
            "config": dataclasses.asdict(config),
            "env_steps": config.iterations * config.rollout_size,
            "learner_steps": len(losses),
            "curve": return_curve(stats_host, config.rollout_size),
            "train_return": last_return(stats_host),
            "eval_return": float(evaluate(learner.params, eval_rng)),
            "loss_last": float(np.mean(jax.device_get(losses[-16:]))),
            # every delivered row was of the current policy version (masked rows would be stale ones)
            "stale_rows_delivered": int(len(rows_used) * config.minibatch_size - rows_used.sum()),
            "iteration_us": clock.median_us(),
            "learner_compute_us": learner_compute_us(step_jit, learner, delivery),
            "stages": stats["stages"],
            "plane_stats": {k: v for k, v in stats.items() if k != "stages"},
            "wall_s": wall,
        }
        train.plane = plane
        return result

    return train


def main(argv: Optional[list[str]] = None) -> None:
    defaults = PPOConfig()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_arguments(parser, defaults)
    parser.add_argument("--hidden", type=int, default=defaults.hidden)
    run_cli(defaults, make_train, parser.parse_args(argv))


if __name__ == "__main__":
    main()
