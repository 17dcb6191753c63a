"""Fully jitted learners: env step, add, sample, priority update and learner step inside ONE ``lax.scan``.

The PureJaxRL / Flashbax way of writing RL: the whole training run is one compiled program, the replay buffer a set
of pure functions over a state pytree carried by the scan. Conduit's functional API (``conduit_jax.make_buffer``)
is written for this; here it runs three learners on the pure-JAX environments of ``experiments.envs``:

  * DQN with uniform replay, and DQN with prioritized replay (priorities ``|TD error| + eps``, importance weights
    from ``Delivery.weights``): each scan iteration steps ``num_envs`` environments once, adds the ``num_envs``
    transitions, then runs ``updates_per_step`` (sample, double-DQN step, priority update) behind a ``lax.cond`` that
    opens once ``learning_starts`` env steps were taken and the buffer can deliver;
  * PPO: each iteration is a rollout of ``num_steps`` x ``num_envs`` steps with GAE, ingested into a buffer of
    exactly that capacity with ``samplers.epochs(minibatch)`` (ingesting starts a new epoch: every item once per
    epoch), then ``epochs x num_minibatches`` (sample, PPO step) in an inner scan.

The replay contender of the DQN loop is pluggable (``REPLAYS``): Conduit's buffer, Flashbax's ``make_item_buffer`` or
its ``make_prioritised_item_buffer``, behind the same ``Replay`` functions, so the same loop (env, network, batch
size, replay ratio) runs with each; ``benchmarks/bench_w7.py`` times them against each other.

``make_train(config, buffer_kind) -> train(rng) -> (carry, metrics)`` (jitted); ``make_learner`` gives the pieces
(``init(rng) -> carry``, ``step(carry, _) -> (carry, metrics)``) for callers that scan segments themselves.
``python -m experiments.jitted --help``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from typing import Any, Callable, NamedTuple, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np
import optax

import conduit_jax as cj
from conduit_jax.demo import LearnerState, QNetwork
from experiments import envs
from experiments.dqn import double_dqn_step
from experiments.ppo import ActorCritic, collect_rollout

BUFFER_KINDS = ("conduit", "flashbax")  # DQN; PPO runs on conduit only (Flashbax has no epoch sampler)


@dataclasses.dataclass(frozen=True)
class DQNConfig:
    env: str = "CartPole"
    num_envs: int = 8  # transitions added per scan iteration
    updates_per_step: int = 1  # learner updates per scan iteration (replay ratio: batch_size * this / num_envs)
    total_env_steps: int = 50_000
    learning_starts: int = 1_000  # env steps before the first update
    capacity: int = 65_536
    batch_size: int = 128
    prioritized: bool = False
    alpha: float = 0.6
    beta: float = 0.4  # importance-weight exponent at the first update, annealed linearly to 1 over the run
    per_eps: float = 1e-6  # priority = |td| + per_eps
    hidden: int = 64
    learning_rate: float = 1e-3
    gamma: float = 0.99
    target_period: int = 500  # learner steps between target-network copies
    epsilon_start: float = 1.0
    epsilon_end: float = 0.05
    epsilon_fraction: float = 0.3  # of total_env_steps over which epsilon decays linearly
    devices: int = 1  # the mesh Conduit's buffer shards over (Flashbax: 1 only)
    # how updates wait for learning_starts: "cond" runs (sample, learn, update) under lax.cond (PureJaxRL's DQN);
    # "mask" runs them every iteration and keeps the learner's new parameters only once learning has started
    # (the priorities of the draw are written either way; Conduit's update skips the -1 ids of an invalid draw)
    gate: str = "cond"
    record_ids: bool = False  # metrics["ids"]: the ids of every draw ([iterations, updates_per_step, B, ...])
    seed: int = 0

    @property
    def iterations(self) -> int:
        return self.total_env_steps // self.num_envs

    @property
    def annealed_updates(self) -> int:
        return max(1, (self.total_env_steps - self.learning_starts) // self.num_envs * self.updates_per_step)


@dataclasses.dataclass(frozen=True)
class PPOConfig:
    env: str = "CartPole"
    num_envs: int = 8
    num_steps: int = 128  # rollout length per environment
    total_env_steps: int = 100_000
    epochs: int = 4
    num_minibatches: int = 4
    hidden: int = 64
    learning_rate: float = 2.5e-3
    gamma: float = 0.99
    gae_lambda: float = 0.95
    clip_eps: float = 0.2
    entropy_coef: float = 0.01
    value_coef: float = 0.5
    max_grad_norm: float = 0.5
    devices: int = 1
    seed: int = 0

    @property
    def rollout_size(self) -> int:
        return self.num_envs * self.num_steps

    @property
    def minibatch_size(self) -> int:
        return self.rollout_size // self.num_minibatches

    @property
    def iterations(self) -> int:
        return self.total_env_steps // self.rollout_size


# ------------------------------------------------------------------------------------------------------------------
# The replay contenders: the same functions over each library's state
# ------------------------------------------------------------------------------------------------------------------
class Sample(NamedTuple):
    data: Any  # the batch, leading axis [batch_size]
    ids: Any  # what update() takes back (Conduit: int32[B, 2]; Flashbax: int32[B])
    weights: jax.Array  # float32[B]: importance weights (ones without priorities)
    valid: jax.Array  # bool[]: False when nothing could be drawn (the batch is then not to be learned from)


class Replay(NamedTuple):
    """A replay buffer as the loop uses it. Every function is pure and traceable; randomness lives in the state."""

    name: str
    prioritized: bool
    init: Callable[[], Any]
    add: Callable[[Any, Any], Any]  # (state, items[n]) -> state
    sample: Callable[[Any], tuple[Any, Sample]]
    update: Callable[[Any, Any, jax.Array], Any]  # (state, ids, |td|) -> state; the identity without priorities
    can_sample: Callable[[Any], jax.Array]
    buffer: Optional[cj.Buffer] = None  # Conduit's Buffer when the contender is ours (tests read its state with it)


def transition_spec(obs_dim: int) -> dict[str, jax.ShapeDtypeStruct]:
    """One DQN item (no batch axis)."""
    f32 = jnp.float32
    return {"obs": jax.ShapeDtypeStruct((obs_dim,), f32), "action": jax.ShapeDtypeStruct((), jnp.int32),
            "reward": jax.ShapeDtypeStruct((), f32), "terminated": jax.ShapeDtypeStruct((), jnp.bool_),
            "next_obs": jax.ShapeDtypeStruct((obs_dim,), f32)}


def _beta(config: DQNConfig) -> Callable[[jax.Array], jax.Array]:
    return optax.linear_schedule(config.beta, 1.0, config.annealed_updates)


def conduit_replay(config: DQNConfig, spec) -> Replay:
    """``cj.make_buffer`` with ``samplers.uniform`` or ``samplers.prioritized`` (the sampler anneals beta itself)."""
    if config.prioritized:
        sampler = cj.samplers.prioritized(config.batch_size, alpha=config.alpha, beta=_beta(config),
                                          eps=config.per_eps)
    else:
        sampler = cj.samplers.uniform(config.batch_size)
    buffer = cj.make_buffer(spec, config.capacity, sampler, mesh=cj.default_mesh(config.devices))

    def sample(state):
        state, delivery = buffer.sample(state)
        weights = jnp.ones((config.batch_size,), jnp.float32) if delivery.weights is None else delivery.weights
        return state, Sample(delivery.data, delivery.ids, weights, delivery.valid)

    def update(state, ids, td):
        return buffer.update(state, ids, td) if config.prioritized else state  # the sampler adds per_eps

    return Replay("conduit-per" if config.prioritized else "conduit", config.prioritized,
                  lambda: buffer.init(seed=config.seed), buffer.ingest, sample, update, buffer.can_sample, buffer)


class FlashbaxState(NamedTuple):
    buffer: Any  # Flashbax's own state
    key: jax.Array  # the sampling key, split on every draw
    draws: jax.Array  # int32[]: draws so far (the beta schedule's step, as Conduit's sampler counts them)


def flashbax_replay(config: DQNConfig, spec) -> Replay:
    """Flashbax's ``make_item_buffer`` / ``make_prioritised_item_buffer(device="cpu")`` with ``add_sequences=True``
    (the ``num_envs`` transitions of a step in one add). Flashbax returns sampling probabilities, not weights: the
    loop's weights are ``(N * P(i)) ** -beta`` over the batch maximum, N the stored items, as Conduit's sampler
    computes them."""
    import flashbax as fbx

    if config.devices != 1:
        raise ValueError(f"flashbax: its buffers are not sharded; devices must be 1, got {config.devices}")
    common = dict(max_length=config.capacity, min_length=1, sample_batch_size=config.batch_size, add_sequences=True)
    if config.prioritized:
        buffer = fbx.make_prioritised_item_buffer(**common, priority_exponent=config.alpha, device="cpu")
    else:
        buffer = fbx.make_item_buffer(**common)
    example = jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), spec)
    beta = _beta(config)

    def init():
        return FlashbaxState(buffer.init(example), jax.random.key(config.seed), jnp.zeros((), jnp.int32))

    def add(state, items):
        return state._replace(buffer=buffer.add(state.buffer, items))

    def sample(state):
        key, sub = jax.random.split(state.key)
        out = buffer.sample(state.buffer, sub)
        valid = buffer.can_sample(state.buffer)
        if config.prioritized:
            n = jnp.where(state.buffer.is_full, config.capacity, state.buffer.current_index).astype(jnp.float32)
            w = jnp.power(n * out.probabilities, -beta(state.draws))
            weights, ids = w / jnp.max(w), out.indices
        else:
            weights, ids = jnp.ones((config.batch_size,), jnp.float32), jnp.zeros((config.batch_size,), jnp.int32)
        return FlashbaxState(state.buffer, key, state.draws + 1), Sample(out.experience, ids, weights, valid)

    def update(state, ids, td):
        if not config.prioritized:
            return state
        return state._replace(buffer=buffer.set_priorities(state.buffer, ids, td + config.per_eps))

    return Replay("flashbax-per" if config.prioritized else "flashbax", config.prioritized, init, add, sample,
                  update, lambda state: buffer.can_sample(state.buffer))


REPLAYS = {"conduit": conduit_replay, "flashbax": flashbax_replay}


# ------------------------------------------------------------------------------------------------------------------
# DQN
# ------------------------------------------------------------------------------------------------------------------
class Actors(NamedTuple):
    obs: jax.Array  # float32[num_envs, obs_dim]
    env_state: Any
    rng: jax.Array


class DQNCarry(NamedTuple):
    learner: LearnerState
    actors: Actors
    replay: Any  # the contender's state
    iteration: jax.Array  # int32[]


class Parts(NamedTuple):
    """A learner as the pieces of its scan: ``init(rng) -> carry``, ``step(carry, _) -> (carry, metrics)``."""

    init: Callable[[jax.Array], Any]
    step: Callable[[Any, Any], tuple[Any, dict]]
    iterations: int  # scan length of a whole run
    env_steps_per_iteration: int
    updates_per_iteration: int  # learner updates per iteration once learning has started
    replay: Optional[Replay]
    buffer: Optional[cj.Buffer]  # Conduit's Buffer when the contender is ours


def _check(name: str, value, low: int = 1) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"jitted: {name} must be an int >= {low}, got {value!r}")


def make_dqn(config: DQNConfig, buffer_kind="conduit") -> Parts:
    """``buffer_kind``: a name in ``REPLAYS`` or a factory ``(config, spec) -> Replay`` of one's own."""
    if not callable(buffer_kind) and buffer_kind not in REPLAYS:
        raise ValueError(f"jitted: unknown buffer_kind {buffer_kind!r}; use one of {', '.join(REPLAYS)}")
    for name in ("num_envs", "updates_per_step", "total_env_steps", "capacity", "batch_size", "target_period"):
        _check(name, getattr(config, name))
    if config.iterations < 1:
        raise ValueError(f"jitted: total_env_steps {config.total_env_steps} < num_envs {config.num_envs}")
    if config.gate not in ("cond", "mask"):
        raise ValueError(f"jitted: gate must be 'cond' or 'mask', got {config.gate!r}")
    env = envs.make(config.env)
    if env.num_actions == 0:
        raise ValueError(f"jitted DQN needs a discrete action space; {config.env} is continuous")
    venv = envs.vectorize(env)
    n = config.num_envs
    replay = (buffer_kind if callable(buffer_kind) else REPLAYS[buffer_kind])(config, transition_spec(env.obs_dim))
    network = QNetwork(env.num_actions, config.hidden)
    optimizer = optax.chain(optax.clip_by_global_norm(10.0), optax.adam(config.learning_rate))
    decay_steps = max(1.0, config.epsilon_fraction * config.total_env_steps)

    def init(rng) -> DQNCarry:
        net_rng, reset_rng, actor_rng = jax.random.split(rng, 3)
        params = network.init(net_rng, jnp.zeros((1, env.obs_dim), jnp.float32))
        learner = LearnerState(params, jax.tree_util.tree_map(jnp.copy, params), optimizer.init(params),
                               jnp.zeros((), jnp.int32))
        obs, env_state = venv.reset(jax.random.split(reset_rng, n))
        return DQNCarry(learner, Actors(obs, env_state, actor_rng), replay.init(), jnp.zeros((), jnp.int32))

    def learner_step(learner: LearnerState, data, weights):
        discount = config.gamma * (1.0 - data["terminated"].astype(jnp.float32))
        return double_dqn_step(network, optimizer, learner, data, weights, discount, config.target_period)

    def update(learner, replay_state, learn=True):
        replay_state, batch = replay.sample(replay_state)
        new_learner, td, loss = learner_step(learner, batch.data, batch.weights)
        valid = batch.valid & learn
        # an invalid draw teaches nothing: keep the learner (Conduit's update skips the -1 ids such a draw has)
        learner = jax.tree_util.tree_map(lambda a, b: jnp.where(valid, a, b), new_learner, learner)
        replay_state = replay.update(replay_state, batch.ids, td) if replay.prioritized else replay_state
        return learner, replay_state, jnp.where(valid, loss, 0.0), valid, batch.ids

    def skip(learner, replay_state):
        ids = jax.eval_shape(replay.sample, replay_state)[1].ids
        return (learner, replay_state, jnp.zeros((), jnp.float32), jnp.zeros((), bool),
                jnp.full(ids.shape, -1, ids.dtype))

    def step(carry: DQNCarry, _):
        learner, actors, replay_state, t = carry
        env_steps = t * n
        epsilon = config.epsilon_start + (config.epsilon_end - config.epsilon_start) * jnp.minimum(
            1.0, env_steps / decay_steps)
        rng, explore_rng, action_rng, env_rng = jax.random.split(actors.rng, 4)
        greedy = jnp.argmax(network.apply(learner.params, actors.obs), axis=-1).astype(jnp.int32)
        random = jax.random.randint(action_rng, (n,), 0, env.num_actions, jnp.int32)
        action = jnp.where(jax.random.uniform(explore_rng, (n,)) < epsilon, random, greedy)
        obs, env_state, reward, terminated, _, info = venv.step(jax.random.split(env_rng, n), actors.env_state,
                                                                action)
        items = {"obs": actors.obs, "action": action, "reward": reward, "terminated": terminated,
                 "next_obs": info["final_obs"]}  # bootstrap through a truncation: only termination stops it
        replay_state = replay.add(replay_state, items)
        losses, updated, drawn = [], [], []
        for _ in range(config.updates_per_step):
            learn = (env_steps + n >= config.learning_starts) & replay.can_sample(replay_state)
            if config.gate == "cond":
                learner, replay_state, loss, did, ids = jax.lax.cond(learn, update, skip, learner, replay_state)
            else:
                learner, replay_state, loss, did, ids = update(learner, replay_state, learn)
            losses.append(loss)
            updated.append(did)
            drawn.append(jnp.where(did, ids, -1))
        metrics = {"loss": jnp.stack(losses), "updated": jnp.stack(updated),
                   "episode_return": jnp.sum(info["episode_return"]),
                   "episodes": jnp.sum(info["episode_done"].astype(jnp.int32))}
        if config.record_ids:
            metrics["ids"] = jnp.stack(drawn)
        return DQNCarry(learner, Actors(obs, env_state, rng), replay_state, t + 1), metrics

    return Parts(init, step, config.iterations, n, config.updates_per_step, replay, replay.buffer)


