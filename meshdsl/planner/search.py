"""Layout search: enumerate meshes and layouts, drop the illegal and the too big, rank by predicted time.

The candidate splits are the model's own: :mod:`~meshdsl.planner.roles` says which of its dims
are batch, tensor-parallel and FSDP-able (declared by the model, or inferred from its shapes), so
a model with dims no shipped model has is planned alike. Candidates, for ``N`` devices: every
factorisation ``N = stage x data x model`` (axes of size 1 left out), and on it

* ``data``: the batch dims together, or beside an expert dim (a tensor-parallel dim that never
  meets the batch in one tensor: expert parallelism);
* ``model``: each Megatron group of tensor-parallel dims (dims no tensor holds two of) together,
  or each tensor-parallel dim alone; on a mesh of ``model`` alone also nothing, every device
  computing everything (on a small model no communication can beat any split);
* parameter rules: none, or FSDP: the parameter dim(s) found in the most parameter bytes (of a
  size ``data`` divides, not already on ``model``) stored split over ``data``;
* ``stage``: the stacked layers split into pipeline stages, for models that can be pipelined,
  with each Megatron group (or tensor-parallel dim) on ``model`` and as many microbatches as
  stages times two (or fewer, as the local batch allows), under each schedule: 1F1B, GPipe, and
  interleaved 1F1B with 2 virtual stages where the microbatches are a multiple of the stages and
  twice the stages divide the layers. The trace prices each schedule's bubble (every stage runs
  every tick of its timetable, ``md.pipeline.ticks``: the interleaved one has fewer, each a chunk)
  and its memory (GPipe's residuals of every tick, 1F1B's ring of ``md.pipeline.schedule.residual_slots``).
* ``context``: for a model whose ``attention`` layer names its ``length`` and ``memory`` dims, the
  sequence split over ``context`` (2 to 8 devices) beside the batch on ``data``, attention by
  ``ring`` or ``all_to_all`` (``[attention]``): what wins where one sequence's activations dominate
  memory. The trace prices each strategy's permutes or all-to-alls like any collective.

Pruning runs cheapest first: a rule whose axes do not divide its dim, then a state (parameters
plus optimizer state, exact from the shapes) over the memory limit, are dropped before anything
is traced; the rest are traced once each (:mod:`~meshdsl.planner.trace`, nothing compiled) and
priced (:mod:`~meshdsl.planner.cost`), and those whose predicted peak is over the limit dropped,
as are those the model cannot take (a ``ConfigError``, e.g. a pipeline it has no parts for). A
candidate whose trace raises any other error meets a bug in meshdsl: it is left out too, so one
layout does not end the search, and listed as a failure the command reports. When no candidate
is left to rank and some failed, the search ends with :class:`SearchFailed` (chained to the first
failure), never with "no layout is legal": a crash is not a verdict on the layouts. A program
meshdsl cannot read on the JAX at hand (:class:`~meshdsl.errors.UnsupportedJaxError`) ends the
search at once: it would fail every candidate alike.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import itertools
import math
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, TextIO, cast

import meshdsl as md
from meshdsl.errors import ConfigError, UnsupportedJaxError
from meshdsl.measure.fits import remats
from meshdsl.model.protocol import Model, Pipelined
from meshdsl.planner import memory as memory_model
from meshdsl.planner.cost import Prediction, price
from meshdsl.planner.profile import DeviceProfile
from meshdsl.planner.roles import DimRoles, roles
from meshdsl.planner.trace import Batch, abstract_batch, step_results, trace_step
from meshdsl.planner.workers import Pool
from meshdsl.runtime.waiting import Waiting, is_terminal
from meshdsl.train.step import Trainer

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
        pipe = f" | {self.layout.pipeline.microbatches} microbatches" if "stage" in self.axis_sizes else ""
        schedule = self.layout.pipeline.schedule
        if pipe and schedule != "1f1b":
            v = self.layout.pipeline.virtual_stages
            pipe += f", {schedule}" + (f" v={v}" if v > 1 else "")
        attention = "".join(f" | attention {a}={s}" for a, s in self.layout.attention.items())
        return f"[{mesh}] {str(self.layout) or 'replicated'}{params}{pipe}{attention}"

    def toml(self, description: str, assumed: Mapping[str, Any] | None = None) -> str:
        """This candidate as a layout file ``md.Layout.load`` and ``meshdsl train --layout`` read; ``assumed``:
        the model settings the plan assumed (``remat``, ``compute_dtype``), as a ``[train]`` table train applies."""

        def table(name: str, rules: Mapping[str, tuple[str, ...]]) -> list[str]:
            body = [
                f'{d} = "{a[0]}"' if len(a) == 1 else f"{d} = {list(a)!r}".replace("'", '"') for d, a in rules.items()
            ]
            return ["", f"[{name}]", *body]

        lines = [
            f"description = {description!r}".replace("'", '"'),
            "",
            "[mesh]",
            *(f"{a} = {n}" for a, n in self.axis_sizes.items()),
        ]
        lines += table("rules", self.layout.rules)
        if self.layout.params is not None:
            lines += table("params", self.layout.params.rules)
        if "stage" in self.axis_sizes:
            p = self.layout.pipeline
            lines += ["", "[pipeline]", f"microbatches = {p.microbatches}", f'schedule = "{p.schedule}"']
            if p.virtual_stages > 1:
                lines.append(f"virtual_stages = {p.virtual_stages}")
        if self.layout.attention:
            lines += ["", "[attention]", *(f'{a} = "{s}"' for a, s in self.layout.attention.items())]
        if assumed:
            values = {k: ("true" if v else "false") if isinstance(v, bool) else f'"{v}"' for k, v in assumed.items()}
            lines += ["", "[train]", *(f"{k} = {v}" for k, v in values.items())]
        return "\n".join(lines) + "\n"


@dataclasses.dataclass(frozen=True)
class Dropped:
    """A candidate left out, why, and (for memory) how many bytes per device it needs."""

    candidate: Candidate
    reason: str
    memory_bytes: float | None = None
    failed: bool = False
    """Tracing it raised an error other than meshdsl's own: a bug, not an illegal layout."""
    error: BaseException | None = dataclasses.field(default=None, compare=False, repr=False)
    """The exception of a failed candidate (kept to chain it to :class:`SearchFailed`)."""


