"""Checkpoints of a RolloutPlane (conduit_jax/rollout_checkpoint.py): a bit-exact round trip that keeps delivering the
same batches, refusal of corrupted / edited / mismatching / missing steps, and a save killed mid-write. One small
plane configuration, saved once per module and copied where a test damages it."""

import gc
import json
import os
import shutil

import jax
import numpy as np
import pytest

from conduit_jax import RolloutPlane, checkpoint, rollout_checkpoint, rollouts
from conduit_jax.checkpoint import CheckpointError

GROUP, LONGEST = 4, 8
SPEC = rollouts.RolloutSpec(GROUP, LONGEST, {"tokens": np.int32, "logprobs": np.float32})
SETTINGS = dict(token_capacity=256, group_capacity=16, groups_per_batch=2,
                layout=rollouts.packed(rows=4, row_length=16), max_staleness=1, trim_rows=True)
# orbax leaves the other reads of a failed restore behind as coroutines whose errors surface at garbage collection
# (as tests/test_checkpoint.py notes), some as callbacks into the read's event loop, closed by then
pytestmark = [pytest.mark.filterwarnings(f"ignore:Exception ignored in{what}:pytest.PytestUnraisableExceptionWarning")
              for what in (".*coroutine", r"[\s\S]*Event loop is closed")]


def make_groups(rng, count, version, first_uid):
    """``count`` groups whose token t of sequence ``uid`` is ``uid * 100 + t`` (as tests/test_rollout_plane.py)."""
    tokens, logprobs, rewards, prompts = [], [], [], []
    for g in range(count):
        group = [[(first_uid + g * GROUP + j) * 100 + t for t in range(int(rng.integers(1, LONGEST + 1)))]
                 for j in range(GROUP)]
        tokens.append(group)
        logprobs.append([[-0.5 * t for t in range(len(s))] for s in group])
        rewards.append(rng.integers(0, 3, GROUP).astype(float).tolist())
        prompts.append([int(rng.integers(0, len(s) + 1)) for s in group])
    return rollouts.groups_from_lists(SPEC, tokens=tokens, logprobs=logprobs, rewards=rewards, prompt_lengths=prompts,
                                      policy_version=version)


def host_leaves(state):
    flat, _ = jax.tree_util.tree_flatten_with_path(jax.device_get(state))
    return {jax.tree_util.keystr(path): np.asarray(leaf) for path, leaf in flat}


