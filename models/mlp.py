"""The two-layer MLP of the Mesh-TensorFlow paper: ``y = relu(x w1) w2``, two ``md.nn.Linear`` layers.

Dims ``batch``, ``d_io`` (input and output width) and ``d_ff`` (hidden width). Trained (mean
squared error) to map random inputs to a fixed, learnable target: the input rotated by one place
along ``d_io``, negated where it is positive. It costs almost nothing to generate, so a step's time
is the model's.
"""

from __future__ import annotations

import dataclasses

import jax
from meshdsl.models.presets import Presets

import meshdsl as md


@dataclasses.dataclass(frozen=True)
class Config(Presets):
    batch: int = 64
    d_io: int = 256
    d_ff: int = 1024
    layers: int = 2

    PRESETS = {
        "tiny": dict(batch=16, d_io=16, d_ff=32),
        "small": dict(batch=256, d_io=512, d_ff=2048),
        "1b": dict(batch=1024, d_io=8192, d_ff=65536),
    }


class Model:
    LAYOUTS = ("data_parallel", "megatron", "dp_tp", "fsdp")
    """The shipped layouts (layouts/*.toml) this model is benchmarked under by default."""
    """The MLP for ``config``: ``init``, ``batch``, ``loss``."""

    def __init__(self, config: Config):
        self.config = config
        self.batch_dim = md.Dim("batch", config.batch)
        self.io = md.Dim("d_io", config.d_io)
        self.ff = md.Dim("d_ff", config.d_ff)
        self.hidden = md.nn.Linear(self.io, self.ff)
        self.output = md.nn.Linear(self.ff, self.io)

    def init(self, key: jax.Array) -> dict[str, md.Tensor]:
        """LeCun-normal weights (normal, standard deviation 1/sqrt(fan_in)); the same under every layout."""
        k1, k2 = jax.random.split(key)
        return {"w1": self.hidden.init(k1), "w2": self.output.init(k2)}

    def apply(self, params: dict[str, md.Tensor], x: md.Tensor) -> md.Tensor:
        return self.output(params["w2"], md.relu(self.hidden(params["w1"], x)))

    def batch(self, key: jax.Array) -> dict[str, md.Tensor]:
        """A synthetic batch: random inputs and their targets (see the module docstring)."""
        x = md.random.normal(key, [self.batch_dim, self.io])
        rotated = md.shift(x, 1, self.io, wrap=True)
        return {"x": x, "y": rotated - 2 * md.relu(rotated)}

    def loss(self, params: dict[str, md.Tensor], batch: dict[str, md.Tensor]) -> md.Tensor:
        return md.reduce_mean(md.square(self.apply(params, batch["x"]) - batch["y"]))

    def flops_per_step(self) -> float:
        """Model FLOPs of one training step: 3 x (2 matmuls x 2 flops per multiply-add)."""
        c = self.config
        return 3 * 2 * 2 * c.batch * c.d_io * c.d_ff

    def examples_per_step(self) -> int:
        return self.config.batch
