"""W1: SAC-sized transitions, uniform replay.

Item: obs f32[39], act f32[4], rew f32, done bool, next_obs f32[39] (333 raw bytes). Capacity 1,000,000, filled with
random data before timing. Measured: add throughput for chunks of 1,000 items, and uniform sample latency for a batch
of 256 with the batch ready (JAX results blocked on). Conduit's headline row runs on ``default_mesh(1)``; when the
process has 8 devices (``XLA_FLAGS=--xla_force_host_platform_device_count=8``, or ``run.py --emulated-mesh``) it also
runs on the emulated 8-device mesh, a correctness configuration that is slower on this 2-core host.

    python -m benchmarks.bench_w1 [--quick] [--capacity N] [--rounds R] [--no-emulated]
"""

from __future__ import annotations

import itertools

import numpy as np

from benchmarks import common, peers

W1_SPEC = {
    "obs": ((39,), np.float32),
    "act": ((4,), np.float32),
    "rew": ((), np.float32),
    "done": ((), np.bool_),
    "next_obs": ((39,), np.float32),
}
POOL_CHUNKS = 32  # distinct random chunks cycled through by every add (identical input for every contender)


def add_op(contender, pools):
    """The add metric's operation (W1 and the workloads that time adds the same way): each call adds the next of the
    contender's prepared chunks, cycling through them."""
    prepared = contender._prepared
    counter = itertools.count()
    n = len(prepared)
    return lambda: contender.add(prepared[next(counter) % n])


def _sample_op(batch_size):
    def make(contender, pools):
        return lambda: contender.sample(batch_size)

    return make


def entries(settings: common.Settings, emulated: bool = True) -> list[common.Entry]:
    import jax

    spec, cap, b = W1_SPEC, settings.capacity, settings.batch_size
    out = [
        common.Entry("conduit[1dev]", lambda: peers.Conduit(spec, cap, b, devices=1)),
    ]
    if emulated and jax.device_count() >= 8:
        out.append(common.Entry("conduit[8dev-emulated,correctness]", lambda: peers.Conduit(spec, cap, b, devices=8)))
    out += [
        common.Entry("numpy", lambda: peers.NumpyRing(spec, cap, b)),
        common.Entry("numpy+device_put", lambda built: peers.NumpyToJax(built["numpy"]), derived=True),
        common.Entry("cpprb", lambda: peers.CpprbUniform(spec, cap, b)),
        common.Entry("flashbax", lambda: peers.FlashbaxUniform(spec, cap, b)),
        common.Entry("torchrl", lambda: peers.TorchRLUniform(spec, cap, b)),
    ]
    return out


def run(settings: common.Settings, emulated: bool = True) -> list[dict]:
    common.configure_runtime("w1")
    rng = np.random.default_rng(1)
    pools = {"chunks": [peers.random_batch(W1_SPEC, settings.chunk, rng) for _ in range(POOL_CHUNKS)]}
    metrics = [
        common.Metric(f"add_chunk{settings.chunk}", f"add, chunks of {settings.chunk:,} items", "items/s",
                      settings.chunk, add_op, applies=lambda c: not isinstance(c, peers.NumpyToJax),
                      reps=settings.add_reps, first_from_fill=True),
        common.Metric(f"sample_b{settings.batch_size}", f"uniform sample, batch {settings.batch_size} (ready)",
                      "samples/s", settings.batch_size, _sample_op(settings.batch_size), reps=settings.sample_reps),
    ]
    status = peers.torchrl_status()
    notes = {"torchrl": status["torchrl"], "torchrl_extension": status["extension"],
             "numpy+device_put": "the NumPy ring's batch moved to a JAX device array (what a JAX learner pays)",
             "cpprb_layout": "scalar leaves stored as [N, 1] (cpprb's shape default)"}
    return common.run_workload(
        "w1", f"SAC transitions, uniform, capacity {settings.capacity:,}, batch {settings.batch_size}",
        W1_SPEC, settings, entries(settings, emulated), metrics, pools=pools, notes=notes)


def main(argv=None):
    parser = common.workload_parser(__doc__)
    parser.add_argument("--no-emulated", action="store_true", help="skip the 8-device mesh even when available")
    args = parser.parse_args(argv)
    run(common.Settings.for_run(args.quick, args.capacity, args.rounds), emulated=not args.no_emulated)


if __name__ == "__main__":
    main()
