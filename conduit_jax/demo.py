"""The `conduit demo`: synthetic actors -> ``plane.ingest`` -> ``plane.deliver`` -> a jitted DQN learner step, run
under ``sync`` and under a prefetching schedule side by side, so the report shows what the schedule hides.

It shows one experience path end to end, the way a user wires it:
  * actors: a few NumPy vector environments, each stepped with a random behaviour policy (DQN is off-policy), each
    sending its batch of transitions ``{obs, action, reward, done, next_obs}`` to the plane as one ``ingest`` call;
  * placement: by default the planner's plan for the detected host (``placement.plan(spec, capacity,
    Topology.detect(), workload)``); with ``devices=N`` the plane shards over N devices instead;
  * the plane: an ``ExperienceDataPlane`` under ``sync`` and, on an identical copy of the workload, under
    ``schedule`` (``overlap`` by default), whose delivery worker draws the next batch while the learner computes;
  * the learner: a small Q-network (flax) trained with a TD(0) update (optax), jitted, data-parallel over the plane's
    mesh: it consumes ``delivery.data`` exactly as the plane hands it over.

Both runs execute the same loop in the same process, in interleaved rounds (sync, scheduled, sync, ...), so drift of
the machine hits both alike. Per iteration the loop times, with ``time.perf_counter`` from the learner's thread:
actors, ingest (the ``ingest`` calls), deliver (``plane.deliver()`` plus waiting for the batch to be computed) and
learner (the jitted step, until its loss is on the host). The exposed experience path is ingest + deliver: what the
learner's thread spends on experience (under a staging schedule an ingest is a copy and its write rides the next
draw). Nothing else blocks, so what a schedule overlaps really overlaps. Iterations that compile are reported apart.

The module imports JAX only inside ``run_demo``: ``conduit --help`` reads ``DemoConfig`` without starting JAX.
``run_demo(config) -> dict`` does the work and returns a JSON-friendly summary; ``format_summary`` renders it.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any, NamedTuple, Optional

import numpy as np

from conduit_jax.errors import ConfigError

SAMPLERS = ("uniform", "fifo", "epochs")
SCHEDULES = ("overlap", "deferred", "adaptive", "staged", "sync")  # the run compared with sync ("sync": sync only)
STAGES = ("actors", "ingest", "deliver", "learner")
EXPOSED = ("ingest", "deliver")  # the experience path on the learner's thread (the demo reports no priorities)


@dataclasses.dataclass(frozen=True)
class DemoConfig:
    iterations: int = 600  # per schedule
    num_actors: int = 4
    envs_per_actor: int = 32  # each actor ingests this many transitions per iteration
    obs_dim: int = 8  # LunarLander-sized observations
    num_actions: int = 4
    batch_size: int = 128  # a multiple of the plane's shards: the batch is delivered sharded
    capacity: int = 16384  # a multiple of the plane's shards; below the items ingested in a run, so the ring wraps
    sampler: str = "uniform"  # uniform | fifo | epochs
    schedule: str = "overlap"  # the prefetching schedule run beside sync (overlap | deferred | adaptive), or sync
    depth: int = 2  # batches the prefetching schedule keeps in flight
    devices: Optional[int] = None  # None: the planner's placement for this host; N: shard over the first N devices
    rounds: int = 3  # interleaved rounds: each run does iterations / rounds per round
    warmup: int = 10  # iterations per run left out of the latency table (the first compile; caches settle)
    seed: int = 0
    learning_rate: float = 1e-3
    gamma: float = 0.99
    hidden: int = 256
    target_update_period: int = 50  # learner steps between target-network copies
    trace: Optional[str] = None  # write a Chrome/Perfetto trace of both runs here (JSON)
    plot: Optional[str] = None  # write a PNG of the per-stage times of both runs here (needs matplotlib)
    progress: bool = True  # a tqdm progress bar on stderr, cleared before the report is printed

    @property
    def items_per_iteration(self) -> int:
        return self.num_actors * self.envs_per_actor

    @property
    def schedules(self) -> tuple[str, ...]:
        return ("sync",) if self.schedule == "sync" else ("sync", self.schedule)


def check_config(config: DemoConfig) -> None:
    """Host-side checks with the bad value and a fix in the message (the plane checks capacity and batch itself)."""
    for name in ("iterations", "num_actors", "envs_per_actor", "obs_dim", "num_actions", "batch_size", "capacity",
                 "hidden", "target_update_period", "depth", "rounds"):
        value = getattr(config, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"demo: {name} must be a positive int, got {value!r}")
    if not isinstance(config.warmup, int) or isinstance(config.warmup, bool) or config.warmup < 0:
        raise ConfigError(f"demo: warmup must be an int >= 0, got {config.warmup!r}")
    if config.sampler not in SAMPLERS:
        raise ConfigError(f"demo: sampler must be one of {', '.join(SAMPLERS)}, got {config.sampler!r}")
    if config.schedule not in SCHEDULES:
        raise ConfigError(f"demo: schedule must be one of {', '.join(SCHEDULES)}, got {config.schedule!r}")
    if config.rounds > config.iterations:
        raise ConfigError(f"demo: rounds ({config.rounds}) cannot exceed iterations ({config.iterations}): each "
                          f"round runs iterations / rounds of each schedule")
    if config.sampler == "fifo" and config.items_per_iteration > config.batch_size:
        raise ConfigError(
            f"demo: the fifo queue delivers each item once, one batch of {config.batch_size} per iteration, but the "
            f"actors ingest {config.items_per_iteration} per iteration, so the queue would fill and ingest would "
            f"refuse; use --batch-size {config.items_per_iteration} (or fewer actors/envs)")
    if not 0.0 <= config.gamma <= 1.0:
        raise ConfigError(f"demo: gamma must be in [0, 1], got {config.gamma!r}")
    if config.plot is not None:
        import importlib.util

        if importlib.util.find_spec("matplotlib") is None:
            raise ConfigError("demo: plot needs matplotlib, which is not installed; pip install matplotlib (or "
                              "drop --plot)")


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
class LearnerState(NamedTuple):
    params: Any
    target_params: Any
    opt_state: Any
    step: Any  # int32[]


@functools.cache
def _q_network_class():
    import flax.linen as nn

    class QNetwork(nn.Module):
        """Two ReLU layers of ``hidden`` units, one Q-value per action."""

        num_actions: int
        hidden: int

        @nn.compact
        def __call__(self, obs):
            x = nn.relu(nn.Dense(self.hidden)(obs))
            x = nn.relu(nn.Dense(self.hidden)(x))
            return nn.Dense(self.num_actions)(x)

    return QNetwork


def __getattr__(name: str):
    # ``QNetwork`` (a flax module, also used by experiments/) is built on first use, so importing this module does
    # not import flax and JAX
    if name == "QNetwork":
        return _q_network_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def make_learner(config: DemoConfig):
    """(init(rng) -> LearnerState, step(state, batch) -> (state, metrics)), both pure."""
    import jax
    import jax.numpy as jnp
    import optax

    network = _q_network_class()(config.num_actions, config.hidden)
    optimizer = optax.chain(optax.clip_by_global_norm(10.0), optax.adam(config.learning_rate))

    def init(rng) -> LearnerState:
        params = network.init(rng, jnp.zeros((1, config.obs_dim), jnp.float32))
        target_params = jax.tree_util.tree_map(jnp.copy, params)  # own buffers: the step donates both
        return LearnerState(params, target_params, optimizer.init(params), jnp.zeros((), jnp.int32))

    def step(state: LearnerState, batch):
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


def make_sampler(name: str, batch_size: int):
    from conduit_jax import samplers

    return {"uniform": samplers.uniform, "fifo": samplers.fifo, "epochs": samplers.epochs}[name](batch_size)


def make_schedule(name: str, depth: int):
    from conduit_jax import schedule

    return {"sync": schedule.sync, "staged": schedule.staged, "overlap": lambda: schedule.overlap(depth),
            "deferred": lambda: schedule.deferred(2, depth), "adaptive": lambda: schedule.adaptive(depth)}[name]()


# ------------------------------------------------------------------------------------------------------------------
# Placement: the planner's plan for this host, or N devices
# ------------------------------------------------------------------------------------------------------------------
def choose_placement(config: DemoConfig, spec) -> tuple[dict[str, Any], Any]:
    """``(what was chosen, {'mesh': ...} or {'plan': ...})``: the keyword the plane takes. The planner sees the
    demo's workload: its batch, sampler, and the actors' items per learner step (at a nominal 1 ms step)."""
    import jax

    from conduit_jax import placement
    from conduit_jax.replay import default_mesh

    if config.devices is not None:
        mesh = default_mesh(config.devices)
        return {"source": "--devices", "devices": int(mesh.devices.size), "storage": "device",
                "why": f"sharded over the first {config.devices} devices, as asked"}, {"mesh": mesh}
    step_time = 1e-3
    work = placement.Workload(batch_size=config.batch_size, sampler=config.sampler,
                              ingest_rate=config.items_per_iteration / step_time, step_time=step_time,
                              learner_devices=tuple(d.id for d in jax.devices()))
    topology = placement.Topology.detect()
    plan = placement.plan(spec, config.capacity, topology, work)
    why = {decision: reason for decision, _, reason in plan.reasons}
    return {"source": "planner", "devices": plan.num_shards, "storage": plan.memory["storage"],
            "topology": plan.topology, "why": why.get("shards", "")}, {"plan": plan}


# ------------------------------------------------------------------------------------------------------------------
# The loop
# ------------------------------------------------------------------------------------------------------------------
class _Run:
    """One schedule's copy of the workload: its plane, actors and learner, advanced a round at a time."""

    def __init__(self, config: DemoConfig, schedule_name: str, spec, where: dict[str, Any]):
        import jax
        from jax.sharding import NamedSharding
        from jax.sharding import PartitionSpec as P

        from conduit_jax.plane import ExperienceDataPlane

        self.config, self.name, self._jax = config, schedule_name, jax
        self.plane = ExperienceDataPlane(spec, config.capacity, make_sampler(config.sampler, config.batch_size),
                                         schedule=make_schedule(schedule_name, config.depth), seed=config.seed,
                                         **where)
        self.env_params = make_env(config.obs_dim, config.num_actions, config.seed)
        self.rngs = [np.random.default_rng([config.seed, actor]) for actor in range(config.num_actors)]
        self.env_states = [env_reset(self.env_params, config.envs_per_actor, rng) for rng in self.rngs]
        learner_init, learner_step = make_learner(config)
        replicated = NamedSharding(self.plane.mesh, P())  # params on every shard's device; the batch stays sharded
        self.learner_state = jax.jit(learner_init, out_shardings=replicated)(jax.random.key(config.seed))
        self.learner_step = jax.jit(learner_step, donate_argnums=(0,))
        self.rows: list[dict[str, float]] = []  # per iteration that delivered: stage -> seconds
        self.first_call_s: dict[str, float] = {}
        self.losses: list[float] = []
        self.items_in = self.ingest_calls = self.batches = self.episodes_ended = 0
        self._previous = None  # the last delivery, recycled once the learner is done with it

    def iterate(self) -> None:
        from conduit_jax.errors import NotEnoughDataError, RateLimitedError

        config, plane, timeline = self.config, self.plane, self.plane.timeline
        t0 = time.perf_counter()
        outgoing = []
        for actor, rng in enumerate(self.rngs):
            action = rng.integers(0, config.num_actions, config.envs_per_actor)
            self.env_states[actor], transitions = env_step(self.env_params, self.env_states[actor], action, rng)
            outgoing.append(transitions)
        for transitions in outgoing:  # the actors' bookkeeping, outside the timed ingest and deliver
            self.items_in += len(transitions["done"])
            self.episodes_ended += int(transitions["done"].sum())
        self.ingest_calls += len(outgoing)
        t1 = time.perf_counter()
        for transitions in outgoing:
            plane.ingest(transitions)
        t2 = time.perf_counter()
        try:
            delivery = plane.deliver(recycle=self._previous)
        except (NotEnoughDataError, RateLimitedError):  # the ring is still filling
            delivery = None
        if delivery is not None:
            self._jax.block_until_ready(delivery.data)
        t3 = time.perf_counter()
        if delivery is None:
            timeline.record("actors", t0, t1)
            return
        self.learner_state, metrics = self.learner_step(self.learner_state, delivery.data)
        loss = float(metrics["loss"])  # blocks on the step, as a learner reading its loss does
        t4 = time.perf_counter()
        self._previous = delivery
        self.batches += 1
        self.losses.append(loss)
        timeline.record("actors", t0, t1)
        timeline.record("learner step", t3, t4)
        row = {"actors": t1 - t0, "ingest": t2 - t1, "deliver": t3 - t2, "learner": t4 - t3, "exposed": t3 - t1,
               "iteration": t4 - t0}
        if not self.first_call_s:
            self.first_call_s = {stage: row[stage] for stage in STAGES}
        self.rows.append(row)

    def summary(self) -> dict[str, Any]:
        """The run's counts and latency table (run_demo has closed the plane's worker by now)."""
        stats = self.plane.stats()
        steady = self.rows[1 + self.config.warmup:] or self.rows[1:]
        return {
            "schedule": self.name,
            "items_in": self.items_in,
            "ingest_calls": self.ingest_calls,
            "episodes_ended": self.episodes_ended,
            "batches_delivered": self.batches,
            "items_delivered": self.batches * self.config.batch_size,
            "items_stored": stats["size"],
            "items_overwritten": stats["items_overwritten"],
            "plane_stats": stats,
            "learner_steps": len(self.losses),
            "loss_first": self.losses[0] if self.losses else None,
            "loss_last": float(np.mean(self.losses[-10:])) if self.losses else None,
            "first_call_s": self.first_call_s,
            "latency_us": latency_table(steady),
            "steady_iterations": len(steady),
        }


