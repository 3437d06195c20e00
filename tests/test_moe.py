"""models/moe.py: top-2 gating with capacity against numpy, training under the shipped layouts equals
one device, expert parallelism is all-to-alls (md.explain == compiled HLO), and the loss falls.

Compiling is most of the cost here, so each training program is compiled once and shared between
the tests (the ``runs`` fixture), and every layout starts from the single-device initial state.
"""

from pathlib import Path

import jax
import model_figures
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec
from meshdsl.models import moe

import meshdsl as md
from meshdsl.analysis import hlo
from meshdsl.train.optim import adamw
from meshdsl.train.step import Trainer

LAYOUTS = Path(__file__).resolve().parent.parent / "layouts"
STEPS = 5
LONG_STEPS = 20


@pytest.fixture(scope="module")
def model() -> moe.Model:
    return moe.Model(moe.Config.preset("tiny"))


def _layout(name: str) -> tuple[md.Mesh, md.Layout]:
    if name == "single":
        return md.Mesh({"x": 1}), md.Layout()
    layout = md.Layout.load(LAYOUTS / f"{name}.toml")
    return layout.mesh(), layout


def _is_tensor(x) -> bool:
    return isinstance(x, md.Tensor)


class Run:
    """A Trainer on one layout and the losses of its first ``steps`` steps.

    Every run starts from the single-device run's initial state, put on the mesh as the layout
    stores it (md.random makes ``Trainer.init`` layout-invariant; compiling it once per layout
    would only add compile time), so the runs differ only in how the step is laid out.
    """

    def __init__(self, model: moe.Model, name: str, steps: int, start: dict | None = None):
        self.mesh, self.layout = _layout(name)
        self.trainer = Trainer(model, adamw(1e-2), self.mesh, self.layout, donate=False)  # state0 is reused
        self.data = jax.random.key(1)
        self.state0 = self.trainer.init(jax.random.key(0)) if start is None else self._put(start)
        state, losses = self.state0, []
        for _ in range(steps):
            state, loss = self.trainer.step(state, self.data)
            losses.append(loss)
        self.losses = np.array([float(x) for x in losses])

    def _put(self, state: dict) -> dict:
        stored = self.layout.param_layout

        def put(x):
            if _is_tensor(x):
                return md.tensor(jax.device_put(x.numpy(), stored.sharding(self.mesh, x.shape)), x.shape)
            return jax.device_put(np.asarray(x), NamedSharding(self.mesh.jax_mesh, PartitionSpec()))

        return jax.tree_util.tree_map(put, state, is_leaf=_is_tensor)


@pytest.fixture(scope="module")
def runs(model):
    """``runs(name)``: the Run on layout ``name`` (``"single"``: one device, LONG_STEPS steps), made once."""
    made: dict[str, Run] = {}

    def get(name: str) -> Run:
        if name not in made:
            if name == "single":
                made[name] = Run(model, name, LONG_STEPS)
            else:
                made[name] = Run(model, name, STEPS, start=get("single").state0)
        return made[name]

    return get


def explain_and_hlo(r: Run) -> tuple[md.Report, dict]:
    """md.explain of the run's step, and the collectives of its compiled HLO."""
    report = r.trainer.explain(r.state0, r.data)
    return report, hlo.summary(r.trainer.step.lower(r.state0, r.data).compile().as_text())


# ---- (1) gating -----------------------------------------------------------------------------


