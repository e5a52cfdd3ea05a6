"""The built-in models and their loss.

    tf_setup(deterministic=True, intra_op_threads=1)   # before anything else in TensorFlow
    model = build_model("cnn", seed=0)
    loss, payload = Gradients(model, loss)(x, y, pulled)   # worker.gradients: every runner's path

Every model (``MODELS``, from the smallest: ``tiny``, 7,850 parameters, to ``mlp25m``,
25,330,442, the size the training benchmark ``bench/training.py`` compares on; each with its
layers and size in docs/your-model.md) takes 28x28x1 images and ends in Dense(10, softmax),
with sparse categorical cross-entropy.

Loss scaling: each worker differentiates the *mean* loss over its own shard;
the server takes the batch-weighted mean of those gradients. That equals
``tf.nn.compute_average_loss(per_example, global_batch_size=B)`` with summed
replica gradients, the convention of TensorFlow's MirroredStrategy.
"""

from __future__ import annotations

import os

import numpy as np

MODELS = ("tiny", "deepcnn", "cnn", "mlp", "mlp25m")


def tf_setup(deterministic: bool = True, intra_op_threads: int = 0):
    """Configure TensorFlow before first use; returns the tensorflow module.

    With ``deterministic``, oneDNN is switched off (it must be, before TensorFlow
    is imported, and it changes bits) and op determinism is enabled, so equal
    inputs give equal bits across processes with the same thread counts.
    """
    if deterministic:
        os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf

    if intra_op_threads:
        tf.config.threading.set_intra_op_parallelism_threads(intra_op_threads)
    if deterministic:
        tf.config.experimental.enable_op_determinism()
    return tf


def device_name() -> str:
    import tensorflow as tf

    return "/GPU:0" if tf.config.list_physical_devices("GPU") else "/CPU:0"


def build_model(name: str = "cnn", seed: int = 0):
    import keras

    keras.utils.set_random_seed(seed)
    relu, layers = "relu", keras.layers
    hidden = {  # what each model has between its 28x28x1 input and its 10-way softmax
        "tiny": lambda: [layers.Flatten()],
        "deepcnn": lambda: [layers.Conv2D(16, 3, activation=relu), layers.Conv2D(16, 3, activation=relu),
                            layers.MaxPooling2D(2), layers.Conv2D(32, 3, activation=relu), layers.MaxPooling2D(2),
                            layers.Flatten(), layers.Dense(64, activation=relu)],
        "cnn": lambda: [layers.Conv2D(32, 3, activation=relu), layers.Flatten()],
        "mlp": lambda: [layers.Flatten(), layers.Dense(1024, activation=relu), layers.Dense(128, activation=relu)],
        "mlp25m": lambda: [layers.Flatten(), layers.Dense(8192, activation=relu), layers.Dense(2304, activation=relu)],
    }
    if name not in hidden:
        raise ValueError(f"unknown model {name!r}; choose one of {', '.join(MODELS)}")
    return keras.Sequential([keras.Input(shape=(28, 28, 1)), *hidden[name](), layers.Dense(10, activation="softmax")],
                            name=name)


def save_npz(path: str, values: dict[str, np.ndarray]) -> None:
    """Variables by path to an .npz ('/' in names is stored as '__')."""
    np.savez(path, **{k.replace("/", "__"): v for k, v in values.items()})


def load_npz(path: str) -> dict[str, np.ndarray]:
    with np.load(path) as f:
        return {k.replace("__", "/"): f[k] for k in f.files}


def save_ordered_npz(model, values: dict[str, np.ndarray], path: str) -> None:
    """Values in the model's trainable_variables order, as w0, w1, ... (names may differ across runners)."""
    np.savez(path, **{f"w{i}": values[v.path] for i, v in enumerate(model.trainable_variables)})


def load_ordered_npz(model, path: str) -> None:
    with np.load(path) as f:
        arrays = [f[f"w{i}"] for i in range(len(f.files))]
    variables = model.trainable_variables
    if len(arrays) != len(variables) or any(tuple(v.shape) != a.shape for v, a in zip(variables, arrays)):
        raise ValueError(f"{path} does not hold this model's weights: "
                         f"{[a.shape for a in arrays]} vs {[tuple(v.shape) for v in variables]}")
    for v, a in zip(variables, arrays):
        v.assign(a)


def loss(y_true, probs):
    """The built-in models' per-example loss: sparse categorical cross-entropy of the
    softmax output; ``worker.gradients.Gradients`` differentiates its mean."""
    import keras

    return keras.losses.sparse_categorical_crossentropy(y_true, probs)


def evaluate(model, x: np.ndarray, y: np.ndarray, batch_size: int = 512) -> tuple[float, float]:
    """(mean loss, accuracy) of the model as it is."""
    losses, correct = [], 0
    for start in range(0, len(y), batch_size):
        probs = model(x[start : start + batch_size], training=False)
        yb = y[start : start + batch_size]
        losses.append(np.asarray(loss(yb, probs)))
        correct += int(np.sum(np.argmax(np.asarray(probs), axis=1) == yb))
    return float(np.mean(np.concatenate(losses))), correct / len(y)
