"""Ops that rename and regroup dims: reshape, rename, replace_dimensions, transpose, rearrange.

The drawn test applies every op of the family to a drawn tensor (a rename, a transpose, a merge
of two neighbouring dims, a cut of one dim in two, a regrouping of two neighbours, an einops
rearrange that cuts, reorders and merges) under a drawn layout over the old and the new dim
names, and runs the full harness check: values against numpy's row-major reshape and transpose
on both backends, gradients, shardings, and md.explain == the compiled HLO.

The unit tests pin down the collective each layout case of docs/design.md costs:
split -> unsplit is an all-gather, unsplit -> split a local slice (nothing), a split moving to
another dim one all-to-all, merging or cutting dims whose leading dims are split alike nothing,
and a transpose nothing.
"""

import harness
import numpy as np
import pytest
import reference as R
import strategies as S
from hypothesis import assume, event, given, settings
from hypothesis import strategies as st
from reference import Named

import meshdsl as md

D = md.Dim
NEW = ("renamed", "merged", "hi", "lo", "c1", "c2", "h", "l", "g")
"""Dim names the drawn ops create; the drawn layout has rules for them too."""


def event_collectives(fn, mesh, layout, args):
    """Record which collective kinds the example ran (``--hypothesis-show-statistics``)."""
    event("collectives: " + (", ".join(sorted(md.explain(fn, mesh, layout, *args).summary())) or "none"))


def _sizes(d):
    return [(n, s) for n, s in d.items()]


@settings(max_examples=S.examples(15))
@given(mesh=S.meshes(), pool=S.dim_pool(3), data=st.data(), rng=S.rngs())
def test_reshape_family(mesh, pool, data, rng):
    x = data.draw(S.sub_shape(pool, min_rank=2, max_rank=3), label="x dims")
    names = list(x)
    sizes = dict(pool)
    md_ops, ref_ops = {}, {}

    old = data.draw(st.sampled_from(names), label="renamed dim")
    md_ops["rename"] = lambda t: md.rename(t, old, "renamed")
    ref_ops["rename"] = lambda t: R.rename(t, old, "renamed")

    perm = data.draw(st.permutations(names), label="transpose order")
    form = data.draw(st.sampled_from(["names", "string", "dims"]), label="transpose form")
    arg = {"names": list(perm), "string": " ".join(perm), "dims": [D(n, x[n]) for n in perm]}[form]
    md_ops["transpose"] = lambda t: md.transpose(t, arg)
    ref_ops["transpose"] = lambda t: t.to(perm)

    i = data.draw(st.integers(0, len(names) - 2), label="merge at")
    merged = [*_sizes(x)[:i], ("merged", x[names[i]] * x[names[i + 1]]), *_sizes(x)[i + 2 :]]
    sizes["merged"] = merged[i][1]
    md_ops["merge"] = lambda t: md.reshape(t, [D(n, s) for n, s in merged])
    ref_ops["merge"] = lambda t: R.reshape(t, merged)

    # Regroup the same neighbours as two dims of another factorisation (or the same one: then
    # each group is one dim to one dim, a rename by position).
    c1, c2 = data.draw(st.sampled_from(S.factor_pairs(merged[i][1])), label="regroup sizes")
    regrouped = [*_sizes(x)[:i], ("c1", c1), ("c2", c2), *_sizes(x)[i + 2 :]]
    sizes.update(c1=c1, c2=c2)
    md_ops["replace_dimensions"] = lambda t: md.replace_dimensions(t, names[i : i + 2], [D("c1", c1), D("c2", c2)])
    ref_ops["replace_dimensions"] = lambda t: R.reshape(t, regrouped)

    cuttable = [n for n in names if S.factor_pairs(x[n])]
    if cuttable:
        cut = data.draw(st.sampled_from(cuttable), label="cut dim")
        hi, lo = data.draw(st.sampled_from(S.factor_pairs(x[cut])), label="cut sizes")
        cut_dims = [d for n, s in _sizes(x) for d in ([("hi", hi), ("lo", lo)] if n == cut else [(n, s)])]
        sizes.update(hi=hi, lo=lo)
        md_ops["cut"] = lambda t: md.reshape(t, [D(n, s) for n, s in cut_dims])
        ref_ops["cut"] = lambda t: R.reshape(t, cut_dims)

        # rearrange: cut `cut` into (h l), reorder all atoms, merge two neighbours into g.
        h, l_ = data.draw(st.sampled_from(S.factor_pairs(x[cut])), label="rearrange cut sizes")
        atoms = [d for n, s in _sizes(x) for d in ([("h", h), ("l", l_)] if n == cut else [(n, s)])]
        order = data.draw(st.permutations([n for n, _ in atoms]), label="rearrange order")
        k = data.draw(st.integers(0, len(order) - 2), label="rearrange merge at")
        atom_size = dict(atoms)
        out = [(n, atom_size[n]) for n in order[:k]] + [("g", atom_size[order[k]] * atom_size[order[k + 1]])]
        out += [(n, atom_size[n]) for n in order[k + 2 :]]
        sizes.update(h=h, l=l_, g=out[k][1])
        left = " ".join("(h l)" if n == cut else n for n in names)
        right = " ".join([*order[:k], f"(g: {order[k]} {order[k + 1]})", *order[k + 2 :]])
        pattern = f"{left} -> {right}"
        md_ops["rearrange"] = lambda t: md.rearrange(t, pattern, h=h)
        ref_ops["rearrange"] = lambda t: R.reshape(R.reshape(t, atoms).to(order), out)

    sizes.update(renamed=x[old])
    layout = data.draw(S.layouts_any_order(mesh, sizes, risk=0.05), label="layout")
    keys = list(md_ops)

    def fn(*ts):
        return {k: md_ops[k](t) for k, t in zip(keys, ts)}

    def ref(*ts):
        return {k: ref_ops[k](t) for k, t in zip(keys, ts)}

    args = [harness.rand(rng, x) for _ in keys]
    assume(harness.check(fn, args, ref, mesh, layout, backends=data.draw(S.backends(), label="backends")))
    event_collectives(fn, mesh, layout, args)


