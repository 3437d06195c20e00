"""meshdsl.analysis.hlo reads the collectives, their sizes, groups and run counts out of compiled HLO; and
md.explain predicts exactly those of programs with a user's ``jax.checkpoint``, with and without
``prevent_cse``, under checkpoint policies, inside and outside ``md.scan``, with the gradient taken
inside ``md.compile`` and around it (the checkpoint then inside the compiled function or around the
call), on every mesh shape."""

import os

_DEVICES_FLAG = "--xla_force_host_platform_device_count=8"
if _DEVICES_FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_DEVICES_FLAG}".strip()

import functools  # noqa: E402

import harness  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import strategies as S  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from jax import lax  # noqa: E402
from jax.ad_checkpoint import checkpoint_name  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import meshdsl as md  # noqa: E402
from meshdsl.analysis.hlo import HloCollective, collectives, summary  # noqa: E402
from meshdsl.analysis.jaxpr_walk import CSE_AFTER_BARRIERS  # noqa: E402
from meshdsl.explain import Source, report_of_jaxpr  # noqa: E402

needs_8_devices = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 (host) devices")


def _mesh() -> Mesh:
    return Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("a", "b"))


def _key(c: HloCollective) -> tuple:
    return (c.collective.value, c.buffer_bytes, c.group_size, c.count)


# ---- compiled programs -------------------------------------------------------------------


@needs_8_devices
def test_shard_map_program_collectives_match_hand_count():
    def f(x):
        # x is the local f32[2,8] block: S = 64 bytes throughout.
        def step(c, _):
            return c + lax.psum(c, "b"), None

        looped, _ = lax.scan(step, x, None, length=5)
        return (
            lax.psum(x, "a"),
            lax.all_gather(x, "b", axis=1, tiled=True),
            lax.psum_scatter(x, "a", scatter_dimension=1, tiled=True),
            lax.all_to_all(x, "a", 1, 1, tiled=True),
            lax.ppermute(x, "a", [(0, 1), (1, 2), (2, 3), (3, 0)]),
            lax.pmax(x, ("a", "b")),
            looped,
        )

    program = jax.jit(jax.shard_map(f, mesh=_mesh(), in_specs=P("a", "b"), out_specs=P("a", "b")))
    text = program.lower(jnp.ones((8, 16), jnp.float32)).compile().as_text()

    assert sorted(map(_key, collectives(text))) == sorted(
        [
            ("all-reduce", 64, 4, 1),  # psum over a
            ("all-gather", 128, 2, 1),  # gathered f32[2,16]
            ("reduce-scatter", 64, 4, 1),  # input f32[2,8] (output f32[2,2] x 4)
            ("all-to-all", 64, 4, 1),  # printed as a 4-tuple of f32[2,2]
            ("collective-permute", 64, 8, 1),  # the pairs of both b columns: 8 devices
            ("all-reduce", 64, 8, 1),  # pmax over a and b
            ("all-reduce", 64, 2, 5),  # psum over b, 5 scan steps
        ]
    )
    assert summary(text) == {
        "all-reduce": {"count": 7, "bytes": 2 * 3 / 4 * 64 + 2 * 7 / 8 * 64 + 5 * (2 * 1 / 2 * 64)},
        "all-gather": {"count": 1, "bytes": 1 / 2 * 128},
        "reduce-scatter": {"count": 1, "bytes": 3 / 4 * 64},
        "all-to-all": {"count": 1, "bytes": 3 / 4 * 64},
        "collective-permute": {"count": 1, "bytes": 64},
    }