def reference_route(probs: np.ndarray, capacity: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Top-2 gating with capacity, token by token (GShard; Mesh-TF's _top_2_gating, second_policy="all").

    Per group (batch row): every token's first choice is placed, in token order, then every
    token's second choice; a choice whose expert already holds ``capacity`` tokens is dropped.
    Gates are the two probabilities over their sum (+1e-9), in float32.
    """
    batch, length, experts = probs.shape
    dispatch = np.zeros((batch, length, experts, capacity), np.float32)
    combine = np.zeros((batch, length, experts, capacity), np.float32)
    aux = np.zeros(batch, np.float64)
    for b in range(batch):
        p = probs[b]
        order = np.argsort(-p, axis=-1, kind="stable")  # ties: the lower expert first
        choices = order[:, :2]
        gates = np.take_along_axis(p, choices, axis=-1)
        denom = (gates[:, 0] + gates[:, 1]) + np.float32(1e-9)
        filled = np.zeros(experts, np.int64)
        for rank in range(2):
            for t in range(length):
                e = choices[t, rank]
                if filled[e] < capacity:
                    dispatch[b, t, e, filled[e]] = 1.0
                    combine[b, t, e, filled[e]] = gates[t, rank] / denom[t]
                filled[e] += 1
        fraction = np.bincount(choices[:, 0], minlength=experts) / length
        aux[b] = experts * np.sum(fraction * p.astype(np.float64).mean(axis=0))
    return dispatch, combine, aux


def test_gating_matches_numpy_top2_with_capacity(model):
    c = model.config
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((c.batch, c.length, c.experts)).astype(np.float32)
    logits[: c.batch // 2, :, 0] += 3.0  # half the groups crowd expert 0: first choices overflow
    logits[c.batch // 2 :, :, 1] += 1.5  # some second choices find a full expert
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs = (probs / probs.sum(-1, keepdims=True)).astype(np.float32)
    probs[-1, :4] = np.float32(1.0 / c.experts)  # ties: the lower experts win
    want_dispatch, want_combine, want_aux = reference_route(probs, c.expert_capacity)
    assert c.expert_capacity == 4
    kept = want_dispatch.sum()
    assert 0 < kept < 2 * c.batch * c.length, "the example should drop some choices and keep others"

    mesh, layout = _layout("moe_expert")
    x = md.tensor(probs, [model.batch_dim, model.length, model.experts_unsplit])
    dispatch, combine, aux = md.compile(model.route, mesh, layout)(x)
    assert dispatch.names == combine.names == ("batch", "length", "experts_unsplit", "expert_capacity")
    np.testing.assert_array_equal(dispatch.numpy(), want_dispatch)
    # The gates exactly where the reference puts them, each within one ulp: XLA rewrites the gate
    # normalisation g / broadcast(sum) as g * broadcast(1 / sum), which rounds twice.
    np.testing.assert_array_equal(combine.numpy() != 0, want_combine != 0)
    np.testing.assert_array_max_ulp(combine.numpy(), want_combine, maxulp=1)
    np.testing.assert_allclose(aux.numpy(), want_aux, rtol=1e-5)


# ---- (2) layouts ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["moe_expert", "data_parallel", "dp_tp"])
def test_training_under_layout_equals_one_device(runs, name):
    single, split = runs("single"), runs(name)
    assert split.mesh.size == 8
    np.testing.assert_allclose(split.losses, single.losses[:STEPS], rtol=1e-4)
    report, compiled = explain_and_hlo(split)
    assert report.summary() == compiled


# ---- (3) expert parallelism -----------------------------------------------------------------


def test_moe_expert_dispatch_and_combine_are_all_to_alls(model, runs):
    report, compiled = explain_and_hlo(runs("moe_expert"))
    assert report.summary() == compiled

    c, moe_layers = model.config, model.layers.size
    a2a = [row for row in report.rows if row.collective.value == "all-to-all"]
    by_tensor = {row.tensor: row for row in a2a}
    assert all(row.op == "reshape" and row.axes == ("data",) for row in a2a), report
    # Rows are named by the reshape's result: the expert side (dispatch) and the token side (combine).
    m = model
    dispatch = by_tensor[str(md.Shape([m.experts, m.groups, m.capacity, m.d_model]))]
    combine = by_tensor[str(md.Shape([m.experts_unsplit, m.batch_dim, m.capacity, m.d_model]))]
    # Per MoE layer and direction: one all-to-all forward, and one in the backward pass.
    assert dispatch.count == combine.count == 2 * moe_layers
    local = c.experts * (c.batch // 8) * c.expert_capacity * c.d_model * 4
    assert dispatch.buffer_bytes == combine.buffer_bytes == local
    assert compiled["all-to-all"] == {"count": 4 * moe_layers, "bytes": 4 * moe_layers * local * 7 / 8}
    assert "all-gather" not in compiled


# ---- (4) learning ---------------------------------------------------------------------------


def test_loss_falls(runs):
    losses = runs("single").losses
    why = model_figures.recorded_losses_mismatch("moe", losses)
    assert why is None, why
    assert np.all(np.isfinite(losses))
    assert losses[-3:].mean() < 0.5 * losses[:3].mean(), losses
