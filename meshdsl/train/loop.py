"""The training loop behind ``meshdsl train``."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO, cast

import jax
import jax.numpy as jnp
import numpy as np

import meshdsl as md
from meshdsl import models
from meshdsl.errors import ConfigError, Interrupted, TrainingError
from meshdsl.measure.peaks import peak_flops
from meshdsl.measure.timing import compile_checked, memory_bytes
from meshdsl.model import protocol as model_protocol
from meshdsl.model.loader import build_model, load_module
from meshdsl.model.protocol import HuggingFaceMapped, Model
from meshdsl.runtime import distributed, output_paths
from meshdsl.runtime.layout_spec import is_shipped, layout_path, load_layout
from meshdsl.runtime.waiting import heartbeat
from meshdsl.train import feedback, logs, optim, resolve, resume, settings
from meshdsl.train.config import RunConfig
from meshdsl.train.data import TokenFile
from meshdsl.train.examples import ExampleFile
from meshdsl.train.progress import Progress, Step, Summary, peak_bytes
from meshdsl.train.rules import split_warnings, unused_rules
from meshdsl.train.signals import Stops, describe
from meshdsl.train.step import Trainer, check_accumulate, pipelined
from meshdsl.train.token_batch import token_batch_of


def _model(run: RunConfig) -> Any:
    flags = {"compute_dtype": run.compute_dtype, "remat": run.remat or None}
    fields = {f.name for f in dataclasses.fields(load_module(run.model).Config)}
    for field, value in flags.items():
        if value is not None and field not in fields:
            flag = "--" + field.replace("_", "-")
            kind = "str" if field == "compute_dtype" else "bool"
            raise ConfigError(
                f"{flag}: model {run.model} cannot take it: its Config has no {field} field; "
                f"a model takes {flag} by declaring {field}: {kind} in its Config and using it"
            )
    given = {k: v for k, v in flags.items() if v is not None}
    return build_model(run.model, run.preset, **{**given, **run.overrides})  # --set wins over a layout's [train]


def _optimizer(run: RunConfig) -> optim.Optimizer:
    kwargs = {} if run.learning_rate is None else {"learning_rate": run.learning_rate}
    multiplier = optim.schedule(run.lr_schedule, run.steps, run.warmup_steps, run.min_lr_ratio)
    # a constant rate without warmup stays a number: the very program (and losses) of a run without a schedule
    steady = run.lr_schedule == "constant" and not run.warmup_steps
    return optim.make(run.optimizer, None if steady else multiplier, **kwargs)


def build_trainer(run: RunConfig, mesh: md.Mesh | None = None, model: Model | None = None) -> Trainer:
    """The trainer ``run`` asks for, its settings decided first (:func:`meshdsl.train.resolve.settle`);
    ``model``: the model ``run`` names, when already built (by :func:`check`)."""
    return _trainer(resolve.settle(run).run, mesh, model)


def _trainer(run: RunConfig, mesh: md.Mesh | None, model: Model | None) -> Trainer:
    """:func:`build_trainer` of a settled ``run``."""
    layout = load_layout(run.layout)
    pipeline = layout.pipeline.replace(run.microbatches, run.schedule, run.virtual_stages)
    return Trainer(
        _model(run) if model is None else model,
        _optimizer(run),
        mesh or layout.mesh(),
        layout,
        run.backend,
        run.grad_reduce_dtype,
        pipeline=pipeline,
        accumulate=run.accumulate,
        metrics=True,
        error_feedback=run.grad_error_feedback,
    )


def token_file(run: RunConfig, model: Model) -> TokenFile:
    """The token file ``run.data`` for ``model`` (an ``.npz``: padded examples, :mod:`meshdsl.train.examples`),
    in the keys and dims of the model's own batch (:mod:`meshdsl.train.token_batch`); ConfigError for a
    model that reads no token sequences."""
    what = f"--data {run.data!r}: model {run.model}"
    try:
        spec = token_batch_of(model, what)
    except ConfigError as e:
        readers = [
            n
            for n in models.NAMES
            if {"length", "vocab"} <= {f.name for f in dataclasses.fields(load_module(n).Config)}
        ]
        raise ConfigError(f"{e}; of the shipped models, --data is for {', '.join(readers)}") from None
    vocab = model_protocol.config_field(model, "vocab")
    if isinstance(vocab, bool) or not isinstance(vocab, int):
        raise ConfigError(
            f"{what}: its Config has no integer vocab field (the number of token ids), "
            "which --data needs to check the file's ids"
        )
    assert run.data is not None  # a token file is read for a run with --data
    if run.data.endswith(".npz"):  # padded examples (input_ids, labels with -100)
        if model_protocol.config_field(model, "ignore_labels") is False:
            raise ConfigError(
                f"{what}: padded examples hold -100 targets, which this model's loss counts as labels (NaN); "
                "leave them out of its loss with --set ignore_labels=true"
            )
        return ExampleFile(run.data, spec, vocab, seed=run.seed, eval_fraction=run.eval_fraction)
    return TokenFile(run.data, spec, vocab, seed=run.seed, eval_fraction=run.eval_fraction)


@dataclasses.dataclass(frozen=True)
class Prepared:
    """A run ready to build: its settings decided and checked, its model built."""

    run: RunConfig
    model: Model
    settled: resolve.Settled


def prepare(run: RunConfig, model: Model | None = None) -> Prepared:
    """``run``'s settings decided and checked in one place (:func:`meshdsl.train.resolve.settle`: flag,
    layout file, resumed checkpoint, default), then the mistakes that need the model; ``model``: the
    model ``run`` names, when a caller's earlier check built it.

    Checked: every setting (named as the flag or layout-file key that set it), the settings the run
    would ignore, those a resume may not change, the model, preset, optimizer, layout (file and
    pipeline), the token file (and the resumed checkpoint's place in it), the ``init_from_hf`` folder's
    weights (their headers), that the checkpoint dir, ``log_json`` (and its PNG), ``tensorboard`` and
    the profile folder can be written, stay apart from the inputs and from each other
    (:func:`_check_outputs`), and that no ``step_<N>`` this run would save is in the way. Nothing is
    compiled, created or changed, so a mistake costs no work and loses no file.
    """
    settled = resolve.settle(run)
    run = settled.run
    layout = load_layout(run.layout)
    model = _model(run) if model is None else model
    _optimizer(run)
    pipeline = layout.pipeline.replace(run.microbatches, run.schedule, run.virtual_stages)
    is_pipelined = pipelined(model, layout, pipeline, run.backend)
    check_accumulate(run.accumulate, is_pipelined)
    if run.grad_error_feedback:
        feedback.check(layout, run.grad_reduce_dtype, is_pipelined, run.accumulate, run.backend)
    tokens = token_file(run, model) if run.data is not None else None
    if settled.checkpoint is not None:
        saved = md.checkpoint.read_manifest(settled.checkpoint)["metadata"]
        resume.check_config(settled.checkpoint, saved, resume.config_of(model), run.model)
        _check_data(settled.checkpoint, saved.get("data_state"), tokens, settled.start)
    if run.init_from_hf is not None:  # the weights' names and shapes, from the files' headers alone
        like = jax.eval_shape(model.init, jax.random.key(0))
        md.checkpoint.check_safetensors(run.init_from_hf, like=like, names=cast(HuggingFaceMapped, model).hf_names())
    if run.checkpoint_dir is not None:
        md.checkpoint.CheckpointManager(run.checkpoint_dir, run.save_every, run.keep)
        output_paths.check_dir(run.checkpoint_dir, "--checkpoint-dir")
    logs.check(run.log_json, run.tensorboard)
    if run.profile_steps is not None:
        output_paths.check_dir(_profile_dir(run), "--profile-dir")
    _check_outputs(run)
    return Prepared(run, model, settled)


def check(run: RunConfig, model: Model | None = None) -> Any:
    """Raise the md error for each mistake in ``run`` that shows before any device is used
    (:func:`prepare`); return the model ``run`` names, built to check it."""
    return prepare(run, model).model


def _check_outputs(run: RunConfig) -> None:
    """ConfigError for an output that is an input, another output (the JSON log, its loss curve,
    TensorBoard's and the trace's folders), or inside the checkpoint dir; and for a ``step_<N>`` there
    that a step of this run would save to but cannot replace."""
    model_file = run.model if run.model.endswith(".py") else None
    inputs = {"--data": run.data, "--layout": layout_path(run.layout), "--model": model_file}
    png = None if run.log_json is None else logs.loss_curve_path(run.log_json)
    files = {"--log-json": run.log_json, "--log-json's loss curve": png}
    folders = {"--tensorboard": run.tensorboard, "--checkpoint-dir": run.checkpoint_dir}
    if run.profile_steps is not None:
        folders["--profile-dir"] = _profile_dir(run)
    for flag, path in {**files, **folders}.items():
        output_paths.check_not_input(path, flag, inputs)
    output_paths.check_apart(files, folders, own="--checkpoint-dir")
    if run.checkpoint_dir is not None:
        manager = md.checkpoint.CheckpointManager(run.checkpoint_dir, run.save_every, run.keep)
        done = manager.steps() if run.resume else []
        manager.check_free(range(done[-1] + 1 if done else 1, run.steps + 1))


def _profile_dir(run: RunConfig) -> str:
    return run.profile_dir or run.tensorboard or "profile"


def rule_warnings(spec: str, layout: md.Layout, name: str, model: Model) -> list[str]:
    """Warnings for the rules of a user's layout ``spec`` that name no dim of the model ``name``
    (none for a shipped layout: see :mod:`meshdsl.train.rules`)."""
    return [] if is_shipped(layout_path(spec)) else unused_rules(layout, model, name)


def _finished(prepared: Prepared) -> bool:
    """Whether a resumed run's checkpoint is already at ``--steps`` (known from its manifest, before compiling)."""
    return prepared.settled.checkpoint is not None and prepared.settled.start == prepared.run.steps


def _start(
    run: RunConfig,
    trainer: Trainer,
    manager: md.checkpoint.CheckpointManager | None,
    out: TextIO,
    expected: Path | None,
) -> tuple[Any, jax.Array, int]:
    """State, data key and first step: fresh, or from the latest checkpoint when resuming (``expected``,
    the one :func:`prepare` compared the run with)."""
    key = jax.random.key(run.seed)
    data_key = jax.random.key_data(jax.random.fold_in(key, 1))
    found = manager.latest() if manager is not None else None
    if found is None:
        if run.resume:
            out.write(f"no checkpoint in {run.checkpoint_dir}; starting from step 0\n")
        state = trainer.init(jax.random.key_data(key))
        if run.init_from_hf is not None:
            state["params"] = _hf_params(run.init_from_hf, trainer, state["params"])
            out.write(f"parameters from {run.init_from_hf}\n")
        return state, data_key, 0
    if found != expected:
        raise ConfigError(f"checkpoint dir {run.checkpoint_dir!r} changed while this run started: it now holds {found}")
    saved = md.checkpoint.read_manifest(found)["metadata"]
    like = {**jax.eval_shape(trainer.init, jax.random.key_data(key)), "data_key": data_key}
    state, _ = md.checkpoint.restore(found, trainer.mesh, trainer.layout.param_layout, like=like)
    out.write(f"resuming from {found} at step {saved['step']}\n")
    return state, _as_fresh(state.pop("data_key")), int(saved["step"])


def _as_fresh(key: jax.Array) -> jax.Array:
    """A restored data key as a fresh run holds it: an uncommitted array, not the checkpoint's replicated
    global one (whose sharding, unlike the key the step was compiled with, made the first step compile again)."""
    return jnp.asarray(np.asarray(key.addressable_data(0)))


def _hf_params(folder: str, trainer: Trainer, like: Any) -> Any:
    """The weights of the Hugging Face ``folder`` in the trainer's stored layout, each device reading its block."""
    model = cast(HuggingFaceMapped, trainer.model)  # built from the folder's config.json (an hf: model spec)
    return md.checkpoint.load_safetensors(
        folder, like=like, names=model.hf_names(), mesh=trainer.mesh, layout=trainer.layout.param_layout
    )


def _check_data(found: Path, saved: dict[str, Any] | None, tokens: TokenFile | None, step: int) -> None:
    """ConfigError unless the checkpoint ``found`` (its ``data_state``: ``saved``) was trained on the data this
    run reads (same file, seed and windows; see :meth:`TokenFile.check_state`), so the resumed run reads its
    next unseen batch."""
    if tokens is None and saved is not None:
        raise ConfigError(f"checkpoint {found} was trained on a token file; pass --data to continue it")
    if tokens is not None:
        if saved is None:
            raise ConfigError(
                f"checkpoint {found} records no token-file state (trained without --data, or by an "
                "older meshdsl); start a new --checkpoint-dir to train on this file"
            )
        tokens.check_state(saved, step, str(found))


def _save(
    manager: md.checkpoint.CheckpointManager, step: int, state: Any, data_key: jax.Array, metadata: dict[str, Any]
) -> str:
    """Save the state and data key as ``step_<step>``; the line that says so."""
    start = time.perf_counter()
    path = manager.save(step, {**state, "data_key": data_key}, metadata)
    size = sum(a.nbytes for a in jax.tree_util.tree_leaves(state)) / 2**20
    return f"saved checkpoint {path} ({size:.1f} MiB in {time.perf_counter() - start:.2f} s)"


def _header(run: RunConfig, mesh: md.Mesh, layout: md.Layout) -> str:
    """The first line: model, preset, mesh, platform, the layout's rules and (when it has them) its
    parameter rules, then a schedule or accumulation other than the default."""
    params = "" if layout.params is None else f"; parameters stored under {layout.params}"
    extra = []
    if run.lr_schedule != "constant" or run.warmup_steps:
        warmup = f", {run.warmup_steps} warmup steps" if run.warmup_steps else ""
        extra.append(f"{run.lr_schedule} learning rate{warmup}")
    if run.accumulate is not None and run.accumulate > 1:
        extra.append(f"{run.accumulate} microbatches a step")
    shown = f" ({'; '.join(extra)})" if extra else ""
    where = f"on mesh {mesh} ({jax.devices()[0].platform})"
    return f"meshdsl train: {run.model} {run.preset} {where} under {layout.shown()}{params}{shown}\n"


def _eval_batches(run: RunConfig, trainer: Trainer, tokens: TokenFile | None) -> Callable[[int], tuple[Any, jax.Array]]:
    """Eval batch ``i``'s ``(data, index)`` for ``trainer.evaluate``: the synthetic task's batch from a key
    stream of its own (``fold_in(seed key, 2)``, never a training batch's), or the token file's held-out batch."""
    if tokens is None:
        key = jax.random.key_data(jax.random.fold_in(jax.random.key(run.seed), 2))
        return lambda i: (key, jnp.int32(i))
    return lambda i: (tokens.eval_batch_at(i, trainer.mesh, trainer.layout), jnp.int32(0))


def _evaluate(trainer: Trainer, state: Any, eval_batch: Callable[[int], tuple[Any, jax.Array]], count: int) -> float:
    """The mean loss of held-out batches ``0 .. count - 1`` at ``state`` (all dispatched, then read)."""
    held_out = [trainer.evaluate(state, *eval_batch(i)) for i in range(count)]
    return sum(float(distributed.local_value(x)) for x in held_out) / count


def _stop(loss: float, step: int, manager: md.checkpoint.CheckpointManager | None) -> None:
    """TrainingError for a loss that is not finite at ``step``, naming the checkpoint left intact."""
    kept = manager.latest() if manager is not None else None
    where = f"the last checkpoint, {kept}, is intact" if kept is not None else "no checkpoint was saved"
    raise TrainingError(f"loss is {loss} at step {step}: stopped ({where}); pass --allow-nan to train on")


class _Profiler:
    """A ``jax.profiler`` trace of steps ``A..B`` (``--profile-steps A:B``) into a folder."""

    def __init__(self, spec: str | None, steps: int, folder: str):
        self.span = None if spec is None else settings.profile_steps(spec, steps)
        self.folder, self.on = folder, False

    def before(self, step: int) -> None:
        if self.span is not None and step == self.span[0]:
            jax.profiler.start_trace(self.folder)
            self.on = True

    def after(self, step: int, result: Any) -> str | None:
        """Stop after the last traced step (once its result is ready); the line that says where the trace is."""
        if not self.on or self.span is None or step != self.span[1]:
            return None
        jax.block_until_ready(result)
        jax.profiler.stop_trace()
        self.on = False
        steps = f"{self.span[0]}-{self.span[1]}"
        return f"profiled steps {steps} into {self.folder} (open with TensorBoard's profile tab or Perfetto)"

    def stop(self) -> None:
        if self.on:
            jax.profiler.stop_trace()
            self.on = False


def train(
    run: RunConfig,
    out: TextIO = sys.stdout,
    mesh: md.Mesh | None = None,
    err: TextIO = sys.stderr,
    model: Model | None = None,
    signals: bool = False,
) -> list[float]:
    """Train as ``run`` says and return the loss of every step it ran.

    In a multi-process run only process 0 writes to ``out``, ``run.log_json`` and ``run.tensorboard``.
    ``mesh`` overrides the layout file's mesh. The step (and the eval step) is compiled ahead and the
    time reported apart from the step times. With ``run.checkpoint_dir`` it saves ``step_<N>`` every
    ``run.save_every`` steps and after the last; with ``run.resume`` it continues from the latest
    checkpoint there, so the losses returned are those of steps ``run.steps - len(losses) + 1`` to
    ``run.steps``. A NaN or infinite loss raises TrainingError naming the step (nothing of that step
    is saved) unless ``run.allow_nan``. Mistakes in ``run`` raise before anything is compiled
    (:func:`check`); rules of the layout that name no dim of the model are warned about on ``err``.
    The checkpoint dir is locked for the run (a second run on it is a ConfigError before anything is
    built). A step that needs more memory than a device has is a ConfigError before any state is made
    (:mod:`meshdsl.measure.fits`). ``model``: what ``check(run)`` returned, when the caller checked first
    (the model is then not built again). ``signals`` (what ``meshdsl train`` passes): SIGTERM or Ctrl-C
    stops the run after its step, saved, raising :class:`meshdsl.errors.Interrupted`
    (:mod:`meshdsl.train.signals`).
    """
    prepared = prepare(run, model)
    run = prepared.run
    manager = None
    if run.checkpoint_dir is not None:
        manager = md.checkpoint.CheckpointManager(run.checkpoint_dir, run.save_every, run.keep)
    stops = Stops(err, None if manager is None else manager.release) if signals else None
    with stops or contextlib.nullcontext():
        if manager is None:
            return _train(prepared, out, mesh, err, None, stops)
        note = manager.acquire()
        if note is not None:
            err.write(f"meshdsl train: note: {note}\n")
        try:
            return _train(prepared, out, mesh, err, manager, stops)
        finally:
            manager.release()


def _train(
    prepared: Prepared,
    out: TextIO,
    mesh: md.Mesh | None,
    err: TextIO,
    manager: md.checkpoint.CheckpointManager | None,
    stops: Stops | None = None,
) -> list[float]:
    """:func:`train` after :func:`prepare`, with the checkpoint dir (if any) locked."""
    run, model = prepared.run, prepared.model
    primary = distributed.is_primary()
    if not primary:
        out = err = io.StringIO()
    trainer = _trainer(run, mesh, model)
    mesh, layout = trainer.mesh, trainer.layout
    warnings = rule_warnings(run.layout, layout, run.model, model)
    for warning in [*warnings, *split_warnings(layout, mesh, model, run.model, warned=bool(warnings))]:
        err.write(f"meshdsl train: warning: {warning}\n")
    tokens = None if run.data is None else token_file(run, model)
    out.write(_header(run, mesh, layout))
    out.writelines(f"{note}\n" for note in prepared.settled.notes)
    eval_batch = _eval_batches(run, trainer, tokens) if run.eval_every else None
    if _finished(prepared):
        out.write(f"nothing to train: the checkpoint is at step {run.steps}, which is --steps (nothing compiled)\n")
        return []
    out.write(f"compiling the train step{' and the eval step' if eval_batch else ''} ...\n")
    out.flush()
    began = time.perf_counter()
    # Compiled ahead to check its memory (before any state exists) and to time it; the jit calls below
    # find the executable in JAX's cache and, being jit calls, take host-local inputs (the data key)
    # as every process's copy of one array.
    like = jax.random.key_data(jax.random.key(run.seed)) if tokens is None else tokens.abstract_batch(mesh, layout)
    with heartbeat("meshdsl train", "compiling the train step", err):
        compiled = compile_checked(trainer, like, f"a training step of {run.model} {run.preset} under {run.layout}")
    state, data_key, first = _start(run, trainer, manager, out, prepared.settled.checkpoint)
    if first == run.steps:
        out.write(f"nothing to train: the checkpoint is at step {first}, which is --steps\n")
        return []
    metadata = resume.record(run, model)
    counts = model_protocol.step_counts(model)
    unit, examples, flops = counts.unit, counts.examples, counts.flops
    if examples is None:
        err.write(f"meshdsl train: note: model {run.model} has no examples_per_step(), so no throughput is shown\n")
    device = jax.local_devices()[0]  # memory_stats() answers only for this process's own devices
    peak = peak_flops(device.device_kind, model_protocol.compute_dtype(model))
    language = model_protocol.config_field(model, "vocab") is not None
    batch_of = (lambda step: data_key) if tokens is None else (lambda step: tokens.batch_at(step, mesh, layout))
    if eval_batch is not None:
        trainer.evaluate.lower(state, *eval_batch(0)).compile()
    compile_seconds = time.perf_counter() - began
    out.write(f"compiled in {compile_seconds:.1f} s\n")

    if stops is not None:
        stops.training()  # before the log is opened: a stop at once must not cut a resumed log's rewrite short
    sinks = logs.Logs(run.log_json if primary else None, run.tensorboard if primary else None, first)
    progress = Progress(first, run.steps, unit, out, run.log_every)
    profiler = _Profiler(run.profile_steps, run.steps, _profile_dir(run))
    losses: list[float] = []
    times: list[float] = []
    evals: list[tuple[int, float]] = []
    stopped: int | None = None
    try:
        for step in range(first, run.steps):
            if stops is not None:
                stops.step = step
            batch = batch_of(step)
            profiler.before(step + 1)
            start = time.perf_counter()
            state, metrics = trainer.step(state, batch)
            loss = float(distributed.local_value(metrics["loss"]))
            seconds = time.perf_counter() - start
            traced = profiler.after(step + 1, state)
            losses.append(loss)
            times.append(seconds)
            if not math.isfinite(loss) and not run.allow_nan:
                _stop(loss, step + 1, manager)
            record = Step(step + 1, loss, seconds, trainer.optimizer.learning_rate_at(step))
            if examples is not None:
                record.throughput = examples / seconds
            if flops is not None and peak is not None:
                record.mfu = flops / seconds / (peak * mesh.size)
            if eval_batch is not None and ((step + 1) % run.eval_every == 0 or step + 1 == run.steps):
                record.eval_loss = _evaluate(trainer, state, eval_batch, run.eval_steps)
                record.eval_perplexity = math.exp(min(record.eval_loss, 700.0)) if language else None
                evals.append((step + 1, record.eval_loss))
            grad_norm = float(distributed.local_value(metrics["grad_norm"]))
            throughput = {f"{unit}_per_second": record.throughput}
            sinks.write(
                step + 1,
                {
                    "loss": loss,
                    "seconds": seconds,
                    "learning_rate": record.learning_rate,
                    "grad_norm": grad_norm,
                    **throughput,
                    "mfu": record.mfu,
                    "eval_loss": record.eval_loss,
                    "eval_perplexity": record.eval_perplexity,
                },
            )
            progress.update(record)
            if traced:
                progress.note(traced)
            stopped = None if stops is None or step + 1 == run.steps else stops.agreed()
            if manager is not None and (manager.due(step + 1) or step + 1 == run.steps or stopped):
                data_state = {} if tokens is None else {"data_state": tokens.state(step + 1)}
                progress.note(_save(manager, step + 1, state, data_key, {**metadata, **data_state}))
            if stopped:
                break
    finally:
        profiler.stop()
        progress.close()
        picture = sinks.close()
    written = [f"log: {run.log_json}" + ("" if picture is None else f", loss curve {picture}")] if run.log_json else []
    if run.tensorboard:
        written.append(
            f"TensorBoard: {run.tensorboard} (view: pip install tensorboard; tensorboard --logdir {run.tensorboard})"
        )
    summary = Summary(
        steps=len(losses),
        seconds=time.perf_counter() - began,
        compile_seconds=compile_seconds,
        step_seconds=times,
        unit=unit,
        per_step=examples,
        final_eval=evals[-1] if evals else None,
        best_eval=min(evals, key=lambda e: e[1]) if evals else None,
        perplexity=language,
        peak_bytes=peak_bytes(device),
        compiled_bytes=memory_bytes(compiled)["total"],
        platform=device.platform,
        checkpoint=None if manager is None else f"{run.checkpoint_dir} (latest {manager.latest()})",
        logs=written,
    )
    out.write("\n".join(summary.lines()) + "\n")
    if stopped:
        raise Interrupted(stopped, _stop_line(stopped, first + len(losses), run, manager))
    return losses


def _stop_line(signum: int, step: int, run: RunConfig, manager: md.checkpoint.CheckpointManager | None) -> str:
    """What a run a signal stopped after ``step`` says last: what it saved and how to go on."""
    where = f"saved {manager.path(step)}; continue with --resume" if manager else "nothing saved (no --checkpoint-dir)"
    return f"{describe(signum)}: stopped after step {step} of {run.steps}: {where}"
