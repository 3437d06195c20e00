"""Layout search: enumerate meshes and layouts, drop the illegal and the too big, rank by predicted time.

Candidates, for ``N`` devices: every factorisation ``N = stage x data x model`` (axes of size 1
left out), and on it

* ``data``: the batch dims (``batch``, ``groups``), or for a mixture of experts ``batch`` and
  ``experts`` (expert parallel);
* ``model``: the model's tensor-parallel dims (``heads``, ``d_ff``, ``vocab``, ``experts``: those
  the model has) all together, as Megatron splits them, or each one alone;
* parameter rules: none, or FSDP (``d_model``/``d_io`` stored split over ``data``);
* ``stage``: ``layers`` split into pipeline stages (1F1B), for models that can be pipelined, with
  the tensor-parallel dims all on ``model`` and as many microbatches as stages times two (or
  fewer, as the local batch allows).

Pruning runs cheapest first: a rule whose axes do not divide its dim, then a state (parameters
plus optimizer state, exact from the shapes) over the memory limit, are dropped before anything
is traced; the rest are traced once each (:mod:`~meshdsl.planner.trace`, nothing compiled) and
priced (:mod:`~meshdsl.planner.cost`), and those whose predicted peak is over the limit dropped.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

import jax

import meshdsl as md
from meshdsl.errors import ConfigError
from meshdsl.planner import memory as memory_model
from meshdsl.planner.cost import Prediction, price
from meshdsl.planner.profile import DeviceProfile
from meshdsl.planner.trace import abstract_batch, trace_step
from meshdsl.train.step import Trainer

BATCH_DIMS = ("batch", "groups")
TENSOR_PARALLEL_DIMS = ("heads", "d_ff", "vocab", "experts")
FSDP_DIMS = ("d_model", "d_io")
GiB = 2.0**30


@dataclasses.dataclass(frozen=True)
class Candidate:
    """A mesh (``axis_sizes``) and a layout for it."""

    axis_sizes: Mapping[str, int]
    layout: md.Layout

    @property
    def name(self) -> str:
        mesh = " ".join(f"{a}={n}" for a, n in self.axis_sizes.items())
        params = f" | params {self.layout.params}" if self.layout.params is not None else ""
        pipe = f" | {self.layout.pipeline.microbatches} microbatches" if "layers" in self.layout.rules else ""
        return f"[{mesh}] {self.layout}{params}{pipe}"

    def toml(self, description: str) -> str:
        """This candidate as a layout file ``md.Layout.load`` and ``meshdsl train --layout`` read."""
        def table(name: str, rules: Mapping[str, tuple[str, ...]]) -> list[str]:
            body = [f'{d} = "{a[0]}"' if len(a) == 1 else f"{d} = {list(a)!r}".replace("'", '"') for d, a in rules.items()]
            return ["", f"[{name}]", *body]

        lines = [f"description = {description!r}".replace("'", '"'), "", "[mesh]", *(f"{a} = {n}" for a, n in self.axis_sizes.items())]
        lines += table("rules", self.layout.rules)
        if self.layout.params is not None:
            lines += table("params", self.layout.params.rules)
        if "layers" in self.layout.rules:
            p = self.layout.pipeline
            lines += ["", "[pipeline]", f"microbatches = {p.microbatches}", f'schedule = "{p.schedule}"']
        return "\n".join(lines) + "\n"


@dataclasses.dataclass(frozen=True)
class Dropped:
    """A candidate left out, why, and (for memory) how many bytes per device it needs."""

    candidate: Candidate
    reason: str
    memory_bytes: float | None = None


@dataclasses.dataclass
class SearchResult:
    """Ranked predictions (fastest first) and the dropped candidates."""

    ranked: list[tuple[Candidate, Prediction]]
    dropped: list[Dropped]
    traced: int

    @property
    def best(self) -> tuple[Candidate, Prediction]:
        return self.ranked[0]


def model_dims(model: Any, state: Any, batch: Any) -> dict[str, int]:
    """Every named dim of ``model``'s parameters and batch (name -> size)."""
    dims: dict[str, int] = {}
    for leaf in jax.tree_util.tree_leaves((state["params"], batch), is_leaf=lambda x: isinstance(x, md.Tensor)):
        if isinstance(leaf, md.Tensor):
            dims.update({d.name: d.size for d in leaf.shape})
    for value in vars(model).values():
        if isinstance(value, md.Dim):
            dims[value.name] = value.size
    return dims


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _meshes(devices: int, stages: list[int]) -> Iterator[dict[str, int]]:
    for s in [1, *stages]:
        if devices % s:
            continue
        for m in _divisors(devices // s):
            sizes = {"stage": s, "data": devices // (s * m), "model": m}
            yield {a: n for a, n in sizes.items() if n > 1} or {"data": 1}


def _model_axis_choices(tp: list[str]) -> list[tuple[str, ...]]:
    """All tensor-parallel dims together (Megatron), or each one alone."""
    return [tuple(tp)] + ([(d,) for d in tp] if len(tp) > 1 else [])


def _microbatches(local_batch: int, stages: int) -> int:
    return max(m for m in range(1, 2 * stages + 1) if local_batch % m == 0)


def candidates(model: Any, dims: Mapping[str, int], devices: int, pipeline: bool = True) -> list[Candidate]:
    """Every candidate mesh x layout for ``model`` (named ``dims``) on ``devices`` devices."""
    tp = [d for d in TENSOR_PARALLEL_DIMS if d in dims]
    batch_dims = [d for d in BATCH_DIMS if d in dims]
    data_choices = [tuple(batch_dims)] + ([("batch", "experts")] if "experts" in dims and "batch" in dims else [])
    fsdp = {d: "data" for d in FSDP_DIMS if d in dims}
    stages = [s for s in _divisors(dims.get("layers", 1))[1:] if s <= 8] if pipeline and getattr(model, "pipelined", False) else []
    out = []
    for sizes in _meshes(devices, stages):
        data_rules = data_choices if sizes.get("data", 1) > 1 else [()]
        model_rules = _model_axis_choices(tp) if "model" in sizes else [()]
        if "stage" in sizes:
            model_rules = [tuple(tp)] if "model" in sizes else [()]
        for on_data, on_model in itertools.product(data_rules, model_rules):
            if set(on_data) & set(on_model):
                continue
            rules = {d: "data" for d in on_data} | {d: "model" for d in on_model}
            param_choices = [None]
            pipe = None
            if "stage" in sizes:
                rules["layers"] = "stage"
                pipe = {"microbatches": _microbatches(dims["batch"] // sizes.get("data", 1), sizes["stage"]), "schedule": "1f1b"}
            elif "data" in sizes and sizes["data"] > 1 and fsdp:
                param_choices.append({d: "model" for d in on_model} | fsdp)
            for params in param_choices:
                out.append(Candidate(dict(sizes), md.Layout(rules, params=params, mesh_axes=sizes, pipeline=pipe)))
    return out


def indivisible(candidate: Candidate, dims: Mapping[str, int]) -> str | None:
    """Why a rule of ``candidate`` cannot split its dim evenly, or None."""
    layouts = [candidate.layout] + ([candidate.layout.params] if candidate.layout.params is not None else [])
    for lay in layouts:
        for dim, axes in lay.rules.items():
            n = math.prod(candidate.axis_sizes.get(a, 1) for a in axes)
            if dim in dims and dims[dim] % n:
                return f"{dim} (size {dims[dim]}) is not divisible by {'x'.join(axes)} ({n})"
    return None


def abstract_state(model: Any, optimizer: Any) -> Any:
    """Global shapes of the training state (layout-independent)."""
    return Trainer(model, optimizer, md.Mesh.abstract({"data": 1}), md.Layout()).abstract_state()


def legal_candidates(model: Any, optimizer: Any, devices: int, pipeline: bool = True) -> list[Candidate]:
    """Every candidate of ``model`` on ``devices`` devices whose rules divide their dims (what search traces)."""
    dims = model_dims(model, abstract_state(model, optimizer), abstract_batch(model).shapes)
    return [c for c in candidates(model, dims, devices, pipeline) if indivisible(c, dims) is None]


def search(
    model: Any,
    optimizer: Any,
    devices: int,
    profile: DeviceProfile,
    memory_limit: float | None = None,
    pipeline: bool = True,
    progress: Callable[[str], None] | None = None,
) -> SearchResult:
    """Rank every legal candidate of ``model`` on ``devices`` devices that fits ``memory_limit`` bytes.

    ConfigError when none fits, naming the closest candidate and by how much it is over.
    """
    limit = memory_limit if memory_limit is not None else profile.memory_bytes
    state, batch = abstract_state(model, optimizer), abstract_batch(model)
    dims = model_dims(model, state, batch.shapes)
    ranked: list[tuple[Candidate, Prediction]] = []
    dropped: list[Dropped] = []
    traced = 0
    for cand in candidates(model, dims, devices, pipeline):
        why = indivisible(cand, dims)
        if why is not None:
            dropped.append(Dropped(cand, why))
            continue
        mesh = md.Mesh.abstract(cand.axis_sizes)
        try:
            stored = memory_model.local_bytes({"params": state["params"], "opt": state["opt"]}, cand.layout.param_layout, mesh)
        except md.LayoutError as e:
            dropped.append(Dropped(cand, str(e)))
            continue
        if stored > limit:
            dropped.append(Dropped(cand, "parameters and optimizer state exceed the memory limit", stored))
            continue
        try:
            traced += 1
            prediction = price(trace_step(model, optimizer, cand.axis_sizes, cand.layout, batch=batch), model, profile)
        except (md.LayoutError, md.ShapeError) as e:
            dropped.append(Dropped(cand, str(e)))
            continue
        if progress is not None:
            progress(f"  {cand.name}: {prediction.step_s * 1e3:.2f} ms, {prediction.memory.total / GiB:.2f} GiB")
        if prediction.memory.total > limit:
            dropped.append(Dropped(cand, "predicted peak memory exceeds the memory limit", prediction.memory.total))
            continue
        ranked.append((cand, prediction))
    if not ranked:
        raise ConfigError(_no_fit(model, devices, limit, dropped))
    ranked.sort(key=lambda item: item[1].step_s)
    return SearchResult(ranked, dropped, traced)


def _no_fit(model: Any, devices: int, limit: float, dropped: list[Dropped]) -> str:
    name = type(model).__module__.split(".")[-1]
    over = [d for d in dropped if d.memory_bytes is not None]
    if not over:
        reasons = "; ".join(sorted({d.reason for d in dropped})[:3])
        return f"no layout of {name} is legal on {devices} devices ({len(dropped)} candidates, e.g. {reasons})"
    best = min(over, key=lambda d: d.memory_bytes)
    need = best.memory_bytes
    return (
        f"no layout of {name} fits {limit / GiB:.2f} GiB per device on {devices} devices; the closest, {best.candidate.name}, "
        f"needs {need / GiB:.2f} GiB, {(need - limit) / GiB:.2f} GiB ({need / limit - 1:.0%}) over"
    )


def write_layout(candidate: Candidate, prediction: Prediction, path: str | Path, profile: DeviceProfile) -> None:
    """Write ``candidate`` as a layout TOML file, its prediction in the description."""
    description = (
        f"Chosen by meshdsl search for {profile.name}: predicted {prediction.step_s * 1e3:.3f} ms per step, "
        f"{prediction.memory.total / GiB:.3f} GiB and {prediction.total_bytes / GiB:.3f} GiB moved per device."
    )
    Path(path).write_text(candidate.toml(description))