@needs_8_devices
def test_permute_bytes_are_what_the_busiest_sender_sends():
    def f(x):
        # x is the local f32[2,8] block: S = 64 bytes. Position 0 along a sends in two of the three permutes,
        # 1 and 2 in one each, 3 in none: the busiest device sends 2 S, not the 3 S the permutes hold.
        once = lax.ppermute(x, "a", [(0, 1)])
        twice = lax.ppermute(x * 2, "a", [(0, 1), (1, 2)])
        other = lax.ppermute(x * 3, "a", [(2, 3)])
        return once + twice + other

    program = jax.jit(jax.shard_map(f, mesh=_mesh(), in_specs=P("a", "b"), out_specs=P("a", "b")))
    x = jnp.ones((8, 16), jnp.float32)
    want = {"collective-permute": {"count": 3, "bytes": 2 * 64.0}}
    assert summary(program.lower(x).compile().as_text()) == want
    assert report_of_jaxpr(jax.make_jaxpr(program)(x).jaxpr, {"a": 4, "b": 2}, cpu=True).summary() == want


@needs_8_devices
@pytest.mark.parametrize(
    ("spec", "group"),
    # Device (a, b) of the 4 x 2 mesh has partition id 2a + b: over a, ids step by 2; over (b, a), b is major.
    [(P("a", None), (0, 2, 4, 6)), (P("b", None), (0, 1)), (P(("b", "a"), None), (0, 2, 4, 6, 1, 3, 5, 7))],
)
def test_automatic_partitioning_mesh_replica_groups(spec, group):
    # GSPMD prints groups as mesh['axis_0'=4,...] {'axis_0'} (with ", device_ids=(...)" when the
    # devices are not in mesh order): the sum over the split dim is an all-reduce of the local
    # partial f32[16] over the devices the dim is split on.
    mesh = _mesh()
    x = jax.ShapeDtypeStruct((8, 16), jnp.float32, sharding=NamedSharding(mesh, spec))
    program = jax.jit(lambda x: jnp.sum(x, axis=0), out_shardings=NamedSharding(mesh, P()))
    text = program.lower(x).compile().as_text()

    assert "replica_groups=mesh[" in text
    assert [_key(c) for c in collectives(text)] == [("all-reduce", 64, len(group), 1)]
    assert sorted(collectives(text)[0].group) == sorted(group)


# ---- hand-written HLO ---------------------------------------------------------------------

_ADD = """%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %sum = f32[] add(%x, %y)
}
"""


def _module(*entry: str, computations: str = _ADD, header: str = "HloModule m, num_partitions=8") -> str:
    body = "\n".join(f"  {line}" for line in entry)
    entry_header = "ENTRY %main (p: f32[8]) -> f32[8] {\n  %p = f32[8]{0} parameter(0)"
    return f"{header}\n\n{computations}\n{entry_header}\n{body}\n}}\n"


def _keys(text: str, **kwargs) -> list[tuple]:
    return [_key(c) for c in collectives(text, **kwargs)]


def test_iota_replica_groups_take_the_group_dim():
    text = _module(
        "%ar0 = f32[8]{0} all-reduce(%p), channel_id=1, replica_groups=[4,2]<=[2,4]T(1,0), to_apply=%add",
        "%ar1 = f32[8]{0} all-reduce(%p), channel_id=2, replica_groups=[2,4]<=[8], to_apply=%add",
    )
    assert _keys(text) == [("all-reduce", 32, 2, 1), ("all-reduce", 32, 4, 1)]
    # [2,4] laid out, transposed to [4,2]: rows (0,4), (1,5), ...; then iota 0..7 in rows of 4.
    assert [c.group for c in collectives(text)] == [(0, 4), (0, 1, 2, 3)]


