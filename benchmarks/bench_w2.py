"""W2: W1's transitions under prioritized replay (PER).

Capacity 1,000,000 filled with random data; alpha 0.6, beta 0.4, eps 1e-6; batch 256. One step = sample a batch
(ready, with its ids and importance weights) then update the 256 sampled priorities, as a DQN/SAC learner does after
computing TD errors. The priorities come from a pool of random arrays prepared beforehand (on device for JAX
contenders, where a learner's TD errors would be). Also measured: add throughput for chunks of 1,000 items (new items
enter the priority tree at the largest priority seen).

Contenders: Conduit ``samplers.prioritized`` + ``plane.update_priorities`` (reported as not available when the
installed conduit_jax lacks them), cpprb ``PrioritizedReplayBuffer``, Flashbax ``make_prioritised_item_buffer``, a
NumPy vectorised sum tree, TorchRL ``PrioritizedSampler`` when its C++ extension loads.

    python -m benchmarks.bench_w2 [--quick] [--capacity N] [--rounds R] [--no-emulated]
"""

from __future__ import annotations

import itertools

import numpy as np

from benchmarks import common, peers
from benchmarks.bench_w1 import POOL_CHUNKS, W1_SPEC, add_op

PRIORITY_POOL = 64


def _cycle_op(batch_size):
    def make(contender, pools):
        prepared = [contender.prepare_priorities(p) for p in pools["priorities"]]
        counter = itertools.count()
        n = len(prepared)

        def step():
            out = contender.sample(batch_size)
            contender.update_priorities(out.ids, prepared[next(counter) % n])
            return out

        return step

    return make


def entries(settings: common.Settings, per: peers.PER, emulated: bool = True) -> list[common.Entry]:
    import jax

    spec, cap, b = W1_SPEC, settings.capacity, settings.batch_size
    out = [common.Entry("conduit[1dev]", lambda: peers.Conduit(spec, cap, b, per=per, devices=1))]
    if emulated and jax.device_count() >= 8:
        out.append(common.Entry("conduit[8dev-emulated,correctness]",
                                lambda: peers.Conduit(spec, cap, b, per=per, devices=8)))
    out += [
        common.Entry("numpy-sumtree", lambda: peers.NumpySumTreePER(spec, cap, b, per=per)),
        common.Entry("cpprb-per", lambda: peers.CpprbPER(spec, cap, b, per=per)),
        common.Entry("flashbax-per", lambda: peers.FlashbaxPER(spec, cap, b, per=per)),
        common.Entry("torchrl-per", lambda: peers.TorchRLPER(spec, cap, b, per=per)),
    ]
    return out


def run(settings: common.Settings, emulated: bool = True) -> list[dict]:
    common.configure_runtime("w2")
    per = peers.PER(alpha=0.6, beta=0.4, eps=1e-6)
    rng = np.random.default_rng(2)
    pools = {
        "chunks": [peers.random_batch(W1_SPEC, settings.chunk, rng) for _ in range(POOL_CHUNKS)],
        # |TD error|-like priorities: positive, heavy-ish tail
        "priorities": [np.abs(rng.standard_normal(settings.batch_size)).astype(np.float32)
                       for _ in range(PRIORITY_POOL)],
    }
    metrics = [
        common.Metric(f"add_chunk{settings.chunk}", f"PER add, chunks of {settings.chunk:,} items", "items/s",
                      settings.chunk, add_op, reps=settings.add_reps, first_from_fill=True),
        common.Metric(f"per_cycle_b{settings.batch_size}",
                      f"PER step: sample batch {settings.batch_size} + update its {settings.batch_size} priorities",
                      "samples/s", settings.batch_size, _cycle_op(settings.batch_size), reps=settings.sample_reps,
                      # a cycle's update rides in the next cycle's sample: the steady kernel first runs in cycle 2
                      first_calls=2),
    ]
    why = peers.conduit_prioritized_available()
    if why:
        print(f"conduit prioritized: not available yet ({why})", flush=True)
    status = peers.torchrl_status()
    notes = {
        "per": f"alpha {per.alpha}, beta {per.beta}, eps {per.eps}; stored (p + eps)^alpha",
        "weights": "IS weights normalised over the batch (Conduit, Flashbax, NumPy) or over the buffer (cpprb)",
        "flashbax": "sample and set_priorities jitted apart (state donated to add and set_priorities); weights "
                    "computed from its probabilities inside the jitted sample",
        "torchrl": status["torchrl"],
        "torchrl_extension": status["extension"],
    }
    if why:
        notes["conduit"] = f"conduit prioritized: not available yet ({why})"
    return common.run_workload(
        "w2", f"SAC transitions, PER alpha {per.alpha} beta {per.beta}, capacity {settings.capacity:,}, "
              f"batch {settings.batch_size}", W1_SPEC, settings, entries(settings, per, emulated), metrics,
        pools=pools, notes=notes)


def main(argv=None):
    parser = common.workload_parser(__doc__)
    parser.add_argument("--no-emulated", action="store_true", help="skip the 8-device mesh even when available")
    args = parser.parse_args(argv)
    run(common.Settings.for_run(args.quick, args.capacity, args.rounds), emulated=not args.no_emulated)


if __name__ == "__main__":
    main()