def run_demo(config: DemoConfig = DemoConfig()) -> dict[str, Any]:
    """Run the workload under ``sync`` and under ``config.schedule`` in interleaved rounds and return the summary:
    the placement chosen, per run its counts, plane stats and per-stage latency, and the cut the schedule made."""
    check_config(config)
    start = time.perf_counter()
    from conduit_jax.spec import ExperienceSpec

    spec = ExperienceSpec.from_example(example_transition(config.obs_dim))
    chosen, where = choose_placement(config, spec)
    runs = [_Run(config, name, spec, where) for name in config.schedules]
    progress = None
    if config.progress:
        from tqdm.auto import tqdm

        progress = tqdm(total=config.iterations * len(runs), unit="it", leave=False,
                        desc=f"conduit demo ({' vs '.join(config.schedules)})")
    try:
        done = 0
        for round_ in range(config.rounds):
            until = config.iterations * (round_ + 1) // config.rounds
            for run in runs:
                for _ in range(until - done):
                    run.iterate()
                if progress is not None:
                    progress.update(until - done)
                    if run.losses:
                        progress.set_postfix(loss=f"{run.losses[-1]:.4f}", refresh=False)
            done = until
    finally:
        if progress is not None:
            progress.close()  # leave=False: the bar's line is cleared, the report starts on a clean line
        for run in runs:
            run.plane.close()
    mesh = runs[0].plane.mesh
    summary = {
        "config": dataclasses.asdict(config),
        "platform": mesh.devices.flat[0].platform,
        "num_devices": int(mesh.devices.size),
        "placement": chosen,
        "spec": str(spec),
        "items_per_iteration": config.items_per_iteration,
        "runs": {run.name: run.summary() for run in runs},
    }
    summary["cut"] = schedule_cut(summary["runs"])
    if config.trace is not None:
        write_trace(config.trace, runs)
    if config.plot is not None:
        write_plot(config.plot, summary)
    summary["wall_s"] = time.perf_counter() - start
    return summary


