"""ExperienceSpec: construction from examples and structs, and batch validation (every bad leaf named at once)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conduit_jax import ExperienceDataPlane, ExperienceSpec, SpecError, samplers
from conduit_jax.spec import SUPPORTED_DTYPES


def example_item():
    """One item with nested dicts, per-item scalars and every dtype family the plane is meant for."""
    return {
        "obs": {"pixels": np.zeros((4, 3), np.uint8), "mask": np.zeros((5,), np.bool_)},
        "action": np.int32(0),
        "reward": 0.0,  # python float -> float32
        "done": False,  # python bool -> bool
        "step": 7,  # python int -> int32
        "logits": np.zeros((3,), jnp.bfloat16),
        "value": np.float32(0.0),
    }


EXPECTED = {  # leaf name -> (per-item shape, dtype), in tree-flatten (sorted key) order
    "action": ((), np.int32),
    "done": ((), np.bool_),
    "logits": ((3,), jnp.bfloat16),
    "obs/mask": ((5,), np.bool_),
    "obs/pixels": ((4, 3), np.uint8),
    "reward": ((), np.float32),
    "step": ((), np.int32),
    "value": ((), np.float32),
}


def good_batch(n=3):
    return {
        "obs": {"pixels": np.zeros((n, 4, 3), np.uint8), "mask": np.zeros((n, 5), np.bool_)},
        "action": np.zeros((n,), np.int32),
        "reward": np.zeros((n,), np.float32),
        "done": np.zeros((n,), np.bool_),
        "step": np.zeros((n,), np.int32),
        "logits": np.zeros((n, 3), jnp.bfloat16),
        "value": np.zeros((n,), np.float32),
    }


# -- construction -------------------------------------------------------------------------------------------------
def test_from_example_nested_scalars_and_dtypes():
    spec = ExperienceSpec.from_example(example_item())
    assert spec.names == tuple(EXPECTED)
    assert spec.shapes == tuple(s for s, _ in EXPECTED.values())
    assert spec.dtypes == tuple(np.dtype(d) for _, d in EXPECTED.values())
    assert spec.item_bytes == 4 + 1 + 3 * 2 + 5 + 12 + 4 + 4 + 4
    # the structs view round-trips through from_structs to an equal (and equally hashed) spec
    again = ExperienceSpec.from_structs(spec.structs)
    assert again == spec and hash(again) == hash(spec)
    batch = spec.batch_structs(6)
    assert batch["obs"]["pixels"].shape == (6, 4, 3) and batch["obs"]["pixels"].dtype == np.uint8


def test_from_structs_matches_from_example():
    structs = {
        "obs": {"pixels": jax.ShapeDtypeStruct((4, 3), jnp.uint8), "mask": jax.ShapeDtypeStruct((5,), jnp.bool_)},
        "action": jax.ShapeDtypeStruct((), jnp.int32),
        "reward": jax.ShapeDtypeStruct((), jnp.float32),
        "done": jax.ShapeDtypeStruct((), jnp.bool_),
        "step": jax.ShapeDtypeStruct((), jnp.int32),
        "logits": jax.ShapeDtypeStruct((3,), jnp.bfloat16),
        "value": jax.ShapeDtypeStruct((), jnp.float32),
    }
    assert ExperienceSpec.from_structs(structs) == ExperienceSpec.from_example(example_item())
    # arrays work as structs too (jax and numpy)
    assert ExperienceSpec.from_structs({"x": jnp.zeros((2,), jnp.int32)}).dtypes == (np.dtype(np.int32),)


@pytest.mark.parametrize("dtype", SUPPORTED_DTYPES, ids=lambda d: np.dtype(d).name)
def test_every_supported_dtype_accepted(dtype):
    spec = ExperienceSpec.from_example({"x": np.zeros((3,), dtype)})
    assert spec.dtypes == (np.dtype(dtype),)
    assert spec.validate({"x": np.zeros((2, 3), dtype)}) == 2


def test_empty_item_rejected():
    with pytest.raises(SpecError, match="no leaves"):
        ExperienceSpec.from_structs({})


@pytest.mark.parametrize("wide, narrow", [(np.int64, "int32"), (np.float64, "float32"), (np.uint64, "uint32")])
def test_64bit_example_rejected_with_cast_hint(wide, narrow):
    item = {"a": np.zeros((2,), wide), "ok": np.float32(0), "nested": {"b": np.zeros((), wide)}}
    with pytest.raises(SpecError) as info:
        ExperienceSpec.from_example(item)
    msg = str(info.value)
    for leaf in ("'a'", "'nested/b'"):  # every bad leaf is named, not just the first
        assert leaf in msg
    assert "'ok'" not in msg
    assert str(np.dtype(wide)) in msg and f"cast it to {narrow}" in msg
    spec = ExperienceSpec.from_example(item, cast=True)
    assert spec.dtypes == (np.dtype(narrow), np.dtype(narrow), np.dtype(np.float32))


def test_unsupported_dtype_rejected():
    with pytest.raises(SpecError, match=r"leaf 'c'.*complex64"):
        ExperienceSpec.from_structs({"c": jax.ShapeDtypeStruct((2,), np.complex64)})


def test_numpy_float64_scalar_example_needs_cast():
    """np.float64(...) is a subclass of Python float, but it carries an explicit 64-bit dtype: like a float64 array it
    must be refused without cast=True (batches built from it are float64 and validate() refuses them)."""
    with pytest.raises(SpecError, match=r"'r'.*float64"):
        ExperienceSpec.from_example({"r": np.float64(0.5)})
    assert ExperienceSpec.from_example({"r": np.float64(0.5)}, cast=True).dtypes == (np.dtype(np.float32),)


# -- validation -----------------------------------------------------------------------------------------------------
def test_validate_returns_item_count():
    spec = ExperienceSpec.from_example(example_item())
    assert spec.validate(good_batch(3)) == 3
    assert spec.validate(jax.tree_util.tree_map(jnp.asarray, good_batch(1))) == 1


def test_validate_collects_every_bad_leaf():
    spec = ExperienceSpec.from_example(example_item())
    batch = good_batch(3)
    batch["obs"]["pixels"] = np.zeros((3, 4, 4), np.uint8)  # wrong trailing shape
    batch["reward"] = np.zeros((3,), np.int32)  # wrong dtype
    batch["logits"] = np.zeros((3, 3), np.float32)  # wrong dtype (float32 for bfloat16)
    batch["action"] = np.int32(1)  # no item axis
    batch["done"] = "yes"  # not an array
    with pytest.raises(SpecError) as info:
        spec.validate(batch)
    msg = str(info.value)
    assert msg.startswith("ingest(): ")
    # each bad leaf, with what was expected and what came
    assert re.search(r"leaf 'obs/pixels' has shape \(3, 4, 4\).*trailing shape \(4, 3\)", msg)
    assert "leaf 'reward' has dtype int32 but the spec says float32" in msg
    assert "leaf 'logits' has dtype float32 but the spec says bfloat16" in msg
    assert re.search(r"leaf 'action' has shape \(\).*leading item axis", msg)
    assert "leaf 'done' is a str" in msg
    for good in ("'obs/mask'", "'step'", "'value'"):
        assert good not in msg


def test_validate_dtype_and_shape_of_one_leaf_both_reported():
    spec = ExperienceSpec.from_example({"x": np.zeros((2,), np.float32)})
    with pytest.raises(SpecError) as info:
        spec.validate({"x": np.zeros((4, 3), np.int32)})
    msg = str(info.value)
    assert "dtype int32 but the spec says float32" in msg and "shape (4, 3)" in msg and "(2,)" in msg


@pytest.mark.parametrize("change, words", [
    (lambda b: b.pop("reward"), ["missing", "'reward'"]),
    (lambda b: b["obs"].pop("mask"), ["missing", "'obs/mask'"]),
    (lambda b: b.update(extra=np.zeros((3,), np.int32)), ["unexpected", "'extra'"]),
    (lambda b: (b.pop("value"), b["obs"].update(depth=np.zeros((3,), np.float32))),
     ["missing", "'value'", "unexpected", "'obs/depth'"]),
], ids=["missing", "missing-nested", "extra", "missing-and-extra"])
def test_validate_missing_and_extra_keys(change, words):
    spec = ExperienceSpec.from_example(example_item())
    batch = good_batch(3)
    change(batch)
    with pytest.raises(SpecError) as info:
        spec.validate(batch, where="sample()")
    msg = str(info.value)
    assert msg.startswith("sample(): ")
    for word in words:
        assert word in msg


def test_validate_structure_mismatch_with_same_names():
    spec = ExperienceSpec.from_example((np.zeros((2,), np.float32), np.int32(0)))  # a tuple item
    assert spec.names == ("[0]", "[1]")
    with pytest.raises(SpecError, match="structure"):
        spec.validate([np.zeros((3, 2), np.float32), np.zeros((3,), np.int32)])  # a list batch


def test_validate_list_leaf_rejected_naming_the_leaf():
    """A Python list is a pytree node, not a leaf: it shows up as a structure problem that names the leaf."""
    spec = ExperienceSpec.from_example({"a": np.zeros((2,), np.float32), "done": False})
    with pytest.raises(SpecError) as info:
        spec.validate({"a": np.zeros((3, 2), np.float32), "done": [True, False, True]})
    assert "'done'" in str(info.value)


def test_validate_not_a_pytree_of_arrays():
    spec = ExperienceSpec.from_example({"a": np.zeros((2,), np.float32)})
    with pytest.raises(SpecError, match=r"leaf 'a' is a float"):
        spec.validate({"a": 1.0})
    with pytest.raises(SpecError, match="missing"):
        spec.validate(np.zeros((3, 2), np.float32))  # a bare array for a dict spec


@pytest.mark.parametrize("wide, narrow", [(np.int64, np.int32), (np.float64, np.float32)])
def test_validate_64bit_leaf_tells_how_to_cast(wide, narrow):
    spec = ExperienceSpec.from_example({"a": np.zeros((2,), narrow), "b": np.zeros((), narrow)})
    batch = {"a": np.zeros((5, 2), wide), "b": np.zeros((5,), wide)}
    with pytest.raises(SpecError) as info:
        spec.validate(batch)
    msg = str(info.value)
    for leaf in ("'a'", "'b'"):
        assert f"leaf {leaf} has dtype {np.dtype(wide)} but the spec says {np.dtype(narrow)}" in msg
    assert f"astype(np.{np.dtype(narrow)})" in msg and "cast=True" in msg
    assert spec.validate(batch, cast=True) == 5
    # cast=True only narrows 64 -> 32 bits of the same kind; anything else is still refused
    with pytest.raises(SpecError, match="dtype"):
        spec.validate({"a": np.zeros((5, 2), np.int16), "b": np.zeros((5,), narrow)}, cast=True)


@pytest.mark.parametrize("wide, narrow, value", [(np.int64, np.int32, 2**40 + 3), (np.int64, np.int32, -2**31 - 1),
                                                  (np.uint64, np.uint32, 2**32), (np.float64, np.float32, 1e39)])
def test_cast_refuses_values_the_narrow_dtype_cannot_hold(wide, narrow, value):
    """cast=True narrows only what fits: 2**40 + 3 as int32 would be 3, silently; 1e39 as float32 would be inf."""
    spec = ExperienceSpec.from_example({"a": np.zeros((2,), narrow)})
    batch = {"a": np.zeros((5, 2), wide)}
    batch["a"][3, 1] = value
    with pytest.raises(SpecError, match=rf"leaf 'a' at index \(3, 1\) holds {re.escape(repr(batch['a'][3, 1].item()))}, "
                                        rf"which {np.dtype(narrow)} cannot hold"):
        spec.validate(batch, cast=True)
    batch["a"][3, 1] = 7  # in range: accepted, and nan/inf floats stay what they are
    assert spec.validate(batch, cast=True) == 5


def test_validate_empty_batch_rejected():
    spec = ExperienceSpec.from_example(example_item())
    with pytest.raises(SpecError, match=r"empty \(0 items\)"):
        spec.validate(good_batch(0))


def test_validate_disagreeing_item_counts():
    spec = ExperienceSpec.from_example({"a": np.zeros((2,), np.float32), "b": np.int32(0)})
    with pytest.raises(SpecError) as info:
        spec.validate({"a": np.zeros((4, 2), np.float32), "b": np.zeros((3,), np.int32)})
    msg = str(info.value)
    assert "disagree" in msg and "'a': 4" in msg and "'b': 3" in msg


# -- cast=True through a plane --------------------------------------------------------------------------------------
def test_plane_with_cast_narrows_64bit_leaves(mesh):
    example = {"i": np.zeros((3,), np.int64), "f": np.float64(0.0), "u8": np.zeros((2,), np.uint8)}
    spec = ExperienceSpec.from_example(example, cast=True)
    assert spec.dtypes == (np.dtype(np.float32), np.dtype(np.int32), np.dtype(np.uint8))
    n = 8
    ints = np.array([[g, -g, 2**31 - 1 - g] for g in range(n)], np.int64)  # in int32 range: narrowed exactly
    floats = np.linspace(-2.0, 3.0, n)  # float64; exactly representable in float32 after rounding
    batch = {"i": ints, "f": floats, "u8": np.arange(2 * n, dtype=np.uint8).reshape(n, 2)}

    strict = ExperienceDataPlane(spec, 8, samplers.fifo(8), mesh=mesh)
    with pytest.raises(SpecError, match="cast=True"):
        strict.ingest(batch)

    plane = ExperienceDataPlane(spec, 8, samplers.fifo(8), mesh=mesh, cast=True)
    plane.ingest(batch)
    out = jax.device_get(plane.sample().data)
    order = np.argsort(out["u8"][:, 0])  # FIFO batch order is checked in test_samplers; compare as a set here
    assert out["i"].dtype == np.int32 and out["f"].dtype == np.float32
    np.testing.assert_array_equal(out["i"][order], ints.astype(np.int32))
    np.testing.assert_array_equal(out["f"][order], floats.astype(np.float32))
    np.testing.assert_array_equal(out["u8"][order], batch["u8"])
