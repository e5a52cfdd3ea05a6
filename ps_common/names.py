"""The names both sides agree on, each defined once.

    from ps_common.names import MODES, DEAD_WORKER_POLICIES, OPTIMIZER_DEFAULTS

The server's flags, its core and the wire conversion (``protos.wire.mode_to_wire``,
driven by ``MODES`` and the proto's ``Mode`` enum), the worker, and the operator
commands all read these tuples; nothing else spells them out. Plain Python.

The optimizers too: each one's Keras arguments and defaults (``OPTIMIZER_DEFAULTS``),
every wire field of one (``optimizer_fields``), and what the server cannot run of a
Keras optimizer (``keras_optimizer_fields``), which the worker checks before training
(``worker.keras_optimizer``) and the server on initialization
(``OptimizerSpec.from_keras``), so both refuse alike.
"""

from __future__ import annotations

import json
from typing import Sequence

import numpy as np

# How the server applies pushes: a barrier per step, on arrival, or on arrival
# within a staleness bound. The proto's Mode enum has one value per name, upper-cased.
MODES = ("sync", "async", "ssp")

# Async and ssp: what to do with a stale gradient (none, drop above a bound, scale the
# learning rate by 1 / (1 + staleness)).
STALE_POLICIES = ("none", "drop", "scale")

# Async and ssp: how a push is applied. "locked": each variable's step under its own lock,
# copy-on-write (no lost update); "hogwild": in place under no lock (ps_server/core/optim/hogwild.py).
ASYNC_APPLIES = ("locked", "hogwild")

# Sync: what a round does when a worker it waits for is declared dead.
DEAD_WORKER_POLICIES = ("abort", "wait", "shrink")

# The options every Keras 3 optimizer takes, with Keras' defaults (base_optimizer.py).
_OPTIONS: dict = {"weight_decay": None, "clipnorm": None, "clipvalue": None, "global_clipnorm": None,
                  "use_ema": False, "ema_momentum": 0.99, "ema_overwrite_frequency": None}
_ADAM = {"learning_rate": 0.001, "beta_1": 0.9, "beta_2": 0.999, "epsilon": 1e-7}

# The server's optimizers by the name on the wire, each with every argument it takes
# and Keras 3's default for it (keras.optimizers.<Class>.__init__), options included.
OPTIMIZER_DEFAULTS: dict[str, dict] = {
    "sgd": {"learning_rate": 0.01, "momentum": 0.0, "nesterov": False, **_OPTIONS},
    "adam": {**_ADAM, "amsgrad": False, **_OPTIONS},
    "adamw": {**_ADAM, "amsgrad": False, **_OPTIONS, "weight_decay": 0.004},
    "adagrad": {"learning_rate": 0.001, "initial_accumulator_value": 0.1, "epsilon": 1e-7, **_OPTIONS},
    "rmsprop": {"learning_rate": 0.001, "rho": 0.9, "momentum": 0.0, "epsilon": 1e-7, "centered": False,
                **_OPTIONS},
    "adamax": {**_ADAM, **_OPTIONS},
    "nadam": {**_ADAM, **_OPTIONS},
    "ftrl": {"learning_rate": 0.001, "learning_rate_power": -0.5, "initial_accumulator_value": 0.1,
             "l1_regularization_strength": 0.0, "l2_regularization_strength": 0.0,
             "l2_shrinkage_regularization_strength": 0.0, "beta": 0.0, **_OPTIONS},
    "lion": {"learning_rate": 0.001, "beta_1": 0.9, "beta_2": 0.99, **_OPTIONS},
    "adadelta": {"learning_rate": 0.001, "rho": 0.95, "epsilon": 1e-7, **_OPTIONS},
    "lamb": {**_ADAM, **_OPTIONS},
    "adafactor": {"learning_rate": 0.001, "beta_2_decay": -0.8, "epsilon_1": 1e-30, "epsilon_2": 1e-3,
                  "clip_threshold": 1.0, "relative_step": True, **_OPTIONS},
    "schedule_free_adamw": {"learning_rate": 0.0025, "beta_1": 0.9, "beta_2": 0.999, "epsilon": 1e-8,
                            "warmup_steps": 0, **_OPTIONS},
    # Its AdamW rule's: adam_*, epsilon; its Muon rule's: momentum, nesterov, muon_*, ns_steps, rms_rate
    # and weight_decay; which variable takes which rule: exclude_embeddings, exclude_layers.
    "muon": {"learning_rate": 0.001, "adam_beta_1": 0.9, "adam_beta_2": 0.999, "adam_weight_decay": 0.004,
             "epsilon": 1e-7, "exclude_layers": (), "exclude_embeddings": True, "muon_a": 3.4445,
             "muon_b": -4.7750, "muon_c": 2.0315, "adam_lr_ratio": 1.0, "momentum": 0.95, "ns_steps": 5,
             "nesterov": True, "rms_rate": 0.2, **_OPTIONS, "weight_decay": 0.004},
}
OPTIMIZERS = tuple(OPTIMIZER_DEFAULTS)

