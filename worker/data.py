"""Datasets and how each worker gets its shard of every global batch.

    data = load_dataset("digits")                  # offline, bundled with scikit-learn
    for step, batch in enumerate(global_batches(len(data.y_train), 64, epochs=3, seed=0)):
        mine = shard(batch, worker_index=1, num_workers=2)

``global_batches`` yields the same index batches in every process (a seeded
shuffle per epoch), and ``shard`` splits each one into contiguous parts, so the
union of all workers' shards at a step is exactly the batch one process would
see, in the same order (MirroredStrategy splits a batch the same way). The last
batch of an epoch may be smaller; shards are then uneven, and the server's
batch-weighted aggregation accounts for it.

Datasets: ``digits`` (scikit-learn's bundled 8x8 digits, resized bilinearly to
28x28x1, values in [0, 1], a fixed stratified 80/20 split; the embedded default,
works offline), ``mnist`` (the Keras loader; needs internet the first time),
``synthetic`` (random images labelled by a fixed random linear map; for tests).
NumPy only, except the mnist loader.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from ps_common.batches import global_batches, shard, steps_per_epoch  # noqa: F401 (this module's API)

DATASETS = ("digits", "mnist", "synthetic")
IMAGE_SHAPE = (28, 28, 1)
NUM_CLASSES = 10


@dataclasses.dataclass(frozen=True)
class Dataset:
    name: str
    x_train: np.ndarray  # float32 (n, 28, 28, 1)
    y_train: np.ndarray  # int64 (n,)
    x_test: np.ndarray
    y_test: np.ndarray


def _bilinear_matrix(n_in: int, n_out: int) -> np.ndarray:
    """(n_out, n_in) matrix resizing a 1-D signal bilinearly (align-centers)."""
    m = np.zeros((n_out, n_in), dtype=np.float64)
    scale = n_in / n_out
    for i in range(n_out):
        src = (i + 0.5) * scale - 0.5
        lo = int(math.floor(src))
        frac = src - lo
        for j, w in ((lo, 1.0 - frac), (lo + 1, frac)):
            m[i, min(max(j, 0), n_in - 1)] += w
    return m


def resize_images(images: np.ndarray, size: int) -> np.ndarray:
    """Bilinear resize of (n, h, w) square images to (n, size, size)."""
    r = _bilinear_matrix(images.shape[1], size)
    return np.einsum("ij,njk,lk->nil", r, images, r)


def _digits() -> Dataset:
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    bunch = load_digits()
    images = resize_images(bunch.images.astype(np.float64) / 16.0, IMAGE_SHAPE[0])
    x = np.clip(images, 0.0, 1.0).astype(np.float32)[..., None]
    y = bunch.target.astype(np.int64)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.2, random_state=0, stratify=y)
    return Dataset("digits", x_train, y_train, x_test, y_test)


def _mnist() -> Dataset:
    try:
        import keras

        (x_train, y_train), (x_test, y_test) = keras.datasets.mnist.load_data()
    except Exception as e:  # offline machines: say what to do instead
        raise RuntimeError(f"cannot load mnist ({type(e).__name__}: {e}); use --dataset digits offline") from None
    prep = lambda x: (x.astype(np.float32) / 255.0)[..., None]
    return Dataset("mnist", prep(x_train), y_train.astype(np.int64), prep(x_test), y_test.astype(np.int64))


def _synthetic(n_train: int = 1024, n_test: int = 256, seed: int = 1234) -> Dataset:
    rng = np.random.default_rng(seed)
    dim = int(np.prod(IMAGE_SHAPE))
    w = rng.standard_normal((dim, NUM_CLASSES))
    x = rng.random((n_train + n_test, dim), dtype=np.float64)
    y = np.argmax((x - 0.5) @ w, axis=1).astype(np.int64)
    x = x.astype(np.float32).reshape((-1,) + IMAGE_SHAPE)
    return Dataset("synthetic", x[:n_train], y[:n_train], x[n_train:], y[n_train:])


def load_dataset(name: str) -> Dataset:
    if name == "digits":
        return _digits()
    if name == "mnist":
        return _mnist()
    if name == "synthetic":
        return _synthetic()
    raise ValueError(f"unknown dataset {name!r}; choose one of {', '.join(DATASETS)}")


