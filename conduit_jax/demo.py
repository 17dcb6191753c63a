"""The `conduit demo`: synthetic actors -> ``plane.ingest`` -> ``plane.sample`` -> a jitted DQN learner step.

It shows one experience path end to end, the way a user wires it:
  * actors: a few NumPy vector environments, each stepped with a random behaviour policy (DQN is off-policy), each
    sending its batch of transitions ``{obs, action, reward, done, next_obs}`` to the plane as one ``ingest`` call;
  * the plane: an ``ExperienceDataPlane`` sharded over the local devices (8 emulated CPU devices under ``conduit demo``);
  * the learner: a small Q-network (flax) trained with a TD(0) update (optax), jitted, data-parallel over the plane's
    mesh: it consumes ``delivery.data`` exactly as the plane hands it over, sharded on the batch axis.

Every stage is timed with ``time.perf_counter`` and blocked with ``jax.block_until_ready`` so each number is that
stage's own latency. The stages therefore run one after another (the synchronous baseline); the latency-aware scheduler
that overlaps delivery with the learner step is not built yet. The first call of each stage compiles and is reported
apart from the steady state.

``run_demo(config) -> dict`` does the work and returns a JSON-friendly summary; ``format_summary`` renders it.
"""

from __future__ import annotations

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

from conduit_jax import samplers
from conduit_jax.errors import ConfigError
from conduit_jax.plane import ExperienceDataPlane
from conduit_jax.replay import default_mesh
from conduit_jax.spec import ExperienceSpec

SAMPLERS = ("uniform", "fifo", "epochs")
STAGES = ("actors", "ingest", "sample", "learner")


@dataclasses.dataclass(frozen=True)
class DemoConfig:
    iterations: int = 300
    num_actors: int = 4
    envs_per_actor: int = 32  # each actor ingests this many transitions per iteration
    obs_dim: int = 8  # LunarLander-sized observations
    num_actions: int = 4
    batch_size: int = 128  # a multiple of the device count: the batch is delivered sharded
    capacity: int = 16384  # a multiple of the device count; below iterations * items_per_iteration so the ring wraps
    sampler: str = "uniform"  # uniform | fifo | epochs
    devices: Optional[int] = None  # devices the plane shards over; None: every local device
    seed: int = 0
    learning_rate: float = 1e-3
    gamma: float = 0.99
    hidden: int = 64
    target_update_period: int = 50  # learner steps between target-network copies
    progress: bool = True  # a tqdm progress bar on stderr

    @property
    def items_per_iteration(self) -> int:
        return self.num_actors * self.envs_per_actor


def check_config(config: DemoConfig) -> None:
    """Host-side checks with the bad value and a fix in the message (the plane checks capacity and batch itself)."""
    for name in ("iterations", "num_actors", "envs_per_actor", "obs_dim", "num_actions", "batch_size", "capacity",
                 "hidden", "target_update_period"):
        value = getattr(config, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"demo: {name} must be a positive int, got {value!r}")
    if config.sampler not in SAMPLERS:
        raise ConfigError(f"demo: sampler must be one of {', '.join(SAMPLERS)}, got {config.sampler!r}")
    if config.sampler == "fifo" and config.items_per_iteration > config.batch_size:
        raise ConfigError(
            f"demo: the fifo queue delivers each item once, one batch of {config.batch_size} per iteration, but the "
            f"actors ingest {config.items_per_iteration} per iteration, so the queue would fill and ingest would "
            f"refuse; use --batch-size {config.items_per_iteration} (or fewer actors/envs)")
    if not 0.0 <= config.gamma <= 1.0:
        raise ConfigError(f"demo: gamma must be in [0, 1], got {config.gamma!r}")


# ------------------------------------------------------------------------------------------------------------------
# Actors: a synthetic vectorized environment in NumPy (pure step functions over an explicit state)
# ------------------------------------------------------------------------------------------------------------------
class EnvParams(NamedTuple):
    effect: np.ndarray  # float32[num_actions, obs_dim]: how each action pushes the state
    decay: float
    noise: float
    bound: float  # an episode terminates when any |obs| exceeds it


class EnvState(NamedTuple):
    obs: np.ndarray  # float32[envs, obs_dim]
    episode_steps: np.ndarray  # int32[envs]