class SearchFailed(RuntimeError):
    """No candidate could be ranked because meshdsl failed to trace some: a bug in meshdsl to report,
    not a verdict on the layouts (the first failure is its ``__cause__``)."""


@dataclasses.dataclass
class SearchResult:
    """Ranked predictions (fastest first) and the dropped candidates."""

    ranked: list[tuple[Candidate, Prediction]]
    dropped: list[Dropped]
    traced: int
    in_workers: int = 0
    """How many of the traced candidates worker processes priced (:mod:`~meshdsl.planner.workers`)."""

    @property
    def best(self) -> tuple[Candidate, Prediction]:
        return self.ranked[0]

    @property
    def failures(self) -> list[Dropped]:
        """The candidates meshdsl failed to trace (a bug to report, not an illegal layout)."""
        return [d for d in self.dropped if d.failed]

    def dropped_by_reason(self) -> dict[str, int]:
        """How many candidates were dropped for each kind of reason: ``over memory`` (stored state or
        predicted peak over the limit), ``illegal`` (the model cannot take the layout: indivisible
        dims, a pipeline without parts, ...), ``failed to trace`` (a bug); kinds with none left out."""
        counts = {"over memory": 0, "illegal": 0, "failed to trace": 0}
        for d in self.dropped:
            counts["failed to trace" if d.failed else "over memory" if d.memory_bytes is not None else "illegal"] += 1
        return {k: n for k, n in counts.items() if n}