def latency_table(rows: list[dict[str, float]]) -> dict[str, dict[str, float]]:
    """Median, p99 and mean per stage, in microseconds, over the steady-state iterations."""
    if not rows:
        return {}
    out = {}
    for stage in (*STAGES, "exposed", "iteration"):
        us = np.asarray([row[stage] for row in rows]) * 1e6
        out[stage] = {"median": float(np.median(us)), "p99": float(np.percentile(us, 99)), "mean": float(us.mean())}
    return out


def schedule_cut(runs: dict[str, dict[str, Any]]) -> Optional[dict[str, float]]:
    """What the scheduled run saved against sync, from mean times per iteration: the fraction of sync's exposed path
    (ingest + deliver) removed, the same for deliver alone (a detail), and the iteration time saved in units of sync's
    exposed path (1.0: all of it came off the iteration). None with one run."""
    if len(runs) < 2:
        return None
    sync, scheduled = (runs[name]["latency_us"] for name in runs)
    if not sync or not scheduled or sync["exposed"]["mean"] <= 0 or sync["deliver"]["mean"] <= 0:
        return None
    exposed = sync["exposed"]["mean"]
    return {"exposed": 1.0 - scheduled["exposed"]["mean"] / exposed,
            "deliver": 1.0 - scheduled["deliver"]["mean"] / sync["deliver"]["mean"],
            "iteration": (sync["iteration"]["mean"] - scheduled["iteration"]["mean"]) / exposed}


