"""The training loop behind ``meshdsl train``."""

from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path
from typing import Any, TextIO

import jax

import meshdsl as md
import models
from meshdsl.errors import ConfigError
from meshdsl.train import optim
from meshdsl.train.data import TokenFile
from meshdsl.train.step import Trainer


@dataclasses.dataclass
class RunConfig:
    """What ``meshdsl train`` runs; every field has a command-line flag."""

    model: str = "transformer"
    preset: str = "small"
    layout: str = "data_parallel"
    steps: int = 200
    optimizer: str = "adamw"
    learning_rate: float | None = None
    backend: str = "spmd"
    seed: int = 0
    data: str | None = None
    compute_dtype: str | None = None
    remat: bool = False
    grad_reduce_dtype: str | None = None


LAYOUTS = Path(__file__).resolve().parents[2] / "layouts"


def load_layout(spec: str) -> md.Layout:
    """A layout from a TOML path, a shipped layout's name (``dp_tp``: ``layouts/dp_tp.toml``), or inline rules."""
    if Path(spec).exists() or spec.endswith(".toml"):
        return md.Layout.load(spec)
    if (LAYOUTS / f"{spec}.toml").exists():
        return md.Layout.load(LAYOUTS / f"{spec}.toml")
    if ":" not in spec:
        shipped = ", ".join(sorted(p.stem for p in LAYOUTS.glob("*.toml")))
        raise md.LayoutError(f"layout {spec!r} is neither a file, a shipped layout ({shipped}) nor rules like 'batch:data'")
    return md.Layout(spec, mesh_axes={"data": -1})


def build_model(name: str, preset: str, **overrides: Any) -> Any:
    """The model ``name`` at ``preset``; overrides that are None are left at the preset's values."""
    module = models.get(name)
    fields = {f.name for f in dataclasses.fields(module.Config)}
    unknown = [k for k, v in overrides.items() if v is not None and k not in fields]
    if unknown:
        raise ConfigError(f"model {name} has no option {', '.join(unknown)}")
    return module.Model(module.Config.preset(preset, **{k: v for k, v in overrides.items() if v is not None}))


def build_trainer(run: RunConfig, mesh: md.Mesh | None = None) -> Trainer:
    model = build_model(run.model, run.preset, compute_dtype=run.compute_dtype, remat=run.remat or None)
    layout = load_layout(run.layout)
    kwargs = {} if run.learning_rate is None else {"learning_rate": run.learning_rate}
    optimizer = optim.make(run.optimizer, **kwargs)
    return Trainer(model, optimizer, mesh or layout.mesh(), layout, run.backend, run.grad_reduce_dtype)


class Progress:
    """One status line: step, a bar, loss, step time and examples (tokens) per second."""

    def __init__(self, total: int, unit: str, out: TextIO):
        self.total, self.unit, self.out = total, unit, out
        self.live = out.isatty()

    def update(self, step: int, loss: float, seconds: float, examples: int) -> None:
        done = int(20 * step / self.total)
        line = (
            f"step {step:>{len(str(self.total))}}/{self.total} [{'#' * done}{'.' * (20 - done)}] "
            f"loss {loss:.4f}  step {seconds * 1e3:7.1f} ms  {examples / seconds:,.0f} {self.unit}/s"
        )
        if self.live:
            self.out.write("\r" + line)
            if step == self.total:
                self.out.write("\n")
        elif step == 1 or step == self.total or step % max(1, self.total // 20) == 0:
            self.out.write(line + "\n")
        self.out.flush()


def train(run: RunConfig, out: TextIO = sys.stdout) -> list[float]:
    """Train as ``run`` says and return the loss of every step."""
    trainer = build_trainer(run)
    model, mesh, layout = trainer.model, trainer.mesh, trainer.layout
    key = jax.random.key(run.seed)
    state = trainer.init(jax.random.key_data(key))
    data_key = jax.random.key_data(jax.random.fold_in(key, 1))
    tokens = None
    if run.data is not None:
        c = model.config
        tokens = TokenFile(run.data, c.batch, c.length, c.vocab)
    out.write(f"meshdsl train: {run.model} {run.preset} on mesh {mesh} ({jax.devices()[0].platform}) under {layout}\n")
    unit = "tokens" if hasattr(model.config, "length") else "examples"
    progress = Progress(run.steps, unit, out)
    losses = []
    for step in range(run.steps):
        batch = data_key if tokens is None else tokens.batch_at(step, mesh, layout)
        start = time.perf_counter()
        state, loss = trainer.step(state, batch)
        losses.append(float(loss))
        progress.update(step + 1, losses[-1], time.perf_counter() - start, model.examples_per_step())
    return losses
