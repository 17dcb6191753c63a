"""Test setup: 8 emulated CPU devices, configured before JAX initialises its backends."""

import atexit
import os
import shutil
import tempfile

# LLVM optimisation level 0 for the code XLA:CPU generates: most of the suite's time is compiling kernels that then
# run a few times each, and at -O0 a kernel compiles in ~70% of the time (the RLlib adapter's draw kernel: 0.92 ->
# 0.64 s; the whole default run: 3,536 compilations in 630 -> 564 s). LLVM's level changes how fast the generated
# code runs, not what it computes (no fast-math at either level). Users and the benchmarks keep XLA's default; a
# caller's own XLA_FLAGS come first and may set another level.
flags = os.environ.get("XLA_FLAGS", "")
if "--xla_backend_optimization_level" not in flags:
    flags += " --xla_backend_optimization_level=0"
os.environ["XLA_FLAGS"] = (flags + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The suite is compile-bound: many tests build planes whose kernels are the same XLA programs, in this process, in
# pytest-xdist's other worker and in the processes tests start (Ray actors, a second JAX process). JAX's persistent
# compilation cache, in one directory for the whole run, compiles each of them once: the process that starts the run
# makes it (and removes it at exit), and every process started after inherits these variables, which JAX reads when
# it is imported. Every kernel is still compiled from scratch in the first test that needs it.
# No size limit: with one, JAX evicts by scanning the whole directory (a stat and a read per entry) on every write, so
# a write cost ~70 ms once ~2,000 kernels were cached (quadratic over the run). Without it there is no file lock
# either: a process that reads an entry while another writes the same one finds it truncated, which JAX reports
# with a warning and compiles the kernel itself (the entries are the same program: the last write is whole).
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="conduit-test-jax-cache-")
    atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import jax  # noqa: E402
import pytest  # noqa: E402

from conduit_jax.replay import default_mesh  # noqa: E402

assert jax.device_count() == 8, "tests need 8 emulated CPU devices; XLA_FLAGS was set too late"


def _mesh_2x4():
    from jax.sharding import AxisType
    return jax.make_mesh((2, 4), ("host", "local"), axis_types=(AxisType.Auto, AxisType.Auto))


MESHES = {"1dev": lambda: default_mesh(1), "8dev": lambda: default_mesh(8), "2x4": _mesh_2x4}


@pytest.fixture(params=["1dev", "8dev"])
def mesh(request):
    """The same test body on one device and on the 8-device mesh."""
    return MESHES[request.param]()


@pytest.fixture(params=["1dev", "8dev", "2x4"])
def any_mesh(request):
    """One device, a 1-D 8-device mesh and a 2x4 mesh (capacity sharded over both axes)."""
    return MESHES[request.param]()


@pytest.fixture(scope="module", params=["1dev", "8dev"])
def module_mesh(request):
    """Like ``mesh`` but shared by a module's tests, so a plane built once can serve many read-only checks."""
    return MESHES[request.param]()


def _host_leaves(state):
    import numpy as np

    flat, _ = jax.tree_util.tree_flatten_with_path(jax.device_get(state))
    return [(jax.tree_util.keystr(path), np.asarray(leaf)) for path, leaf in flat]


@pytest.fixture
def state_snapshot():
    """``check = state_snapshot(plane)``; later ``check()`` asserts every leaf of ``plane.state`` is bit-identical
    (same tree, shape, dtype and bytes) to what it was at the snapshot, and was not donated away."""
    import numpy as np

    def snapshot(plane):
        treedef = jax.tree_util.tree_structure(plane.state)
        before = _host_leaves(plane.state)

        def check():
            assert jax.tree_util.tree_structure(plane.state) == treedef
            after = _host_leaves(plane.state)
            for (path, old), (_, new) in zip(before, after):
                assert old.dtype == new.dtype and old.shape == new.shape, path
                assert np.array_equal(old, new), f"state leaf {path} changed"

        return check

    return snapshot


@pytest.fixture
def status_reads(monkeypatch):
    """``reads = status_reads(plane)``: from then on ``len(reads)`` counts the plane's status-kernel launches (each
    one a kernel plus a device read, which the shell avoids by keeping the counters it needs in step)."""

    def count(plane):
        reads = []
        read = plane.engine.status
        monkeypatch.setattr(plane.engine, "status", lambda: reads.append(1) or read())
        return reads

    return count