def model_roles(model: Model, state: Any, batch: Any) -> DimRoles:
    """The roles of ``model``'s dims (:func:`meshdsl.planner.roles.roles`) from its abstract state and batch."""
    return roles(model, state["params"], batch)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _meshes(devices: int, stages: list[int]) -> Iterator[dict[str, int]]:
    for s in [1, *stages]:
        if devices % s:
            continue
        for m in _divisors(devices // s):
            sizes = {"stage": s, "data": devices // (s * m), "model": m}
            yield {a: n for a, n in sizes.items() if n > 1} or {"data": 1}


def _microbatches(local_batch: int, stages: int) -> int:
    return max(m for m in range(1, 2 * stages + 1) if local_batch % m == 0)


def _pipelines(layers: int, local_batch: int, stages: int) -> list[dict[str, Any]]:
    """The ``[pipeline]`` tables tried on ``stages`` stages: 1F1B and GPipe over :func:`_microbatches`, and
    interleaved with 2 virtual stages where those microbatches are a multiple of the stages and ``2 stages``
    divide the ``layers``."""
    m = _microbatches(local_batch, stages)
    out: list[dict[str, Any]] = [{"microbatches": m, "schedule": s} for s in ("1f1b", "gpipe")]
    if m % stages == 0 and layers % (2 * stages) == 0:
        out.append({"microbatches": m, "schedule": "interleaved", "virtual_stages": 2})
    return out


def _data_choices(r: DimRoles) -> list[tuple[str, ...]]:
    """The batch dims together, and each expert dim beside those batch dims it never meets."""
    return [r.batch] + [tuple(b for b in r.batch if not r.meet(b, e)) + (e,) for e in r.expert]


def candidates(model: Model, r: DimRoles, devices: int, pipeline: bool = True) -> list[Candidate]:
    """Every candidate mesh x layout for ``model``, whose dims have the roles ``r``, on ``devices`` devices."""
    groups = [*r.groups, *((d,) for d in r.tensor)]
    stages = [s for s in _divisors(r.sizes[r.stage])[1:] if s <= 8] if pipeline and r.stage is not None else []
    out = []
    for sizes in _meshes(devices, stages):
        data_rules = _data_choices(r) if sizes.get("data", 1) > 1 else [()]
        model_rules = [*groups, *([()] if "data" not in sizes else [])] if "model" in sizes else [()]
        if "stage" in sizes and "model" in sizes:
            model_rules = list(r.groups) or groups
        for on_data, on_model in itertools.product(data_rules, model_rules):
            if set(on_data) & set(on_model):
                continue
            rules = {d: "data" for d in on_data} | {d: "model" for d in on_model}
            param_choices: list[dict[str, str] | None] = [None]
            pipes: list[dict[str, Any] | None] = [None]
            if "stage" in sizes and r.stage is not None:  # a stage mesh only for a model with a stage dim
                rules[r.stage] = "stage"
                local_batch = cast(Pipelined, model).batch_dim.size // sizes.get("data", 1)
                pipes = list(_pipelines(r.sizes[r.stage], local_batch, sizes["stage"]))
            elif sizes.get("data", 1) > 1:
                param_choices += [
                    {d: "model" for d in on_model} | {f: "data"} for f in r.best_fsdp(on_model, sizes["data"])
                ]
            for params, pipe in itertools.product(param_choices, pipes):
                out.append(Candidate(dict(sizes), md.Layout(rules, params=params, mesh_axes=sizes, pipeline=pipe)))
    return out + _context_candidates(model, r, devices)


def sequence_dims(model: Model, r: DimRoles) -> tuple[str, str] | None:
    """The query ``length`` and key ``memory`` dims of the model's self-attention (its ``attention``
    layer's, an ``md.nn.MultiHeadAttention``), when the model has both; else None."""
    attention = getattr(model, "attention", None)
    length, memory = getattr(attention, "length", None), getattr(attention, "memory", None)
    if isinstance(length, str) and isinstance(memory, str) and length in r.sizes and memory in r.sizes:
        return length, memory
    return None


def _context_candidates(model: Model, r: DimRoles, devices: int) -> list[Candidate]:
    """The sequence split over ``context`` (every divisor of the devices from 2 to 8), the batch dims over
    ``data`` on the rest, attention by each of ``ring`` and ``all_to_all`` (one that the head counts do
    not allow drops out as illegal when traced)."""
    seq = sequence_dims(model, r)
    if seq is None:
        return []
    out = []
    for c in [d for d in _divisors(devices)[1:] if d <= 8]:
        sizes = {"data": devices // c, "context": c} if devices > c else {"context": c}
        rules = {d: "data" for d in r.batch} if "data" in sizes else {}
        rules |= {d: "context" for d in seq}
        for strategy in ("ring", "all_to_all"):
            layout = md.Layout(rules, mesh_axes=sizes, attention={"context": strategy})
            out.append(Candidate(dict(sizes), layout))
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


def abstract_state(model: Model, optimizer: Any) -> Any:
    """Global shapes of the training state (layout-independent)."""
    return Trainer(model, optimizer, md.Mesh.abstract({"data": 1}), md.Layout()).abstract_state()


def legal_candidates(model: Model, optimizer: Any, devices: int, pipeline: bool = True) -> list[Candidate]:
    """Every candidate of ``model`` on ``devices`` devices whose rules divide their dims (what search traces)."""
    r = model_roles(model, abstract_state(model, optimizer), abstract_batch(model).shapes)
    return [c for c in candidates(model, r, devices, pipeline) if indivisible(c, r.sizes) is None]


@contextlib.contextmanager
def _collected_once() -> Iterator[None]:
    """Python's automatic garbage collection off inside, and the young generations (what was made inside: a
    candidate's traces and jaxprs) collected once on the way out.

    Tracing a step makes millions of objects, so the automatic collector ran full collections over the whole
    heap (JAX's modules and caches) again and again: a quarter of the 8B search's CPU time. One young
    collection per candidate frees the same garbage in one pass over that candidate's objects (nothing it
    computes changes).
    """
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.collect(1)
        if was:
            gc.enable()


@dataclasses.dataclass(frozen=True)
class Pricing:
    """What pricing any candidate of one search needs beside the candidate, the same for all of them
    (built once per process: :func:`pricing`)."""

    model: Model
    optimizer: Any
    profile: DeviceProfile
    state: Any
    batch: Batch
    results: Any


def pricing(model: Model, optimizer: Any, profile: DeviceProfile) -> Pricing:
    """The training state's and the batch's global shapes, and the step's results, traced once (none depends on
    the layout)."""
    state, batch = abstract_state(model, optimizer), abstract_batch(model)
    return Pricing(model, optimizer, profile, state, batch, step_results(model, optimizer, batch))


def loaded(spec: str, preset: str, overrides: Mapping[str, Any], optimizer: str) -> tuple[Model, Any]:
    """The model and optimizer as the loader builds them: with :func:`functools.partial`, a search's picklable
    ``rebuild`` (a worker process builds its own; a model loaded from a user's file cannot be pickled)."""
    from meshdsl.model.loader import build_model
    from meshdsl.train import optim

    return build_model(spec, preset, **overrides), optim.make(optimizer)


def _rebuilt(
    rebuild: Callable[[], tuple[Model, Any]], profile: DeviceProfile, state: Any, batch: Batch, results: Any
) -> Pricing:
    """In a worker: the search's :class:`Pricing`, its model and optimizer rebuilt, the shapes as the search sent
    them (tracing them again would cost each worker a second)."""
    return Pricing(*rebuild(), profile, state, batch, results)


def _priced(p: Pricing, cand: Candidate) -> Prediction | Dropped:
    """``cand`` traced and priced, or dropped: illegal for the model (a layout, shape or config error), or failed (any
    other error, a bug in meshdsl); an :class:`UnsupportedJaxError` ends the search."""
    try:
        with _collected_once():
            traced = trace_step(
                p.model,
                p.optimizer,
                cand.axis_sizes,
                cand.layout,
                batch=p.batch,
                platform=p.profile.platform,
                results=p.results,
                state=p.state,
            )
            return price(traced, p.model, p.profile)
    except UnsupportedJaxError:
        raise
    except (md.LayoutError, md.ShapeError, md.ConfigError) as e:
        return Dropped(cand, str(e))
    except Exception as e:  # a bug met by one layout of many: left out, and reported (SearchResult.failures)
        reason = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}"
        return Dropped(cand, reason, failed=True, error=e)


def _stored_drop(cand: Candidate, state: Any, dims: Mapping[str, int], limit: float) -> Dropped | None:
    """Why ``cand`` is dropped before tracing (a rule that does not divide its dim, a parameter rule the layout
    cannot take, the stored state over ``limit``), or None."""
    why = indivisible(cand, dims)
    if why is not None:
        return Dropped(cand, why)
    try:
        stored = memory_model.local_bytes(
            {"params": state["params"], "opt": state["opt"]},
            cand.layout.param_layout,
            md.Mesh.abstract(cand.axis_sizes),
        )
    except md.LayoutError as e:
        return Dropped(cand, str(e))
    if stored > limit:
        return Dropped(cand, "parameters and optimizer state exceed the memory limit", stored)
    return None


def search(
    model: Model,
    optimizer: Any,
    devices: int,
    profile: DeviceProfile,
    memory_limit: float | None = None,
    pipeline: bool = True,
    progress: Callable[[str], None] | None = None,
    name: str = "the model",
    status: TextIO | None = None,
    rebuild: Callable[[], tuple[Model, Any]] | None = None,
    workers: int = 1,
) -> SearchResult:
    """Rank every legal candidate of ``model`` on ``devices`` devices that fits ``memory_limit`` bytes.

    ``status``: where to print progress lines (candidates considered, elapsed, ETA: at most one every 2 s;
    :class:`~meshdsl.runtime.waiting.Waiting`); None prints none. ``workers``: processes that may price
    candidates (this one included; :mod:`~meshdsl.planner.workers`), given ``rebuild``, a picklable function
    building ``model`` and ``optimizer`` again (:func:`loaded` with :func:`functools.partial`); the result is
    the same with any number.

    ConfigError when none fits, naming the closest candidate and by how much it is over (``name``:
    the model's name in that message).
    """
    limit = memory_limit if memory_limit is not None else profile.memory_bytes
    if status is not None and is_terminal(status):
        print(
            f"meshdsl search: tracing {name}'s state, batch and step to find its dims' roles ...",
            file=status,
            flush=True,
        )
    began = time.monotonic()
    shared = pricing(model, optimizer, profile)
    # About a candidate's time: pricing traced the step once on global arrays, as a candidate does on local ones.
    guess_s = time.monotonic() - began
    r = model_roles(model, shared.state, shared.batch.shapes)
    every = candidates(model, r, devices, pipeline)
    outcomes: list[Prediction | Dropped | None] = [_stored_drop(c, shared.state, r.sizes, limit) for c in every]
    to_trace = [i for i, o in enumerate(outcomes) if o is None]
    waiting = Waiting("meshdsl search", "candidates traced and priced", len(every), out=status) if status else None
    if waiting is not None:
        waiting.done = len(every) - len(to_trace)  # dropped before tracing
        waiting.show(f"next: {every[to_trace[0]].name}" if to_trace else "")

    def done(k: int, outcome: Prediction | Dropped) -> None:
        cand = every[order[k]]
        if progress is not None and isinstance(outcome, Prediction):
            progress(f"  {cand.name}: {outcome.step_s * 1e3:.2f} ms, {outcome.memory.total / GiB:.2f} GiB")
        if waiting is not None:
            waiting.advance()

    shapes = (profile, shared.state, shared.batch, shared.results)
    setup = None if rebuild is None else functools.partial(_rebuilt, rebuild, *shapes)
    pool: Pool[Candidate, Prediction | Dropped] = Pool(_priced, shared, setup, workers)
    # One quick candidate first (where the guess started no workers, its time decides whether they pay), then the
    # pipelined ones: they take several times as long, and one left for the end would keep a process busy while the
    # others idle.
    order = sorted(to_trace, key=lambda i: "stage" not in every[i].axis_sizes)
    quick = [i for i in order if "stage" not in every[i].axis_sizes][:1]
    order = quick + [i for i in order if i not in quick]
    for i, outcome in zip(order, pool.run([every[i] for i in order], done, guess_s), strict=True):
        outcomes[i] = outcome
    if waiting is not None and not to_trace:
        waiting.show(force=True)
    ranked: list[tuple[Candidate, Prediction]] = []
    dropped: list[Dropped] = []
    for cand, found in zip(every, outcomes, strict=True):
        if isinstance(found, Dropped):
            dropped.append(found)
        elif found is not None and found.memory.total > limit:
            dropped.append(Dropped(cand, "predicted peak memory exceeds the memory limit", found.memory.total))
        elif found is not None:
            ranked.append((cand, found))
    failures = [d for d in dropped if d.failed]
    if not ranked and failures:
        first = failures[0]
        raise SearchFailed(
            f"meshdsl failed to trace {len(failures)} of {len(to_trace)} traced candidates of {name} "
            f"(a bug in meshdsl to report, not an illegal layout), e.g. {first.candidate.name}: {first.reason}"
        ) from first.error
    if not ranked:
        raise ConfigError(_no_fit(name, devices, limit, dropped, remats(model)))
    ranked.sort(key=lambda item: item[1].step_s)
    return SearchResult(ranked, dropped, len(to_trace), pool.in_workers)


def memory_caveat(candidate: Candidate, remat: bool = False) -> str | None:
    """Why ``candidate``'s predicted memory is not to be trusted as it is, or None; ``remat``: the model
    recomputes its layers' activations in the backward pass.

    The memory walk is checked against XLA's compiled steps (docs/performance.md): within 10% for every layout
    of the tiny and small presets without remat, for every layout of the small preset with remat, and for the
    1B layouts search ranks. With remat a pipelined layout may read up to 20% low: four stages of one layer at
    the tiny preset split over ``model`` (1F1B -20%, GPipe -11%; not yet explained: XLA's buffers there include
    a dozen ``cond`` results of 8 KiB each, as big as an activation at that preset). A plan that says such a
    layout fits must say so too, not leave it to the out-of-memory error."""
    if remat and "stage" in candidate.axis_sizes:
        check = "compile it (python -m meshdsl.planner.validate --only ...) before trusting that it fits"
        return f"with remat, the memory of a pipelined layout is predicted up to 20% low (docs/performance.md): {check}"
    return None


def _no_fit(name: str, devices: int, limit: float, dropped: list[Dropped], remat: bool = False) -> str:
    over = [(d.memory_bytes, d) for d in dropped if d.memory_bytes is not None]
    if not over:
        reasons = "; ".join(sorted({d.reason for d in dropped})[:3])
        return f"no layout of {name} is legal on {devices} devices ({len(dropped)} candidates, e.g. {reasons})"
    need, best = min(over, key=lambda item: item[0])
    return (
        f"no layout of {name} fits {limit / GiB:.2f} GiB per device on {devices} devices; the closest, "
        f"{best.candidate.name}, "
        f"needs {need / GiB:.2f} GiB, {(need - limit) / GiB:.2f} GiB ({need / limit - 1:.0%}) over; to fit: "
        + ("" if remat else "recompute activations (--set remat=true where the model has it), ")
        + "a smaller batch (--set batch=N) or more devices"
    )


def assumed(model: Model) -> dict[str, Any]:
    """The model settings a plan depends on and train can set from a layout's ``[train]`` table: ``remat`` and
    ``compute_dtype``, those the model's config has (a model without the field is never given it)."""
    config = getattr(model, "config", None)
    return {k: getattr(config, k) for k in ("remat", "compute_dtype") if hasattr(config, k)}


def write_layout(
    candidate: Candidate, prediction: Prediction, path: str | Path, profile: DeviceProfile, model: Model | None = None
) -> None:
    """Write ``candidate`` as a layout TOML file, its prediction in the description, and what the plan assumed of
    ``model`` (:func:`assumed`) as its ``[train]`` table, so train and bench run the program search priced."""
    description = (
        f"Chosen by meshdsl search for {profile.name}: predicted {prediction.step_s * 1e3:.3f} ms per step, "
        f"{prediction.memory.total / GiB:.3f} GiB and {prediction.total_bytes / GiB:.3f} GiB moved per device."
    )
    Path(path).write_text(candidate.toml(description, None if model is None else assumed(model)))