def write_trace(path: str, runs: list[_Run]) -> None:
    """Both runs' timelines in one Chrome/Perfetto trace (ui.perfetto.dev): one process per schedule, one track per
    thread (the learner's, and the delivery worker's under a prefetching schedule)."""
    import json

    events = []
    for pid, run in enumerate(runs):
        events.append({"name": "process_name", "ph": "M", "pid": pid, "args": {"name": f"schedule {run.name}"}})
        events += [event | {"pid": pid} for event in run.plane.timeline.chrome_trace()["traceEvents"]]
    with open(path, "w") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)


def write_plot(path: str, summary: dict[str, Any]) -> None:
    """A PNG: mean time per iteration of each stage, stacked, one bar per schedule."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(summary["runs"])
    fig, ax = plt.subplots(figsize=(6, 3.2))
    left = np.zeros(len(names))
    for stage in STAGES:
        means = np.array([summary["runs"][name]["latency_us"].get(stage, {}).get("mean", 0.0) for name in names])
        ax.barh(names, means, left=left, label=stage)
        left += means
    ax.set_xlabel("mean time per iteration (us)")
    ax.set_title("conduit demo: where an iteration's time goes")
    ax.legend(ncol=4, fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.25))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def format_summary(summary: dict[str, Any]) -> str:
    """The summary as a short report for a terminal: the placement, one block per run, and the cut."""
    c, where = summary["config"], summary["placement"]
    lines = [
        f"Conduit-JAX demo: {c['iterations']} iterations per schedule in {c['rounds']} interleaved rounds, "
        f"sampler {c['sampler']}(batch_size={c['batch_size']}), capacity {c['capacity']}",
        f"  placement       {where['source']}: {summary['num_devices']} {summary['platform']} "
        f"device{'s' if summary['num_devices'] > 1 else ''}, storage in {where['storage']} memory"
        + (f"\n                  why: {where['why']}" if where.get("why") else ""),
        f"  spec            {summary['spec']}",
    ]
    for name, run in summary["runs"].items():
        lines += ["", f"  schedule {name}:",
                  f"    items in {run['items_in']:,} ({run['ingest_calls']} ingest calls), delivered "
                  f"{run['items_delivered']:,} ({run['batches_delivered']} batches), stored {run['items_stored']:,}, "
                  f"overwritten {run['items_overwritten']:,}; {run['episodes_ended']} episodes ended"]
        if run["learner_steps"]:
            lines.append(f"    learner {run['learner_steps']} DQN steps, TD loss {run['loss_first']:.4f} -> "
                         f"{run['loss_last']:.4f} (mean of the last 10)")
        table = run["latency_us"]
        if table:
            lines.append(f"    {'stage':<10} {'median':>9} {'p99':>9} {'mean':>9}   (us, {run['steady_iterations']} "
                         f"steady iterations)")
            for stage, row in table.items():
                note = "   ingest + deliver: the learner's thread on experience" if stage == "exposed" else ""
                lines.append(f"    {stage:<10} {row['median']:>9.0f} {row['p99']:>9.0f} {row['mean']:>9.0f}{note}")
    cut = summary["cut"]
    if cut is not None:
        sync, scheduled = (summary["runs"][name]["latency_us"] for name in summary["runs"])
        name = list(summary["runs"])[1]
        lines += ["", f"  {name} against sync: exposed path (ingest + deliver) {sync['exposed']['mean']:.0f} -> "
                      f"{scheduled['exposed']['mean']:.0f} us ({100 * cut['exposed']:.1f}% cut); iteration "
                      f"{sync['iteration']['mean']:.0f} -> {scheduled['iteration']['mean']:.0f} us "
                      f"({100 * (scheduled['iteration']['mean'] / sync['iteration']['mean'] - 1):+.1f}%: "
                      f"{cut['iteration']:.2f}x sync's exposed path saved)",
                  f"    detail: deliver alone {sync['deliver']['mean']:.0f} -> {scheduled['deliver']['mean']:.0f} us "
                  f"({100 * cut['deliver']:.1f}% cut)"]
    for label, key in (("trace", "trace"), ("plot", "plot")):
        if c[key]:
            lines.append(f"  {label} written to {c[key]}")
    lines.append(f"  wall time {summary['wall_s']:.1f} s")
    return "\n".join(lines)
