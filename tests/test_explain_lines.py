"""``md.explain`` names the line of the user's code each collective comes from (issue 24).

The user's code is a module written to a temporary file and imported from there, as a user's own
model is; the expected lines are found in that file's text, not written down.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import jax
import numpy as np

import meshdsl as md
from meshdsl.analysis.user_lines import user_line

CODE = """
import jax
import meshdsl as md


def norm(x, w):
    h = md.einsum(x, w, out=["batch", "d_ff"])
    return md.sqrt(md.reduce_sum(md.square(h)))


def grad(x, w):
    return jax.grad(lambda w: norm(x, w).array)(w)


def rows(x, w):
    return md.reduce_sum(md.relu(md.einsum(x, w, out=["d_ff", "batch"])), "d_ff")


def layers(x, ws):
    def step(total, w):
        return total + md.reduce_sum(md.tanh(md.einsum(w, x, out=["batch", "d_ff"]))), None

    total, _ = md.scan(step, md.zeros([]), ws, "layers")
    return total
"""

B, D, F, L = md.Dim("batch", 8), md.Dim("d_model", 4), md.Dim("d_ff", 8), md.Dim("layers", 2)


def _module(tmp_path: Path) -> tuple[ModuleType, Path]:
    path = tmp_path / "my_model.py"
    path.write_text(CODE)
    spec = importlib.util.spec_from_file_location("my_model_for_explain", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module, path


def _line(path: Path, code: str) -> str:
    """``PATH:N`` of the one line of ``path`` holding ``code``."""
    found = [i for i, line in enumerate(path.read_text().splitlines(), 1) if code in line]
    assert len(found) == 1, (code, found)
    return f"{path}:{found[0]}"


def _tensor(*dims: md.Dim) -> md.Tensor:
    rng = np.random.default_rng(0)
    return md.tensor(rng.standard_normal([d.size for d in dims]).astype(np.float32), list(dims))


def test_each_row_names_the_user_s_line_and_its_gradient_the_forward_line(tmp_path) -> None:
    module, path = _module(tmp_path)
    mesh = md.Mesh({"data": 4, "model": 2})
    report = md.explain(module.grad, mesh, "batch:data; d_ff:model", _tensor(B, D), _tensor(D, F))
    sources = {(r.op, r.collective.value): r.source for r in report.rows}
    assert sources == {
        ("sqrt", "all-reduce"): _line(path, "md.sqrt("),
        ("einsum (grad)", "all-reduce"): _line(path, 'md.einsum(x, w, out=["batch", "d_ff"])'),
    }, str(report)
    header = str(report).splitlines()[0].split()
    assert header[-1] == "source"
    sqrt_row = next(line for line in str(report).splitlines() if line.startswith("sqrt"))
    assert sqrt_row.endswith(_line(path, "md.sqrt("))


def test_stored_layers_gathered_by_a_scan_name_the_scan_s_line(tmp_path) -> None:
    """An FSDP parameter stack is gathered inside md.scan's step (traced again by the gradient's
    transformations): its gather names the line calling md.scan."""
    module, path = _module(tmp_path)
    mesh = md.Mesh({"data": 4})
    layout = md.Layout("batch:data", params="d_model:data")

    def loss_grad(x, ws):
        return jax.grad(lambda ws: module.layers(x, ws).array)(ws)

    report = md.explain(loss_grad, mesh, layout, _tensor(B, D), _tensor(L, D, F), in_layouts=[None, layout.params])
    stored = {r.collective.value: r.source for r in report.rows if "stored tensors" in r.tensor}
    scan = _line(path, "md.scan(")
    assert stored == {"all-gather": scan}, str(report)


def test_a_collective_of_meshdsl_s_own_names_meshdsl_s_line() -> None:
    """No user code asked for the train step's sum of the loss over the batch's devices: its all-reduce
    names meshdsl's line; the shipped model's rows name its file as installed (``meshdsl/models/``)."""
    from meshdsl.explain import report_of_jaxpr
    from meshdsl.model.loader import build_model
    from meshdsl.planner.trace import trace_step
    from meshdsl.train import optim

    traced = trace_step(build_model("mlp", "tiny"), optim.make("adamw"), {"data": 2}, md.Layout("batch:data"), None)
    report = report_of_jaxpr(traced.jaxpr, {"data": 2}, True)
    loss = [r for r in report.rows if r.op == "array"]
    assert loss and all(r.source.startswith("meshdsl/train/") for r in loss), str(report)
    shipped = [r for r in report.rows if r.op.startswith("einsum")]
    assert shipped and all(r.source.startswith("meshdsl/models/mlp.py:") for r in shipped), str(report)


def test_an_equation_without_a_traceback_names_nothing() -> None:
    assert user_line(None) == "" and user_line(jax.extend.source_info_util.new_source_info()) == ""


def test_a_sum_left_pending_until_the_result_names_the_line_that_left_it(tmp_path) -> None:
    """A sum over a split dim that nothing needs before the compiled function returns is added there,
    in meshdsl's code; its row names the user's ``md.reduce_sum`` (README's first program)."""
    module, path = _module(tmp_path)
    report = md.explain(
        module.rows, md.Mesh({"data": 4, "model": 2}), "batch:data; d_ff:model", _tensor(B, D), _tensor(D, F)
    )
    assert [(r.op, r.collective.value, r.source) for r in report.rows] == [
        (
            "result",
            "all-reduce",
            _line(path, 'return md.reduce_sum(md.relu(md.einsum(x, w, out=["d_ff", "batch"])), "d_ff")'),
        )
    ], str(report)
