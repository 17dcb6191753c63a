"""Checkpoints of a ``RolloutPlane``: its whole buffer state plus JSON metadata, written by ``checkpoint``'s machinery.

    handle = plane.save("ckpt/rollouts")       # returns at once; handle.wait() until it is on disk
    ...                                         # later, in another process:
    plane = cj.RolloutPlane.restore("ckpt/rollouts", schedule=cj.schedule.overlap(2))  # the newest step

What a checkpoint holds. Step ``k`` of a directory is an orbax step folder ``<directory>/<k>/`` with an ``arrays`` item,
every leaf of the plane's ``rollouts.RolloutState`` (token rings, group table, the queue's cursor, reader and counters,
the learner's policy version), and a JSON ``meta`` item: the format and its version, the ``RolloutSpec`` (group size,
max length, token leaf names and dtype names), ``token_capacity``, ``group_capacity``, ``groups_per_batch``, the layout
(name, rows, row length), ``max_staleness``, ``scale_advantages``, ``min_fill``, ``trim_rows``, the schedule, the
sequences masked stale at delivery so far (``stats()['masked_stale']``), every array's shape, dtype and CRC-32, and the
metadata's own CRC-32. Nothing is pickled. Numbering, the background write, atomicity (a save killed mid-write leaves
only orbax's tmp folder, which restore never reads) and retention (``max_to_keep``) are ``checkpoint.write_step``'s, so
they behave as for an ``ExperienceDataPlane``.

Save writes the staged groups and the learner's latest policy version, and copies the state under the plane's lock
(one on-device copy, dispatched); a background thread writes the copy while ingest and deliver go on. Restore
rebuilds the plane from the recorded settings (the schedule unless one is given; on ``mesh``, default one device;
batches to ``learner_mesh``), reads every array into its place, checks its CRC-32, and
rebuilds the host's bookkeeping from the state (``rollouts.HostQueue.from_state``): the restored plane delivers the
batches the saved one would have, bit for bit. It refuses (``CheckpointError``) a missing, unfinished or corrupted
step (an array whose CRC-32 differs, metadata edited after the save) and any setting passed explicitly (``spec=``,
``token_capacity=``, ``layout=``, ...) that differs from the recorded one, naming the field, what was saved and what
came.

Not in a checkpoint: batches a prefetching schedule already drew (``plane.in_flight()``). Their groups have left the
queue, so a restored plane does not deliver them; ``save`` warns (``ConduitWarning``) when there are any.
"""

from __future__ import annotations

import time
import warnings
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from conduit_jax import checkpoint, engine, rollouts
from conduit_jax.checkpoint import CheckpointError, SaveHandle
from conduit_jax.errors import ConduitWarning, ConfigError

FORMAT = "conduit-jax-rollout-plane"
FORMAT_VERSION = 1
READABLE_VERSIONS = (1,)
# the RolloutPlane constructor's arguments a checkpoint records (restore's ``expected`` may name any of them)
SETTINGS = ("spec", "token_capacity", "group_capacity", "groups_per_batch", "layout", "max_staleness",
            "scale_advantages", "min_fill", "trim_rows")

all_steps = checkpoint.all_steps  # the finished steps of a directory, oldest first
latest_step = checkpoint.latest_step


# -- save -------------------------------------------------------------------------------------------------------------
def save(plane, directory, held, *, step: Optional[int] = None, max_to_keep: Optional[int] = 3,
         block: bool = False) -> SaveHandle:
    """Save ``plane`` (a ``RolloutPlane``) as step ``step`` (default: one past the newest) of ``directory``; returns a
    ``checkpoint.SaveHandle`` at once (``block=True``: once the step is on disk). ``held()`` is a context manager that
    holds the plane still with its staged groups and the learner's policy version written (``RolloutPlane.save``
    passes its own): the state and the count of prefetched batches are read under it. See the module docstring."""
    copy = _copy_kernel(plane)  # compiled here, outside the plane's lock
    in_flight = []

    def take():
        with held():
            snapshot = copy(plane.engine.state)
            in_flight.append(len(plane.in_flight()))
            meta = _metadata(plane)
        return snapshot, meta

    handle = checkpoint.write_step(directory, take, step=step, max_to_keep=max_to_keep, block=False, where="save()")
    if in_flight and in_flight[0]:
        warnings.warn(
            f"save(): {in_flight[0]} batches the {plane.schedule.name} schedule prefetched (their groups already "
            f"drawn from the queue) live on the host, outside the state: the checkpoint does not hold them, so a "
            f"restored plane will not deliver them. A plane under schedule.staged() prefetches nothing: save from one to "
            f"avoid this", ConduitWarning, stacklevel=3)
    if block:
        handle.wait()
    return handle