# The Keras class of each (``type(model.optimizer).__name__``).
KERAS_OPTIMIZER_CLASSES = {"SGD": "sgd", "Adam": "adam", "AdamW": "adamw", "Adagrad": "adagrad",
                           "RMSprop": "rmsprop", "Adamax": "adamax", "Nadam": "nadam", "Ftrl": "ftrl",
                           "Lion": "lion", "Adadelta": "adadelta", "Lamb": "lamb",
                           "Adafactor": "adafactor", "ScheduleFreeAdamW": "schedule_free_adamw", "Muon": "muon"}

# A push's metric that skips its update: sync, the whole round when any push of it carries a
# value > 0 (every worker's reply carries the sum); async and ssp, the push. A Keras
# LossScaleOptimizer's gradients that are not finite on some worker skip the step everywhere,
# as an all-reduced gradient would (worker.keras).
SKIP_UPDATE = "tfps/skip_update"


def asks_skip(metrics) -> bool:
    """Whether ``metrics`` (a push's, or the round's sum a reply carries) hold ``SKIP_UPDATE`` > 0."""
    return bool(metrics) and SKIP_UPDATE in metrics and float(np.sum(metrics[SKIP_UPDATE])) > 0


# A variable that two optimizers of a step apply to (``OptimizerSpec.groups`` naming it twice):
# group g's (after the first that names it) state and pushes go by ``shared_name(name, g)``, a
# second name of the same value on the server, with its own optimizer state (``core.store``).
SHARED_MARK = "@group"


def shared_name(name: str, group: int) -> str:
    """The name by which group ``group``'s optimizer steps ``name`` where an earlier group steps it too."""
    return f"{name}{SHARED_MARK}{group}"


def unshared(name: str) -> tuple[str, int]:
    """(name, group) of a second name (``shared_name``), else (``name``, -1)."""
    variable, mark, group = name.rpartition(SHARED_MARK)
    return (variable, int(group)) if mark and group.isdigit() else (name, -1)


def stepped_names(groups: Sequence[Sequence[str]]) -> list[list[str]]:
    """The names each group's optimizer steps its variables by (``groups``: each one's variables,
    in order): a variable an earlier group names too, by its second name."""
    seen: set[str] = set()
    stepped = []
    for g, names in enumerate(groups):
        stepped.append([shared_name(n, g) if n in seen else n for n in names])
        seen.update(names)
    return stepped


def broadcast_poster(key: str) -> int:
    """The worker that posts broadcast ``key``: the one a key ending in ``@w<i>`` names (a vote:
    each worker posts its own key and reads the others'), else the chief (worker 0)."""
    _, named, index = key.rpartition("@w")
    return int(index) if named and index.isdigit() else 0

# Where a Keras 3 optimizer keeps each of the server's slots (``ps_server.core.optim``): the
# attribute holding one variable per trainable variable, in the order it was built with
# (Nadam's ``u_product`` is one variable, every variable's alike on the server). With
# use_ema, "ema" is ``_model_variables_moving_average`` for every optimizer.
KERAS_SLOTS: dict[str, dict[str, str]] = {
    "sgd": {"momentum": "momentums"},
    "adam": {"m": "_momentums", "v": "_velocities", "v_hat": "_velocity_hats"},
    "adamw": {"m": "_momentums", "v": "_velocities", "v_hat": "_velocity_hats"},
    "lamb": {"m": "_momentums", "v": "_velocities"},
    "adagrad": {"accumulator": "_accumulators"},
    "rmsprop": {"velocity": "_velocities", "momentum": "_momentums", "average_gradient": "_average_gradients"},
    "adamax": {"m": "_m", "u": "_u"},
    "nadam": {"m": "_momentums", "v": "_velocities", "u_product": "_u_product"},
    "ftrl": {"accumulator": "_accumulators", "linear": "_linears"},
    "lion": {"m": "_momentums"},
    "adadelta": {"accumulated_grad": "_accumulated_grads", "accumulated_delta_var": "_accumulated_delta_vars"},
    "adafactor": {"r": "_r", "c": "_c", "v": "_v"},
    "schedule_free_adamw": {"momentum": "_momentums", "velocity": "_velocities"},
    "muon": {"momentum": "momentums", "velocity": "adam_velocities"},  # velocity: its AdamW rule's only
}

