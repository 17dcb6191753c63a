"""W7: a fully jitted DQN (env step, add, sample, priority update, learner step in ONE ``lax.scan``) with Conduit's
functional buffer against Flashbax's, the same loop for both (``experiments/jitted.py``).

Contenders, per metric (interleaved rounds in one process, on 1 device):
  * ``dqn_uniform``: ``conduit[1dev]`` (``cj.make_buffer(..., samplers.uniform(B))``) vs ``flashbax``
    (``fbx.make_item_buffer(add_sequences=True)``);
  * ``dqn_per``: ``conduit[1dev]`` (``samplers.prioritized(B, 0.6, beta 0.4 -> 1, 1e-6)``) vs ``flashbax-per``
    (``fbx.make_prioritised_item_buffer(device="cpu")`` + ``set_priorities``; IS weights computed in the loop);
  * ``dqn_per_mask`` (full runs): ``dqn_per`` with the updates masked instead of gated by ``lax.cond``;
  * full runs also time ``no-buffer(floor)`` in ``dqn_uniform`` and ``dqn_per``: the same loop with a stand-in that
    stores nothing and draws a random batch (env + policy + learner alone); peer time / floor time bounds the ratio
    any buffer could reach, and (contender - floor) is each buffer's own time per iteration.
Both run the same CartPole (8 vectorised envs), Q-network (64-64), batch, replay ratio (one update of B per env step
of the 8 envs) and gate. One timed call is a jitted segment of ``chunk`` scan iterations with the carry donated,
after warm-up (learning has started); env steps/s = chunk x 8 / time, updates/s = chunk / time. Recompiles: backend
compilations (``jax.monitoring``) during the timed rounds, and the segment's ``_cache_size()``.

On the emulated 8-device mesh (``XLA_FLAGS=--xla_force_host_platform_device_count=8``, in a subprocess unless this
process already has 8 devices) only Conduit runs: Flashbax has no sharded buffer. On a 2-core host those 8 "devices"
share the cores: a correctness configuration (W6), not a scaling one.

Not applicable here: the fraction of memcpy. The loop is compute-bound (network, env, tree), its buffer moves
~5 KB per update; the column shows the delivered bytes per second over memcpy for completeness.

    python -m benchmarks.bench_w7 [--quick] [--capacity N] [--rounds R]
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import numpy as np

FLAG = "--xla_force_host_platform_device_count=8"
MESH_DEVICES = 8
NUM_ENVS = 8
# metric -> (prioritized, gate); dqn_per_mask (full runs, 1 device) is dqn_per with the updates masked instead of
# under lax.cond: XLA copies the sum tree in and out of the cond's branch (Conduit's 256 KiB leaf level and its
# 16 KiB level, twice each per update at 65,536 items; Flashbax's 512 KiB tree three times), without the cond
# Conduit's copies go (Flashbax keeps two)
METRICS = {"dqn_uniform": (False, "cond"), "dqn_per": (True, "cond"), "dqn_per_mask": (True, "mask")}
PEERS = {"dqn_uniform": "flashbax", "dqn_per": "flashbax-per", "dqn_per_mask": "flashbax-per"}


def metrics_for(settings, devices: int) -> list[str]:
    if settings.quick:  # a smoke run: well under a minute, most of it compilation
        return ["dqn_uniform", "dqn_per"] if devices == 1 else ["dqn_uniform"]
    return list(METRICS) if devices == 1 else ["dqn_uniform", "dqn_per"]


def settings_for(quick: bool, capacity=None, rounds=None):
    from benchmarks import common

    # chunk: scan iterations per timed call (x NUM_ENVS env steps); sample_reps: calls per contender per round
    if quick:
        s = common.Settings(capacity=8_192, batch_size=64, chunk=100, rounds=2, sample_reps=2, quick=True)
    else:
        s = common.Settings(capacity=65_536, batch_size=128, chunk=500, rounds=10, sample_reps=3)
    if capacity is not None:
        s.capacity = capacity
    if rounds is not None:
        s.rounds = rounds
    return s


def _config(settings, prioritized: bool, devices: int, gate: str = "cond"):
    from experiments import jitted

    calls = 1 + 3 + settings.rounds * settings.sample_reps  # first + warm-up + timed
    return jitted.DQNConfig(num_envs=NUM_ENVS, capacity=settings.capacity, batch_size=settings.batch_size,
                            prioritized=prioritized, devices=devices, learning_starts=500, gate=gate,
                            total_env_steps=calls * settings.chunk * NUM_ENVS)


FLOOR = "no-buffer(floor)"


def floor_replay(config, spec):
    """The loop without a buffer: add does nothing, a draw is a random batch of the spec (one normal draw per leaf).
    Its time is the env, policy and learner alone: what a buffer that cost nothing would take."""
    import jax
    import jax.numpy as jnp

    from experiments import jitted

    b = config.batch_size

    def sample(key):
        key, sub = jax.random.split(key)
        data = jax.tree_util.tree_map(lambda s: jax.random.normal(sub, (b,) + s.shape).astype(s.dtype), spec)
        return key, jitted.Sample(data, jnp.zeros((b,), jnp.int32), jnp.ones((b,), jnp.float32), jnp.bool_(True))

    return jitted.Replay(FLOOR, config.prioritized, lambda: jax.random.key(config.seed), lambda state, items: state,
                         sample, lambda state, ids, td: state, lambda state: jnp.bool_(True))


class Loop:
    """One contender: its learner's carry and the jitted segment (``chunk`` scan iterations, carry donated)."""

    def __init__(self, label: str, config, kind: str, chunk: int, log):
        import jax

        from experiments import jitted

        self.label, self.jax = label, jax
        self.parts = jitted.make_dqn(config, kind)
        with log.phase(label, "construct"):
            self.carry = jax.block_until_ready(jax.jit(self.parts.init)(jax.random.key(config.seed)))
        self.segment = jax.jit(lambda carry: jax.lax.scan(self.parts.step, carry, None, chunk), donate_argnums=0)
        self.metrics = None
        self.chunk = chunk

    def __call__(self) -> None:
        self.carry, self.metrics = self.segment(self.carry)
        self.jax.block_until_ready((self.carry, self.metrics))

    def updates_last_call(self) -> int:
        return int(np.asarray(self.jax.device_get(self.metrics["updated"])).sum())

    def cache_size(self) -> int:
        return self.segment._cache_size()


