"""A small convolutional image classifier, written once in named dims.

Dims: ``batch, height, width, channels`` (the image), one channel dim per conv layer
(``channels_1 ... channels_L``), the kernel's ``kh, kw`` and ``classes``. ``layers`` 3x3 convs
(``md.nn.Conv2d``, "SAME", He-normal) with bias and relu, global average pooling over ``height``
and ``width``, a dense classifier (``md.nn.Linear`` plus a bias), softmax cross-entropy over
``classes``.

Any layout applies: ``height:space`` (layouts/spatial.toml) splits the image into horizontal
bands, each conv exchanging one-row halos with its neighbours and the pooling ending in a
``psum``; ``batch:data`` is plain data parallelism; ``channels_i:model`` rules split layers'
widths (Megatron-style: a split output width costs nothing, a split input width one ``psum``).

The synthetic task: each class has a fixed pattern, a random colour (one value per image
channel) plus a random texture (height x width x channels), the same at every step; an example
is its class's pattern plus unit noise, its label uniform over ``classes`` (``md.random.bits``).
The colour survives the average pooling, the texture rewards the convolutions; the loss of
``tiny`` falls clearly within 20 AdamW steps at learning rate 1e-2.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from meshdsl.models.presets import Presets

import meshdsl as md
from meshdsl.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Config(Presets):
    batch: int = 32
    height: int = 32
    width: int = 32
    in_channels: int = 3
    channels: int = 64
    layers: int = 4
    kernel: int = 3
    classes: int = 10
    signal: float = 1.0
    """Amplitude of the class patterns (colour + texture) relative to the unit noise."""

    PRESETS = {
        "tiny": dict(batch=8, height=16, width=16, in_channels=3, channels=8, layers=3, classes=4),
        "small": dict(batch=32, height=32, width=32, in_channels=3, channels=64, layers=4, classes=10),
        # 9 * 3 * 4096 + 7 * 9 * 4096^2 + 4096 * 1000 (+ biases) = 1.06e9 parameters.
        "1b": dict(batch=64, height=32, width=32, in_channels=3, channels=4096, layers=8, classes=1000),
    }

    def __post_init__(self) -> None:
        if self.kernel % 2 == 0:
            raise ConfigError(f"kernel must be odd ('SAME' convolution), got {self.kernel}")
        if self.layers < 1:
            raise ConfigError(f"layers must be at least 1, got {self.layers}")


class Model:
    """The convnet for ``config``: ``init``, ``batch``, ``loss``."""

    LAYOUTS = ("spatial", "data_parallel")
    """The shipped layouts (layouts/*.toml) this model is benchmarked under by default."""

    def __init__(self, config: Config):
        c = self.config = config
        D = md.Dim
        self.batch_dim, self.height, self.width = D("batch", c.batch), D("height", c.height), D("width", c.width)
        self.kh, self.kw, self.classes = D("kh", c.kernel), D("kw", c.kernel), D("classes", c.classes)
        # chans[0] is the image's; chans[i] the output of conv layer i.
        self.chans = [D("channels", c.in_channels)] + [D(f"channels_{i}", c.channels) for i in range(1, c.layers + 1)]
        k = (c.kernel, c.kernel)
        self.convs = [md.nn.Conv2d(a, b, k, init_scale=2**0.5) for a, b in zip(self.chans, self.chans[1:])]
        self.classifier = md.nn.Linear(self.chans[-1], self.classes)

    def parameter_count(self) -> int:
        c = self.config
        convs = sum(c.kernel**2 * a.size * b.size + b.size for a, b in zip(self.chans, self.chans[1:]))
        return convs + c.channels * c.classes + c.classes

    def init(self, key: jax.Array) -> dict[str, Any]:
        """He-normal conv kernels, zero biases, a 1/sqrt(fan_in) classifier; the same under every layout."""
        keys = jax.random.split(key, self.config.layers + 1)
        return {
            "convs": [conv.init(k) for conv, k in zip(self.convs, keys)],
            "dense": self.classifier.init(keys[-1]),
            "dense_bias": md.zeros([self.classes]),
        }

    def logits(self, params: dict[str, Any], images: md.Tensor) -> md.Tensor:
        x = images
        for conv, p in zip(self.convs, params["convs"]):
            x = md.relu(conv(p, x))
        pooled = md.reduce_mean(x, [self.height, self.width])
        return self.classifier(params["dense"], pooled) + params["dense_bias"]

    def loss(self, params: dict[str, Any], batch: dict[str, md.Tensor]) -> md.Tensor:
        """Mean softmax cross-entropy over ``classes``."""
        logits = self.logits(params, batch["images"])
        target = md.reduce_sum(logits * md.one_hot(batch["labels"], self.classes), self.classes)
        return md.reduce_mean(md.logsumexp(logits, self.classes) - target)

    def batch(self, key: jax.Array) -> dict[str, md.Tensor]:
        """A synthetic batch of the task in the module docstring."""
        c = self.config
        k_labels, k_noise = jax.random.split(key)
        labels = md.cast(md.random.bits(k_labels, [self.batch_dim]) % c.classes, jnp.int32)
        image = [self.height, self.width, self.chans[0]]
        colours = md.random.normal(jax.random.key(4321), [self.classes, self.chans[0]])
        textures = md.random.normal(jax.random.key(4322), [self.classes, *image])
        patterns = (colours + textures) * c.signal
        signal = md.einsum(md.one_hot(labels, self.classes), patterns, out=[self.batch_dim, *image])
        return {"images": signal + md.random.normal(k_noise, [self.batch_dim, *image]), "labels": labels}

    def flops_per_step(self) -> float:
        """Model FLOPs of a training step: 3 x (2 per multiply-add) of every conv and the classifier."""
        c = self.config
        pixels = c.batch * c.height * c.width
        convs = sum(2 * pixels * c.kernel**2 * a.size * b.size for a, b in zip(self.chans, self.chans[1:]))
        return 3 * (convs + 2 * c.batch * c.channels * c.classes)

    def examples_per_step(self) -> int:
        return self.config.batch