def test_mesh_replica_groups_multiply_named_axes_and_sub_axes():
    text = _module(
        "%ar0 = f32[8]{0} all-reduce(%p), replica_groups=mesh['a'=4,'b'=2] {'a'}, to_apply=%add",
        "%ar1 = f32[8]{0} all-reduce(%p), replica_groups=mesh['a'=4,'b'=2] {'a','b'}, to_apply=%add",
        "%ar2 = f32[8]{0} all-reduce(%p), replica_groups=mesh[a=8,b=2] {a:(2)4,b}, to_apply=%add",
        "%ar3 = f32[8]{0} all-reduce(%p), replica_groups=mesh['x'=2,'y'=4], device_ids=([4,2]T(1,0)) {'y'}, "
        "to_apply=%add",
    )
    assert [c.group_size for c in collectives(text)] == [4, 8, 8, 4]
    # Partition ids are row-major over the mesh (device_ids permuting them): 'a' of a=4,b=2 steps by 2;
    # a:(2)4 of a=8 is the middle factor of 8 = 2 x 4 x 1; device_ids [4,2]T(1,0) lays out x=2,y=4 as
    # [[0,2,4,6],[1,3,5,7]], so 'y' at x=0 is 0,2,4,6.
    assert [c.group for c in collectives(text)] == [(0, 2, 4, 6), tuple(range(8)), tuple(range(8)), (0, 2, 4, 6)]


def test_all_device_groups_take_the_device_count():
    line = "%ar = f32[8]{0} all-reduce(%p), replica_groups={}, to_apply=%add"
    assert _keys(_module(line)) == [("all-reduce", 32, 8, 1)]  # num_partitions=8 in the header
    assert _keys(_module(line), num_devices=4) == [("all-reduce", 32, 4, 1)]
    assert _keys(_module(line, header="HloModule m")) == [("all-reduce", 32, 1, 1)]  # printer omits 1
    with pytest.raises(ValueError, match="num_devices"):
        collectives(_module(line, header=""))


def test_combined_collectives_count_per_buffer_but_all_to_all_once():
    text = _module(
        "%a2a = (f32[2,2]{1,0}, f32[2,2]{1,0}, /*index=2*/bf16[4]{0}) all-to-all(%p, %p, %p), "
        "channel_id=1, replica_groups={{0,2,4,6},{1,3,5,7}}",
        "%ar = (f32[], bf16[4,4]{1,0}) all-reduce(%p, %p), replica_groups={{0,1},{2,3},{4,5},{6,7}}, to_apply=%add",
        "%rs = (f32[2]{0}, f32[4]{0}) reduce-scatter(%p, %p), replica_groups={{0,1,2,3},{4,5,6,7}}, "
        "dimensions={0}, to_apply=%add",
    )
    assert _keys(text) == [
        ("all-to-all", 16 + 16 + 8, 4, 1),
        ("all-reduce", 4, 2, 1),
        ("all-reduce", 32, 2, 1),
        ("reduce-scatter", 8 * 4, 4, 1),
        ("reduce-scatter", 16 * 4, 4, 1),
    ]


def test_async_pairs_count_once_at_their_output():
    wrapped = (
        _ADD
        + """
%wrapped_a2a (w: f32[8]) -> f32[8] {
  %w = f32[8]{0} parameter(0)
  ROOT %a2a = f32[8]{0} all-to-all(%w), replica_groups={{0,1}}, dimensions={0}
}
"""
    )
    text = _module(
        "%ags = (f32[8]{0}, f32[32]{0}) all-gather-start(%p), replica_groups={{0,1,2,3},{4,5,6,7}}, dimensions={0}",
        "%agd = f32[32]{0} all-gather-done(%ags)",
        "%ars = f32[8]{0} all-reduce-start(%p), replica_groups={{0,1}}, to_apply=%add",
        "%ard = f32[8]{0} all-reduce-done(%ars)",
        "%cps = (f32[8]{0}, f32[8]{0}, u32[], u32[]) collective-permute-start(%p), source_target_pairs={{0,1},{1,2}}",
        "%cpd = f32[8]{0} collective-permute-done(%cps)",
        "%rss = ((f32[8]{0}), f32[2]{0}) reduce-scatter-start(%p), replica_groups={{0,1,2,3}}, dimensions={0}, "
        "to_apply=%add",
        "%rsu = ((f32[8]{0}), f32[2]{0}) reduce-scatter-update(%rss)",
        "%rsd = f32[2]{0} reduce-scatter-done(%rsu)",
        "%as = ((f32[8]{0}), f32[8]{0}, s32[]) async-start(%p), calls=%wrapped_a2a",
        "%ad = f32[8]{0} async-done(%as)",
        computations=wrapped,
    )
    assert _keys(text) == [
        ("all-gather", 128, 4, 1),
        ("all-reduce", 32, 2, 1),
        ("collective-permute", 32, 3, 1),
        ("reduce-scatter", 32, 4, 1),
        ("all-to-all", 32, 2, 1),
    ]


