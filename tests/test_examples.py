"""Padded fine-tuning examples (``meshdsl train --data examples.npz``): inputs and shifted labels as
transformers pairs them, ``-100`` labels left out of the loss, grain-shuffled with a held-out tail and a
resumable state, each mistake in the file one line. References: numpy slicing of the file's arrays."""

from __future__ import annotations

import numpy as np
import pytest

import meshdsl as md
from meshdsl.model.loader import build_model
from meshdsl.train.examples import ExampleFile
from meshdsl.train.token_batch import token_batch_of

N, T, VOCAB = 20, 9, 64


def spec(length: int = T - 1, batch: int = 4):
    return token_batch_of(build_model("llama", "tiny", batch=batch, length=length), "examples")


def write(path, **arrays) -> str:
    np.savez(path, **arrays)
    return str(path)


@pytest.fixture
def examples(tmp_path):
    rng = np.random.default_rng(0)
    ids = rng.integers(0, VOCAB, (N, T))
    labels = ids.copy()
    labels[:, :3] = -100  # prompts
    labels[1, 6:] = -100  # padding
    return ids, labels, write(tmp_path / "e.npz", input_ids=ids, labels=labels)


def test_batches_pair_inputs_with_the_next_labels_in_a_seeded_order(examples):
    ids, labels, path = examples
    mesh, layout = md.Mesh({"data": 2}), md.Layout("batch:data")
    data = ExampleFile(path, spec(), VOCAB, seed=3, eval_fraction=0.2)
    assert (data.windows, data.eval_windows) == (16, 4)
    seen = []
    for step in range(4):  # one epoch: 16 training examples, 4 a batch
        batch = data.batch_at(step, mesh, layout)
        rows = [data.window_of(step * 4 + r) for r in range(4)]
        np.testing.assert_array_equal(batch["inputs"].numpy(), ids[rows, :-1])
        np.testing.assert_array_equal(batch["targets"].numpy(), labels[rows, 1:])
        seen += rows
    assert sorted(seen) == list(range(16))  # every training example once, never the held-out tail
    again = ExampleFile(path, spec(), VOCAB, seed=3, eval_fraction=0.2)
    np.testing.assert_array_equal(again.batch_at(2, mesh, layout)["inputs"].numpy(), ids[seen[8:12], :-1])
    again.check_state(data.state(2), 2, "ck")
    other = ExampleFile(path, spec(), VOCAB, seed=4, eval_fraction=0.2)
    with pytest.raises(md.ConfigError, match="was trained on other data"):
        other.check_state(data.state(2), 2, "ck")
    held = data.eval_batch_at(0, mesh, layout)["targets"].numpy()
    np.testing.assert_array_equal(held, labels[[16, 17, 18, 19], 1:])


def test_short_examples_are_padded_with_ignored_targets_and_a_mask_ignores_its_labels(tmp_path, examples):
    ids, _, _ = examples
    mask = np.ones_like(ids)
    mask[2, 5:] = 0
    path = write(tmp_path / "m.npz", input_ids=ids, attention_mask=mask)
    data = ExampleFile(path, spec(length=12), VOCAB, eval_fraction=0.0)
    np.testing.assert_array_equal(data.inputs[2], np.r_[ids[2], [0, 0, 0, 0]][:12])
    np.testing.assert_array_equal(data.targets[2], np.r_[ids[2, 1:5], [-100] * 8])
    np.testing.assert_array_equal(data.targets[0], np.r_[ids[0, 1:], [-100] * 4])


@pytest.mark.parametrize(
    "arrays, message",
    [
        ({"tokens": np.zeros((2, 9))}, r"holds \['tokens'\]; it needs input_ids"),
        ({"input_ids": np.zeros(9, int)}, r"input_ids is int64\[9\]; it must be integers \[N, T\]"),
        ({"input_ids": np.zeros((2, 9), int), "labels": np.zeros((2, 8), int)}, r"labels is int64\[2, 8\]"),
        ({"input_ids": np.full((2, 9), 64)}, r"input_ids hold id 64 at \[0, 0\], outside the vocab of 64"),
        ({"input_ids": np.zeros((2, 9), int), "labels": np.full((2, 9), -100)}, "example 0 .* has no label"),
        ({"input_ids": np.zeros((2, 12), int)}, r"longer than length \+ 1 = 9; set length=11"),
    ],
)
def test_file_mistakes_are_one_line(tmp_path, arrays, message):
    path = write(tmp_path / "bad.npz", **arrays)
    with pytest.raises(md.DataError, match=message):
        ExampleFile(path, spec(), VOCAB)


def test_a_missing_file_is_named(tmp_path):
    with pytest.raises(md.DataError, match="not found"):
        ExampleFile(str(tmp_path / "none.npz"), spec(), VOCAB)


def test_padded_examples_need_a_model_that_ignores_their_labels(tmp_path, examples, capsys):
    """A shipped decoder counts -100 as a label unless ``ignore_labels``: refused before anything runs,
    the remedy named; nothing written."""
    from meshdsl.cli import main

    argv = ["train", "--model", "llama", "--preset", "tiny", "--set", f"length={T - 1}", "--data", examples[2]]
    assert main([*argv, "--steps", "1", "--log-json", str(tmp_path / "log.json")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--set ignore_labels=true" in err, err
    assert not (tmp_path / "log.json").exists()
