"""Layouts (parsing, equality, PartitionSpec, NamedSharding, TOML files) and the errors users
meet: each is the right md error class, raised at the documented moment, and its message names
what is needed to fix the mistake (tensor, dim, size, mesh axis, axis size, file path).
"""

import re

import harness
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

import meshdsl as md


@pytest.fixture(scope="module")
def mesh():
    return harness.mesh("data4_model2")


def _x(sizes):
    return harness.rand(np.random.default_rng(0), sizes)


# ---- layouts ----


def test_layout_forms_are_equal():
    assert md.Layout("batch:data, d_ff:model") == md.Layout({"batch": "data", "d_ff": "model"})
    assert md.Layout("batch:data; d_ff:model") == md.Layout({"batch": ("data",), "d_ff": ["model"]})
    assert md.Layout("d_model:(data, model)").rules == {"d_model": ("data", "model")}
    assert md.Layout("d_model:(data, model)") != md.Layout("d_model:(model, data)")
    assert md.Layout("batch:data") != md.Layout("batch:model")
    assert md.Layout() == md.Layout("") == md.Layout({})
    layout = md.Layout("batch:data; d_model:(data, model)")
    assert md.Layout(str(layout)) == layout
    assert md.Layout(layout) == layout


def test_layout_spec_and_sharding(mesh):
    layout = md.Layout({"batch": "data", "d_ff": ("model", "data"), "heads": "model"})
    shape = md.Shape([md.Dim("batch", 8), md.Dim("d_model", 6), md.Dim("heads", 4)])
    assert layout.spec(shape) == PartitionSpec("data", None, "model")
    assert layout.spec([md.Dim("d_ff", 16), md.Dim("seq", 2)]) == PartitionSpec(("model", "data"), None)
    assert layout.axes_of("d_ff") == ("model", "data")
    assert layout.axes_of("seq") == ()
    sharding = layout.sharding(mesh, shape)
    assert isinstance(sharding, NamedSharding)
    assert sharding.is_equivalent_to(NamedSharding(mesh.jax_mesh, PartitionSpec("data", None, "model")), 3)
    assert sharding.shard_shape((8, 6, 4)) == (2, 6, 2)


def test_layout_load(tmp_path):
    path = tmp_path / "layout.toml"
    path.write_text('[rules]\nbatch = "data"\nd_model = ["data", "model"]\n')
    assert md.Layout.load(path) == md.Layout({"batch": "data", "d_model": ("data", "model")})
    assert md.Layout.load(str(path)) == md.Layout.load(path)


def test_layout_load_missing_file_names_the_path(tmp_path):
    path = tmp_path / "no" / "such.toml"
    with pytest.raises(md.LayoutError, match=re.escape(str(path))):
        md.Layout.load(path)


def test_layout_load_invalid_toml_names_the_path(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("[rules\nbatch = data\n")
    with pytest.raises(md.LayoutError, match=re.escape(str(path))):
        md.Layout.load(path)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("d_ff;heads", r"malformed layout rule 'd_ff'"),
        ("d:(data, data)", r"repeats a mesh axis"),
        ("d:data; d:model", r"two rules for dim 'd'"),
        ("1d:data", r"dim name '1d' is not an identifier"),
        ("d:", r"mesh axis names must be identifiers"),
    ],
)
def test_malformed_rule_is_a_layout_error_when_built(text, message):
    with pytest.raises(md.LayoutError, match=message):
        md.Layout(text)


def test_layout_errors_are_value_errors():
    assert issubclass(md.LayoutError, ValueError) and issubclass(md.ShapeError, ValueError)
    assert issubclass(md.LayoutError, md.MeshDslError) and issubclass(md.ShapeError, md.MeshDslError)


# ---- layouts that do not fit the mesh or the tensors ----


def test_rule_naming_a_missing_axis_fails_in_compile(mesh):
    with pytest.raises(md.LayoutError, match=r"batch:pipe.*'pipe'.*data=4 model=2"):
        md.compile(lambda x: x, mesh, "batch:pipe")


@pytest.mark.parametrize("backend", harness.BACKENDS)
def test_indivisible_split_names_tensor_dim_size_axis_and_axis_size(mesh, backend):
    x = _x({"batch": 6, "d": 4})
    compiled = md.compile(lambda x: x * 2.0, mesh, {"batch": "data"}, backend=backend)
    with pytest.raises(md.LayoutError) as e:
        compiled(x)
    message = str(e.value)
    for part in ["argument", "[batch=6, d=4]", "dim batch (size 6)", "mesh axis data (size 4)", "not divisible by 4"]:
        assert part in message, (part, message)


def test_indivisible_split_over_an_axis_pair_names_both(mesh):
    x = _x({"batch": 12})
    with pytest.raises(md.LayoutError) as e:
        md.compile(lambda x: x, mesh, {"batch": ("data", "model")})(x)
    message = str(e.value)
    for part in ["dim batch (size 12)", "data (size 4) x model (size 2)", "not divisible by 8"]:
        assert part in message, (part, message)