# The classes of keras.optimizers the server does not run, each with why (one line; the
# worker refuses them at compile, the server on initialization: keras_optimizer_fields).
REFUSED_KERAS_OPTIMIZERS = {
    "Optimizer": "it is the abstract base of Keras' optimizers, with no update of its own",
    "LossScaleOptimizer": "it scales the loss for mixed precision around another optimizer, whose steps it may "
                          "skip: tfps.keras serves it (mixed_float16), other front doors push the inner "
                          "optimizer's unscaled gradients",
    "MultiOptimizer": "it steps each variable with an optimizer its own code chooses: tfps.keras serves it, "
                      "each of its optimizers a group of the server's, other front doors push to one optimizer",
}

# A field an optimizer does not take holds this (the first optimizer's default that has it),
# so that two specs of one optimizer are equal exactly when the maths is.
UNUSED_FIELD_VALUES: dict = {}
for _defaults in OPTIMIZER_DEFAULTS.values():
    for _field, _value in _defaults.items():
        UNUSED_FIELD_VALUES.setdefault(_field, _value)
UNUSED_FIELD_VALUES["learning_rate_schedule"] = None
UNUSED_FIELD_VALUES["sparse_rule"] = ""  # the server's --sparse-rule, else sum (tfps.keras asks keras)
UNUSED_FIELD_VALUES["gradient_accumulation_steps"] = None  # every optimizer's: none
UNUSED_FIELD_VALUES["groups"] = ()  # one optimizer over every variable

# Fields whose Keras value may be None; 0 on the wire (OptimizerConfig) means None.
NONE_AS_ZERO = ("weight_decay", "clipnorm", "clipvalue", "global_clipnorm", "ema_overwrite_frequency",
                "gradient_accumulation_steps", "adam_weight_decay", "rms_rate")

# Keras' learning-rate schedules the server evaluates (ps_server/core/optim/schedules.py), by
# class name; a serialized one of them names this module.
LEARNING_RATE_SCHEDULES = ("ExponentialDecay", "PiecewiseConstantDecay", "PolynomialDecay",
                           "InverseTimeDecay", "CosineDecay", "CosineDecayRestarts")
SCHEDULES_MODULE = "keras.optimizers.schedules"

# get_config() keys that carry no maths.
_IGNORED_KERAS_KEYS = ("name", "is_legacy_optimizer")


def optimizer_fields(name: str, **given) -> dict:
    """Every field of the wire's OptimizerConfig for optimizer ``name``: the values
    ``given``, else that optimizer's Keras default, else the neutral value of a field it
    does not take (``UNUSED_FIELD_VALUES``). As the wire carries them: None is 0, a
    schedule (a dict) is its JSON (``schedule_to_wire``)."""
    fields = {**UNUSED_FIELD_VALUES, **OPTIMIZER_DEFAULTS.get(name, {}), **given}
    for field in NONE_AS_ZERO:
        if fields[field] is None:
            fields[field] = 0
    fields["learning_rate_schedule"] = schedule_to_wire(fields["learning_rate_schedule"])
    return {"name": name, **fields}


def schedule_to_wire(schedule) -> str:
    """A serialized schedule (dict) as OptimizerConfig.learning_rate_schedule carries it;
    None (a constant learning rate) is ""; a string is taken as JSON already."""
    if schedule is None or isinstance(schedule, str):
        return schedule or ""
    return json.dumps(schedule, sort_keys=True, allow_nan=False)