def make_env(obs_dim: int, num_actions: int, seed: int) -> EnvParams:
    rng = np.random.default_rng(seed)
    effect = rng.normal(0.0, 0.3, (num_actions, obs_dim)).astype(np.float32)
    return EnvParams(effect=effect, decay=0.95, noise=0.3, bound=3.0)


def env_reset(params: EnvParams, num_envs: int, rng: np.random.Generator) -> EnvState:
    obs = rng.normal(0.0, 0.5, (num_envs, params.effect.shape[1])).astype(np.float32)
    return EnvState(obs, np.zeros(num_envs, np.int32))


def env_step(params: EnvParams, state: EnvState, action: np.ndarray, rng: np.random.Generator):
    """One step of every env: returns (next state, transitions). The reward favours staying near the origin; leaving
    the box ``|obs| <= bound`` terminates the episode (reward -1) and that env starts a fresh one."""
    noise = rng.normal(0.0, params.noise, state.obs.shape).astype(np.float32)
    next_obs = params.decay * state.obs + params.effect[action] + noise
    done = np.any(np.abs(next_obs) > params.bound, axis=1)
    reward = np.where(done, np.float32(-1.0), -np.mean(np.square(next_obs), axis=1) * np.float32(0.1))
    transitions = {"obs": state.obs, "action": action.astype(np.int32), "reward": reward.astype(np.float32),
                   "done": done, "next_obs": next_obs.astype(np.float32)}
    fresh = env_reset(params, state.obs.shape[0], rng)
    following = EnvState(np.where(done[:, None], fresh.obs, next_obs).astype(np.float32),
                         np.where(done, 0, state.episode_steps + 1).astype(np.int32))
    return following, transitions


def example_transition(obs_dim: int):
    """One item, without the batch axis: what ``ExperienceSpec.from_example`` reads."""
    return {"obs": np.zeros(obs_dim, np.float32), "action": np.int32(0), "reward": np.float32(0.0),
            "done": np.bool_(False), "next_obs": np.zeros(obs_dim, np.float32)}


# ------------------------------------------------------------------------------------------------------------------
# Learner: DQN's TD(0) update on a small Q-network, pure and jitted
# ------------------------------------------------------------------------------------------------------------------
class QNetwork(nn.Module):
    num_actions: int
    hidden: int

    @nn.compact
    def __call__(self, obs):
        x = nn.relu(nn.Dense(self.hidden)(obs))
        x = nn.relu(nn.Dense(self.hidden)(x))
        return nn.Dense(self.num_actions)(x)


class LearnerState(NamedTuple):
    params: Any
    target_params: Any
    opt_state: Any
    step: jax.Array  # int32[]


def make_learner(config: DemoConfig):
    """(init(rng) -> LearnerState, step(state, batch) -> (state, metrics)), both pure."""
    network = QNetwork(config.num_actions, config.hidden)
    optimizer = optax.chain(optax.clip_by_global_norm(10.0), optax.adam(config.learning_rate))

    def init(rng) -> LearnerState:
        params = network.init(rng, jnp.zeros((1, config.obs_dim), jnp.float32))
        target_params = jax.tree_util.tree_map(jnp.copy, params)  # own buffers: the step donates both
        return LearnerState(params, target_params, optimizer.init(params), jnp.zeros((), jnp.int32))

    def step(state: LearnerState, batch) -> tuple[LearnerState, dict[str, jax.Array]]:
        q_next = network.apply(state.target_params, batch["next_obs"]).max(axis=-1)
        not_done = 1.0 - batch["done"].astype(jnp.float32)
        target = jax.lax.stop_gradient(batch["reward"] + config.gamma * not_done * q_next)

        def loss_fn(params):
            q = network.apply(params, batch["obs"])
            q_taken = jnp.take_along_axis(q, batch["action"][:, None], axis=1)[:, 0]
            return jnp.mean(optax.huber_loss(q_taken, target)), q_taken

        (loss, q_taken), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        step = state.step + 1
        target_params = optax.periodic_update(params, state.target_params, step, config.target_update_period)
        return LearnerState(params, target_params, opt_state, step), {"loss": loss, "q_mean": jnp.mean(q_taken)}

    return init, step