def _copy_kernel(plane):
    """The plane's state copied, compiled once per engine."""
    return plane.engine.beside.get("checkpoint_copy", lambda: _compiled_copy(plane.buffer))


def _compiled_copy(buffer):
    def copy(state):
        return jax.tree.map(jnp.copy, state)

    kernel = engine.compiled(copy, "rollout_checkpoint_copy", out_shardings=buffer.shardings)
    abstract = jax.tree.map(lambda leaf, sharding: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding),
                            jax.eval_shape(buffer.init), buffer.shardings)
    kernel.lower(abstract).compile()
    return kernel


def _metadata(plane) -> dict:
    from conduit_jax import __version__

    config, spec = plane.config, plane.spec
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "conduit_jax_version": __version__,
        "saved_unix_s": time.time(),
        "spec": {"group_size": spec.group_size, "max_length": spec.max_length,
                 "token_leaves": [[name, np.dtype(dtype).name] for name, dtype in spec.token_leaves.items()]},
        "token_capacity": config.token_capacity,
        "group_capacity": config.group_capacity,
        "groups_per_batch": config.groups_per_batch,
        "layout": {"name": config.layout.name, "rows": config.layout.rows, "row_length": config.layout.row_length},
        "max_staleness": config.max_staleness,
        "scale_advantages": config.scale_advantages,
        "min_fill": plane.min_fill,
        "trim_rows": plane.trim_rows,
        "schedule": checkpoint.schedule_json(plane.schedule),
        "masked_stale": plane.masked_stale,
    }


# -- restore ----------------------------------------------------------------------------------------------------------
class Restored(NamedTuple):
    """What ``read`` returns: ``settings`` (the ``RolloutPlane`` constructor's keyword arguments as recorded, with
    ``schedule``), ``state`` (the ``rollouts.RolloutState``, placed for ``mesh``), ``masked_stale`` (the saved plane's
    count), ``step``."""

    settings: dict
    state: Any
    masked_stale: int
    step: int


def read(directory, *, step: Optional[int] = None, schedule=None, mesh=None, **expected) -> Restored:
    """Read step ``step`` (default: the newest finished one) of a rollout checkpoint, checked, with its state placed
    as a ``RolloutPlane`` on ``mesh`` places it (``RolloutPlane.restore`` builds the plane from it). ``expected``:
    any of ``SETTINGS``, each refused (``CheckpointError``) when it differs from the recorded one."""
    unknown = sorted(set(expected) - set(SETTINGS))
    if unknown:
        raise ConfigError(f"restore(): unknown arguments {unknown}; a rollout checkpoint records {list(SETTINGS)}")
    directory = checkpoint.checked_directory(directory, "restore()")
    step = checkpoint.choose_step(directory, step, f"restore({directory})")
    where = f"restore({directory}, step={step})"
    meta = _read_meta(directory, step, where)
    settings = _settings(meta, where)
    for name, given in expected.items():
        _check_given(name, settings[name], given, where)
    settings["schedule"] = checkpoint.schedule_from_json(meta, schedule, where)
    buffer = rollouts.make_rollout_buffer(
        settings["spec"], settings["token_capacity"], settings["group_capacity"], settings["groups_per_batch"],
        settings["layout"], max_staleness=settings["max_staleness"], scale_advantages=settings["scale_advantages"],
        mesh=mesh)
    abstract = jax.eval_shape(buffer.init)
    shapes = checkpoint.named_leaves(abstract)
    targets = {name: jax.ShapeDtypeStruct(shapes[name].shape, shapes[name].dtype, sharding=sharding)
               for name, sharding in checkpoint.named_leaves(buffer.shardings).items()}
    if set(meta["arrays"]) != set(targets):
        raise CheckpointError(f"{where}: the step holds arrays {sorted(meta['arrays'])}, a rollout plane of its spec "
                              f"has {sorted(targets)}: the checkpoint is corrupted")
    arrays = checkpoint.read_arrays(directory, step, meta, targets, where)
    state = checkpoint.unflatten_like(abstract, arrays, where)
    return Restored(settings, state, _field(meta, "masked_stale", int, where), step)