_LOOPS = (
    _ADD
    + """
%in_body (ib: (s32[], f32[8])) -> (s32[], f32[8]) {
  %ib = (s32[], f32[8]{0}) parameter(0)
  %iv = f32[8]{0} get-tuple-element(%ib), index=1
  %ar_inner = f32[8]{0} all-reduce(%iv), replica_groups={{0,1}}, to_apply=%add
  ROOT %it = (s32[], f32[8]{0}) tuple(%ib, %ar_inner)
}

%cond (c: (s32[], f32[8])) -> pred[] {
  %c = (s32[], f32[8]{0}) parameter(0)
  ROOT %lt = pred[] constant(true)
}

%outer_body (ob: (s32[], f32[8])) -> (s32[], f32[8]) {
  %ob = (s32[], f32[8]{0}) parameter(0)
  %inner = (s32[], f32[8]{0}) while(%ob), condition=%cond, body=%in_body, backend_config={"known_trip_count":{"n":"4"}}
  %ov = f32[8]{0} get-tuple-element(%inner), index=1
  %ag_outer = f32[16]{0} all-gather(%ov), replica_groups={{0,1}}, dimensions={0}
  ROOT %ot = (s32[], f32[8]{0}) tuple(%ob, %ov)
}

%branch_a (ba: f32[8]) -> f32[8] {
  %ba = f32[8]{0} parameter(0)
  ROOT %ar_a = f32[8]{0} all-reduce(%ba), replica_groups={{0,1,2,3}}, to_apply=%add
}

%branch_b (bb: f32[8]) -> f32[8] {
  %bb = f32[8]{0} parameter(0)
  %called = f32[8]{0} call(%bb), to_apply=%branch_a
  ROOT %cp_b = f32[8]{0} collective-permute(%called), source_target_pairs={{0,1},{1,0}}
}
"""
)


def test_loops_multiply_trip_counts_and_branches_count_once():
    text = _module(
        "%t = (s32[], f32[8]{0}) tuple(%p, %p)",
        "%outer = (s32[], f32[8]{0}) while(%t), condition=%cond, body=%outer_body, "
        'backend_config={"known_trip_count":{"n":"3"}}',
        "%pred = pred[] constant(true)",
        "%branch = f32[8]{0} conditional(%pred, %p, %p), true_computation=%branch_a, false_computation=%branch_b",
        "%idx = s32[] constant(0)",
        "%switch = f32[8]{0} conditional(%idx, %p, %p), branch_computations={%branch_a, %branch_b}",
        computations=_LOOPS,
    )
    branches = [("all-reduce", 32, 4, 1), ("all-reduce", 32, 4, 1), ("collective-permute", 32, 2, 1)]
    assert _keys(text) == [("all-reduce", 32, 2, 12), ("all-gather", 64, 2, 3), *branches, *branches]
    assert summary(text)["all-reduce"] == {"count": 12 + 4, "bytes": 12 * 32 + 4 * (2 * 3 / 4 * 32)}