def make_sampler(name: str, batch_size: int) -> samplers.Sampler:
    return {"uniform": samplers.uniform, "fifo": samplers.fifo, "epochs": samplers.epochs}[name](batch_size)


# ------------------------------------------------------------------------------------------------------------------
# The loop
# ------------------------------------------------------------------------------------------------------------------
def run_demo(config: DemoConfig = DemoConfig()) -> dict[str, Any]:
    """Run the demo and return its summary (counts, plane stats, per-stage latency, learner loss)."""
    check_config(config)
    start = time.perf_counter()
    mesh = default_mesh(config.devices)
    spec = ExperienceSpec.from_example(example_transition(config.obs_dim))
    plane = ExperienceDataPlane(spec, config.capacity, make_sampler(config.sampler, config.batch_size), mesh=mesh,
                                seed=config.seed)

    env_params = make_env(config.obs_dim, config.num_actions, config.seed)
    rngs = [np.random.default_rng([config.seed, actor]) for actor in range(config.num_actors)]
    env_states = [env_reset(env_params, config.envs_per_actor, rng) for rng in rngs]

    learner_init, learner_step = make_learner(config)
    replicated = NamedSharding(mesh, P())  # params on every device; the batch stays sharded: data-parallel learner
    learner_state = jax.jit(learner_init, out_shardings=replicated)(jax.random.key(config.seed))
    learner_step = jax.jit(learner_step, donate_argnums=(0,))

    times: dict[str, list[float]] = {stage: [] for stage in STAGES}
    warm_rows = []  # warm rows: iterations where no stage ran for the first time (compiled)
    losses, q_means = [], []
    items_in = ingest_calls = batches = episodes_ended = 0

    progress = None
    if config.progress:
        from tqdm.auto import tqdm
        progress = tqdm(total=config.iterations, desc=f"conduit demo ({plane.num_shards} shards)", unit="it",
                        leave=False)
    for iteration in range(config.iterations):
        first_calls = {stage: not times[stage] for stage in STAGES}
        row = dict.fromkeys(STAGES, 0.0)

        t0 = time.perf_counter()
        outgoing = []
        for actor, rng in enumerate(rngs):
            action = rng.integers(0, config.num_actions, config.envs_per_actor)
            env_states[actor], transitions = env_step(env_params, env_states[actor], action, rng)
            outgoing.append(transitions)
        row["actors"] = time.perf_counter() - t0

        t0 = time.perf_counter()
        for transitions in outgoing:
            plane.ingest(transitions)
        plane.block_until_ready()
        row["ingest"] = time.perf_counter() - t0
        for transitions in outgoing:
            items_in += len(transitions["done"])
            episodes_ended += int(transitions["done"].sum())
        ingest_calls += len(outgoing)

        t0 = time.perf_counter()
        delivery = plane.sample() if plane.can_sample() else None
        if delivery is not None:
            jax.block_until_ready(delivery.data)
        row["sample"] = time.perf_counter() - t0

        if delivery is not None:
            batches += 1
            t0 = time.perf_counter()
            learner_state, metrics = learner_step(learner_state, delivery.data)
            metrics = jax.device_get(metrics)  # blocks on the step
            row["learner"] = time.perf_counter() - t0
            losses.append(float(metrics["loss"]))
            q_means.append(float(metrics["q_mean"]))

        ran = {"actors": True, "ingest": True, "sample": True, "learner": delivery is not None}
        for stage in STAGES:
            if ran[stage]:
                times[stage].append(row[stage])
        total = sum(row.values())
        if not any(first_calls[s] and ran[s] for s in STAGES) and ran["learner"]:
            warm_rows.append(row | {"iteration": total})
        if progress is not None:
            progress.update(1)
            if losses and iteration % 25 == 0:
                progress.set_postfix(loss=f"{losses[-1]:.4f}", refresh=False)
    if progress is not None:
        progress.close()

    stats = plane.stats()
    return {
        "config": dataclasses.asdict(config),
        "platform": mesh.devices.flat[0].platform,
        "num_devices": int(mesh.devices.size),
        "spec": str(spec),
        "items_per_iteration": config.items_per_iteration,
        "items_in": items_in,
        "ingest_calls": ingest_calls,
        "episodes_ended": episodes_ended,
        "batches_delivered": batches,
        "items_delivered": batches * config.batch_size,
        "items_stored": stats["size"],
        "items_overwritten": stats["items_overwritten"],
        "plane_stats": stats,
        "learner_steps": len(losses),
        "loss_first": losses[0] if losses else None,
        "loss_last": float(np.mean(losses[-10:])) if losses else None,
        "q_mean_last": q_means[-1] if q_means else None,
        "first_call_s": {stage: times[stage][0] for stage in STAGES if times[stage]},
        "latency_us": latency_table(warm_rows),
        "experience_path_share": experience_path_share(warm_rows),
        "steady_iterations": len(warm_rows),
        "wall_s": time.perf_counter() - start,
    }