def measure(settings, devices: int, log, peers: bool) -> list[dict]:
    """Time every metric's contenders in interleaved rounds; timing records (ratios added by the caller)."""
    from benchmarks import common

    ours = "conduit[1dev]" if devices == 1 else f"conduit[{devices}dev-emulated]"
    records = []
    item = 4 * 4 * 2 + 4 + 4 + 1  # obs, next_obs f32[4], action i32, reward f32, terminated bool
    for metric in metrics_for(settings, devices):
        prioritized, gate = METRICS[metric]
        config = _config(settings, prioritized, devices, gate)
        loops = {ours: Loop(ours, config, "conduit", settings.chunk, log)}
        if peers:
            try:
                loops[PEERS[metric]] = Loop(PEERS[metric], config, "flashbax", settings.chunk, log)
            except ImportError as exc:
                records.append({"record": "unavailable", "workload": "w7", "contender": PEERS[metric],
                                "reason": f"flashbax is not installed ({exc})"})
            if not settings.quick and config.gate == "cond":
                loops[FLOOR] = Loop(FLOOR, config, floor_replay, settings.chunk, log)
        first = {name: common.time_first_call(loop, log, name, f"{metric}/first") for name, loop in loops.items()}
        common.log_line(f"   {metric}: first calls " + ", ".join(f"{n} {s:.1f} s" for n, s in first.items())
                        + f"; timing {len(loops)} contenders x {settings.rounds} rounds x {settings.sample_reps} "
                          f"calls of {settings.chunk} iterations")
        cache_before = {name: loop.cache_size() for name, loop in loops.items()}
        timings = common.interleaved(loops, rounds=settings.rounds, reps=settings.sample_reps, log=log,
                                     phase=f"{metric}/steady")
        for name, t in timings.items():
            loop = loops[name]
            updates = loop.updates_last_call()
            env_steps = settings.chunk * NUM_ENVS
            median = float(np.median(t.calls))
            records.append(common.timing_record(
                "w7", metric, name, t, items_per_call=env_steps, bytes_per_call=updates * settings.batch_size * item,
                memcpy_bps=settings.memcpy_bps, rate_unit="env steps/s", devices=devices,
                first_call_s=first[name], compile_s=log.get(name, f"{metric}/first").seconds,
                compiles=log.get(name, f"{metric}/first").compiles,
                recompiles=log.get(name, f"{metric}/steady").compiles,
                jit_cache_entries=loop.cache_size(), jit_cache_growth=loop.cache_size() - cache_before[name],
                updates_per_call=updates, updates_per_s=updates / median, env_steps_per_s=env_steps / median,
                batch_size=settings.batch_size, num_envs=NUM_ENVS, capacity=settings.capacity, gate=config.gate,
                chunk=settings.chunk,
                **({"group": f"{devices}dev-emulated"} if devices > 1 else {})))
        del loops
    return records