# ------------------------------------------------------------------------------------------------------------------
# PPO
# ------------------------------------------------------------------------------------------------------------------
class PPOLearner(NamedTuple):
    params: Any
    opt_state: Any


class PPOCarry(NamedTuple):
    learner: PPOLearner
    actors: Actors
    replay: Any  # Conduit's ReplayState
    iteration: jax.Array  # int32[]


def ppo_spec(obs_dim: int) -> dict[str, jax.ShapeDtypeStruct]:
    f32 = jax.ShapeDtypeStruct((), jnp.float32)
    return {"obs": jax.ShapeDtypeStruct((obs_dim,), jnp.float32), "action": jax.ShapeDtypeStruct((), jnp.int32),
            "log_prob": f32, "value": f32, "advantage": f32, "ret": f32}


def make_ppo(config: PPOConfig, buffer_kind: str = "conduit") -> Parts:
    if buffer_kind != "conduit":
        raise ValueError(f"jitted PPO runs on Conduit's epochs sampler only; got buffer_kind {buffer_kind!r} "
                         f"(Flashbax has no sampling without replacement)")
    for name in ("num_envs", "num_steps", "epochs", "num_minibatches", "hidden"):
        _check(name, getattr(config, name))
    if config.rollout_size % config.num_minibatches:
        raise ValueError(f"jitted PPO: rollout size {config.rollout_size} (num_envs x num_steps) must be a multiple "
                         f"of num_minibatches {config.num_minibatches}")
    if config.iterations < 1:
        raise ValueError(f"jitted PPO: total_env_steps {config.total_env_steps} < one rollout "
                         f"({config.rollout_size})")
    env = envs.make(config.env)
    if env.num_actions == 0:
        raise ValueError(f"this PPO has a categorical policy; {config.env} is continuous")
    venv = envs.vectorize(env)
    network = ActorCritic(env.num_actions, config.hidden)
    n, T = config.num_envs, config.num_steps
    updates = config.epochs * config.num_minibatches
    lr = optax.linear_schedule(config.learning_rate, 0.0, config.iterations * updates)
    optimizer = optax.chain(optax.clip_by_global_norm(config.max_grad_norm), optax.adam(lr, eps=1e-5))
    # capacity = one rollout: each ingest replaces the whole ring and starts a fresh epoch
    buffer = cj.make_buffer(ppo_spec(env.obs_dim), config.rollout_size, cj.samplers.epochs(config.minibatch_size),
                            mesh=cj.default_mesh(config.devices))

    def init(rng) -> PPOCarry:
        net_rng, reset_rng, actor_rng = jax.random.split(rng, 3)
        params = network.init(net_rng, jnp.zeros((1, env.obs_dim), jnp.float32))
        obs, env_state = venv.reset(jax.random.split(reset_rng, n))
        return PPOCarry(PPOLearner(params, optimizer.init(params)), Actors(obs, env_state, actor_rng),
                        buffer.init(seed=config.seed), jnp.zeros((), jnp.int32))

    def ppo_step(learner: PPOLearner, data):
        advantage = data["advantage"]
        advantage = (advantage - advantage.mean()) / (advantage.std() + 1e-8)

        def loss_fn(params):
            logits, value = network.apply(params, data["obs"])
            log_probs = jax.nn.log_softmax(logits)
            log_prob = jnp.take_along_axis(log_probs, data["action"][:, None], axis=1)[:, 0]
            ratio = jnp.exp(log_prob - data["log_prob"])
            policy_loss = -jnp.mean(jnp.minimum(ratio * advantage, jnp.clip(ratio, 1 - config.clip_eps,
                                                                              1 + config.clip_eps) * advantage))
            value_clipped = data["value"] + jnp.clip(value - data["value"], -config.clip_eps, config.clip_eps)
            value_loss = 0.5 * jnp.mean(jnp.maximum((value - data["ret"]) ** 2, (value_clipped - data["ret"]) ** 2))
            entropy = jnp.mean(-jnp.sum(jnp.exp(log_probs) * log_probs, axis=-1))
            return policy_loss + config.value_coef * value_loss - config.entropy_coef * entropy

        loss, grads = jax.value_and_grad(loss_fn)(learner.params)
        updates_, opt_state = optimizer.update(grads, learner.opt_state, learner.params)
        return PPOLearner(optax.apply_updates(learner.params, updates_), opt_state), loss

    def step(carry: PPOCarry, _):
        learner, actors, replay_state, t = carry
        actors, items, returns, done = collect_rollout(network, venv, learner.params, actors, T, config.gamma,
                                                       config.gae_lambda)
        returns, episodes = jnp.sum(returns), jnp.sum(done.astype(jnp.int32))
        replay_state = buffer.ingest(replay_state, items)

        def minibatch(inner, _):
            learner, replay_state = inner
            replay_state, delivery = buffer.sample(replay_state)
            new_learner, loss = ppo_step(learner, delivery.data)
            learner = jax.tree_util.tree_map(lambda a, b: jnp.where(delivery.valid, a, b), new_learner, learner)
            return (learner, replay_state), (loss, delivery.valid, delivery.ids)

        (learner, replay_state), (losses, valid, ids) = jax.lax.scan(minibatch, (learner, replay_state), None,
                                                                     updates)
        metrics = {"loss": losses, "updated": valid, "episode_return": returns, "episodes": episodes,
                   "ids": ids}  # int32[updates, minibatch, 2]: every rollout row once per epoch
        return PPOCarry(learner, actors, replay_state, t + 1), metrics

    return Parts(init, step, config.iterations, config.rollout_size, updates, None, buffer)