def test_while_without_trip_count_is_an_error_only_when_it_holds_collectives():
    def program(body: str, computations: str) -> str:
        return _module(
            "%t = (s32[], f32[8]{0}) tuple(%p, %p)",
            f"%loop = (s32[], f32[8]{{0}}) while(%t), condition=%cond, body=%{body}",
            computations=computations,
        )

    with pytest.raises(ValueError, match="%loop"):
        collectives(program("in_body", _LOOPS))
    quiet = (
        _LOOPS
        + """
%quiet_body (qb: (s32[], f32[8])) -> (s32[], f32[8]) {
  ROOT %qb = (s32[], f32[8]{0}) parameter(0)
}
"""
    )
    assert collectives(program("quiet_body", quiet)) == []


def test_loop_condition_runs_once_more_than_the_body():
    checked = (
        _ADD
        + """
%checked_cond (c: f32[8]) -> pred[] {
  %c = f32[8]{0} parameter(0)
  %any = f32[8]{0} all-reduce(%c), replica_groups={{0,1}}, to_apply=%add
  ROOT %go = pred[] constant(true)
}

%body (b: f32[8]) -> f32[8] {
  ROOT %b = f32[8]{0} parameter(0)
}
"""
    )
    text = _module(
        "%loop = f32[8]{0} while(%p), condition=%checked_cond, body=%body, "
        'backend_config={"known_trip_count":{"n":"2"}}',
        computations=checked,
    )
    assert _keys(text) == [("all-reduce", 32, 2, 3)]


def test_element_sizes():
    text = _module(
        "%ag0 = (pred[3]{0}, s8[2]{0}, bf16[2]{0}, f8e4m3fn[2]{0}) all-gather(%p), replica_groups={{0,1}}, "
        "dimensions={0}",
        "%ag1 = (c128[2]{0}, f64[], s4[2]{0}) all-gather(%p), replica_groups={{0,1}}, dimensions={0}",
    )
    assert [c.buffer_bytes for c in collectives(text)] == [3, 2, 4, 2, 32, 8, 2]


# ---- md.explain against the compiled program under a user's jax.checkpoint -------------------------
#
# JAX lowers the recomputation of a differentiated jax.checkpoint with prevent_cse=True (its
# default) behind an optimization barrier on its operands. XLA:CPU's first CSE respects it; its
# second, after expanding the barriers and combining all-reduces, merges every recomputed
# collective with the forward pass's but the all-reduces. With prevent_cse=False all merge. A
# policy decides which values are saved, hence what is recomputed at all.

POLICIES = {
    "recompute all": None,
    "nothing_saveable": jax.checkpoint_policies.nothing_saveable,
    "dots_saveable": jax.checkpoint_policies.dots_saveable,
    "all but hidden": jax.checkpoint_policies.save_anything_except_these_names("hidden"),
    "everything_saveable": jax.checkpoint_policies.everything_saveable,
}
PLACES = ("grad inside md.compile", "grad around md.compile", "grad and checkpoint around md.compile")
CHECKPOINT_MESHES = ({"x": 8}, {"data": 2, "model": 4}, {"a": 2, "b": 2, "c": 2})


def _block(x: md.Tensor, w: md.Tensor, w2: md.Tensor) -> md.Tensor:
    """``einsum(tanh(einsum(x, w)), w2)``, its hidden activation named ``hidden`` for policies."""
    hidden = md.tanh(md.einsum(x, w, out=["batch", "d_ff"]))
    hidden = jax.tree_util.tree_map(lambda a: checkpoint_name(a, "hidden"), hidden)
    return md.einsum(hidden, w2, out=["batch", "d_model"])