def round_ratios(records: list[dict]) -> list[dict]:
    """Per metric: ours / peer env steps/s per round (their time / ours, round medians), and its median."""
    out = []
    for metric in METRICS:
        rows = {r["contender"]: r for r in records if r.get("record") == "timing" and r["metric"] == metric
                and not r.get("group")}
        ours, peer = rows.get("conduit[1dev]"), rows.get(PEERS[metric])
        if ours is None or peer is None:
            continue
        per_round = [p / o for o, p in zip(ours["round_medians_s"], peer["round_medians_s"])]
        floor = rows.get(FLOOR)
        out.append({"record": "ratio", "workload": "w7", "metric": metric, "ours": "conduit[1dev]",
                    "peer": PEERS[metric], "ours_over_peer_env_steps_per_s_median_of_rounds":
                        float(np.median(per_round)), "per_round": per_round,
                    "ours_over_peer_updates_per_s": ours["updates_per_s"] / peer["updates_per_s"],
                    # a buffer that cost nothing would reach peer time / floor time; the buffers' own share
                    **({"bound_if_our_buffer_cost_nothing": peer["median_s"] / floor["median_s"],
                        "ours_buffer_us_per_iteration": (ours["median_s"] - floor["median_s"]) / ours["chunk"] * 1e6,
                        "peer_buffer_us_per_iteration": (peer["median_s"] - floor["median_s"]) / peer["chunk"] * 1e6}
                       if floor is not None else {})})
    return out


