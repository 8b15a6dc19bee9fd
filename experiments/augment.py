"""Image augmentations in JAX (jit/vmap-able, explicit PRNG keys, NHWC, values in [0, 1]).

Used by the ``augment`` pair mode: the two views of a record are two independent
draws of :func:`augment_batch` applied to the same image, on the device.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["random_crop", "random_flip", "color_jitter", "augment_image", "augment_batch"]


def random_crop(key, image, padding: int):
  """Pads by ``padding`` pixels (reflect) and crops back to the original size at a random offset."""
  if padding <= 0:
    return image
  h, w, c = image.shape
  padded = jnp.pad(image, ((padding, padding), (padding, padding), (0, 0)), mode="reflect")
  off = jax.random.randint(key, (2,), 0, 2 * padding + 1)
  return jax.lax.dynamic_slice(padded, (off[0], off[1], 0), (h, w, c))


def random_flip(key, image):
  """Horizontal flip with probability 1/2."""
  return jnp.where(jax.random.bernoulli(key), image[:, ::-1, :], image)


def _grayscale(image):
  if image.shape[-1] == 1:
    return image
  return image @ jnp.asarray([0.299, 0.587, 0.114], image.dtype)[:, None]


def color_jitter(key, image, brightness: float = 0.4, contrast: float = 0.4,
                 saturation: float = 0.4):
  """Random brightness, contrast and saturation factors in ``[1-s, 1+s]``; output clipped to [0, 1].

  Saturation is a no-op on single-channel images.
  """
  kb, kc, ks = jax.random.split(key, 3)
  b = jax.random.uniform(kb, (), minval=1 - brightness, maxval=1 + brightness)
  c = jax.random.uniform(kc, (), minval=1 - contrast, maxval=1 + contrast)
  s = jax.random.uniform(ks, (), minval=1 - saturation, maxval=1 + saturation)
  image = image * b
  mean = jnp.mean(_grayscale(image))
  image = (image - mean) * c + mean
  if image.shape[-1] == 3:
    gray = _grayscale(image)
    image = (image - gray) * s + gray
  return jnp.clip(image, 0.0, 1.0)


def augment_image(key, image, *, crop_padding: int = 4, flip: bool = True, brightness: float = 0.4,
                  contrast: float = 0.4, saturation: float = 0.4):
  """Crop -> flip -> colour jitter for one ``(H, W, C)`` image."""
  k1, k2, k3 = jax.random.split(key, 3)
  image = random_crop(k1, image, crop_padding)
  if flip:
    image = random_flip(k2, image)
  if brightness or contrast or saturation:
    image = color_jitter(k3, image, brightness, contrast, saturation)
  return image


def augment_batch(key, images, **kwargs):
  """Applies :func:`augment_image` independently to each image of ``(n, H, W, C)``."""
  keys = jax.random.split(key, images.shape[0])
  return jax.vmap(lambda k, x: augment_image(k, x, **kwargs))(keys, images)