def _explained_and_run(
    mesh_: md.Mesh,
    layout: md.Layout,
    args: list[md.Tensor],
    place: str,
    prevent_cse: bool,
    policy: str,
    scanned: bool,
    value: bool,
    stored: md.Layout | None = None,
) -> tuple[dict, dict]:
    """(md.explain's summary, the compiled HLO's) of the gradient of ``sum(block)`` (``scanned``: a
    residual layer loop of blocks), with ``value``: the loss too (the forward pass stays live);
    ``stored``: the weights' layout (FSDP), else the layout's."""
    in_layouts = (None, stored, stored)
    remat = functools.partial(jax.checkpoint, prevent_cse=prevent_cse, policy=POLICIES[policy])
    inner = remat if place != PLACES[2] else (lambda f: f)

    def forward(x, w, w2):
        if scanned:
            layer = lambda h, p: (h + inner(_block)(h, p["w"], p["w2"]), None)  # noqa: E731
            return md.reduce_sum(md.scan(layer, x, {"w": w, "w2": w2}, "layers")[0])
        return md.reduce_sum(inner(_block)(x, w, w2))

    differentiate = functools.partial(jax.value_and_grad if value else jax.grad, argnums=(0, 1, 2))
    if place == PLACES[0]:

        def program(x, w, w2):
            return differentiate(lambda *a: forward(*a).array)(x, w, w2)

        predicted = md.explain(program, mesh_, layout, *args, in_layouts=in_layouts).summary()
        text = md.compile(program, mesh_, layout, in_layouts=in_layouts).lower(*args).compile().as_text()
        return predicted, summary(text)
    compiled = md.compile(forward, mesh_, layout, in_layouts=in_layouts)
    call = remat(lambda *a: compiled(*a)) if place == PLACES[2] else compiled

    def program(*arrays):
        return differentiate(lambda *a: call(*(md.tensor(v, t.shape) for v, t in zip(a, args))).array)(*arrays)

    arrays = [t.array for t in args]
    predicted = report_of_jaxpr(jax.make_jaxpr(program)(*arrays).jaxpr, mesh_.axis_sizes, cpu=True).summary()
    return predicted, summary(jax.jit(program).lower(*arrays).compile().as_text(), num_devices=mesh_.size)


@pytest.mark.parametrize("prevent_cse", [True, False], ids=["prevent_cse", "allow_cse"])
@pytest.mark.parametrize("place", PLACES)
@settings(max_examples=S.examples(5))
@given(
    axes=st.sampled_from(CHECKPOINT_MESHES),
    data=st.data(),
    policy=st.sampled_from(list(POLICIES)),
    scanned=st.booleans(),
    value=st.sampled_from([True, True, False]),  # mostly with the loss, which keeps the forward pass live
)
def test_explain_equals_hlo_under_user_checkpoints(place, prevent_cse, axes, data, policy, scanned, value):
    mesh_ = md.Mesh(axes)
    sizes = {"batch": 8, "d_model": 8, "d_ff": 8, "layers": 2}
    pool = sizes if scanned else {k: v for k, v in sizes.items() if k != "layers"}
    # d_model mostly split: the first einsum's partial sum is then the collective a recomputation
    # repeats; or the weights stored with d_model split (FSDP), gathered again by the recomputation.
    layout = data.draw(S.layouts_splitting(mesh_, pool, "d_model", risk=0.0), label="layout")
    taken = {a for name in ("d_ff", "layers") for a in layout.rules.get(name, ())}
    free = [
        axes
        for axes in S.axis_choices(mesh_)
        if axes and not taken & set(axes) and 8 % S.group_size(mesh_, md.Layout({"d": axes}), "d") == 0
    ]
    stored_axes = data.draw(st.sampled_from([None, *free]), label="weights stored with d_model over")
    stored = None if stored_axes is None else md.Layout({**layout.rules, "d_model": stored_axes})
    rng = np.random.default_rng(0)
    stack = {"layers": 2} if scanned else {}
    args = [
        harness.rand(rng, {"batch": 8, "d_model": 8}),
        harness.rand(rng, {**stack, "d_model": 8, "d_ff": 8}),
        harness.rand(rng, {**stack, "d_ff": 8, "d_model": 8}),
    ]
    predicted, actual = _explained_and_run(mesh_, layout, args, place, prevent_cse, policy, scanned, value, stored)
    assert predicted == actual