def summary_table(records: list[dict]) -> str:
    ratios = {r["metric"]: r for r in records if r.get("record") == "ratio"}
    header = (f"{'metric':<13} {'contender':<26} {'devices':>7} {'env steps/s':>12} {'updates/s':>10} "
              f"{'ours/peer (median of rounds)':>29} {'recomp':>6} {'jit cache':>9}")
    lines = ["w7 fully jitted DQN loop (env steps/s and updates/s from the median segment time)", header,
             "-" * len(header)]
    for r in records:
        if r.get("record") != "timing":
            continue
        ratio = ""
        if r["metric"] in ratios and r["contender"] == "conduit[1dev]":
            ratio = f"{ratios[r['metric']]['ours_over_peer_env_steps_per_s_median_of_rounds']:.2f}x"
        if r["metric"] in ratios and r["contender"] == FLOOR and "bound_if_our_buffer_cost_nothing" in ratios[
                r["metric"]]:
            ratio = f"(bound {ratios[r['metric']]['bound_if_our_buffer_cost_nothing']:.2f}x)"
        lines.append(f"{r['metric']:<13} {r['contender']:<26} {r['devices']:>7} {r['env_steps_per_s']:>12,.0f} "
                     f"{r['updates_per_s']:>10,.0f} {ratio:>29} {r['recompiles']:>6} {r['jit_cache_entries']:>9}")
    for r in ratios.values():
        if "ours_buffer_us_per_iteration" in r:
            lines.append(f"{r['metric']}: buffer time per iteration over the floor: conduit "
                         f"{r['ours_buffer_us_per_iteration']:.1f} us, {r['peer']} "
                         f"{r['peer_buffer_us_per_iteration']:.1f} us; a buffer that cost nothing would be {r['bound_if_our_buffer_cost_nothing']:.2f}x "
                         f"{r['peer']}")
    lines.append("Flashbax has no sharded buffer: the 8-device rows are Conduit only (emulated devices on 2 cores: a "
                 "correctness configuration)")
    return "\n".join(lines)


def _mesh_subprocess(settings) -> list[dict]:
    """The 8-device rows from ``python -m benchmarks.bench_w7 --mesh-only OUT`` run with the device flag."""
    from benchmarks import common

    with tempfile.TemporaryDirectory(prefix="conduit-w7-") as tmp:
        out = Path(tmp) / "w7_mesh.jsonl"
        flags = (os.environ.get("XLA_FLAGS", "") + " " + FLAG).strip()
        common.run_workload_module("w7", ["--mesh-only", str(out), "--capacity", str(settings.capacity), "--rounds",
                                          str(settings.rounds)] + (["--quick"] if settings.quick else []),
                                   f"the {MESH_DEVICES}-device rows need XLA_FLAGS={FLAG}", {"XLA_FLAGS": flags})
        env, records = common.read_jsonl(out)
    for r in records:
        r["subprocess_environment"] = {k: env.get(k) for k in ("device_count", "XLA_FLAGS", "load_average")}
    return records