# ---- the layout cases of docs/design.md, by hand ----

X = {"a": 8, "b": 4}
"""f32[a=8, b=4]: 128 bytes."""

RENAME = (lambda t: md.rename(t, "a", "c"), lambda t: R.rename(t, "a", "c"))
KEEP_POSITIONS = (lambda t: md.reshape(t, [D("c", 8), D("a", 4)]), lambda t: R.reshape(t, [("c", 8), ("a", 4)]))
REPLACE = (
    lambda t: md.replace_dimensions(t, ["a", "b"], [D("c", 8), D("d", 4)]),
    lambda t: R.reshape(t, [("c", 8), ("d", 4)]),
)
REPLACE_8x8 = (  # on f32[a=8, b=8]
    lambda t: md.replace_dimensions(t, ["a", "b"], [D("c", 8), D("d", 8)]),
    lambda t: R.reshape(t, [("c", 8), ("d", 8)]),
)
MERGE = (lambda t: md.reshape(t, [D("m", 32)]), lambda t: R.reshape(t, [("m", 32)]))
REGROUP = (lambda t: md.reshape(t, [D("p", 2), D("q", 16)]), lambda t: R.reshape(t, [("p", 2), ("q", 16)]))
TRANSPOSE = (lambda t: md.transpose(t, ["b", "a"]), lambda t: t.to("b a"))

# (id, mesh, op, layout, {collective: (count, bytes per device)})
CASES = [
    # split -> unsplit: all-gather of the [8, 4] result: (n-1)/n * 128 bytes.
    ("rename split -> unsplit", "data4_model2", RENAME, {"a": "data"}, {"all-gather": (1, 96.0)}),
    (
        "rename split over axis pair -> unsplit",
        "data4_model2",
        RENAME,
        {"a": ("data", "model")},
        {"all-gather": (1, 112.0)},
    ),
    ("rename split -> unsplit on x8", "x8", RENAME, {"a": "x"}, {"all-gather": (1, 112.0)}),
    ("rename unsplit -> split", "data4_model2", RENAME, {"c": "data"}, {}),
    ("rename unsplit -> split over axis pair", "a2_b2_c2", RENAME, {"c": ("c", "a"), "b": "b"}, {}),
    ("rename split stays", "data4_model2", RENAME, {"a": "data", "c": "data", "b": "model"}, {}),
    # a different axis on the same position: slice model locally, one all-to-all (24 bytes) puts the
    # blocks in (model, data) order, then gather data (48 bytes): 72 bytes, where gathering first moves 96.
    (
        "rename to another axis",
        "data4_model2",
        RENAME,
        {"a": "data", "c": "model"},
        {"all-to-all": (1, 24.0), "all-gather": (1, 48.0)},
    ),
    # The split moves from position 0 to position 1: one all-to-all of the local [4, 4] block.
    (
        "reshape keeping positions moves the split",
        "data4_model2",
        KEEP_POSITIONS,
        {"a": "model"},
        {"all-to-all": (1, 32.0)},
    ),
    (
        "replace_dimensions moves the split",
        "data4_model2",
        REPLACE,
        {"a": "model", "d": "model"},
        {"all-to-all": (1, 32.0)},
    ),
    ("replace_dimensions moves the split on x8", "x8", REPLACE_8x8, {"a": "x", "d": "x"}, {"all-to-all": (1, 28.0)}),
    # Merging [a, b] -> [m] with a and m split alike: each device holds one contiguous block.
    ("merge, leading dims split alike", "data4_model2", MERGE, {"a": "data", "m": "data"}, {}),
    (
        "merge, split alike over an axis pair",
        "data4_model2",
        MERGE,
        {"a": ("data", "model"), "m": ("data", "model")},
        {},
    ),
    ("merge, split alike over x", "x8", MERGE, {"a": "x", "m": "x"}, {}),
    ("regroup [8, 4] -> [2, 16], leading split alike", "a2_b2_c2", REGROUP, {"a": "a", "p": "a"}, {}),
    # Not alike: the input's split is gathered ((n-1)/n of the whole 128 bytes), the output's sliced.
    (
        "merge, leading dims split differently",
        "data4_model2",
        MERGE,
        {"a": "data", "m": "model"},
        {"all-gather": (1, 96.0)},
    ),
    ("merge, trailing dim split", "data4_model2", MERGE, {"b": "data", "m": "data"}, {"all-gather": (1, 96.0)}),
    ("merge, split -> unsplit", "a2_b2_c2", MERGE, {"a": ("a", "b")}, {"all-gather": (1, 96.0)}),
    ("transpose", "data4_model2", TRANSPOSE, {"a": "data", "b": "model"}, {}),
    ("transpose, axis pair", "a2_b2_c2", TRANSPOSE, {"a": ("c", "a"), "b": "b"}, {}),
]