@pytest.mark.parametrize("backend", harness.BACKENDS)
def test_two_dims_of_one_tensor_on_one_axis(mesh, backend):
    x = _x({"batch": 8, "d": 4})
    with pytest.raises(md.LayoutError) as e:
        md.compile(lambda x: x, mesh, {"batch": "model", "d": "model"}, backend=backend)(x)
    message = str(e.value)
    for part in ["[batch=8, d=4]", "dims batch and d", "mesh axis model (size 2)"]:
        assert part in message, (part, message)


@pytest.mark.parametrize("backend", harness.BACKENDS)
def test_two_dims_on_one_axis_in_an_intermediate(mesh, backend):
    # x[a] and y[b] are legal alone; their product [a, b] is not.
    x, y = _x({"a": 4}), _x({"b": 4})
    with pytest.raises(
        md.LayoutError, match=r"\[a=4, b=4\]: dims a and b are both split over mesh axis model \(size 2\)"
    ):
        md.compile(lambda x, y: md.reduce_sum(x * y), mesh, {"a": "model", "b": "model"}, backend=backend)(x, y)


def test_explain_raises_the_same_layout_error(mesh):
    x = _x({"batch": 6})
    with pytest.raises(md.LayoutError, match=r"dim batch \(size 6\).*data \(size 4\)"):
        md.explain(lambda x: x, mesh, {"batch": "data"}, x)


def test_sharding_of_an_unfit_shape_is_a_layout_error(mesh):
    with pytest.raises(md.LayoutError, match=r"dim batch \(size 6\)"):
        md.Layout({"batch": "data"}).sharding(mesh, [md.Dim("batch", 6)])


# ---- meshes ----


def test_mesh_forms_and_errors():
    assert md.Mesh("data=4 model=2") == md.Mesh({"data": 4, "model": 2}) == md.Mesh([("data", 4), ("model", 2)])
    assert md.Mesh("data=4 model=-1").axis_sizes == {"data": 4, "model": 2}
    assert md.Mesh({"x": 8}).size == 8 and md.Mesh("a=2 b=2 c=2").shape == (2, 2, 2)
    with pytest.raises(md.LayoutError, match="needs 16 devices, but only 8"):
        md.Mesh({"data": 4, "model": 4})
    with pytest.raises(md.LayoutError, match="malformed mesh axis"):
        md.Mesh("data:4")


# ---- shape errors ----


def test_add_with_same_name_different_size_is_a_shape_error():
    with pytest.raises(md.ShapeError, match=r"dim d has size 4 in one operand and 5 in another"):
        _x({"batch": 2, "d": 4}) + _x({"batch": 2, "d": 5})


def test_einsum_output_naming_a_missing_dim_is_a_shape_error():
    with pytest.raises(md.ShapeError, match=r"einsum output names dim 'vocab', which no input has"):
        md.einsum(_x({"a": 2, "b": 3}), _x({"b": 3}), out=["a", "vocab"])


def test_einsum_inputs_with_same_name_different_size_is_a_shape_error():
    with pytest.raises(md.ShapeError, match=r"dim a has size 3 in one input and 4 in another"):
        md.einsum(_x({"a": 3}), _x({"a": 4}))


def test_einsum_output_dim_of_wrong_size_is_a_shape_error():
    with pytest.raises(md.ShapeError, match="does not match"):
        md.einsum(_x({"a": 3, "b": 2}), _x({"b": 2}), out=[md.Dim("a", 4)])


def test_tensor_with_mismatched_sizes_is_a_shape_error():
    with pytest.raises(md.ShapeError, match=r"dim b=5 does not match the array, whose axis 1 has size 4"):
        md.tensor(np.ones((3, 4), np.float32), [md.Dim("a", 3), md.Dim("b", 5)])
    with pytest.raises(md.ShapeError, match=r"has 2 axes, but 1 dims were named"):
        md.tensor(np.ones((3, 4), np.float32), "a")
    with pytest.raises(md.ShapeError, match="repeats dim name"):
        md.tensor(np.ones((3, 3), np.float32), "a a")


def test_dim_errors():
    with pytest.raises(md.ShapeError, match="not an identifier"):
        md.Dim("2x", 3)
    with pytest.raises(md.ShapeError, match="non-negative int"):
        md.Dim("x", -1)
    with pytest.raises(md.ShapeError, match="no dim 'c'"):
        md.reduce_sum(_x({"a": 2, "b": 3}), "c")


def test_tensor_from_names_takes_sizes_from_the_array():
    t = md.tensor(jnp.zeros((3, 4)), "a b")
    assert t.shape == md.Shape([md.Dim("a", 3), md.Dim("b", 4)])
    assert t.names == ("a", "b") and t.shape.size == 12 and t.shape["b"].size == 4