class FunctionalPlane:
    """The functional API behind the plane's host calls, so one test body checks both: each call is the ``Buffer``'s
    pure function under ``jax.jit`` with the state donated, as a learner's jitted loop runs it. A sample the state
    cannot serve raises ``NotEnoughDataError`` here (the functional call itself returns ``valid=False``)."""

    def __init__(self, spec, capacity, sampler=None, *, mesh=None, seed=0, **kwargs):
        import conduit_jax as cj

        self.buffer = cj.make_buffer(spec, capacity, sampler, mesh=mesh, **kwargs)
        self.config, self.sampler = self.buffer.config, self.buffer.config.sampler
        self.capacity, self.num_shards, self.batch_size = capacity, self.config.num_shards, self.sampler.batch_size
        self.state = self.buffer.init(seed)
        self._ingest = jax.jit(self.buffer.ingest, donate_argnums=0)
        self._sample = jax.jit(self.buffer.sample, donate_argnums=0)
        self._update = jax.jit(self.buffer.update, donate_argnums=0)

    def ingest(self, batch):
        self.state = self._ingest(self.state, batch)

    def sample(self):
        from conduit_jax import NotEnoughDataError

        self.state, delivery = self._sample(self.state)
        if not bool(delivery.valid):
            raise NotEnoughDataError("the functional sample was flagged invalid")
        return delivery

    def update_priorities(self, ids, priorities):
        self.state = self._update(self.state, ids, priorities)

    def can_sample(self):
        return bool(jax.jit(self.buffer.can_sample)(self.state))


@pytest.fixture(params=["plane", "functional"])
def front(request):
    """The class a test builds its buffer with: ``ExperienceDataPlane`` or the functional API behind the same calls
    (``FunctionalPlane``), so statistical and bad-input test bodies run through both."""
    from conduit_jax import ExperienceDataPlane

    return ExperienceDataPlane if request.param == "plane" else FunctionalPlane


@pytest.fixture
def td_errors_computing():
    """``priorities = td_errors_computing(ids, seconds)``: TD errors (all ones, one per id) from a stand-in learner step
    that is still computing when this returns: a chain of dependent matmuls sized from a timed run to take about
    ``seconds``. (A step held on a host event cannot be used: on the CPU backend a program with a host callback runs
    at dispatch.)"""
    import jax.numpy as jnp

    @jax.jit
    def learner_step(m, ids, rounds):  # `rounds` dependent matmuls, then the TD errors
        m = jax.lax.fori_loop(0, rounds, lambda i, x: jnp.tanh(x @ m), m)
        return jnp.abs(jnp.sum(m)) * 0 + jnp.ones(ids.shape[0])

    def start(ids, seconds: float):
        import time

        m = jnp.full((256, 256), 1e-3, jnp.float32)
        jax.block_until_ready(learner_step(m, ids, 1))  # compiled
        begin = time.perf_counter()
        jax.block_until_ready(learner_step(m, ids, 32))
        priorities = learner_step(m, ids, int(32 * seconds / (time.perf_counter() - begin)) + 1)
        assert not priorities.is_ready(), "the learner step ran at dispatch: the CPU backend's async dispatch is off"
        return priorities

    return start


