"""``meshdsl generate``: continue prompts with a trained decoder under a layout (:func:`meshdsl.decoding.generate.run`).

The model and parameters come from the latest checkpoint of ``--checkpoint-dir`` (its model and
config as ``meshdsl train`` recorded them) or, without one, from ``--model``/``--preset`` at
``--seed`` (random weights: a smoke test of a layout). Prompts are ids (``--prompt-ids "1 2 3;
4 5"``) or text (``--prompt``, read with the ``tokenizers`` package from ``--tokenizer``, default
the checkpoint folder's ``tokenizer.json``). Prints each row's new ids (and text), then the
prefill and decode tokens/s apart.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from meshdsl.commands import Command, flags


def add_arguments(generate: argparse.ArgumentParser) -> None:
    """``generate``'s flags."""
    flags.add_model(generate)
    flags.add_preset(generate)
    flags.add_set(generate)
    flags.add_layout(generate)
    flags.add_backend(generate)
    flags.add_init_from_hf(generate, weights=True)
    generate.add_argument(
        "--checkpoint-dir", default=None, metavar="DIR", help="the latest checkpoint of a meshdsl train run"
    )
    generate.add_argument("--prompt-ids", default=None, metavar="IDS", help='prompts as ids: "1 2 3; 4 5"')
    generate.add_argument("--prompt", action="append", default=[], metavar="TEXT", help="a prompt as text (repeat)")
    generate.add_argument(
        "--tokenizer",
        default=None,
        metavar="FILE",
        help="tokenizer.json (default: the weights' folder's)",
    )
    generate.add_argument("--max-new-tokens", type=int, default=16)
    generate.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    generate.add_argument("--top-k", type=int, default=None)
    generate.add_argument("--top-p", type=float, default=None)
    generate.add_argument("--eos-token-id", type=int, default=None)
    generate.add_argument(
        "--seed", type=int, default=0, help="the sampling key (and random weights' without a checkpoint)"
    )


def config(args: argparse.Namespace) -> dict[str, object]:
    """The model's ``--set`` overrides."""
    return flags.overrides(args.set)


def _prompt_ids(text: str) -> list[list[int]]:
    """``"1 2 3; 4 5"`` as id lists (ConfigError naming the piece that is not an int)."""
    from meshdsl.errors import ConfigError

    rows = []
    for i, part in enumerate(text.split(";")):
        try:
            rows.append([int(t) for t in part.split()])
        except ValueError:
            raise ConfigError(f"--prompt-ids: prompt {i} {part.strip()!r} is not ids separated by spaces") from None
        if not rows[-1]:
            raise ConfigError(f"--prompt-ids: prompt {i} is empty (prompts are separated by ';')")
    return rows


def _tokenizer(args: argparse.Namespace) -> Any:
    """The ``tokenizers.Tokenizer`` of ``--tokenizer`` or the checkpoint dir's tokenizer.json; None without text."""
    from meshdsl.errors import ConfigError

    folder = args.checkpoint_dir or args.init_from_hf
    path = args.tokenizer or (str(Path(folder) / "tokenizer.json") if folder else None)
    if not args.prompt:
        return None
    if path is None or not Path(path).is_file():
        raise ConfigError(f"--prompt is text, which needs a tokenizer.json (--tokenizer); {path or 'none'} is no file")
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise ConfigError("--prompt needs the tokenizers package: pip install 'meshdsl[text]'") from None
    return Tokenizer.from_file(path)


def check(args: argparse.Namespace, overrides: dict[str, object]) -> dict[str, Any]:
    """Prompts, flags, model and layout, before any device is used; returns what ``run`` needs."""
    from meshdsl.errors import ConfigError
    from meshdsl.model.loader import build_model
    from meshdsl.runtime.layout_spec import load_layout

    if (args.prompt_ids is None) == (not args.prompt):
        raise ConfigError("give prompts as --prompt-ids or as --prompt (text), one of the two")
    if args.checkpoint_dir is not None and args.init_from_hf is not None:
        raise ConfigError("--checkpoint-dir and --init-from-hf both name the weights: give one")
    for flag, folder in (("--checkpoint-dir", args.checkpoint_dir), ("--init-from-hf", args.init_from_hf)):
        if folder is not None and not Path(folder).is_dir():
            raise ConfigError(f"{flag} {folder!r} is not a directory")
    tokenizer = _tokenizer(args)
    rows = _prompt_ids(args.prompt_ids) if args.prompt_ids is not None else None
    if rows is None:
        rows = [tokenizer.encode(text).ids for text in args.prompt]
    if args.checkpoint_dir is not None:
        name, model, found = _checkpoint_model(args.checkpoint_dir, overrides)
    elif args.init_from_hf is not None:
        name = flags.model_spec(args.model, args.init_from_hf)
        model, found = build_model(name, args.preset, **overrides), None
    else:
        name, model, found = args.model, build_model(args.model, args.preset, **overrides), None
    layout = load_layout(args.layout)
    from meshdsl.decoding import checks

    vocab, length = model.config.vocab, model.config.length
    checks.prompts(rows, vocab)
    checks.lengths(max(map(len, rows)), args.max_new_tokens, length)
    checks.eos(args.eos_token_id, vocab)
    if args.temperature > 0 or args.top_k is not None or args.top_p is not None:
        import jax

        checks.sampling(args.temperature, args.top_k, args.top_p, jax.random.key(0), vocab)
    return {
        "name": name,
        "model": model,
        "found": found,
        "layout": layout,
        "rows": rows,
        "tokenizer": tokenizer,
        "overrides": overrides,
    }