def _summary(counts):
    return {k: {"count": c, "bytes": b} for k, (c, b) in counts.items()}


@pytest.mark.parametrize(("mesh", "op", "layout", "want"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_layout_case(mesh, op, layout, want):
    fn, ref = op
    x = harness.rand(np.random.default_rng(0), {"a": 8, "b": 8} if op is REPLACE_8x8 else X)
    m = harness.mesh(mesh)
    assert harness.check(fn, [x], ref, m, layout)
    assert md.explain(fn, m, layout, x).summary() == _summary(want)


def test_two_renames_gather_then_slice():
    # rename(a -> tmp) then rename(b -> a) under a:model moves the split from position 0 to
    # position 1 in two ops: the first is split -> unsplit (an all-gather), the second unsplit
    # -> split (a local slice). One reshape doing both at once is the all-to-all above.
    m, layout = harness.mesh("data4_model2"), {"a": "model"}

    def fn(t):
        return md.rename(md.rename(t, "a", "tmp"), "b", "a")

    def ref(t):
        return R.rename(R.rename(t, "a", "tmp"), "b", "a")

    x = harness.rand(np.random.default_rng(1), X)
    assert harness.check(fn, [x], ref, m, layout)
    assert md.explain(fn, m, layout, x).summary() == {"all-gather": {"count": 1, "bytes": 64.0}}


@pytest.mark.parametrize(
    ("mesh", "layout", "want"),
    [
        ("data4_model2", {"a": "data", "m": "data"}, {}),
        ("data4_model2", {"a": "data", "m": "data", "b2": "model"}, {}),
        ("a2_b2_c2", {"a": ("b", "c"), "m": ("b", "c"), "b2": "a"}, {}),
        ("x8", {}, {}),
        # b cut into (b1 b2) while split: gathered first (f32[4, 6] local -> [4, 12]: 96 bytes).
        ("data4_model2", {"b": "model"}, {"all-gather": (1, 96.0)}),
    ],
    ids=["alike", "alike + b2 split", "axis pairs", "replicated", "cut dim split"],
)
def test_rearrange_against_numpy(mesh, layout, want):
    # "a (b1 b2) -> b2 (m: a b1)": numpy's reshape to [a, b1, b2], transpose to [b2, a, b1],
    # reshape to [b2, a * b1], written out here on the array itself.
    m = harness.mesh(mesh)

    def fn(t):
        return md.rearrange(t, "a (b1 b2) -> b2 (m: a b1)", b1=3)

    def ref(t):
        xp = R.xp_of(t)
        a = xp.transpose(xp.reshape(t.array, (4, 3, 4)), (2, 0, 1))
        R.Named(a, ["b2", "a", "b1"])  # the intermediate meshdsl also builds (for the legality check)
        return Named(xp.reshape(a, (4, 12)), ["b2", "m"])

    x = harness.rand(np.random.default_rng(2), {"a": 4, "b": 12})
    assert harness.check(fn, [x], ref, m, layout)
    assert md.explain(fn, m, layout, x).summary() == _summary(want)


def test_rearrange_split_and_merge_round_trip():
    # "batch (heads d_kv) -> batch heads d_kv" and back: the identity, under a layout that
    # splits heads and the merged dim alike (free both ways).
    m, layout = harness.mesh("data4_model2"), {"batch": "data", "heads": "model", "d_model": "model"}

    def fn(t):
        split = md.rearrange(t, "batch (heads d_kv) -> batch heads d_kv", heads=4)
        return split, md.rearrange(split, "batch heads d_kv -> batch (d_model: heads d_kv)")

    def ref(t):
        split = R.reshape(t, [("batch", 8), ("heads", 4), ("d_kv", 4)])
        return split, R.reshape(split, [("batch", 8), ("d_model", 16)])

    x = harness.rand(np.random.default_rng(3), {"batch": 8, "d_model": 16})
    assert harness.check(fn, [x], ref, m, layout)
    assert md.explain(fn, m, layout, x).summary() == {}


def test_impossible_reshapes_are_shape_errors():
    x = harness.rand(np.random.default_rng(4), X)
    with pytest.raises(md.ShapeError):
        md.reshape(x, [D("m", 30)])
    with pytest.raises(md.ShapeError):
        md.rename(x, "a", D("c", 4))
    with pytest.raises(md.ShapeError):
        md.transpose(x, ["a"])
    with pytest.raises(md.ShapeError):
        md.rearrange(x, "a b -> (a b)")  # the merged group needs a name
