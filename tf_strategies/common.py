"""What every parity runner shares: the spec of a run, its result, and the rules.

    spec = RunSpec(model="cnn", steps=20, optimizer="adam")
    result = RunResult(runner="mirrored", losses=[...], weights_step1=[...], weights_final=[...], ...)
    save_result(out_dir, result); result = load_result(out_dir)

Every runner trains ``spec.model`` (``worker.model.build_model``) from the same
initial weights (``spec.initial_weights``, an .npz written once per parity
run by ``write_initial_weights``) on the same global batches
(``worker.data.global_batches`` with ``spec.seed``), each split into
contiguous shards with ``worker.data.shard`` (shard i goes to replica or worker
i).

The one loss-scaling rule: each replica's loss is
``tf.nn.compute_average_loss(per_example_loss, global_batch_size=B)`` where B is
the number of examples in this step's global batch, and replica gradients are
summed. That equals every worker taking the mean over its own shard and the
parameter server weighting the means by batch share, which is what ours does.
``RunSpec.loss_scaling = "wrong-local-mean"`` deliberately breaks it (each
replica takes its local mean, and the sums double the gradient) to show that
the parity check catches a scaling bug.

Determinism: oneDNN off (``TF_ENABLE_ONEDNN_OPTS=0`` before TensorFlow is
imported), ``keras.utils.set_random_seed(seed)``, op determinism on, and the
same intra-op thread count in every process (``worker.model.tf_setup``).

Weights are compared as lists in the model's ``trainable_variables`` order,
so runners need not agree on variable names.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Sequence

import numpy as np

LOSS_SCALINGS = ("global", "wrong-local-mean")


@dataclasses.dataclass(frozen=True)
class RunSpec:
    model: str = "cnn"
    dataset: str = "digits"
    steps: int = 20
    global_batch_size: int = 64
    optimizer: str = "sgd"
    learning_rate: float = 0.0  # 0: Keras' default for the optimizer
    seed: int = 0
    num_workers: int = 2
    intra_op_threads: int = 1
    deterministic: bool = True
    loss_scaling: str = "global"
    initial_weights: str = ""  # .npz of the initial trainable weights, in model order
    heartbeat_timeout_s: float = 0.0  # MWMS' coordination service; 0: TensorFlow's own (10 s)

    @property
    def lr(self) -> float:
        return self.learning_rate or {"sgd": 0.01, "adam": 0.001}[self.optimizer]

    def keras_optimizer(self):
        """A fresh Keras optimizer with exactly the hyperparameters ours uses."""
        import keras

        if self.optimizer == "sgd":
            return keras.optimizers.SGD(learning_rate=self.lr)
        return keras.optimizers.Adam(learning_rate=self.lr, beta_1=0.9, beta_2=0.999, epsilon=1e-7)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "RunSpec":
        return cls(**json.loads(text))


@dataclasses.dataclass
class RunResult:
    runner: str
    losses: list[float]  # per step: the global batch's mean loss (async runners: per applied update)
    weights_step1: list[np.ndarray] | None  # after the first step, in trainable_variables order
    weights_final: list[np.ndarray]  # after the last step
    test_accuracy: float
    steps_per_s: float
    examples: int  # training examples consumed
    wall_s: float
    notes: str = ""
    step_ends_s: list[float] = dataclasses.field(default_factory=list)  # each step's end, from the first's start


def save_result(out_dir: str, result: RunResult) -> None:
    os.makedirs(out_dir, exist_ok=True)
    arrays = {f"final_{i}": w for i, w in enumerate(result.weights_final)}
    if result.weights_step1 is not None:
        arrays.update({f"step1_{i}": w for i, w in enumerate(result.weights_step1)})
    np.savez(os.path.join(out_dir, "weights.npz"), **arrays)
    meta = dataclasses.asdict(result)
    meta.pop("weights_final")
    meta.pop("weights_step1")
    meta["num_weights"] = len(result.weights_final)
    meta["has_step1"] = result.weights_step1 is not None
    tmp = os.path.join(out_dir, "result.json.tmp")
    with open(tmp, "w") as f:
        json.dump(meta, f, indent=2)
    os.replace(tmp, os.path.join(out_dir, "result.json"))


def load_result(out_dir: str) -> RunResult:
    with open(os.path.join(out_dir, "result.json")) as f:
        meta = json.load(f)
    n = meta.pop("num_weights")
    has_step1 = meta.pop("has_step1")
    with np.load(os.path.join(out_dir, "weights.npz")) as w:
        final = [w[f"final_{i}"] for i in range(n)]
        step1 = [w[f"step1_{i}"] for i in range(n)] if has_step1 else None
    return RunResult(weights_final=final, weights_step1=step1, **meta)


def write_initial_weights(spec: RunSpec, path: str) -> None:
    """Build the model once with spec.seed and save its trainable weights in order."""
    from worker import model as models

    models.tf_setup(spec.deterministic, spec.intra_op_threads)
    model = models.build_model(spec.model, spec.seed)
    np.savez(path, **{f"w{i}": np.asarray(v.numpy()) for i, v in enumerate(model.trainable_variables)})


def load_initial_weights(path: str) -> list[np.ndarray]:
    with np.load(path) as f:
        return [f[f"w{i}"] for i in range(len(f.files))]


def assign_weights(variables: Sequence, values: Sequence[np.ndarray]) -> None:
    if len(variables) != len(values):
        raise ValueError(f"{len(values)} arrays for {len(variables)} variables")
    for v, a in zip(variables, values):
        if tuple(v.shape) != a.shape:
            raise ValueError(f"{v.path if hasattr(v, 'path') else v.name}: shape {tuple(v.shape)} != {a.shape}")
        v.assign(a)


def step_batches(spec: RunSpec, num_examples: int):
    """(global batch indices, [shard indices per worker]) for each of spec.steps steps."""
    from worker.data import global_batches, shard, steps_per_epoch

    per_epoch = steps_per_epoch(num_examples, spec.global_batch_size)
    epochs = -(-spec.steps // per_epoch)
    batches = global_batches(num_examples, spec.global_batch_size, epochs, spec.seed)
    for _, batch in zip(range(spec.steps), batches):
        yield batch, [shard(batch, i, spec.num_workers) for i in range(spec.num_workers)]


def max_abs_diff(a: Sequence[np.ndarray], b: Sequence[np.ndarray]) -> float:
    if len(a) != len(b):
        raise ValueError(f"different numbers of variables: {len(a)} vs {len(b)}")
    return max(float(np.max(np.abs(x.astype(np.float64) - y.astype(np.float64)))) for x, y in zip(a, b))