def metadata(directory, step: Optional[int] = None) -> dict:
    """The JSON metadata of a step (default: the newest), checked, e.g. to inspect a checkpoint without restoring it."""
    directory = checkpoint.checked_directory(directory, "metadata()")
    step = checkpoint.choose_step(directory, step, f"metadata({directory})")
    return _read_meta(directory, step, f"metadata({directory}, step={step})")


def _read_meta(directory: str, step: int, where: str) -> dict:
    meta = checkpoint.read_step_metadata(directory, step, where, format=FORMAT, versions=READABLE_VERSIONS,
                                         signed_from=1, what="Conduit-JAX rollout plane")
    if not isinstance(meta.get("arrays"), dict):
        raise CheckpointError(f"{where}: the metadata of step {step} lacks its array list: the checkpoint is corrupted")
    return meta


def _field(meta, key: str, kinds, where: str, optional: bool = False):
    """``meta[key]`` when it is of ``kinds`` (a type or a tuple; a bool is no int here), or None when ``optional``."""
    kinds = kinds if isinstance(kinds, tuple) else (kinds,)
    value = meta.get(key) if isinstance(meta, dict) else None
    if optional and value is None:
        return None
    if not isinstance(value, kinds) or (bool not in kinds and isinstance(value, bool)):
        raise CheckpointError(f"{where}: metadata field '{key}' is {value!r}: the checkpoint is corrupted")
    return value


def _settings(meta: dict, where: str) -> dict:
    """The constructor's arguments as the metadata records them (each field's type checked)."""
    spec, layout = _field(meta, "spec", dict, where), _field(meta, "layout", dict, where)
    leaves = _field(spec, "token_leaves", list, where)
    try:
        token_leaves = {str(name): np.dtype(jnp.dtype(dtype)) for name, dtype in leaves}
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"{where}: the recorded token leaves {leaves!r} are malformed ({exc})") from None
    return {
        "spec": rollouts.RolloutSpec(_field(spec, "group_size", int, where), _field(spec, "max_length", int, where),
                                     token_leaves),
        "token_capacity": _field(meta, "token_capacity", int, where),
        "group_capacity": _field(meta, "group_capacity", int, where),
        "groups_per_batch": _field(meta, "groups_per_batch", int, where),
        "layout": rollouts.Layout(_field(layout, "name", str, where), _field(layout, "rows", int, where, True),
                                  _field(layout, "row_length", int, where, True)),
        "max_staleness": _field(meta, "max_staleness", int, where, True),
        "scale_advantages": _field(meta, "scale_advantages", bool, where),
        "min_fill": float(_field(meta, "min_fill", (int, float), where)),
        "trim_rows": bool(_field(meta, "trim_rows", bool, where, True)),  # absent before it existed: False
    }


def _check_given(name: str, saved, given, where: str) -> None:
    """Refuse a setting passed to restore that differs from the recorded one, naming the (sub)field."""
    if name == "spec":
        if not isinstance(given, rollouts.RolloutSpec):
            raise ConfigError(f"{where}: spec must be a rollouts.RolloutSpec, got {type(given).__name__}")
        pairs = [("spec.group_size", saved.group_size, given.group_size),
                 ("spec.max_length", saved.max_length, given.max_length),
                 ("spec.token_leaves", {k: np.dtype(v).name for k, v in saved.token_leaves.items()},
                  {k: np.dtype(v).name for k, v in dict(given.token_leaves).items()})]
    elif name == "layout":
        if not isinstance(given, rollouts.Layout):
            raise ConfigError(f"{where}: layout must be rollouts.packed(...) or rollouts.padded(), got {given!r}")
        pairs = [(f"layout.{field}", getattr(saved, field), getattr(given, field)) for field in rollouts.Layout._fields]
    else:
        pairs = [(name, saved, given)]
    for field, recorded, came in pairs:
        if recorded != came or type(recorded) is bool and not isinstance(came, (bool, np.bool_)):
            raise CheckpointError(f"{where}: the checkpoint was saved with {field}={recorded!r}, not the given "
                                  f"{came!r}")
