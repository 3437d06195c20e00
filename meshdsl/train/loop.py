"""The training loop behind ``meshdsl train``."""

from __future__ import annotations

import dataclasses
import io
import json
import math
import sys
import time
from pathlib import Path
from typing import Any, TextIO

import jax

import meshdsl as md
from meshdsl import distributed, models, outputs
from meshdsl.errors import ConfigError
from meshdsl.model_loader import build_model, load_module
from meshdsl.train import optim
from meshdsl.train.data import TokenFile
from meshdsl.train.rules import LAYOUTS, is_shipped, unused_rules
from meshdsl.train.step import Trainer, pipelined


@dataclasses.dataclass
class RunConfig:
    """What ``meshdsl train`` runs; every field has a command-line flag."""

    model: str = "transformer"
    """A shipped model's name, a Python file or an importable module (:mod:`meshdsl.model_loader`)."""
    preset: str = "small"
    overrides: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Config fields set by ``--set FIELD=VALUE``."""
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
    log_json: str | None = None
    checkpoint_dir: str | None = None
    save_every: int = 0
    keep: int = 3
    resume: bool = False
    microbatches: int | None = None
    schedule: str | None = None
    virtual_stages: int | None = None


def layout_path(spec: str) -> Path | None:
    """The TOML file a layout spec names (a path, or a shipped layout's name), or None for inline rules."""
    if not spec.strip():
        raise md.LayoutError(f"layout {spec!r} is empty: give a layout TOML file, a shipped layout ({_shipped()}) or rules like 'batch:data'")
    if Path(spec).exists() or spec.endswith(".toml"):
        return Path(spec)
    if (LAYOUTS / f"{spec}.toml").exists():
        return LAYOUTS / f"{spec}.toml"
    if ":" not in spec:
        raise md.LayoutError(f"layout {spec!r} is neither a file, a shipped layout ({_shipped()}) nor rules like 'batch:data'")
    return None


def _shipped() -> str:
    return ", ".join(sorted(p.stem for p in LAYOUTS.glob("*.toml")))


def load_layout(spec: str) -> md.Layout:
    """A layout from a TOML path, a shipped layout's name (``dp_tp``: ``layouts/dp_tp.toml``), or inline rules."""
    path = layout_path(spec)
    return md.Layout(spec, mesh_axes={"data": -1}) if path is None else md.Layout.load(path)


def _model(run: RunConfig) -> Any:
    flags = {"compute_dtype": run.compute_dtype, "remat": run.remat or None}
    return build_model(run.model, run.preset, **run.overrides, **{k: v for k, v in flags.items() if v is not None})


def _optimizer(run: RunConfig) -> optim.Optimizer:
    kwargs = {} if run.learning_rate is None else {"learning_rate": run.learning_rate}
    return optim.make(run.optimizer, **kwargs)


def build_trainer(run: RunConfig, mesh: md.Mesh | None = None) -> Trainer:
    layout = load_layout(run.layout)
    pipeline = layout.pipeline.replace(run.microbatches, run.schedule, run.virtual_stages)
    return Trainer(_model(run), _optimizer(run), mesh or layout.mesh(), layout, run.backend, run.grad_reduce_dtype, pipeline=pipeline)


def token_file(path: str, model: Any, name: str) -> TokenFile:
    """The token file ``path`` for ``model``; ConfigError for a model that reads no token sequences."""
    if not all(hasattr(model.config, f) for f in ("batch", "length", "vocab")):
        readers = [n for n in models.NAMES if {"length", "vocab"} <= {f.name for f in dataclasses.fields(load_module(n).Config)}]
        raise ConfigError(f"--data {path!r}: model {name} reads no token sequences (its config has no length and vocab); --data is for {', '.join(readers)}")
    c = model.config
    return TokenFile(path, c.batch, c.length, c.vocab)


def check(run: RunConfig) -> None:
    """Raise the md error for each mistake in ``run`` that shows before any device is used.

    Checked: the step count and learning rate, model, preset, optimizer, layout (file and
    pipeline), the token file, and that the checkpoint dir and ``log_json`` can be written.
    Nothing is compiled, created or changed, so a mistake costs no work and loses no file.
    """
    if run.steps < 1:
        raise ConfigError(f"--steps {run.steps}: train at least 1 step")
    lr = run.learning_rate
    if lr is not None and not (math.isfinite(lr) and lr > 0):
        raise ConfigError(f"--learning-rate {lr}: the learning rate must be a positive, finite number")
    if (run.resume or run.save_every) and run.checkpoint_dir is None:
        raise ConfigError("--resume and --save-every need --checkpoint-dir")
    model = _model(run)
    _optimizer(run)
    layout = load_layout(run.layout)
    pipelined(model, layout, layout.pipeline.replace(run.microbatches, run.schedule, run.virtual_stages), run.backend)
    if run.data is not None:
        token_file(run.data, model, run.model)
    if run.checkpoint_dir is not None:
        md.checkpoint.CheckpointManager(run.checkpoint_dir, run.save_every, run.keep)
        outputs.check_dir(run.checkpoint_dir, "--checkpoint-dir")
    if run.log_json is not None:
        outputs.check_file(run.log_json, "--log-json")


def rule_warnings(spec: str, layout: md.Layout, name: str, model: Any) -> list[str]:
    """Warnings for the rules of a user's layout ``spec`` that name no dim of the model ``name``
    (none for a shipped layout: see :mod:`meshdsl.train.rules`)."""
    return [] if is_shipped(layout_path(spec)) else unused_rules(layout, model, name)


class Progress:
    """One status line: step, a bar, loss, step time and examples (tokens) per second.

    With ``log_json``, also every step as a line ``{"step", "loss", "seconds"}`` in that file.
    """

    def __init__(self, total: int, unit: str, out: TextIO, log_json: str | None = None):
        self.total, self.unit, self.out = total, unit, out
        self.live = out.isatty()
        try:
            self.log = open(outputs.parent(log_json), "w") if log_json is not None else None
        except OSError as e:
            raise ConfigError(f"--log-json {log_json}: cannot write it: {e.strerror}") from None

    def update(self, step: int, loss: float, seconds: float, examples: int | None) -> None:
        """Show step ``step``; ``examples`` None (a model without ``examples_per_step``): no throughput."""
        done = int(20 * step / self.total)
        line = (
            f"step {step:>{len(str(self.total))}}/{self.total} [{'#' * done}{'.' * (20 - done)}] "
            f"loss {loss:.4f}  step {seconds * 1e3:7.1f} ms"
        ) + ("" if examples is None else f"  {examples / seconds:,.0f} {self.unit}/s")
        if self.live:
            self.out.write("\r" + line)
            if step == self.total:
                self.out.write("\n")
        elif step == 1 or step == self.total or step % max(1, self.total // 20) == 0:
            self.out.write(line + "\n")
        self.out.flush()
        if self.log:
            self.log.write(json.dumps({"step": step, "loss": loss, "seconds": seconds}) + "\n")
            self.log.flush()

    def close(self) -> None:
        if self.log:
            self.log.close()


def _run_metadata(run: RunConfig, model: Any) -> dict[str, Any]:
    """What a checkpoint records about the run beside its state: model, config, optimizer, seed, data."""
    config = json.loads(json.dumps(dataclasses.asdict(model.config)))
    return {"model": run.model, "preset": run.preset, "config": config, "optimizer": run.optimizer,
            "learning_rate": run.learning_rate, "seed": run.seed, "data": run.data, "layout": run.layout}


def _check_resumable(path: Path, saved: dict[str, Any], mine: dict[str, Any]) -> None:
    """ConfigError unless the checkpoint was saved by the same model and optimizer (``remat`` may differ)."""
    if not isinstance(saved.get("step"), int):
        raise md.DataError(f"checkpoint {path} records no training step in its metadata; it was not saved by meshdsl train")
    if path.name != f"step_{saved['step']}":
        raise md.DataError(f"checkpoint {path} records step {saved['step']} in its manifest, not the {path.name} of its name; was step_{saved['step']} renamed? Rename it back or remove it")
    if saved.get("model") != mine["model"] or saved.get("optimizer") != mine["optimizer"]:
        raise ConfigError(
            f"checkpoint {path} holds model {saved.get('model')!r} with optimizer {saved.get('optimizer')!r}; "
            f"this run has model {mine['model']!r} with optimizer {mine['optimizer']!r}"
        )
    config = saved.get("config") or {}
    diffs = [f"{k}={config.get(k)!r} (this run: {v!r})" for k, v in mine["config"].items() if k != "remat" and config.get(k) != v]
    if diffs:
        raise ConfigError(f"checkpoint {path} was saved with a different {mine['model']} config: {', '.join(diffs)}")


def _start(run: RunConfig, trainer: Trainer, manager: md.checkpoint.CheckpointManager | None, out: TextIO) -> tuple[Any, jax.Array, int]:
    """State, data key and first step: fresh, or from the latest checkpoint when resuming."""
    key = jax.random.key(run.seed)
    data_key = jax.random.key_data(jax.random.fold_in(key, 1))
    found = manager.latest() if manager is not None else None
    if found is not None and not run.resume:
        raise ConfigError(f"checkpoint dir {run.checkpoint_dir!r} already holds {found.name}; pass --resume to continue that run, or choose another dir")
    if found is None:
        if run.resume:
            out.write(f"no checkpoint in {run.checkpoint_dir}; starting from step 0\n")
        return trainer.init(jax.random.key_data(key)), data_key, 0
    saved = md.checkpoint.read_manifest(found)["metadata"]
    _check_resumable(found, saved, _run_metadata(run, trainer.model))
    if saved["step"] > run.steps:
        raise ConfigError(f"checkpoint {found} is at step {saved['step']}, past --steps {run.steps}; pass --steps {saved['step'] + 1} or more to continue")
    like = {**jax.eval_shape(trainer.init, jax.random.key_data(key)), "data_key": data_key}
    state, _ = md.checkpoint.restore(found, trainer.mesh, trainer.layout.param_layout, like=like)
    out.write(f"resuming from {found} at step {saved['step']}\n")
    return state, state.pop("data_key"), int(saved["step"])


def _save(manager: md.checkpoint.CheckpointManager, step: int, state: Any, data_key: jax.Array, metadata: dict[str, Any], out: TextIO) -> None:
    """Save the state and data key as ``step_<step>`` and print one line."""
    start = time.perf_counter()
    path = manager.save(step, {**state, "data_key": data_key}, metadata)
    size = sum(a.nbytes for a in jax.tree_util.tree_leaves(state)) / 2**20
    out.write(f"saved checkpoint {path} ({size:.1f} MiB in {time.perf_counter() - start:.2f} s)\n")


def train(run: RunConfig, out: TextIO = sys.stdout, mesh: md.Mesh | None = None, err: TextIO = sys.stderr) -> list[float]:
    """Train as ``run`` says and return the loss of every step it ran.

    In a multi-process run only process 0 writes to ``out`` and ``run.log_json``. ``mesh``
    overrides the layout file's mesh. With ``run.checkpoint_dir`` it saves ``step_<N>`` every
    ``run.save_every`` steps and after the last; with ``run.resume`` it continues from the latest
    checkpoint there, so the losses returned are those of steps ``run.steps - len(losses) + 1``
    to ``run.steps``. Mistakes in ``run`` raise before anything is compiled (:func:`check`);
    rules of the layout that name no dim of the model are warned about on ``err``.
    """
    check(run)
    if not distributed.is_primary():
        out = err = io.StringIO()
    manager = None if run.checkpoint_dir is None else md.checkpoint.CheckpointManager(run.checkpoint_dir, run.save_every, run.keep)
    trainer = build_trainer(run, mesh)
    model, mesh, layout = trainer.model, trainer.mesh, trainer.layout
    for warning in rule_warnings(run.layout, layout, run.model, model):
        err.write(f"meshdsl train: warning: {warning}\n")
    tokens = None if run.data is None else token_file(run.data, model, run.model)
    out.write(f"meshdsl train: {run.model} {run.preset} on mesh {mesh} ({jax.devices()[0].platform}) under {layout}\n")
    state, data_key, first = _start(run, trainer, manager, out)
    if first == run.steps:
        out.write(f"nothing to train: the checkpoint is at step {first}, which is --steps\n")
        return []
    metadata = _run_metadata(run, model)
    unit = "tokens" if hasattr(model.config, "length") else "examples"
    examples = model.examples_per_step() if hasattr(model, "examples_per_step") else None
    if examples is None:
        err.write(f"meshdsl train: note: model {run.model} has no examples_per_step(), so no throughput is shown\n")
    progress = Progress(run.steps, unit, out, run.log_json if distributed.is_primary() else None)
    losses = []
    for step in range(first, run.steps):
        batch = data_key if tokens is None else tokens.batch_at(step, mesh, layout)
        start = time.perf_counter()
        state, loss = trainer.step(state, batch)
        losses.append(float(distributed.local_value(loss)))
        progress.update(step + 1, losses[-1], time.perf_counter() - start, examples)
        if manager is not None and (manager.due(step + 1) or step + 1 == run.steps):
            _save(manager, step + 1, state, data_key, metadata, out)
    progress.close()
    return losses
