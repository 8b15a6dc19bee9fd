"""Flax models used in the Logit-DP experiments (NHWC throughout).

* :class:`EmbeddingNet` -- the paper's small embedding network: three 3x3
  stride-2 convolutions with 8/16/32 channels and ReLU (Kaiming-normal init),
  global mean pooling and a dense projection to ``embedding_dim`` (8 in the
  paper, Xavier-normal init).
* :class:`ResNet18` -- ResNet-18 (CIFAR variant: 3x3 stem, no max-pool) without
  batch normalisation, optionally with GroupNorm.  Batch norm mixes examples in a
  batch, which breaks per-example clipping, so it is never used.
* :class:`FinetuneHead` -- the 64-32-``num_classes`` MLP trained on top of a
  frozen encoder for CIFAR-100 (20 coarse classes) fine-tuning.
* :class:`LoRADense` -- a Dense layer with a low-rank adapter beside its kernel (LoRA), to
  fine-tune the adapter alone with ``make_private(..., trainable=)``; ``MLPEmbedding(lora_rank=r)``
  puts one in every layer.
* :class:`TextTransformer` -- a pre-LayerNorm transformer text encoder (token and learned
  position embeddings, flax's ``MultiHeadDotProductAttention``, mean pooling).
* :class:`ViT` -- a Vision Transformer (patch convolution, class token, learned positions).
  The two make a CLIP pair (image tower and text tower in one params pytree).

Every model maps a batch ``(n, H, W, C)`` to ``(n, d)`` and treats examples
independently, as required by :func:`logit_dp.clipped_grad`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax.numpy as jnp

__all__ = [
    "EmbeddingNet", "ResNet18", "ResNetBlock", "FinetuneHead", "LoRADense", "MLPEmbedding",
    "TransformerBlock", "TextTransformer", "ViT", "is_lora", "make_model"
]

kaiming_normal = nn.initializers.variance_scaling(2.0, "fan_in", "normal")
xavier_normal = nn.initializers.xavier_normal()


class EmbeddingNet(nn.Module):
  """Three 3x3 stride-2 convolutions (8/16/32), mean pool, dense to ``embedding_dim``."""

  embedding_dim: int = 8
  channels: Sequence[int] = (8, 16, 32)
  dtype: Any = None  # computation dtype; None: that of the params and inputs

  @nn.compact
  def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
    """(n, H, W, C) images -> (n, embedding_dim) embeddings."""
    x = jnp.asarray(x, self.dtype)
    for c in self.channels:
      x = nn.Conv(c, (3, 3), strides=(2, 2), padding="SAME", kernel_init=kaiming_normal,
                  dtype=self.dtype)(x)
      x = nn.relu(x)
    x = jnp.mean(x, axis=(1, 2))  # global mean pool over H, W (NHWC)
    return nn.Dense(self.embedding_dim, kernel_init=xavier_normal, dtype=self.dtype)(x)


class ResNetBlock(nn.Module):
  """Basic residual block (two 3x3 convs) with an optional per-example norm."""

  filters: int
  strides: int = 1
  norm: Callable[..., nn.Module] | None = None

  @nn.compact
  def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
    """relu(x + norm(conv(relu(norm(conv(x)))))), x projected by a 1x1 conv if shapes differ."""
    residual = x
    use_bias = self.norm is None  # a norm's own offset replaces the bias
    y = nn.Conv(self.filters, (3, 3), strides=(self.strides,) * 2, padding="SAME",
                use_bias=use_bias, kernel_init=kaiming_normal)(x)
    if self.norm is not None:
      y = self.norm()(y)
    y = nn.relu(y)
    y = nn.Conv(self.filters, (3, 3), padding="SAME", use_bias=use_bias,
                kernel_init=kaiming_normal)(y)
    if self.norm is not None:
      # Zero-initialised last scale: each block starts as the identity, which
      # keeps a norm-free-ish ResNet trainable.
      y = self.norm(scale_init=nn.initializers.zeros)(y)
    if residual.shape != y.shape:
      residual = nn.Conv(self.filters, (1, 1), strides=(self.strides,) * 2, use_bias=use_bias,
                         kernel_init=kaiming_normal, name="proj")(residual)
      if self.norm is not None:
        residual = self.norm(name="proj_norm")(residual)
    return nn.relu(residual + y)


class ResNet18(nn.Module):
  """ResNet-18 without batch norm; ``norm="group"`` adds GroupNorm, ``None`` nothing.

  CIFAR variant (3x3 stride-1 stem, no max-pool), stages of 2 blocks with
  ``width, 2*width, 4*width, 8*width`` filters, global mean pool and a dense
  projection to ``embedding_dim``.
  """

  embedding_dim: int = 8
  width: int = 64
  stage_sizes: Sequence[int] = (2, 2, 2, 2)
  norm: str | None = None
  num_groups: int = 32

  @nn.compact
  def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
    """(n, H, W, C) images -> (n, embedding_dim) embeddings."""
    if self.norm is None or self.norm == "none":
      norm = None
    elif self.norm == "group":
      norm = functools.partial(nn.GroupNorm, num_groups=self.num_groups)
    else:
      raise ValueError(f"unknown norm {self.norm!r}: use None or 'group' "
                       "(batch norm would mix examples and break per-example clipping)")
    x = jnp.asarray(x, jnp.float32)
    x = nn.Conv(self.width, (3, 3), padding="SAME", use_bias=norm is None,
                kernel_init=kaiming_normal, name="stem")(x)
    if norm is not None:
      x = norm(name="stem_norm")(x)
    x = nn.relu(x)
    for i, n_blocks in enumerate(self.stage_sizes):
      for j in range(n_blocks):
        strides = 2 if i > 0 and j == 0 else 1
        x = ResNetBlock(self.width * 2 ** i, strides=strides, norm=norm)(x)
    x = jnp.mean(x, axis=(1, 2))
    return nn.Dense(self.embedding_dim, kernel_init=xavier_normal)(x)


class FinetuneHead(nn.Module):
  """MLP head ``hidden -> ... -> num_classes`` (64-32-20 in the paper)."""

  hidden: Sequence[int] = (64, 32)
  num_classes: int = 20

  @nn.compact
  def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
    """(n, d) embeddings -> (n, num_classes) logits."""
    for h in self.hidden:
      x = nn.relu(nn.Dense(h, kernel_init=kaiming_normal)(x))
    return nn.Dense(self.num_classes, kernel_init=xavier_normal)(x)


class LoRADense(nn.Module):
  """y = x·W + b + (α/r)·(x·A)·B: a Dense layer and a rank-r adapter beside its kernel (LoRA).

  Its params are those of ``nn.Dense`` (``kernel`` W, ``bias`` b: a pretrained Dense's values
  load into them as they are) and the adapter's ``lora_a`` A (in, r), drawn N(0, 1/in), and
  ``lora_b`` B (r, features), zeros: the adapted layer starts as the pretrained one. Fine-tune
  the adapter alone with ``make_private(..., trainable=logit_dp.models.is_lora)``; its pair
  norms are those of A and B (the adapter's two matrix products are layers of their own).
  """

  features: int
  rank: int = 4
  alpha: float | None = None  # None: α = r, a scale of 1
  kernel_init: Callable[..., Any] = nn.initializers.lecun_normal()

  @nn.compact
  def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
    """(..., in) -> (..., features)."""
    kernel = self.param("kernel", self.kernel_init, (x.shape[-1], self.features))
    bias = self.param("bias", nn.initializers.zeros, (self.features,))
    a = self.param("lora_a", nn.initializers.normal(x.shape[-1] ** -0.5), (x.shape[-1], self.rank))
    b = self.param("lora_b", nn.initializers.zeros, (self.rank, self.features))
    scale = (self.rank if self.alpha is None else self.alpha) / self.rank
    return x @ kernel + bias + scale * ((x @ a) @ b)


def is_lora(path, leaf) -> bool:
  """The ``trainable=`` predicate of the LoRA adapters: True for the ``lora_a`` and ``lora_b``
  leaves of `LoRADense` layers, False for every other leaf (the pretrained weights)."""
  del leaf
  return bool(path) and getattr(path[-1], "key", None) in ("lora_a", "lora_b")


class MLPEmbedding(nn.Module):
  """A tiny MLP embedding (flattens the image): for tests and the quickstart notebook.

  ``lora_rank`` r > 0 makes every layer a `LoRADense` of rank r, named as the plain model's
  layers (``Dense_0``, ...), so a plain model's pretrained params load into it.
  """

  embedding_dim: int = 8
  hidden: Sequence[int] = (32,)
  lora_rank: int = 0

  @nn.compact
  def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
    """(n, ...) inputs, flattened per example -> (n, embedding_dim) embeddings."""
    def dense(features, index, init):
      if self.lora_rank:
        return LoRADense(features, self.lora_rank, kernel_init=init, name=f"Dense_{index}")
      return nn.Dense(features, kernel_init=init)

    x = jnp.asarray(x, jnp.float32).reshape(x.shape[0], -1)
    for i, h in enumerate(self.hidden):
      x = nn.relu(dense(h, i, kaiming_normal)(x))
    return dense(self.embedding_dim, len(self.hidden), xavier_normal)(x)


class TransformerBlock(nn.Module):
  """Pre-LayerNorm block: x + Attn(LN(x)), then x + MLP(LN(x)) (GELU), on (n, T, width)."""

  num_heads: int = 4
  mlp_dim: int = 256

  @nn.compact
  def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
    """(n, T, width) -> (n, T, width)."""
    h = nn.LayerNorm()(x)
    x = x + nn.MultiHeadDotProductAttention(num_heads=self.num_heads)(h, h)
    h = nn.LayerNorm()(x)
    h = nn.Dense(self.mlp_dim)(h)
    return x + nn.Dense(x.shape[-1])(nn.gelu(h))


class _TransformerEncoder(nn.Module):
  """The sizes both encoders share: ``depth`` pre-LN blocks of ``width`` features."""

  width: int = 64
  depth: int = 2
  num_heads: int = 4
  mlp_dim: int = 256
  embedding_dim: int = 32


class TextTransformer(_TransformerEncoder):
  """Token ids (n, length) -> (n, embedding_dim): token embedding plus learned positions,
  ``depth`` pre-LN blocks, a final LayerNorm, mean pooling over tokens and a projection."""

  vocab_size: int = 1000
  length: int = 16

  @nn.compact
  def __call__(self, tokens: jnp.ndarray) -> jnp.ndarray:
    """(n, length) int token ids -> (n, embedding_dim) embeddings."""
    x = nn.Embed(self.vocab_size, self.width)(tokens)
    x = x + self.param("positions", nn.initializers.normal(0.02), (self.length, self.width))
    for _ in range(self.depth):
      x = TransformerBlock(self.num_heads, self.mlp_dim)(x)
    x = jnp.mean(nn.LayerNorm()(x), axis=1)
    return nn.Dense(self.embedding_dim)(x)


class ViT(_TransformerEncoder):
  """Images (n, H, W, C) -> (n, embedding_dim): ``patch_size`` patches embedded by a strided
  convolution, a class token and learned positions, ``depth`` pre-LN blocks, a final
  LayerNorm of the class token and a projection."""

  patch_size: int = 4

  @nn.compact
  def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
    """(n, H, W, C) images -> (n, embedding_dim) embeddings."""
    p = self.patch_size
    x = nn.Conv(self.width, (p, p), strides=(p, p), padding="VALID")(jnp.asarray(x, jnp.float32))
    x = x.reshape(x.shape[0], -1, self.width)
    cls = self.param("cls", nn.initializers.zeros, (1, 1, self.width))
    x = jnp.concatenate([jnp.broadcast_to(cls, (x.shape[0], 1, self.width)), x], axis=1)
    x = x + self.param("positions", nn.initializers.normal(0.02), x.shape[1:])
    for _ in range(self.depth):
      x = TransformerBlock(self.num_heads, self.mlp_dim)(x)
    return nn.Dense(self.embedding_dim)(nn.LayerNorm()(x[:, 0]))


def make_model(name: str, **kwargs) -> nn.Module:
  """Builds a model by name: ``embedding_net``, ``resnet18``, ``mlp``, ``text_transformer`` or
  ``vit``."""
  if name == "embedding_net":
    return EmbeddingNet(**kwargs)
  if name == "resnet18":
    return ResNet18(**kwargs)
  if name == "mlp":
    return MLPEmbedding(**kwargs)
  if name == "text_transformer":
    return TextTransformer(**kwargs)
  if name == "vit":
    return ViT(**kwargs)
  raise ValueError(f"unknown model {name!r}")