def latency_table(rows: list[dict[str, float]]) -> dict[str, dict[str, float]]:
    """Median and p99 per stage, in microseconds, over the steady-state iterations."""
    if not rows:
        return {}
    out = {}
    for stage in (*STAGES, "iteration"):
        us = np.asarray([row[stage] for row in rows]) * 1e6
        out[stage] = {"median": float(np.median(us)), "p99": float(np.percentile(us, 99))}
    return out


def experience_path_share(rows: list[dict[str, float]]) -> Optional[float]:
    """Time in ingest + sample over the whole iteration (actors + ingest + sample + learner), summed over the steady
    iterations: the part of each iteration the experience path holds the learner up for, when nothing overlaps."""
    total = sum(row["iteration"] for row in rows)
    if not rows or total <= 0:
        return None
    return sum(row["ingest"] + row["sample"] for row in rows) / total


def format_summary(summary: dict[str, Any]) -> str:
    """The summary as a short report for a terminal."""
    c = summary["config"]
    lines = [
        f"Conduit-JAX demo: {c['iterations']} iterations, {summary['num_devices']} {summary['platform']} devices, "
        f"sampler {c['sampler']}(batch_size={c['batch_size']}), capacity {c['capacity']}",
        f"  spec            {summary['spec']}",
        f"  items in        {summary['items_in']:>10,}  ({summary['ingest_calls']} ingest calls: {c['num_actors']} "
        f"actors x {c['envs_per_actor']} envs per iteration; {summary['episodes_ended']} episodes ended)",
        f"  items delivered {summary['items_delivered']:>10,}  ({summary['batches_delivered']} batches x "
        f"{c['batch_size']})",
        f"  items stored    {summary['items_stored']:>10,}",
        f"  overwritten     {summary['items_overwritten']:>10,}"
        + ("  (slots reused after delivery: a queue never overwrites an undelivered item)"
           if c["sampler"] == "fifo" and summary["items_overwritten"] else ""),
    ]
    if summary["learner_steps"]:
        lines.append(f"  learner         {summary['learner_steps']} DQN steps, TD loss {summary['loss_first']:.4f} -> "
                     f"{summary['loss_last']:.4f} (mean of the last 10)")
    lines.append("  plane.stats()   " + ", ".join(_stat(k, v) for k, v in summary["plane_stats"].items()))
    first = summary["first_call_s"]
    lines.append("  first call (compiles, not in the table): "
                 + ", ".join(f"{stage} {seconds * 1e3:.0f} ms" for stage, seconds in first.items()))
    table = summary["latency_us"]
    if table:
        lines.append(f"  latency per stage over {summary['steady_iterations']} steady iterations (us, each stage "
                     f"blocked; stages run one after another):")
        lines.append(f"    {'stage':<10} {'median':>10} {'p99':>10}")
        notes = {"actors": f"{c['num_actors']} actors step their envs", "ingest": f"{c['num_actors']} ingest calls",
                 "sample": "1 batch", "learner": "1 jitted DQN step", "iteration": "the four stages"}
        for stage, row in table.items():
            lines.append(f"    {stage:<10} {row['median']:>10.0f} {row['p99']:>10.0f}   {notes[stage]}")
        lines.append(f"  experience path (ingest + sample) share of the iteration: "
                     f"{100 * summary['experience_path_share']:.1f}%")
    lines.append(f"  wall time {summary['wall_s']:.1f} s")
    return "\n".join(lines)


def _stat(key: str, value) -> str:
    if key.endswith("_s") and isinstance(value, float):
        return f"{key[:-2]}_us={value * 1e6:.0f}"
    return f"{key}={value}"