# Variants of tests whose behaviour the default run already covers once, run with `-m slow`: the default suite has
# an 8-minute budget on the 2-core CI host. The sharded (8-device) behaviour of every sampler stays in the default
# run through test_plane, test_functional, test_checkpoint, test_staging and test_samplers' sharding test; these
# files' other 8-device variants repeat their one-device statistics on the mesh. Patterns match pytest node ids.
SLOW_VARIANTS = (
    "tests/test_prioritized.py::*8dev*",
    "tests/test_sequences.py::*8dev*",
    "tests/test_delivery.py::*8dev*",
    "tests/test_samplers.py::*8dev*",
    "tests/test_rllib_contract.py::test_prioritized_n_step_transitions_as_rllib[[]1-*",
    "tests/test_rllib_multi_agent.py::test_continued_episodes_and_agents_of_one_module_count_as_rllib[[]Conduit"
    "MultiAgentEpisodeReplayBuffer]",
    "tests/test_rllib_adapter.py::test_dqn_prioritized_trains_through_dlpack[[]sync]",
    "tests/test_rllib_adapter.py::test_dqn_prioritized_trains_through_dlpack[[]adaptive]",
    "tests/test_rllib_adapter.py::test_rllib_schedules_probe_runs_every_path",
    "tests/test_grpo_experiment.py::test_behaviour_logprobs_match_a_recomputation",
    "tests/test_grpo_experiment.py::test_short_runs_through_the_packed_path[[]overlap]",
    "tests/test_checkpoint.py::test_version_1_rings_in_slot_order_are_read_and_converted",
    "tests/test_checkpoint.py::test_byte_rings_round_trip_increment_and_relayout[[]sequences]",
    "tests/test_demo.py::test_both_schedules_run_the_same_workload[[]8]",
    "tests/test_checkpoint.py::test_version_2_byte_rings_saved_as_words_are_read_and_converted",
    "tests/test_rllib_contract.py::test_short_episodes_whose_unfitting_steps_hold_most_priority*",
    "tests/test_rllib_contract.py::test_prioritized_infos_and_extra_model_outputs_as_rllib*",
    "tests/test_rllib_adapter.py::test_multi_agent_dqn_trains_on_the_conduit_buffer",
    "tests/test_experiment_cli.py::test_gpu_dry_run_placement_smoke",
    "tests/test_grpo_experiment.py::test_packed_and_naive_batches_give_the_same_loss",
    "tests/test_rollouts.py::test_matches_the_reference_through_wraps_overwrites_and_staleness[[]layout2-*",
    "tests/test_rollout_plane.py::test_a_grpo_loop_gets_whole_fresh_groups_once_in_order[[]overlap]",
    "tests/test_rollout_plane.py::test_trimmed_batches_are_the_whole_batches_first_rows[[]padded]",
    # the GRPO experiment's run (it compiles a transformer's generation and learner step: ~20 s alone); the rollout
    # path it drives stays in the default run through test_rollout_plane's GRPO-style loop
    "tests/test_grpo_experiment.py::test_short_runs_through_the_packed_path[[]sync]",
    # 8-device repeats of one-device round trips; restore onto other shard counts (8 included) covers every kind
    "tests/test_checkpoint.py::test_round_trip_is_bit_exact_and_keeps_delivering_the_same_batches[[]8dev-uniform]",
    "tests/test_checkpoint.py::test_round_trip_is_bit_exact_and_keeps_delivering_the_same_batches[[]8dev-fifo]",
    "tests/test_checkpoint.py::test_round_trip_is_bit_exact_and_keeps_delivering_the_same_batches[[]8dev-sequences]",
    "tests/test_checkpoint.py::test_incremental_steps_hold_only_new_rows_and_reassemble[[]8dev]",
    # further sizes of the sum tree's run write (a power of two, a wrap, 1-item runs and a large run stay)
    "tests/test_sumtree.py::test_set_run_equals_set_leaves_on_consecutive_slots[[]100-64]",
    "tests/test_sumtree.py::test_set_run_equals_set_leaves_on_consecutive_slots[[]16-16]",
    # a lookback of 1 without a minimum length: lookback 0 and lookback 3 with min_length 5 stay
    "tests/test_rllib_contract.py::test_uniform_sequences_of_episodes_as_rllib[[]1-0-*",
)
SLOW_KEPT = ("test_delivery_is_sharded_over_the_mesh_axes",  # the samplers' sharding, on the mesh
             "test_a_mix_of_sample_and_deliver_keeps_fifo_exactly_once_and_epochs_once_per_epoch")  # issue 42: 1 and 8


# Seconds each file's default tests took in a run on the 2-core CI host (two workers). pytest-xdist hands a worker
# one file at a time in collection order (pyproject.toml: --dist loadfile --no-loadscope-reorder), so the files go
# longest first: the last file handed out is a short one, and neither worker idles long while the other finishes
# (its own reorder, by number of tests, left 20-second single-test files for last). Only the order depends on these
# figures; a file not listed goes last, in the usual order.
FILE_SECONDS = {
    "test_rllib_contract": 71, "test_rllib_adapter": 64, "test_checkpoint": 63, "test_functional": 60,
    "test_rllib_multi_agent": 52, "test_staging": 44, "test_schedule": 36, "test_distributed": 34,
    "test_kernel_hlo": 28, "test_plane": 28, "test_reliability": 26, "test_rollouts": 24, "test_prioritized": 22,
    "test_delivery": 22, "test_learners": 21, "test_benchmarks_smoke": 21, "test_samplers": 19, "test_sumtree": 18,
    "test_sequences": 18, "test_storage": 18, "test_demo": 15, "test_jitted_learners": 14,
    "test_multihost": 11, "test_runtime": 9, "test_rollout_plane": 8, "test_rollout_checkpoint": 6, "test_limits": 5,
}


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(config, items):
    import fnmatch

    for item in items:
        if item.originalname not in SLOW_KEPT and any(fnmatch.fnmatchcase(item.nodeid, pattern)
                                                      for pattern in SLOW_VARIANTS):
            item.add_marker(pytest.mark.slow)
    items.sort(key=lambda item: -FILE_SECONDS.get(item.path.stem, 0))  # stable: a file's tests keep their order
