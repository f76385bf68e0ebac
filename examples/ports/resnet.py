"""A bottleneck ResNet (``transformers.ResNetForImageClassification``) in NNX, channels-last, with its key map.

Math: a stem (7x7 stride-2 conv, BatchNorm, ReLU, 3x3 stride-2 max pool padded with
-inf), stages of bottleneck blocks ``relu(expand(spatial(reduce(x))) + shortcut(x))``
(1x1 reduce to ``out / 4`` channels, 3x3 with the stage's stride, 1x1 expand without
ReLU; the shortcut a 1x1 conv and BatchNorm where the shape changes, else the identity),
a global average pool and a linear classifier. BatchNorm runs on its running
statistics (``train=False``), held as ``nnx.BatchStat``.

Unlike transformers' module tree: images are NHWC and kernels ``(kh, kw, in, out)``;
each conv-norm pair is one :class:`ConvNorm`; a block names its parts ``reduce``,
``spatial``, ``expand`` and ``proj``; the stem wraps its one conv-norm child.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from flax_ln.convert import KeyMap


@dataclasses.dataclass(frozen=True)
class ResNetConfig:
    """The sizes of a bottleneck ResNet."""

    channels: int
    stem: int
    widths: tuple[int, ...]
    depths: tuple[int, ...]
    classes: int
    downsample_first_stage: bool = False


def config_from_hf(hf: Any) -> ResNetConfig:
    """The :class:`ResNetConfig` of a ``transformers.ResNetConfig`` (bottleneck layers, ReLU)."""
    if hf.layer_type != "bottleneck" or hf.hidden_act != "relu" or hf.downsample_in_bottleneck:
        raise ValueError("this port covers bottleneck ResNets with ReLU that downsample in the 3x3 conv")
    return ResNetConfig(
        hf.num_channels,
        hf.embedding_size,
        tuple(hf.hidden_sizes),
        tuple(hf.depths),
        hf.num_labels,
        hf.downsample_in_first_stage,
    )


class ConvNorm(nnx.Module):
    """``act(batchnorm(conv(x)))`` on NHWC: a bias-free conv padded by ``kernel // 2``, then BatchNorm (eps 1e-5)."""

    def __init__(self, cin: int, cout: int, kernel: int, stride: int = 1, *, relu=True, param_dtype, rngs: nnx.Rngs):
        pad = kernel // 2
        self.conv = nnx.Conv(
            cin, cout, (kernel, kernel), strides=stride, padding=((pad, pad), (pad, pad)), use_bias=False,
            param_dtype=param_dtype, rngs=rngs,
        )  # fmt: skip
        self.norm = nnx.BatchNorm(cout, use_running_average=True, epsilon=1e-5, param_dtype=param_dtype, rngs=rngs)
        self.relu = relu

    def __call__(self, x: jax.Array) -> jax.Array:
        y = self.norm(self.conv(x))
        return jax.nn.relu(y) if self.relu else y


class Stem(nnx.Module):
    """A wrapper around one :class:`ConvNorm` (7x7, stride 2): the same parameters, then a 3x3 stride-2 max pool."""

    def __init__(self, c: ResNetConfig, *, param_dtype, rngs: nnx.Rngs):
        self.unit = ConvNorm(c.channels, c.stem, 7, 2, param_dtype=param_dtype, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return nnx.max_pool(self.unit(x), (3, 3), strides=(2, 2), padding=((1, 1), (1, 1)))


class Bottleneck(nnx.Module):
    """``relu(expand(spatial(reduce(x))) + proj(x))``; ``proj`` is None (the identity) when the shape is kept."""

    def __init__(self, cin: int, cout: int, stride: int, *, param_dtype, rngs: nnx.Rngs):
        mid = cout // 4
        kw = dict(param_dtype=param_dtype, rngs=rngs)
        self.reduce = ConvNorm(cin, mid, 1, **kw)
        self.spatial = ConvNorm(mid, mid, 3, stride, **kw)
        self.expand = ConvNorm(mid, cout, 1, relu=False, **kw)
        self.proj = ConvNorm(cin, cout, 1, stride, relu=False, **kw) if cin != cout or stride != 1 else None

    def __call__(self, x: jax.Array) -> jax.Array:
        y = self.expand(self.spatial(self.reduce(x)))
        return jax.nn.relu(y + (x if self.proj is None else self.proj(x)))


class ResNet(nnx.Module):
    """NHWC images (B, H, W, C) -> class logits (B, classes)."""

    def __init__(self, c: ResNetConfig, *, param_dtype=jnp.float32, rngs: nnx.Rngs):
        self.stem = Stem(c, param_dtype=param_dtype, rngs=rngs)
        stages, cin = [], c.stem
        for s, (width, depth) in enumerate(zip(c.widths, c.depths)):
            stride = 2 if (s > 0 or c.downsample_first_stage) else 1
            blocks = [Bottleneck(cin, width, stride, param_dtype=param_dtype, rngs=rngs)]
            blocks += [Bottleneck(width, width, 1, param_dtype=param_dtype, rngs=rngs) for _ in range(depth - 1)]
            stages.append(nnx.List(blocks))
            cin = width
        self.stages = nnx.List(stages)
        self.classify = nnx.Linear(cin, c.classes, param_dtype=param_dtype, rngs=rngs)

    def __call__(self, images: jax.Array) -> jax.Array:
        x = self.stem(images)
        for stage in self.stages:
            for block in stage:
                x = block(x)
        return self.classify(x.mean(axis=(1, 2)))  # (B, C) -> (B, classes)


def _conv_norm(torch_prefix: str, flax_prefix: str) -> list[tuple[str, str, Any]]:
    """The rules of one transformers ResNetConvLayer / ResNetShortCut onto one :class:`ConvNorm`."""
    bn = torch_prefix + r"\.normalization\."
    return [
        (torch_prefix + r"\.convolution\.weight", flax_prefix + ".conv.kernel", "o i kh kw -> kh kw i o"),
        (bn + "weight", flax_prefix + ".norm.scale", None),
        (bn + "bias", flax_prefix + ".norm.bias", None),
        (bn + "running_mean", flax_prefix + ".norm.mean", None),
        (bn + "running_var", flax_prefix + ".norm.var", None),
    ]


_BLOCK = r"resnet\.encoder\.stages\.(\d+)\.layers\.(\d+)"
KEY_MAP = KeyMap(
    [
        *_conv_norm(r"resnet\.embedder\.embedder", "stem.unit"),
        *_conv_norm(_BLOCK + r"\.layer\.0", r"stages.\1.\2.reduce"),
        *_conv_norm(_BLOCK + r"\.layer\.1", r"stages.\1.\2.spatial"),
        *_conv_norm(_BLOCK + r"\.layer\.2", r"stages.\1.\2.expand"),
        *_conv_norm(_BLOCK + r"\.shortcut", r"stages.\1.\2.proj"),
        (r".*\.num_batches_tracked", None, None),  # torch's batch count; eval-mode BatchNorm never reads it
        (r"classifier\.1\.weight", "classify.kernel", "o i -> i o"),
        (r"classifier\.1\.bias", "classify.bias", None),
    ]
)
