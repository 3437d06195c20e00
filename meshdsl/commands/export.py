"""``meshdsl export``: a Hugging Face folder (``md.hf.save``) from a ``meshdsl train`` checkpoint of the llama decoder.

The checkpoint's manifest records the model and its Config; the parameters are restored on one device
(any layout the run was trained under: a checkpoint is re-laid out on load) and written as
``config.json`` and ``model.safetensors`` (shards with an index above ``--max-shard-gb``).
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, cast

from meshdsl.commands import Command

if TYPE_CHECKING:
    from meshdsl.model.protocol import HuggingFaceMapped, Model


def add_arguments(export: argparse.ArgumentParser) -> None:
    """``export``'s flags."""
    export.add_argument("--checkpoint-dir", required=True, metavar="CK", help="a meshdsl train --checkpoint-dir")
    export.add_argument("--step", type=int, default=None, help="the checkpoint step_<N> to export (default: latest)")
    export.add_argument("--out", required=True, metavar="DIR", help="the Hugging Face folder to write")
    export.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    export.add_argument(
        "--max-shard-gb", type=float, default=5.0, help="files of at most this many GB, with an index (default 5)"
    )


@dataclasses.dataclass(frozen=True)
class Checked:
    path: Path
    model: Model


def check(args: argparse.Namespace, config: None) -> Checked:
    """The checkpoint exists and holds the llama decoder, ``--out`` can be written; only the manifest is read."""
    from meshdsl import checkpoint
    from meshdsl.errors import ConfigError, DataError
    from meshdsl.model.loader import HF_PREFIX
    from meshdsl.models import llama
    from meshdsl.runtime import output_paths

    folder = Path(args.checkpoint_dir)
    if not folder.is_dir():
        raise DataError(f"--checkpoint-dir {str(folder)!r} not found")
    steps = checkpoint.steps(folder)
    if not steps:
        raise DataError(f"--checkpoint-dir {str(folder)!r} holds no checkpoint step_<N>")
    if args.step is not None and args.step not in steps:
        raise DataError(f"--step {args.step}: {str(folder)!r} holds steps {steps}")
    path = folder / f"step_{args.step if args.step is not None else steps[-1]}"
    metadata = checkpoint.read_manifest(path)["metadata"]
    model = metadata.get("model")
    if not isinstance(model, str) or not (model == "llama" or model.startswith(HF_PREFIX)):
        raise ConfigError(
            f"checkpoint {path} holds model {model!r}; export writes the llama decoder's (--model llama or "
            "--init-from-hf), whose families Hugging Face knows"
        )
    try:
        config = llama.Config(**metadata["config"])
    except (TypeError, KeyError) as e:
        raise DataError(f"checkpoint {path} records a Config this llama cannot take: {e}") from None
    if not args.max_shard_gb > 0:
        raise ConfigError(f"--max-shard-gb {args.max_shard_gb}: a file holds a positive number of GB")
    output_paths.check_dir(args.out, "--out")
    output_paths.check_not_input(args.out, "--out", {"--checkpoint-dir": args.checkpoint_dir})
    return Checked(path, llama.Model(config))


def run(args: argparse.Namespace, checked: Checked) -> None:
    """Restore the parameters on one device and write the folder."""
    import meshdsl as md

    state, _ = md.checkpoint.restore(checked.path, md.Mesh({"data": 1}))
    out = md.hf.save(
        args.out,
        cast("HuggingFaceMapped", checked.model),
        state["params"],
        dtype=args.dtype,
        max_shard_bytes=int(args.max_shard_gb * 1e9),
    )
    print(f"meshdsl export: {checked.path} -> {out} ({', '.join(sorted(p.name for p in out.iterdir()))})")


COMMAND = Command(
    "export",
    "write a Hugging Face folder from a llama checkpoint",
    add_arguments,
    run,
    check=check,
    order=15,
)
