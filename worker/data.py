"""Datasets and how each worker gets its shard of every global batch.

    data = load_dataset("digits")                  # offline, bundled with scikit-learn
    for step, batch in enumerate(global_batches(len(data.y_train), 64, epochs=3, seed=0)):
        mine = shard(batch, worker_index=1, num_workers=2)

``global_batches`` and ``shard`` are ``ps_common.batches``' (the same batches in every
process; the union of the workers' shards at a step is exactly the batch one process
would see); the server's batch-weighted aggregation accounts for uneven shards.

Datasets: ``digits`` (scikit-learn's bundled 8x8 digits, resized bilinearly to
28x28x1, values in [0, 1], a fixed stratified 80/20 split: 1,437 training and 360
test images; the embedded default, works offline), ``digits-large`` (digits'
training set ten times over, every copy of an image shifted by its own integer
offset of up to 2 pixels each way and given Gaussian noise of sd 0.05, clipped to
[0, 1], all from a fixed seed: 14,370 training images; the same test set as
digits), ``mnist`` (the Keras loader; needs internet the first time),
``synthetic`` (random images labelled by a fixed random linear map; for tests).
NumPy only, except the mnist loader.

    small = train_subset(load_dataset("digits"), 200)   # ps-worker --train-examples 200

``train_subset`` keeps N training examples, the same N in every process and for
every ``--seed``: each label gets its share of N (largest remainders), drawn with
a generator of fixed seed 0; the test set is unchanged.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ps_common.batches import global_batches, shard, steps_per_epoch  # this module's API too (__all__)

DATASETS = ("digits", "digits-large", "mnist", "synthetic")
LARGE_COPIES = 10  # digits-large: augmented copies of each digits training image
SUBSET_SEED = 0  # train_subset draws with this, whatever the run's --seed
IMAGE_SHAPE = (28, 28, 1)
NUM_CLASSES = 10


@dataclasses.dataclass(frozen=True)
class Dataset:
    name: str
    x_train: np.ndarray  # float32 (n, 28, 28, 1)
    y_train: np.ndarray  # int64 (n,)
    x_test: np.ndarray
    y_test: np.ndarray


def resize_images(images: np.ndarray, size: int) -> np.ndarray:
    """Bilinear resize (align-centers) of (n, h, w) square images to (n, size, size): ``r @ image @ r.T``
    with ``r`` the (size, h) matrix that resizes a row or a column."""
    n_in = images.shape[1]
    src = (np.arange(size) + 0.5) * (n_in / size) - 0.5  # each output sample's position in the input
    lo = np.floor(src).astype(np.int64)
    r = np.zeros((size, n_in), dtype=np.float64)
    for j, w in ((lo, 1.0 - (src - lo)), (lo + 1, src - lo)):
        np.add.at(r, (np.arange(size), np.clip(j, 0, n_in - 1)), w)  # the edges clamp, both weights on one pixel
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


def _digits_large() -> Dataset:
    """digits' training images, each ``LARGE_COPIES`` times, shifted and noised (module docstring)."""
    base = _digits()
    rng = np.random.default_rng(0)
    n, h, w, _ = base.x_train.shape
    copies, s, noise_sd = LARGE_COPIES, 2, 0.05  # s: the largest shift each way
    padded = np.pad(base.x_train[..., 0], ((0, 0), (s, s), (s, s)))
    out = np.empty((copies * n, h, w), dtype=np.float32)
    for c in range(copies):
        shifts = rng.integers(-s, s + 1, size=(n, 2))
        copy = out[c * n: (c + 1) * n]  # a view
        for i, (dy, dx) in enumerate(shifts):
            # The image moved by (dy, dx): output pixel (r, q) shows input pixel (r - dy, q - dx).
            copy[i] = padded[i, s - dy: s - dy + h, s - dx: s - dx + w]
        copy[:] = np.clip(copy + rng.normal(0.0, noise_sd, size=(n, h, w)), 0.0, 1.0)
    return Dataset("digits-large", out[..., None], np.tile(base.y_train, copies), base.x_test, base.y_test)


def train_subset(data: Dataset, n: int) -> Dataset:
    """``data`` with N training examples, stratified by label, the same for every run (module
    docstring); N = 0 keeps them all. ``ValueError`` for N < 0 or more than the set holds."""
    total = len(data.y_train)
    if n < 0:
        raise ValueError(f"--train-examples must be >= 0 (0: all), got {n}")
    if n > total:
        raise ValueError(f"--train-examples {n} is more than the {total} training examples of {data.name}")
    if n in (0, total):
        return data
    labels, counts = np.unique(data.y_train, return_counts=True)
    exact = counts * n / total
    share = np.floor(exact).astype(np.int64)
    # Largest remainders get the examples flooring left over (ties to the smaller label).
    share[np.argsort(-(exact - share), kind="stable")[: n - int(share.sum())]] += 1
    rng = np.random.default_rng(SUBSET_SEED)
    keep = [rng.choice(np.flatnonzero(data.y_train == label), size=k, replace=False)
            for label, k in zip(labels, share)]
    idx = np.sort(np.concatenate(keep))
    return dataclasses.replace(data, x_train=data.x_train[idx], y_train=data.y_train[idx])


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
    loaders = {"digits": _digits, "digits-large": _digits_large, "mnist": _mnist, "synthetic": _synthetic}
    if name not in loaders:
        raise ValueError(f"unknown dataset {name!r}; choose one of {', '.join(DATASETS)}")
    return loaders[name]()


__all__ = ["DATASETS", "IMAGE_SHAPE", "NUM_CLASSES", "Dataset", "load_dataset", "resize_images", "train_subset",
           "global_batches", "shard", "steps_per_epoch"]
