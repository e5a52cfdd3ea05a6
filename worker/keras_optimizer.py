"""The compiled Keras optimizer as the server's optimizer fields.

    fields = spec_fields(model.optimizer)   # every OptimizerConfig field; ValueError if it cannot run
    Connection(config, model, optimizer_spec=fields)
    load_state(model.optimizer, model.trainable_variables, states)  # the server's slots, into Keras'

The server runs the optimizer (``ps_server.core.optimizers``; which ones and options:
docs/keras.md); the worker's Keras optimizer never steps. ``spec_fields`` reads
``type(optimizer).__name__`` and ``optimizer.get_config()``, so a program's optimizer reaches
the server exactly as compiled, and refuses what the server cannot run before any training,
in one line, by the rules the server applies too (``ps_common.names.keras_optimizer_fields``,
``REFUSED_KERAS_OPTIMIZERS``). Added here, because ``get_config`` does not show it:
``exclude_from_weight_decay``. A Muon travels as its config: the server chooses its rule per
variable from the variable's name, Keras' path, as Keras does (``ps_server.core.optim.muon``).
"""

from __future__ import annotations

import numpy as np

from ps_common.names import KERAS_OPTIMIZER_CLASSES, KERAS_SLOTS, keras_optimizer_fields, optimizer_fields


def spec_fields(optimizer) -> dict:
    """Every OptimizerConfig field of the compiled Keras 3 ``optimizer`` (``model.optimizer``).
    Its ``loss_scale_factor`` is no field: the gradients reach the server divided by it (the
    wrapped Keras step's ``apply`` divides them, as Keras' does).

    Raises ValueError, one line naming the optimizer, option or schedule, for what the
    server cannot run (module docstring).
    """
    cls = type(optimizer)
    if not cls.__module__.startswith("keras."):  # a user's class, whatever its name
        raise ValueError(f"optimizer {cls.__module__}.{cls.__name__} cannot run on the server: it runs "
                         "keras.optimizers' own classes only")
    config = optimizer.get_config()
    config.pop("loss_scale_factor", None)
    fields = keras_optimizer_fields(cls.__name__, config)
    excluded = getattr(optimizer, "_exclude_from_weight_decay", None) or \
        getattr(optimizer, "_exclude_from_weight_decay_pattern", None)
    if excluded and (fields.get("weight_decay") or fields.get("adam_weight_decay")):  # Muon has two
        raise ValueError(f"{cls.__name__} with exclude_from_weight_decay cannot run on the server: it decays "
                         "every variable")
    name = fields.pop("name")
    # A repeated row steps as Keras applies a tf.IndexedSlices, unless the server was given --sparse-rule.
    return optimizer_fields(name, **fields, sparse_rule="keras")


def load_state(optimizer, variables: list, states: dict, batches_per_update: int = 1) -> int:
    """Build the Keras ``optimizer`` over ``variables`` (the model's trainable ones, in order)
    and give it the server's state: each slot (``KERAS_SLOTS``) and its step count (the
    highest of the variables': an async checkpoint may hold a push half applied; with
    ``gradient_accumulation_steps``, Keras counts ``batches_per_update`` batches an update, and
    the batches of a window the server holds, whose sum is its ``accumulated`` slot).
    A model file saved after this holds what the server holds, so ``fit`` resumes from it in
    one process as from a file that process wrote. Returns the step count."""
    name = KERAS_OPTIMIZER_CLASSES.get(type(optimizer).__name__)
    if name is None:
        raise ValueError(f"{type(optimizer).__name__} has no server state to load")
    optimizer.build(variables)
    slots = {**KERAS_SLOTS[name], "ema": "_model_variables_moving_average", "accumulated": "_accumulated_gradients"}
    for slot, attribute in slots.items():
        held = getattr(optimizer, attribute, None)
        for index, v in enumerate(variables):
            value = states[v.path].get(slot)
            if value is None:  # an option off (no momentum), or a slot the variable has none of
                continue
            target = held if not isinstance(held, (list, tuple)) else held[index] if index < len(held) else None
            if target is None or tuple(target.shape) != np.shape(value):
                raise ValueError(f"{type(optimizer).__name__} keeps the server's {slot!r} slot of {v.path!r} "
                                 f"otherwise than this Keras does ({attribute}); cannot load it")
            target.assign(np.asarray(value))
    steps = max((int(states[v.path]["iterations"]) for v in variables), default=0)
    held = max((int(states[v.path].get("accumulated_batches", 0)) for v in variables), default=0)
    # counting batches (iterations is computed then), and those of a window the server holds (elastic sync)
    optimizer._iterations.assign(steps * batches_per_update + held)
    return steps