def counts(plane):
    return {k: v for k, v in plane.stats().items() if k not in ("dispatches", "compiles", "stages", "exposed_path")}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A plane that delivered a batch, moved to policy version 1 and holds groups of both versions, some staged (not
    written yet when save() is called); its checkpoint (step 0) and the state it saved."""
    rng = np.random.default_rng(0)
    plane = RolloutPlane(SPEC, **SETTINGS)
    plane.ingest(make_groups(rng, 5, 0, 0))
    plane.deliver()
    plane.set_policy_version(1)
    plane.ingest(make_groups(rng, 3, 1, 1000))  # staged: the save writes them first
    assert plane.engine.staged_groups() == 3
    directory = tmp_path_factory.mktemp("rollouts")
    handle = plane.save(directory, block=True)
    assert handle.done() and handle.step == 0 and handle.error is None
    return plane, directory, host_leaves(plane.state)


@pytest.fixture
def damaged(saved, tmp_path):
    """A private copy of the checkpoint, free to damage."""
    shutil.copytree(saved[1], tmp_path / "copy")
    return tmp_path / "copy"


def test_round_trip_is_bit_exact_and_keeps_delivering_the_same_batches(saved):
    plane, directory, state = saved
    restored = RolloutPlane.restore(directory, spec=SPEC, **SETTINGS)
    assert restored.config == plane.config and restored.min_fill == plane.min_fill
    assert restored.schedule == plane.schedule
    again = host_leaves(restored.state)
    assert again.keys() == state.keys()
    for name, leaf in state.items():
        assert again[name].dtype == leaf.dtype and again[name].tobytes() == leaf.tobytes(), name
    assert int(state[".policy_version"]) == 1 and int(state[".written"]) == 8  # the staged groups are in it
    queue, original = restored.queue, plane.queue
    for field in ("length", "version", "span", "live"):
        np.testing.assert_array_equal(getattr(queue, field), getattr(original, field))
        assert getattr(queue, field).dtype == getattr(original, field).dtype
    for field in ("cursor", "written", "read", "policy_version", "delivered", "dropped_stale", "dropped_overwritten"):
        assert getattr(queue, field) == getattr(original, field), field
    assert counts(restored) == counts(plane) and len(restored) == len(plane) > 0
    # both planes go on alike: the same batches, array for array, then the same ingest accepted
    rng = np.random.default_rng(1)
    more = make_groups(rng, 2, 1, 2000)
    for step in range(3):
        if step == 1:
            plane.ingest(more)
            restored.ingest(more)
        ours, theirs = plane.deliver(), restored.deliver()
        for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        assert int(ours.groups) > 0
    assert counts(restored) == counts(plane)


def test_corrupted_edited_mismatching_or_missing_steps_are_refused(damaged):
    pristine = damaged.parent / "pristine"
    shutil.copytree(damaged, pristine)
    for root, _, names in os.walk(damaged / "0" / "arrays"):
        for name in names if os.path.basename(root) == "d" else ():  # the data files: one byte flipped in each
            with open(os.path.join(root, name), "r+b") as f:
                data = bytearray(f.read())
                data[len(data) // 2] ^= 0xFF
                f.seek(0)
                f.write(data)
    with pytest.raises(CheckpointError, match="partial or corrupted|checkpoint is corrupted"):
        RolloutPlane.restore(damaged)
    gc.collect()  # let orbax's abandoned reads go now (see pytestmark)
    shutil.rmtree(damaged)
    shutil.copytree(pristine, damaged)

    meta_file = damaged / "0" / "meta" / "metadata"
    meta = json.loads(meta_file.read_text())
    assert meta["format"] == rollout_checkpoint.FORMAT and meta["spec"]["max_length"] == LONGEST
    meta_file.write_text(json.dumps({**meta, "group_capacity": 32}))  # edited: the checksum no longer matches
    with pytest.raises(CheckpointError, match="does not match its recorded checksum"):
        RolloutPlane.restore(damaged)
    resigned = json.loads(json.dumps(meta))  # an array's recorded CRC-32 changed, the metadata signed again
    resigned["arrays"]["leaves.tokens"]["crc32"] ^= 1
    resigned["meta_crc32"] = checkpoint.metadata_checksum(resigned)
    meta_file.write_text(json.dumps(resigned))
    with pytest.raises(CheckpointError, match=r"arrays \['leaves.tokens'\] of step 0 do not match their recorded "):
        RolloutPlane.restore(damaged)
    meta_file.write_text(json.dumps(meta))

    other = rollouts.RolloutSpec(GROUP, 2 * LONGEST, SPEC.token_leaves)
    with pytest.raises(CheckpointError, match=r"spec\.max_length=8, not the given 16"):
        RolloutPlane.restore(damaged, spec=other)
    with pytest.raises(CheckpointError, match=r"layout\.rows=4, not the given 8"):
        RolloutPlane.restore(damaged, layout=rollouts.packed(rows=8, row_length=16))
    with pytest.raises(CheckpointError, match="max_staleness=1, not the given None"):
        RolloutPlane.restore(damaged, max_staleness=None)
    with pytest.raises(CheckpointError, match=r"there is no finished step 7; the directory has steps \[0\]"):
        RolloutPlane.restore(damaged, step=7)
    with pytest.raises(CheckpointError, match="no such directory"):
        RolloutPlane.restore(damaged / "nowhere")


def test_a_save_killed_mid_write_leaves_the_previous_step_restorable(saved, damaged):
    """A process killed while orbax writes step 1 leaves ``1.orbax-checkpoint-tmp-<time>/``, partly written (see
    tests/test_checkpoint.py, which SIGKILLs a child mid-save); that folder is made here from a finished save."""
    plane, _, state = saved
    elsewhere = damaged.parent / "elsewhere"  # written by this process, moved in as another process's leftover
    assert plane.save(elsewhere, step=1, block=True).step == 1
    os.rename(elsewhere / "1", damaged / "1.orbax-checkpoint-tmp-1765000000000000")
    shutil.rmtree(damaged / "1.orbax-checkpoint-tmp-1765000000000000" / "meta")
    assert rollout_checkpoint.all_steps(damaged) == [0]  # the interrupted step is not a checkpoint
    restored = RolloutPlane.restore(damaged)
    for name, leaf in host_leaves(restored.state).items():
        assert leaf.tobytes() == state[name].tobytes(), name
    restored.ingest(make_groups(np.random.default_rng(2), 1, 1, 3000))
    assert restored.save(damaged, block=True).step == 1  # the next save takes its place and clears the leftovers
    assert rollout_checkpoint.all_steps(damaged) == [0, 1]
    assert not [n for n in os.listdir(damaged) if "tmp" in n]
    assert rollout_checkpoint.metadata(damaged)["group_capacity"] == SETTINGS["group_capacity"]
