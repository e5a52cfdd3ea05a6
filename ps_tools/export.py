"""``ps-export``: write a parameter server's state as a Keras model file.

    ps-export --checkpoint /ckpt --model cnn --out model.keras            # newest valid checkpoint in /ckpt
    ps-export --checkpoint /ckpt/ckpt-000000000069.tfps --out cnn.weights.h5
    ps-export --from-server 127.0.0.1:50051 --model cnn --out model.keras  # the live parameters

The model is ``worker.model.build_model(--model)``, the one the workers train;
each of its trainable variables takes the array stored under its path
(``cnn/dense/kernel``). Names or shapes that do not match are an error that
lists the differences; nothing is written then.

- ``.keras``: the whole model, for ``keras.models.load_model``. It is compiled
  with the workers' loss, an accuracy metric and the server's optimizer, so
  ``evaluate`` works as loaded. The optimizer also carries the server's slots
  and step count (``worker.keras_optimizer.load_state``, every optimizer), from a
  checkpoint or from a live server (one Pull of the parameters with their state,
  all of one version), so ``fit`` continues where the server stopped (the
  server's optimizers compute what Keras computes).
- ``.weights.h5``: the weights only, for ``model.load_weights`` on
  ``build_model(--model)``.

The file is written under a temporary name and renamed, so a reader never
opens half of it. A checkpoint is read one array at a time as the model takes it
(``read_checkpoint(..., lazy=True)``): beside the model's own weights and slots,
memory holds one array of the checkpoint, never a second copy of the state. A live
server's parameters come in one pull, so that they are all of one version; memory
then holds them beside the model's weights, two copies: for a multi-GiB table, export
from a checkpoint. Exit status 2 for bad flags or a mismatch, 1 when the source cannot
be read.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

from ps_common import security
from ps_server.core.checkpoint import CheckpointError, ServerState, latest_valid, read_checkpoint
from ps_common.settings import ConfigError
from worker.client import PSClient, PSClientError
from worker.model import MODELS

SUFFIXES = (".weights.h5", ".keras")
# Where Keras 3 keeps each server slot: optimizer attribute, one variable per trainable variable.
class ExportError(RuntimeError):
    """The source and the model do not fit, or the output cannot be written."""


def load_source(checkpoint: str = "", server: str = "", client_options: dict | None = None) -> tuple[ServerState | None, dict, object, str]:
    """(state or None, values, optimizer spec or None, description) from a checkpoint or a server.
    A checkpoint's arrays are each a ``FileArray``, verified but read only when asked."""
    if checkpoint:
        if os.path.isdir(checkpoint):
            found = latest_valid(checkpoint, lazy=True)
            if found is None:
                raise FileNotFoundError(f"no valid checkpoint in {checkpoint}")
            state, path = found
        else:
            state, path = read_checkpoint(checkpoint, lazy=True), checkpoint
        return state, state.values, state.optimizer, f"{path} (version {state.version})"
    with PSClient(server, **(client_options or {})) as client:
        wire = client.status().optimizer
        version, values, states = client.optimizer_state() if wire.name else (*client.pull(), None)
    from ps_server.service import optimizer_from_wire

    spec = optimizer_from_wire(wire) if wire.name else None
    return states, values, spec, f"server {server} (version {version})"


def keras_optimizer(spec):
    """The Keras 3 optimizer the server's ``spec`` reproduces: its class, every argument it
    takes (``ps_common.names.OPTIMIZER_DEFAULTS`` names them) and its schedule."""
    import keras

    from ps_common.names import KERAS_OPTIMIZER_CLASSES, OPTIMIZER_DEFAULTS

    class_name = next(c for c, name in KERAS_OPTIMIZER_CLASSES.items() if name == spec.name)
    kwargs = {field: getattr(spec, field) for field in OPTIMIZER_DEFAULTS[spec.name]}
    if spec.learning_rate_schedule:
        kwargs["learning_rate"] = keras.optimizers.schedules.deserialize(spec.learning_rate_schedule)
    return getattr(keras.optimizers, class_name)(**kwargs)


def assign(model, values: dict[str, np.ndarray]) -> None:
    """Give each trainable variable of ``model`` its array by path; ExportError lists every mismatch.
    An array of a checkpoint (``FileArray``) is read as its variable takes it, one at a time."""
    mine = {v.path: tuple(v.shape) for v in model.trainable_variables}
    theirs = {n: tuple(np.shape(a)) for n, a in values.items()}
    kinds = [
        [f"{n} {list(s)} is not in the source" for n, s in mine.items() if n not in theirs],
        [f"{n} {list(s)} is not in the model" for n, s in theirs.items() if n not in mine],
        [f"{n} is {list(mine[n])} in the model but {list(theirs[n])} in the source"
         for n in mine if n in theirs and mine[n] != theirs[n]],
    ]
    count = sum(map(len, kinds))
    if count:
        shown = [p for kind in kinds for p in kind[:3]]  # a few of each kind
        raise ExportError(f"the source does not hold this model's variables ({count} difference(s)): "
                          + "; ".join(shown) + ("; ..." if len(shown) < count else "")
                          + ": export with the --model the workers trained")
    for v in model.trainable_variables:
        v.assign(np.asarray(values[v.path]))