def run(settings) -> list[dict]:
    import jax

    from benchmarks import common

    common.configure_runtime("w7")
    log = common.CompileLog()
    meter = common.MemcpyMeter(64 << 20)
    meter.measure(3)
    settings.memcpy_bps = meter.bytes_per_s
    load_start = list(os.getloadavg())
    if jax.device_count() > 1:
        common.log_line(f"w7: this process has {jax.device_count()} devices; the 1-device rows use the first")
    common.log_line(f"w7: fully jitted DQN, capacity {settings.capacity:,}, batch {settings.batch_size}, "
                    f"{NUM_ENVS} envs, {settings.chunk} iterations per timed call")
    records = measure(settings, 1, log, peers=True)
    if jax.device_count() >= MESH_DEVICES:
        records += measure(settings, MESH_DEVICES, log, peers=False)
    else:
        records += _mesh_subprocess(settings)
    common.add_ratios(records)
    for r in records:  # the 8-device rows against the 1-device Conduit row of the same metric
        if r.get("record") == "timing" and r.get("group"):
            base = next(b for b in records if b.get("record") == "timing" and b["metric"] == r["metric"]
                        and b["contender"] == "conduit[1dev]")
            r["x_over_conduit"], r["conduit_over_x"] = (r["median_s"] / base["median_s"],
                                                        base["median_s"] / r["median_s"])
    records += round_ratios(records)
    goals = [
        common.Goal("W7 DQN uniform: Conduit >= 1.0x Flashbax item buffer env steps/s (time <= 1.0x; aim 1.3x)",
                    "ratio", "dqn_uniform", 1.0, peer="flashbax"),
        common.Goal("W7 DQN PER: Conduit >= 1.5x Flashbax prioritised buffer env steps/s (time <= 0.667x)",
                    "ratio", "dqn_per", 1 / 1.5, peer="flashbax-per"),
        common.Goal("W7 zero recompiles after warm-up (uniform)", "recompiles", "dqn_uniform", 0),
        common.Goal("W7 zero recompiles after warm-up (PER)", "recompiles", "dqn_per", 0),
    ]
    if "dqn_per_mask" in metrics_for(settings, 1):
        goals.insert(2, common.Goal("W7 DQN PER, updates masked instead of lax.cond: Conduit >= 1.5x Flashbax "
                                    "prioritised buffer env steps/s (time <= 0.667x)", "ratio", "dqn_per_mask",
                                    1 / 1.5, peer="flashbax-per"))
    goal_records = common.evaluate_goals(records, goals, "w7")
    records += goal_records
    meter.measure(3)
    notes = {"frac_memcpy": "not applicable: the loop is compute-bound; the column is delivered bytes / memcpy",
             "x/conduit": "contender time / conduit[1dev] time for the same segment: above 1 Conduit is faster",
             "flashbax_sharding": "Flashbax has no sharded buffer; the 8-device rows are Conduit only",
             "correctness_configuration": "the 8 devices are emulated XLA:CPU devices on 2 shared cores"}
    env = common.environment(meter.record(), {"workload": "w7", "description":
                                              f"fully jitted DQN (CartPole, {NUM_ENVS} envs), capacity "
                                              f"{settings.capacity:,}, batch {settings.batch_size}, "
                                              f"{settings.chunk} scan iterations per call",
                                              "settings": vars(settings), "notes": notes})
    env["load_average_end"], env["load_average"] = env["load_average"], load_start
    path = common.RESULTS_DIR / ("w7.quick.jsonl" if settings.quick else "w7.jsonl")
    common.write_jsonl(path, env, records)
    print()
    for metric in metrics_for(settings, 1):
        print(common.timing_table(records, metric, f"w7 {metric}: one call = {settings.chunk} iterations x "
                                  f"{NUM_ENVS} env steps (x/conduit = contender time / conduit[1dev] time)",
                                  "env steps/s") + "\n")
    print(summary_table(records) + "\n")
    for r in records:
        if r.get("record") == "unavailable":
            print(f"{r['contender']}: {r['reason']}")
    print(f"w7 goals (issue 7):\n{common.goal_lines(goal_records)}")
    print(f"load average start {env['load_average']} end {env['load_average_end']}; results: {path}")
    return records


def _mesh_only(settings, out: str) -> None:
    import jax

    from benchmarks import common

    common.configure_runtime("w7")
    if jax.device_count() < MESH_DEVICES:
        raise SystemExit(f"--mesh-only needs {MESH_DEVICES} devices, this process has {jax.device_count()}")
    meter = common.MemcpyMeter(64 << 20)
    meter.measure(3)
    settings.memcpy_bps = meter.bytes_per_s
    records = measure(settings, MESH_DEVICES, common.CompileLog(), peers=False)
    common.write_jsonl(Path(out), common.environment(meter.record(), {"workload": "w7-mesh"}), records)


def main(argv=None):
    from benchmarks import common

    parser = common.workload_parser(__doc__)
    parser.add_argument("--mesh-only", metavar="OUT", help="internal: the 8-device rows only, written to OUT")
    args = parser.parse_args(argv)
    if args.mesh_only and FLAG.split("=")[0] not in os.environ.get("XLA_FLAGS", "") and "jax" not in sys.modules:
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + FLAG).strip()
    settings = settings_for(args.quick, args.capacity, args.rounds)
    if settings.capacity % MESH_DEVICES or settings.batch_size % MESH_DEVICES:
        parser.error(f"--capacity must be a multiple of {MESH_DEVICES} (the 8-device mesh)")
    if args.mesh_only:
        _mesh_only(settings, args.mesh_only)
    else:
        run(settings)


if __name__ == "__main__":
    main()