def test_checkpointed_recomputation_is_kept_apart_unless_cse_is_allowed():
    # issue 12 item 5: d_model:model; batch:data on data=2 model=4, value and gradient of a
    # checkpointed block. The forward pass's all-reduce over model (tanh's input) is recomputed
    # for the backward pass: kept behind the optimization barrier with prevent_cse=True (JAX's
    # default), merged with the forward's with prevent_cse=False.
    mesh_, layout = md.Mesh({"data": 2, "model": 4}), md.Layout("d_model:model; batch:data")
    rng = np.random.default_rng(0)
    args = [
        harness.rand(rng, {"batch": 16, "d_model": 16}),
        harness.rand(rng, {"d_model": 16, "d_ff": 16}),
        harness.rand(rng, {"d_ff": 16, "d_model": 16}),
    ]
    kept = _explained_and_run(mesh_, layout, args, PLACES[0], True, "recompute all", False, True)
    merged = _explained_and_run(mesh_, layout, args, PLACES[0], False, "recompute all", False, True)
    assert kept[0] == kept[1] and merged[0] == merged[1]
    recomputed = 2 * 3 / 4 * (16 // 2) * 16 * 4  # tanh's input [batch/2, d_ff] f32, all-reduced over model's 4
    assert kept[1]["all-reduce"]["count"] == merged[1]["all-reduce"]["count"] + 1
    assert kept[1]["all-reduce"]["bytes"] == merged[1]["all-reduce"]["bytes"] + recomputed


_BARRIER_CASES = {
    "all-reduce": (lambda w: lax.psum(w, "a"), P()),
    "all-gather": (lambda w: lax.all_gather(w, "a", tiled=True), P()),
    "reduce-scatter": (lambda w: lax.psum_scatter(w, "a", tiled=True), P("a")),
    "all-to-all": (lambda w: lax.all_to_all(w, "a", 0, 0, tiled=True), P("a")),
    "collective-permute": (lambda w: lax.ppermute(w, "a", [(0, 1), (1, 2), (2, 3), (3, 0)]), P("a")),
}


@needs_8_devices
@pytest.mark.parametrize("kind", list(_BARRIER_CASES))
def test_an_optimization_barrier_keeps_only_all_reduces_apart(kind):
    # XLA:CPU of jaxlib 0.10 expands optimization barriers before its last CSE, after its
    # all-reduce combiner: of a collective and its copy behind a barrier, only an all-reduce runs
    # twice. Newer XLA merges nothing a barrier kept apart: each runs twice. md.explain models the
    # XLA at hand (jaxpr_walk.CSE_AFTER_BARRIERS).
    collective, out = _BARRIER_CASES[kind]

    def f(w):
        return collective(w), collective(lax.optimization_barrier(w))

    program = jax.shard_map(f, mesh=_mesh(), in_specs=P("a"), out_specs=(out, out), check_vma=False)
    w = jnp.ones((16, 4), jnp.float32)
    actual = summary(jax.jit(program).lower(w).compile().as_text())
    assert actual[kind]["count"] == (2 if kind == "all-reduce" or not CSE_AFTER_BARRIERS else 1)
    assert report_of_jaxpr(jax.make_jaxpr(program)(w).jaxpr, {"a": 4, "b": 2}, cpu=True).summary() == actual


def test_explain_refuses_collectives_in_a_while_loop():
    # A while_loop's trip count is data: its collectives cannot be counted. An md error names it.
    x = harness.rand(np.random.default_rng(1), {"batch": 8})

    def fn(x):
        def body(state):
            i, total = state
            return i + 1, total + md.reduce_sum(x).array

        return lax.while_loop(lambda state: state[0] < 3, body, (0, jnp.float32(0)))[1]

    with pytest.raises(md.ConfigError, match=r"psum\w* over x in op \w+ runs inside a while_loop"):
        md.explain(fn, md.Mesh({"x": 8}), "batch:x", x)


def test_permute_pairs_and_op_names_are_read():
    text = _module(
        "%cp = f32[8]{0} collective-permute(%p), channel_id=1, source_target_pairs={{0,2},{2,0},{1,3},{3,1}}, "
        'metadata={op_name="jit(f)/transpose(jvp(md.shift))/ppermute" source_file="x.py" source_line=3}',
        "%ar = f32[8]{0} all-reduce(%p), replica_groups={{0,1},{2,3},{4,5},{6,7}}, to_apply=%add",
    )
    permute, reduce = collectives(text)
    assert (permute.group, permute.pairs, permute.op_name) == (
        (0, 1, 2, 3),
        ((0, 2), (2, 0), (1, 3), (3, 1)),
        "jit(f)/transpose(jvp(md.shift))/ppermute",
    )
    assert (reduce.group, reduce.pairs, reduce.op_name) == ((0, 1), (), "")


# ---- md.explain(backend="gspmd"): XLA's choice, measured ----------------------------------------


@needs_8_devices
@pytest.mark.parametrize(
    ("layout", "axes", "expected"),
    [
        # The gradient of a [32, 64] f32 weight: its local block summed over the batch's axes.
        ("batch:data; d_ff:model", ("data",), 2 * (2 - 1) / 2 * 32 * 16 * 4),
        ("batch:(data,model)", ("data", "model"), 2 * (8 - 1) / 8 * 32 * 64 * 4),
        ("batch:model", ("model",), 2 * (4 - 1) / 4 * 32 * 64 * 4),
        ("", (), 0),
    ],
)
def test_explain_gspmd_reports_the_collectives_xla_chose(layout, axes, expected):
    b, d, f = md.Dim("batch", 16), md.Dim("d_model", 32), md.Dim("d_ff", 64)
    rng = np.random.default_rng(0)
    x = md.tensor(rng.standard_normal((16, 32), np.float32), [b, d])
    w = md.tensor(rng.standard_normal((32, 64), np.float32), [d, f])

    def grad(x, w):
        return jax.grad(lambda w: md.reduce_sum(md.tanh(md.einsum(x, w, out=[b, f]))).array)(w)

    mesh = md.Mesh("data=2 model=4")
    report = md.explain(grad, mesh, layout, x, w, backend="gspmd")
    assert report.source is Source.COMPILED and str(report).startswith("measured:")
    assert [(r.op, r.collective.value, r.axes) for r in report.rows] == (
        [("einsum (grad)", "all-reduce", axes)] if axes else []
    )
    assert report.total_bytes == expected
    text = md.compile(grad, mesh, layout, "gspmd").lower(x, w).compile().as_text()
    assert report.summary() == summary(text)
    with pytest.raises(md.ConfigError, match="measured on the devices at hand"):
        md.explain(grad, mesh, layout, x, w, backend="gspmd", platform="gpu")
    with pytest.raises(md.ConfigError, match="mesh data=2 model=4 is abstract"):
        md.explain(grad, md.Mesh.abstract({"data": 2, "model": 4}), layout, x, w, backend="gspmd")


@needs_8_devices
def test_trainer_explain_follows_its_backend():
    from meshdsl.measure.timing import compile_step
    from meshdsl.model.loader import build_model
    from meshdsl.train import optim
    from meshdsl.train.step import Trainer

    trainer = Trainer(
        build_model("mlp", "tiny"), optim.make("sgd"), md.Mesh("data=8"), md.Layout("batch:data"), backend="gspmd"
    )
    step = compile_step(trainer, 0)
    report = trainer.explain(step.state, step.data)
    assert report.source is Source.COMPILED
    # Data parallel SGD: every parameter's f32 gradient and the loss all-reduced over the 8 devices, nothing else.
    params = sum(leaf.size for leaf in jax.tree_util.tree_leaves(trainer.abstract_state()["params"]))
    assert {(r.collective.value, r.axes) for r in report.rows} == {("all-reduce", ("data",))}
    assert report.total_bytes == 2 * 7 / 8 * 4 * (params + 1)