# ------------------------------------------------------------------------------------------------------------------
def make_learner(config: Union[DQNConfig, PPOConfig], buffer_kind: str = "conduit") -> Parts:
    if isinstance(config, DQNConfig):
        return make_dqn(config, buffer_kind)
    if isinstance(config, PPOConfig):
        return make_ppo(config, buffer_kind)
    raise TypeError(f"jitted: config must be a DQNConfig or a PPOConfig, got {type(config).__name__}")


def make_train(config: Union[DQNConfig, PPOConfig], buffer_kind: str = "conduit"):
    """``train(rng) -> (final carry, metrics)``: init and every iteration in one jitted program (``lax.scan`` over
    ``parts.iterations``; metrics stacked on a leading [iterations] axis). ``train.parts`` holds the pieces."""
    parts = make_learner(config, buffer_kind)

    @jax.jit
    def train(rng):
        return jax.lax.scan(parts.step, parts.init(rng), None, parts.iterations)

    train.parts = parts
    return train


def summarize(metrics: dict, parts: Parts, episodes: int = 20) -> dict[str, Any]:
    """Host-side summary of a run's stacked metrics: env steps, updates, last episodes' mean return, last loss."""
    m = jax.device_get(metrics)
    returns, counts = np.asarray(m["episode_return"], np.float64), np.asarray(m["episodes"])
    cum = np.cumsum(counts[::-1])
    last = int(np.searchsorted(cum, episodes)) + 1  # iterations from the end holding >= `episodes` episodes
    tail = slice(len(counts) - last, None)
    updated = np.asarray(m["updated"])
    losses = np.asarray(m["loss"])[updated]
    return {"env_steps": int(len(counts) * parts.env_steps_per_iteration), "updates": int(updated.sum()),
            "episodes": int(counts.sum()),
            "train_return": float(returns[tail].sum() / max(counts[tail].sum(), 1)) if counts.sum() else None,
            "loss_last": float(losses[-20:].mean()) if losses.size else None,
            "finite": bool(np.isfinite(np.asarray(m["loss"])).all())}


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--algo", choices=("dqn", "dqn-per", "ppo"), default="dqn")
    parser.add_argument("--buffer", choices=BUFFER_KINDS, default="conduit", help="the DQN's replay contender")
    parser.add_argument("--env", default="CartPole")
    parser.add_argument("--total-env-steps", type=int, default=None)
    parser.add_argument("--num-envs", type=int, default=None)
    parser.add_argument("--batch-size", type=int, default=None, help="DQN batch")
    parser.add_argument("--devices", type=int, default=1, help="devices Conduit's buffer shards over")
    parser.add_argument("--gate", choices=("cond", "mask"), default="cond",
                        help="DQN: updates under lax.cond until learning starts, or every iteration masked")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="write the result JSON here")
    args = parser.parse_args(argv)
    overrides = {k: v for k, v in (("env", args.env), ("total_env_steps", args.total_env_steps),
                                   ("num_envs", args.num_envs), ("devices", args.devices), ("seed", args.seed))
                 if v is not None}
    if args.algo == "ppo":
        config = PPOConfig(**overrides)
    else:
        if args.batch_size is not None:
            overrides["batch_size"] = args.batch_size
        config = DQNConfig(prioritized=args.algo == "dqn-per", gate=args.gate, **overrides)
    train = make_train(config, args.buffer)
    rng = jax.random.key(config.seed)
    t0 = time.perf_counter()
    compiled = train.lower(rng).compile()
    compile_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    carry, metrics = jax.block_until_ready(compiled(rng))
    wall = time.perf_counter() - t0
    summary = summarize(metrics, train.parts)
    result = {"algorithm": args.algo, "buffer": args.buffer, "config": dataclasses.asdict(config),
              **summary, "compile_s": compile_s, "run_s": wall,
              "env_steps_per_s": summary["env_steps"] / wall, "updates_per_s": summary["updates"] / wall}
    print(json.dumps(result, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