def compile_like_the_server(model, spec, states: dict | None) -> str:
    """Compile with the workers' loss and the server's optimizer, holding its state (``states``:
    {variable: {slot: array, "iterations": n}}, a checkpoint's or a live server's)."""
    import keras

    from worker.keras_optimizer import load_state

    if spec is None:
        model.compile(loss="sparse_categorical_crossentropy", metrics=["accuracy"])
        return "no optimizer (the server holds none yet)"
    if spec.groups:  # a model's own train_step's (a GAN's): no one optimizer of ps-export's models holds them
        model.compile(loss="sparse_categorical_crossentropy", metrics=["accuracy"])
        return (f"not saved: the server runs {len(spec.groups)} optimizers, each over its own variables; "
                "tfps.keras' model.save writes them into the model's own")
    optimizer = keras_optimizer(spec)
    model.compile(optimizer=optimizer, loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    variables = model.trainable_variables
    try:
        step = load_state(optimizer, variables, states)
    except ValueError as e:
        raise ExportError(str(e)) from None
    steps = sorted({int(states[v.path]["iterations"]) for v in variables})
    note = f"{spec.name} with the server's slots at step {step}"
    if len(steps) > 1:  # an async checkpoint taken while a push was half applied
        note += f" (variables were at steps {steps[0]}..{steps[-1]}; Keras keeps one count)"
    return note


def export(out: str, model_name: str = "cnn", checkpoint: str = "", server: str = "",
           client_options: dict | None = None) -> str:
    """Build the model, load the source into it, write ``out``; returns a one-line summary."""
    suffix = next((s for s in SUFFIXES if out.endswith(s)), None)
    if suffix is None:
        raise ExportError(f"--out must end in .keras (whole model) or .weights.h5 (weights only), got {out!r}")
    if bool(checkpoint) == bool(server):
        raise ExportError("give exactly one of --checkpoint and --from-server")
    state, values, spec, source = load_source(checkpoint, server, client_options)

    from worker import model as models

    models.tf_setup(deterministic=True)
    import keras

    keras.backend.clear_session()  # layer names restart at "conv2d", as in a worker process
    model = models.build_model(model_name)
    assign(model, values)
    tmp = f"{out[: -len(suffix)]}.tmp-{os.getpid()}{suffix}"
    try:
        if suffix == ".keras":
            optimizer = compile_like_the_server(model, spec, state.states if hasattr(state, "states") else state)
            model.save(tmp)
        else:
            optimizer = "not saved (weights only)"
            model.save_weights(tmp)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    n = sum(int(np.prod(v.shape)) for v in model.trainable_variables)
    return (f"wrote {out}: model {model_name}, {len(model.trainable_variables)} variables, {n} parameters "
            f"from {source}; optimizer: {optimizer}")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ps-export", description="Write a tfps checkpoint or a live server's "
                                "parameters as a Keras model file (.keras or .weights.h5).")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--checkpoint", help="a checkpoint file, or a directory (its newest valid checkpoint)")
    source.add_argument("--from-server", metavar="HOST:PORT", help="pull the live parameters from a ps-server")
    p.add_argument("--model", default="cnn", choices=MODELS, help="the model the workers trained (default cnn)")
    p.add_argument("--out", required=True, help="output file: NAME.keras or NAME.weights.h5")
    g = p.add_argument_group("security (--from-server)")
    g.add_argument("--tls-ca-file", help="CA (PEM) that signs the server certificate")
    g.add_argument("--tls-cert-file", help="client certificate (PEM) for mutual TLS")
    g.add_argument("--tls-key-file", help="client private key (PEM)")
    g.add_argument("--tls-server-name", help="name to check the server certificate against")
    g.add_argument("--auth-token-file", help="bearer token file (or TFPS_AUTH_TOKEN in the environment)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        client_options = {}
        if args.from_server:
            client_options = dict(tls_ca_file=args.tls_ca_file, tls_cert_file=args.tls_cert_file,
                                  tls_key_file=args.tls_key_file, tls_server_name=args.tls_server_name,
                                  token=security.load_token(args.auth_token_file, os.environ))
        print(export(args.out, args.model, args.checkpoint or "", args.from_server or "", client_options), flush=True)
    except (ExportError, ConfigError) as e:
        print(f"ps-export: error: {e}", file=sys.stderr)
        return 2
    except (OSError, CheckpointError, PSClientError) as e:
        print(f"ps-export: error: cannot read the source: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