def schedule_from_wire(text: str):
    """The dict of OptimizerConfig.learning_rate_schedule; "" is None. ValueError if not JSON."""
    if not text:
        return None
    try:
        return json.loads(text)
    except ValueError as e:
        raise ValueError(f"learning_rate_schedule is not JSON ({e})") from None


def keras_optimizer_fields(class_name: str, config: dict) -> dict:
    """The server's optimizer fields of a Keras 3 optimizer, from ``type(opt).__name__`` and
    ``opt.get_config()``: ``name`` and every argument it gave (None kept as None; a
    schedule as its serialized dict in ``learning_rate_schedule``).

    The one definition of what the server cannot run, for both sides: raises ValueError,
    one line naming it, for an optimizer class it does not know, a config key it does not
    know, ``loss_scale_factor`` set, and a learning rate that is not a number or one of Keras'
    own schedules (``LEARNING_RATE_SCHEDULES``; the server checks its config in full).
    """
    name = KERAS_OPTIMIZER_CLASSES.get(class_name)
    if class_name in REFUSED_KERAS_OPTIMIZERS:
        raise ValueError(f"optimizer {class_name} cannot run on the server: {REFUSED_KERAS_OPTIMIZERS[class_name]}")
    if name is None:
        raise ValueError(f"optimizer {class_name} cannot run on the server; it runs "
                         f"{', '.join(KERAS_OPTIMIZER_CLASSES)} of keras.optimizers")
    config = dict(config)
    for key in _IGNORED_KERAS_KEYS:
        config.pop(key, None)
    value = config.pop("loss_scale_factor", None)
    if value is not None:
        raise ValueError(f"{class_name} with loss_scale_factor={value!r} cannot run on the server "
                         "(loss_scale_factor must be None)")
    accumulation = config.pop("gradient_accumulation_steps", None)
    unknown = sorted(set(config) - set(OPTIMIZER_DEFAULTS[name]))
    if unknown:
        raise ValueError(f"{class_name} has config keys the server does not know: {', '.join(unknown)}")
    if name == "muon" and config.get("rms_rate", 0.2) == 0:
        raise ValueError("Muon with rms_rate=0 cannot run on the server: the wire's 0 is None, no adjustment "
                         "(rms_rate=0 never moves a matrix)")
    fields = {"name": name, **config, **({"gradient_accumulation_steps": accumulation} if accumulation else {})}
    for field in NONE_AS_ZERO:  # None where Keras' default is not (Muon's rms_rate): the wire's None, 0
        if field in config and config[field] is None and OPTIMIZER_DEFAULTS[name].get(field) is not None:
            fields[field] = 0
    lr = config.get("learning_rate", OPTIMIZER_DEFAULTS[name]["learning_rate"])
    if isinstance(lr, dict):
        check_schedule_class(lr)
        fields["learning_rate"] = OPTIMIZER_DEFAULTS[name]["learning_rate"]  # unused with a schedule
        fields["learning_rate_schedule"] = lr
    elif isinstance(lr, bool) or not isinstance(lr, (int, float)):
        raise ValueError(f"{class_name}'s learning_rate must be a number or a serialized "
                         f"{SCHEDULES_MODULE} schedule; got {type(lr).__name__}")
    if name == "adamw" and config.get("weight_decay", 0.004) == 0:
        fields["name"] = "adam"  # AdamW without weight decay is Adam, and 0 is None on the wire
        fields["weight_decay"] = None
    return fields


def check_schedule_class(schedule: dict) -> None:
    """ValueError, naming it, unless ``schedule`` is a serialized schedule of Keras' own
    that the server evaluates (by class name and module; not its config)."""
    class_name = schedule.get("class_name") if isinstance(schedule, dict) else None
    if class_name not in LEARNING_RATE_SCHEDULES or schedule.get("module", SCHEDULES_MODULE) != SCHEDULES_MODULE \
            or schedule.get("registered_name") is not None:
        where = "" if not isinstance(schedule, dict) else \
            f" (module={schedule.get('module')!r}, registered_name={schedule.get('registered_name')!r})"
        what = class_name if isinstance(class_name, str) else repr(schedule)
        raise ValueError(f"learning-rate schedule {what}{where} cannot run on the server; it "
                         f"runs {', '.join(LEARNING_RATE_SCHEDULES)} of {SCHEDULES_MODULE}")