def _checkpoint_model(directory: str, overrides: dict[str, object]) -> tuple[str, Any, Path]:
    """The name and model a checkpoint of ``meshdsl train`` recorded (its config, then ``overrides``)
    and the checkpoint's path."""
    from meshdsl import checkpoint
    from meshdsl.errors import ConfigError
    from meshdsl.model.loader import build_model

    found = checkpoint.latest(directory)
    if found is None:
        raise ConfigError(f"--checkpoint-dir {directory!r} holds no checkpoint (step_<N>)")
    saved = checkpoint.read_manifest(found)["metadata"]
    if not {"model", "preset", "config"} <= set(saved):
        raise ConfigError(f"checkpoint {found} records no model; it was not saved by meshdsl train")
    model = build_model(saved["model"], saved["preset"], **{**saved["config"], **overrides})
    return saved["model"], model, found


def _progress(done: int, total: int) -> None:
    """``generated d/t tokens`` on stderr: rewritten in place on a terminal, every tenth of the way otherwise."""
    live = sys.stderr.isatty()
    if live or done == total or done % max(1, total // 10) == 0:
        print(f"{chr(13) if live else ''}generated {done}/{total} tokens", end="" if live else "\n", file=sys.stderr)
        if live and done == total:
            print(file=sys.stderr)


def run(args: argparse.Namespace, checked: dict[str, Any]) -> None:
    """Load, generate, print each row and the tokens/s of prefill and decode."""
    import jax

    from meshdsl import checkpoint
    from meshdsl.decoding import checks
    from meshdsl.decoding.decoder import Decoder
    from meshdsl.decoding.generate import run as generate

    model, layout, rows = checked["model"], checked["layout"], checked["rows"]
    mesh = layout.mesh()
    sampling = checks.sampling(args.temperature, args.top_k, args.top_p, jax.random.key(args.seed), model.config.vocab)
    decoder = Decoder(model, mesh, layout, args.backend, sampling, args.eos_token_id)
    if checked["found"] is not None:
        state, _ = checkpoint.restore(checked["found"], mesh, layout)
        params = state["params"]
        source = str(checked["found"])
    elif args.init_from_hf is not None:
        from meshdsl import hf

        _, params = hf.load(args.init_from_hf, mesh=mesh, layout=layout, **checked["overrides"])
        source = f"the Hugging Face folder {args.init_from_hf}"
    else:
        params = model.init(jax.random.key(args.seed))
        source = f"random weights (seed {args.seed})"
    params = decoder.place(params)
    print(f"meshdsl generate: {checked['name']} from {source} on mesh {mesh} under {layout}")
    out = generate(decoder, params, rows, args.max_new_tokens, jax.random.key(args.seed), _progress)
    tokenizer = checked["tokenizer"]
    for i, row in enumerate(out.ids):
        new = row[out.prompt_length :].tolist()
        text = f"  {tokenizer.decode(new)!r}" if tokenizer is not None else ""
        print(f"[{i}] {' '.join(map(str, new))}{text}")
    batch = len(rows)
    prompt_tokens = sum(map(len, rows))
    print(f"prefill: {prompt_tokens} tokens in {out.prefill_seconds:.3f} s (compile included)")
    if out.steps:
        rate = batch * out.steps / out.decode_seconds
        print(
            f"decode: {out.steps} steps x {batch} rows in {out.decode_seconds:.3f} s, {rate:,.1f} tokens/s "
            "(after the first step, which compiles)"
        )


COMMAND = Command(
    "generate",
    "continue prompts with a trained decoder under a layout (greedy or sampled)",
    add_arguments,
    run,
    config=config,
    check=check,
    order=25,
)
