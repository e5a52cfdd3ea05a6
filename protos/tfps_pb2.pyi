from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Mode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MODE_UNSPECIFIED: _ClassVar[Mode]
    SYNC: _ClassVar[Mode]
    ASYNC: _ClassVar[Mode]
    SSP: _ClassVar[Mode]

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    FLOAT16: _ClassVar[DType]
    FLOAT32: _ClassVar[DType]
    FLOAT64: _ClassVar[DType]
    INT32: _ClassVar[DType]
    INT64: _ClassVar[DType]
    BFLOAT16: _ClassVar[DType]
MODE_UNSPECIFIED: Mode
SYNC: Mode
ASYNC: Mode
SSP: Mode
DTYPE_UNSPECIFIED: DType
FLOAT16: DType
FLOAT32: DType
FLOAT64: DType
INT32: DType
INT64: DType
BFLOAT16: DType

class Tensor(_message.Message):
    __slots__ = ("name", "dtype", "shape", "data", "sparse", "rows")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    SPARSE_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    sparse: bool
    rows: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[_Union[DType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ..., sparse: _Optional[bool] = ..., rows: _Optional[_Iterable[int]] = ...) -> None: ...

class OptimizerConfig(_message.Message):
    __slots__ = ("name", "learning_rate", "momentum", "nesterov", "beta_1", "beta_2", "epsilon", "learning_rate_schedule", "amsgrad", "rho", "centered", "initial_accumulator_value", "learning_rate_power", "l1_regularization_strength", "l2_regularization_strength", "l2_shrinkage_regularization_strength", "beta", "weight_decay", "clipnorm", "clipvalue", "global_clipnorm", "use_ema", "ema_momentum", "ema_overwrite_frequency", "beta_2_decay", "epsilon_1", "epsilon_2", "clip_threshold", "relative_step", "sparse_rule", "gradient_accumulation_steps", "groups", "warmup_steps", "adam_beta_1", "adam_beta_2", "adam_weight_decay", "adam_lr_ratio", "muon_a", "muon_b", "muon_c", "ns_steps", "rms_rate", "exclude_embeddings", "exclude_layers")
    NAME_FIELD_NUMBER: _ClassVar[int]
    LEARNING_RATE_FIELD_NUMBER: _ClassVar[int]
    MOMENTUM_FIELD_NUMBER: _ClassVar[int]
    NESTEROV_FIELD_NUMBER: _ClassVar[int]
    BETA_1_FIELD_NUMBER: _ClassVar[int]
    BETA_2_FIELD_NUMBER: _ClassVar[int]
    EPSILON_FIELD_NUMBER: _ClassVar[int]
    LEARNING_RATE_SCHEDULE_FIELD_NUMBER: _ClassVar[int]
    AMSGRAD_FIELD_NUMBER: _ClassVar[int]
    RHO_FIELD_NUMBER: _ClassVar[int]
    CENTERED_FIELD_NUMBER: _ClassVar[int]
    INITIAL_ACCUMULATOR_VALUE_FIELD_NUMBER: _ClassVar[int]
    LEARNING_RATE_POWER_FIELD_NUMBER: _ClassVar[int]
    L1_REGULARIZATION_STRENGTH_FIELD_NUMBER: _ClassVar[int]
    L2_REGULARIZATION_STRENGTH_FIELD_NUMBER: _ClassVar[int]
    L2_SHRINKAGE_REGULARIZATION_STRENGTH_FIELD_NUMBER: _ClassVar[int]
    BETA_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_DECAY_FIELD_NUMBER: _ClassVar[int]
    CLIPNORM_FIELD_NUMBER: _ClassVar[int]
    CLIPVALUE_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_CLIPNORM_FIELD_NUMBER: _ClassVar[int]
    USE_EMA_FIELD_NUMBER: _ClassVar[int]
    EMA_MOMENTUM_FIELD_NUMBER: _ClassVar[int]
    EMA_OVERWRITE_FREQUENCY_FIELD_NUMBER: _ClassVar[int]
    BETA_2_DECAY_FIELD_NUMBER: _ClassVar[int]
    EPSILON_1_FIELD_NUMBER: _ClassVar[int]
    EPSILON_2_FIELD_NUMBER: _ClassVar[int]
    CLIP_THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    RELATIVE_STEP_FIELD_NUMBER: _ClassVar[int]
    SPARSE_RULE_FIELD_NUMBER: _ClassVar[int]
    GRADIENT_ACCUMULATION_STEPS_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    WARMUP_STEPS_FIELD_NUMBER: _ClassVar[int]
    ADAM_BETA_1_FIELD_NUMBER: _ClassVar[int]
    ADAM_BETA_2_FIELD_NUMBER: _ClassVar[int]
    ADAM_WEIGHT_DECAY_FIELD_NUMBER: _ClassVar[int]
    ADAM_LR_RATIO_FIELD_NUMBER: _ClassVar[int]
    MUON_A_FIELD_NUMBER: _ClassVar[int]
    MUON_B_FIELD_NUMBER: _ClassVar[int]
    MUON_C_FIELD_NUMBER: _ClassVar[int]
    NS_STEPS_FIELD_NUMBER: _ClassVar[int]
    RMS_RATE_FIELD_NUMBER: _ClassVar[int]
    EXCLUDE_EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    EXCLUDE_LAYERS_FIELD_NUMBER: _ClassVar[int]
    name: str
    learning_rate: float
    momentum: float
    nesterov: bool
    beta_1: float
    beta_2: float
    epsilon: float
    learning_rate_schedule: str
    amsgrad: bool
    rho: float
    centered: bool
    initial_accumulator_value: float
    learning_rate_power: float
    l1_regularization_strength: float
    l2_regularization_strength: float
    l2_shrinkage_regularization_strength: float
    beta: float
    weight_decay: float
    clipnorm: float
    clipvalue: float
    global_clipnorm: float
    use_ema: bool
    ema_momentum: float
    ema_overwrite_frequency: int
    beta_2_decay: float
    epsilon_1: float
    epsilon_2: float
    clip_threshold: float
    relative_step: bool
    sparse_rule: str
    gradient_accumulation_steps: int
    groups: _containers.RepeatedCompositeFieldContainer[OptimizerGroup]
    warmup_steps: int
    adam_beta_1: float
    adam_beta_2: float
    adam_weight_decay: float
    adam_lr_ratio: float
    muon_a: float
    muon_b: float
    muon_c: float
    ns_steps: int
    rms_rate: float
    exclude_embeddings: bool
    exclude_layers: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, name: _Optional[str] = ..., learning_rate: _Optional[float] = ..., momentum: _Optional[float] = ..., nesterov: _Optional[bool] = ..., beta_1: _Optional[float] = ..., beta_2: _Optional[float] = ..., epsilon: _Optional[float] = ..., learning_rate_schedule: _Optional[str] = ..., amsgrad: _Optional[bool] = ..., rho: _Optional[float] = ..., centered: _Optional[bool] = ..., initial_accumulator_value: _Optional[float] = ..., learning_rate_power: _Optional[float] = ..., l1_regularization_strength: _Optional[float] = ..., l2_regularization_strength: _Optional[float] = ..., l2_shrinkage_regularization_strength: _Optional[float] = ..., beta: _Optional[float] = ..., weight_decay: _Optional[float] = ..., clipnorm: _Optional[float] = ..., clipvalue: _Optional[float] = ..., global_clipnorm: _Optional[float] = ..., use_ema: _Optional[bool] = ..., ema_momentum: _Optional[float] = ..., ema_overwrite_frequency: _Optional[int] = ..., beta_2_decay: _Optional[float] = ..., epsilon_1: _Optional[float] = ..., epsilon_2: _Optional[float] = ..., clip_threshold: _Optional[float] = ..., relative_step: _Optional[bool] = ..., sparse_rule: _Optional[str] = ..., gradient_accumulation_steps: _Optional[int] = ..., groups: _Optional[_Iterable[_Union[OptimizerGroup, _Mapping]]] = ..., warmup_steps: _Optional[int] = ..., adam_beta_1: _Optional[float] = ..., adam_beta_2: _Optional[float] = ..., adam_weight_decay: _Optional[float] = ..., adam_lr_ratio: _Optional[float] = ..., muon_a: _Optional[float] = ..., muon_b: _Optional[float] = ..., muon_c: _Optional[float] = ..., ns_steps: _Optional[int] = ..., rms_rate: _Optional[float] = ..., exclude_embeddings: _Optional[bool] = ..., exclude_layers: _Optional[_Iterable[str]] = ...) -> None: ...

class OptimizerGroup(_message.Message):
    __slots__ = ("variables", "optimizer")
    VARIABLES_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    variables: _containers.RepeatedScalarFieldContainer[str]
    optimizer: OptimizerConfig
    def __init__(self, variables: _Optional[_Iterable[str]] = ..., optimizer: _Optional[_Union[OptimizerConfig, _Mapping]] = ...) -> None: ...

class RegisterRequest(_message.Message):
    __slots__ = ("worker_index", "num_workers", "worker_name", "shm_push_name", "shm_pull_name", "process")
    WORKER_INDEX_FIELD_NUMBER: _ClassVar[int]
    NUM_WORKERS_FIELD_NUMBER: _ClassVar[int]
    WORKER_NAME_FIELD_NUMBER: _ClassVar[int]
    SHM_PUSH_NAME_FIELD_NUMBER: _ClassVar[int]
    SHM_PULL_NAME_FIELD_NUMBER: _ClassVar[int]
    PROCESS_FIELD_NUMBER: _ClassVar[int]
    worker_index: int
    num_workers: int
    worker_name: str
    shm_push_name: str
    shm_pull_name: str
    process: str
    def __init__(self, worker_index: _Optional[int] = ..., num_workers: _Optional[int] = ..., worker_name: _Optional[str] = ..., shm_push_name: _Optional[str] = ..., shm_pull_name: _Optional[str] = ..., process: _Optional[str] = ...) -> None: ...

class RegisterResponse(_message.Message):
    __slots__ = ("mode", "num_workers", "worker_id", "initialized", "version", "barrier_timeout_s", "round", "lease_timeout_s", "incarnation", "shm_token", "shm_nonce", "shm_error", "round_restored", "sparse_rule")
    MODE_FIELD_NUMBER: _ClassVar[int]
    NUM_WORKERS_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    INITIALIZED_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    BARRIER_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    LEASE_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    SHM_TOKEN_FIELD_NUMBER: _ClassVar[int]
    SHM_NONCE_FIELD_NUMBER: _ClassVar[int]
    SHM_ERROR_FIELD_NUMBER: _ClassVar[int]
    ROUND_RESTORED_FIELD_NUMBER: _ClassVar[int]
    SPARSE_RULE_FIELD_NUMBER: _ClassVar[int]
    mode: Mode
    num_workers: int
    worker_id: int
    initialized: bool
    version: int
    barrier_timeout_s: float
    round: int
    lease_timeout_s: float
    incarnation: str
    shm_token: bytes
    shm_nonce: bytes
    shm_error: str
    round_restored: bool
    sparse_rule: str
    def __init__(self, mode: _Optional[_Union[Mode, str]] = ..., num_workers: _Optional[int] = ..., worker_id: _Optional[int] = ..., initialized: _Optional[bool] = ..., version: _Optional[int] = ..., barrier_timeout_s: _Optional[float] = ..., round: _Optional[int] = ..., lease_timeout_s: _Optional[float] = ..., incarnation: _Optional[str] = ..., shm_token: _Optional[bytes] = ..., shm_nonce: _Optional[bytes] = ..., shm_error: _Optional[str] = ..., round_restored: _Optional[bool] = ..., sparse_rule: _Optional[str] = ...) -> None: ...

class InitializeRequest(_message.Message):
    __slots__ = ("worker_id", "optimizer", "variables", "non_trainable", "data_plan", "clip_group", "shard_group")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    VARIABLES_FIELD_NUMBER: _ClassVar[int]
    NON_TRAINABLE_FIELD_NUMBER: _ClassVar[int]
    DATA_PLAN_FIELD_NUMBER: _ClassVar[int]
    CLIP_GROUP_FIELD_NUMBER: _ClassVar[int]
    SHARD_GROUP_FIELD_NUMBER: _ClassVar[int]
    worker_id: int
    optimizer: OptimizerConfig
    variables: _containers.RepeatedCompositeFieldContainer[Tensor]
    non_trainable: _containers.RepeatedScalarFieldContainer[str]
    data_plan: DataPlan
    clip_group: ClipGroup
    shard_group: ShardGroup
    def __init__(self, worker_id: _Optional[int] = ..., optimizer: _Optional[_Union[OptimizerConfig, _Mapping]] = ..., variables: _Optional[_Iterable[_Union[Tensor, _Mapping]]] = ..., non_trainable: _Optional[_Iterable[str]] = ..., data_plan: _Optional[_Union[DataPlan, _Mapping]] = ..., clip_group: _Optional[_Union[ClipGroup, _Mapping]] = ..., shard_group: _Optional[_Union[ShardGroup, _Mapping]] = ...) -> None: ...

class ShardGroup(_message.Message):
    __slots__ = ("shards", "shard")
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    shards: _containers.RepeatedScalarFieldContainer[str]
    shard: int
    def __init__(self, shards: _Optional[_Iterable[str]] = ..., shard: _Optional[int] = ...) -> None: ...

class ClipGroup(_message.Message):
    __slots__ = ("shards", "shard", "order")
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    ORDER_FIELD_NUMBER: _ClassVar[int]
    shards: _containers.RepeatedScalarFieldContainer[str]
    shard: int
    order: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, shards: _Optional[_Iterable[str]] = ..., shard: _Optional[int] = ..., order: _Optional[_Iterable[str]] = ...) -> None: ...

class ClipNormRequest(_message.Message):
    __slots__ = ("key", "shard", "names", "squares", "dtypes", "timeout_s")
    KEY_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    NAMES_FIELD_NUMBER: _ClassVar[int]
    SQUARES_FIELD_NUMBER: _ClassVar[int]
    DTYPES_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    key: str
    shard: int
    names: _containers.RepeatedScalarFieldContainer[str]
    squares: _containers.RepeatedScalarFieldContainer[float]
    dtypes: _containers.RepeatedScalarFieldContainer[str]
    timeout_s: float
    def __init__(self, key: _Optional[str] = ..., shard: _Optional[int] = ..., names: _Optional[_Iterable[str]] = ..., squares: _Optional[_Iterable[float]] = ..., dtypes: _Optional[_Iterable[str]] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class ClipNormResponse(_message.Message):
    __slots__ = ("scale", "dtype")
    SCALE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    scale: float
    dtype: str
    def __init__(self, scale: _Optional[float] = ..., dtype: _Optional[str] = ...) -> None: ...

class CommitRoundRequest(_message.Message):
    __slots__ = ("round", "timeout_s", "contributors")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    CONTRIBUTORS_FIELD_NUMBER: _ClassVar[int]
    round: int
    timeout_s: float
    contributors: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, round: _Optional[int] = ..., timeout_s: _Optional[float] = ..., contributors: _Optional[_Iterable[int]] = ...) -> None: ...

class CommitRoundResponse(_message.Message):
    __slots__ = ("version",)
    VERSION_FIELD_NUMBER: _ClassVar[int]
    version: int
    def __init__(self, version: _Optional[int] = ...) -> None: ...

class InitializeHeader(_message.Message):
    __slots__ = ("worker_id", "optimizer", "variables", "non_trainable", "data_plan", "clip_group", "shard_group")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    VARIABLES_FIELD_NUMBER: _ClassVar[int]
    NON_TRAINABLE_FIELD_NUMBER: _ClassVar[int]
    DATA_PLAN_FIELD_NUMBER: _ClassVar[int]
    CLIP_GROUP_FIELD_NUMBER: _ClassVar[int]
    SHARD_GROUP_FIELD_NUMBER: _ClassVar[int]
    worker_id: int
    optimizer: OptimizerConfig
    variables: _containers.RepeatedCompositeFieldContainer[TensorMeta]
    non_trainable: _containers.RepeatedScalarFieldContainer[str]
    data_plan: DataPlan
    clip_group: ClipGroup
    shard_group: ShardGroup
    def __init__(self, worker_id: _Optional[int] = ..., optimizer: _Optional[_Union[OptimizerConfig, _Mapping]] = ..., variables: _Optional[_Iterable[_Union[TensorMeta, _Mapping]]] = ..., non_trainable: _Optional[_Iterable[str]] = ..., data_plan: _Optional[_Union[DataPlan, _Mapping]] = ..., clip_group: _Optional[_Union[ClipGroup, _Mapping]] = ..., shard_group: _Optional[_Union[ShardGroup, _Mapping]] = ...) -> None: ...

class DataPlan(_message.Message):
    __slots__ = ("num_examples", "global_batch_size", "seed", "epochs", "tasks", "applies")
    NUM_EXAMPLES_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    EPOCHS_FIELD_NUMBER: _ClassVar[int]
    TASKS_FIELD_NUMBER: _ClassVar[int]
    APPLIES_FIELD_NUMBER: _ClassVar[int]
    num_examples: int
    global_batch_size: int
    seed: int
    epochs: int
    tasks: int
    applies: int
    def __init__(self, num_examples: _Optional[int] = ..., global_batch_size: _Optional[int] = ..., seed: _Optional[int] = ..., epochs: _Optional[int] = ..., tasks: _Optional[int] = ..., applies: _Optional[int] = ...) -> None: ...

class Assignment(_message.Message):
    __slots__ = ("round", "micro_batches", "sizes", "parts", "task", "finished", "skipped_rounds")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    MICRO_BATCHES_FIELD_NUMBER: _ClassVar[int]
    SIZES_FIELD_NUMBER: _ClassVar[int]
    PARTS_FIELD_NUMBER: _ClassVar[int]
    TASK_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    round: int
    micro_batches: _containers.RepeatedScalarFieldContainer[int]
    sizes: _containers.RepeatedScalarFieldContainer[int]
    parts: int
    task: bool
    finished: bool
    skipped_rounds: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, round: _Optional[int] = ..., micro_batches: _Optional[_Iterable[int]] = ..., sizes: _Optional[_Iterable[int]] = ..., parts: _Optional[int] = ..., task: _Optional[bool] = ..., finished: _Optional[bool] = ..., skipped_rounds: _Optional[_Iterable[int]] = ...) -> None: ...

class WorkRequest(_message.Message):
    __slots__ = ("worker_id",)
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    worker_id: int
    def __init__(self, worker_id: _Optional[int] = ...) -> None: ...

class InitializeChunk(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: InitializeHeader
    data: bytes
    def __init__(self, header: _Optional[_Union[InitializeHeader, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class InitializeResponse(_message.Message):
    __slots__ = ("created", "version")
    CREATED_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    created: bool
    version: int
    def __init__(self, created: _Optional[bool] = ..., version: _Optional[int] = ...) -> None: ...

class PullRequest(_message.Message):
    __slots__ = ("worker_id", "names", "known_version", "known_incarnation", "shm_name", "row_deltas", "optimizer_state", "averages", "window_batches")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    NAMES_FIELD_NUMBER: _ClassVar[int]
    KNOWN_VERSION_FIELD_NUMBER: _ClassVar[int]
    KNOWN_INCARNATION_FIELD_NUMBER: _ClassVar[int]
    SHM_NAME_FIELD_NUMBER: _ClassVar[int]
    ROW_DELTAS_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_STATE_FIELD_NUMBER: _ClassVar[int]
    AVERAGES_FIELD_NUMBER: _ClassVar[int]
    WINDOW_BATCHES_FIELD_NUMBER: _ClassVar[int]
    worker_id: int
    names: _containers.RepeatedScalarFieldContainer[str]
    known_version: int
    known_incarnation: str
    shm_name: str
    row_deltas: bool
    optimizer_state: bool
    averages: _containers.RepeatedScalarFieldContainer[str]
    window_batches: int
    def __init__(self, worker_id: _Optional[int] = ..., names: _Optional[_Iterable[str]] = ..., known_version: _Optional[int] = ..., known_incarnation: _Optional[str] = ..., shm_name: _Optional[str] = ..., row_deltas: _Optional[bool] = ..., optimizer_state: _Optional[bool] = ..., averages: _Optional[_Iterable[str]] = ..., window_batches: _Optional[int] = ...) -> None: ...

class PullResponse(_message.Message):
    __slots__ = ("version", "variables", "incarnation", "optimizer_state")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    VARIABLES_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_STATE_FIELD_NUMBER: _ClassVar[int]
    version: int
    variables: _containers.RepeatedCompositeFieldContainer[Tensor]
    incarnation: str
    optimizer_state: _containers.RepeatedCompositeFieldContainer[Tensor]
    def __init__(self, version: _Optional[int] = ..., variables: _Optional[_Iterable[_Union[Tensor, _Mapping]]] = ..., incarnation: _Optional[str] = ..., optimizer_state: _Optional[_Iterable[_Union[Tensor, _Mapping]]] = ...) -> None: ...

class TensorMeta(_message.Message):
    __slots__ = ("name", "dtype", "shape", "sparse", "rows")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    SPARSE_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    sparse: bool
    rows: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[_Union[DType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., sparse: _Optional[bool] = ..., rows: _Optional[_Iterable[int]] = ...) -> None: ...

class PushHeader(_message.Message):
    __slots__ = ("worker_id", "step", "base_version", "batch_size", "loss", "gradients", "shm_name", "shm_offsets", "metrics", "set_learning_rates", "micro_batch", "task", "overlap_block_bytes")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    GRADIENTS_FIELD_NUMBER: _ClassVar[int]
    SHM_NAME_FIELD_NUMBER: _ClassVar[int]
    SHM_OFFSETS_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    SET_LEARNING_RATES_FIELD_NUMBER: _ClassVar[int]
    MICRO_BATCH_FIELD_NUMBER: _ClassVar[int]
    TASK_FIELD_NUMBER: _ClassVar[int]
    OVERLAP_BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    worker_id: int
    step: int
    base_version: int
    batch_size: int
    loss: float
    gradients: _containers.RepeatedCompositeFieldContainer[TensorMeta]
    shm_name: str
    shm_offsets: _containers.RepeatedScalarFieldContainer[int]
    metrics: _containers.RepeatedCompositeFieldContainer[Tensor]
    set_learning_rates: _containers.RepeatedScalarFieldContainer[float]
    micro_batch: int
    task: int
    overlap_block_bytes: int
    def __init__(self, worker_id: _Optional[int] = ..., step: _Optional[int] = ..., base_version: _Optional[int] = ..., batch_size: _Optional[int] = ..., loss: _Optional[float] = ..., gradients: _Optional[_Iterable[_Union[TensorMeta, _Mapping]]] = ..., shm_name: _Optional[str] = ..., shm_offsets: _Optional[_Iterable[int]] = ..., metrics: _Optional[_Iterable[_Union[Tensor, _Mapping]]] = ..., set_learning_rates: _Optional[_Iterable[float]] = ..., micro_batch: _Optional[int] = ..., task: _Optional[int] = ..., overlap_block_bytes: _Optional[int] = ...) -> None: ...

class PushChunk(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: PushHeader
    data: bytes
    def __init__(self, header: _Optional[_Union[PushHeader, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class PullHeader(_message.Message):
    __slots__ = ("version", "incarnation", "variables", "shm", "shm_offsets", "shm_bytes_needed")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    VARIABLES_FIELD_NUMBER: _ClassVar[int]
    SHM_FIELD_NUMBER: _ClassVar[int]
    SHM_OFFSETS_FIELD_NUMBER: _ClassVar[int]
    SHM_BYTES_NEEDED_FIELD_NUMBER: _ClassVar[int]
    version: int
    incarnation: str
    variables: _containers.RepeatedCompositeFieldContainer[TensorMeta]
    shm: bool
    shm_offsets: _containers.RepeatedScalarFieldContainer[int]
    shm_bytes_needed: int
    def __init__(self, version: _Optional[int] = ..., incarnation: _Optional[str] = ..., variables: _Optional[_Iterable[_Union[TensorMeta, _Mapping]]] = ..., shm: _Optional[bool] = ..., shm_offsets: _Optional[_Iterable[int]] = ..., shm_bytes_needed: _Optional[int] = ...) -> None: ...

class PullChunk(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: PullHeader
    data: bytes
    def __init__(self, header: _Optional[_Union[PullHeader, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class PushPullChunk(_message.Message):
    __slots__ = ("header", "data", "done", "confirmed")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    CONFIRMED_FIELD_NUMBER: _ClassVar[int]
    header: PullHeader
    data: bytes
    done: PushResponse
    confirmed: bool
    def __init__(self, header: _Optional[_Union[PullHeader, _Mapping]] = ..., data: _Optional[bytes] = ..., done: _Optional[_Union[PushResponse, _Mapping]] = ..., confirmed: _Optional[bool] = ...) -> None: ...

class PushRequest(_message.Message):
    __slots__ = ("worker_id", "step", "base_version", "batch_size", "gradients", "loss", "return_values", "metrics", "set_learning_rates", "micro_batch", "task")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    GRADIENTS_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    RETURN_VALUES_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    SET_LEARNING_RATES_FIELD_NUMBER: _ClassVar[int]
    MICRO_BATCH_FIELD_NUMBER: _ClassVar[int]
    TASK_FIELD_NUMBER: _ClassVar[int]
    worker_id: int
    step: int
    base_version: int
    batch_size: int
    gradients: _containers.RepeatedCompositeFieldContainer[Tensor]
    loss: float
    return_values: bool
    metrics: _containers.RepeatedCompositeFieldContainer[Tensor]
    set_learning_rates: _containers.RepeatedScalarFieldContainer[float]
    micro_batch: int
    task: int
    def __init__(self, worker_id: _Optional[int] = ..., step: _Optional[int] = ..., base_version: _Optional[int] = ..., batch_size: _Optional[int] = ..., gradients: _Optional[_Iterable[_Union[Tensor, _Mapping]]] = ..., loss: _Optional[float] = ..., return_values: _Optional[bool] = ..., metrics: _Optional[_Iterable[_Union[Tensor, _Mapping]]] = ..., set_learning_rates: _Optional[_Iterable[float]] = ..., micro_batch: _Optional[int] = ..., task: _Optional[int] = ...) -> None: ...

class PushResponse(_message.Message):
    __slots__ = ("version", "staleness", "contributors", "dropped", "next_step", "replayed", "variables", "incarnation", "metrics", "learning_rate", "assignment")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    STALENESS_FIELD_NUMBER: _ClassVar[int]
    CONTRIBUTORS_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    NEXT_STEP_FIELD_NUMBER: _ClassVar[int]
    REPLAYED_FIELD_NUMBER: _ClassVar[int]
    VARIABLES_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    LEARNING_RATE_FIELD_NUMBER: _ClassVar[int]
    ASSIGNMENT_FIELD_NUMBER: _ClassVar[int]
    version: int
    staleness: int
    contributors: int
    dropped: bool
    next_step: int
    replayed: bool
    variables: _containers.RepeatedCompositeFieldContainer[Tensor]
    incarnation: str
    metrics: _containers.RepeatedCompositeFieldContainer[Tensor]
    learning_rate: float
    assignment: Assignment
    def __init__(self, version: _Optional[int] = ..., staleness: _Optional[int] = ..., contributors: _Optional[int] = ..., dropped: _Optional[bool] = ..., next_step: _Optional[int] = ..., replayed: _Optional[bool] = ..., variables: _Optional[_Iterable[_Union[Tensor, _Mapping]]] = ..., incarnation: _Optional[str] = ..., metrics: _Optional[_Iterable[_Union[Tensor, _Mapping]]] = ..., learning_rate: _Optional[float] = ..., assignment: _Optional[_Union[Assignment, _Mapping]] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("worker_id", "step", "process")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    PROCESS_FIELD_NUMBER: _ClassVar[int]
    worker_id: int
    step: int
    process: str
    def __init__(self, worker_id: _Optional[int] = ..., step: _Optional[int] = ..., process: _Optional[str] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("lease_timeout_s", "incarnation")
    LEASE_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    lease_timeout_s: float
    incarnation: str
    def __init__(self, lease_timeout_s: _Optional[float] = ..., incarnation: _Optional[str] = ...) -> None: ...

class LeaveRequest(_message.Message):
    __slots__ = ("worker_id",)
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    worker_id: int
    def __init__(self, worker_id: _Optional[int] = ...) -> None: ...

class LeaveResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerStatus(_message.Message):
    __slots__ = ("worker_id", "worker_name", "last_step", "last_seen_age_s", "left", "pushes", "dead", "dropped", "work_s", "wait_s", "incarnation")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    WORKER_NAME_FIELD_NUMBER: _ClassVar[int]
    LAST_STEP_FIELD_NUMBER: _ClassVar[int]
    LAST_SEEN_AGE_S_FIELD_NUMBER: _ClassVar[int]
    LEFT_FIELD_NUMBER: _ClassVar[int]
    PUSHES_FIELD_NUMBER: _ClassVar[int]
    DEAD_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    WORK_S_FIELD_NUMBER: _ClassVar[int]
    WAIT_S_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    worker_id: int
    worker_name: str
    last_step: int
    last_seen_age_s: float
    left: bool
    pushes: int
    dead: bool
    dropped: int
    work_s: float
    wait_s: float
    incarnation: int
    def __init__(self, worker_id: _Optional[int] = ..., worker_name: _Optional[str] = ..., last_step: _Optional[int] = ..., last_seen_age_s: _Optional[float] = ..., left: _Optional[bool] = ..., pushes: _Optional[int] = ..., dead: _Optional[bool] = ..., dropped: _Optional[int] = ..., work_s: _Optional[float] = ..., wait_s: _Optional[float] = ..., incarnation: _Optional[int] = ...) -> None: ...

class StatusResponse(_message.Message):
    __slots__ = ("mode", "num_workers", "initialized", "version", "round", "waiting_for", "workers", "pushes_applied", "examples_applied", "mean_staleness", "max_staleness_seen", "optimizer", "num_variables", "num_parameters", "uptime_s", "rounds_timed_out", "last_loss", "incarnation", "pushes_dropped", "pushes_replayed", "rounds_aborted", "dead_worker_policy", "replicas_to_aggregate", "lease_timeout_s", "active_workers", "last_checkpoint_version", "checkpoint_age_s", "staleness", "max_ahead", "stale_gradient_policy", "max_staleness", "pushes_scaled", "optimizer_iterations", "learning_rate_now", "epoch_examples", "num_examples", "tasks_total", "tasks_done", "tasks_held", "tasks_queued", "membership", "membership_dropped")
    MODE_FIELD_NUMBER: _ClassVar[int]
    NUM_WORKERS_FIELD_NUMBER: _ClassVar[int]
    INITIALIZED_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    WAITING_FOR_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    PUSHES_APPLIED_FIELD_NUMBER: _ClassVar[int]
    EXAMPLES_APPLIED_FIELD_NUMBER: _ClassVar[int]
    MEAN_STALENESS_FIELD_NUMBER: _ClassVar[int]
    MAX_STALENESS_SEEN_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    NUM_VARIABLES_FIELD_NUMBER: _ClassVar[int]
    NUM_PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_TIMED_OUT_FIELD_NUMBER: _ClassVar[int]
    LAST_LOSS_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    PUSHES_DROPPED_FIELD_NUMBER: _ClassVar[int]
    PUSHES_REPLAYED_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_ABORTED_FIELD_NUMBER: _ClassVar[int]
    DEAD_WORKER_POLICY_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_TO_AGGREGATE_FIELD_NUMBER: _ClassVar[int]
    LEASE_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_WORKERS_FIELD_NUMBER: _ClassVar[int]
    LAST_CHECKPOINT_VERSION_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_AGE_S_FIELD_NUMBER: _ClassVar[int]
    STALENESS_FIELD_NUMBER: _ClassVar[int]
    MAX_AHEAD_FIELD_NUMBER: _ClassVar[int]
    STALE_GRADIENT_POLICY_FIELD_NUMBER: _ClassVar[int]
    MAX_STALENESS_FIELD_NUMBER: _ClassVar[int]
    PUSHES_SCALED_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_ITERATIONS_FIELD_NUMBER: _ClassVar[int]
    LEARNING_RATE_NOW_FIELD_NUMBER: _ClassVar[int]
    EPOCH_EXAMPLES_FIELD_NUMBER: _ClassVar[int]
    NUM_EXAMPLES_FIELD_NUMBER: _ClassVar[int]
    TASKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    TASKS_DONE_FIELD_NUMBER: _ClassVar[int]
    TASKS_HELD_FIELD_NUMBER: _ClassVar[int]
    TASKS_QUEUED_FIELD_NUMBER: _ClassVar[int]
    MEMBERSHIP_FIELD_NUMBER: _ClassVar[int]
    MEMBERSHIP_DROPPED_FIELD_NUMBER: _ClassVar[int]
    mode: Mode
    num_workers: int
    initialized: bool
    version: int
    round: int
    waiting_for: _containers.RepeatedScalarFieldContainer[int]
    workers: _containers.RepeatedCompositeFieldContainer[WorkerStatus]
    pushes_applied: int
    examples_applied: int
    mean_staleness: float
    max_staleness_seen: int
    optimizer: OptimizerConfig
    num_variables: int
    num_parameters: int
    uptime_s: float
    rounds_timed_out: int
    last_loss: float
    incarnation: str
    pushes_dropped: int
    pushes_replayed: int
    rounds_aborted: int
    dead_worker_policy: str
    replicas_to_aggregate: int
    lease_timeout_s: float
    active_workers: _containers.RepeatedScalarFieldContainer[int]
    last_checkpoint_version: int
    checkpoint_age_s: float
    staleness: int
    max_ahead: int
    stale_gradient_policy: str
    max_staleness: int
    pushes_scaled: int
    optimizer_iterations: int
    learning_rate_now: float
    epoch_examples: _containers.RepeatedScalarFieldContainer[int]
    num_examples: int
    tasks_total: int
    tasks_done: int
    tasks_held: int
    tasks_queued: int
    membership: _containers.RepeatedCompositeFieldContainer[MembershipEvent]
    membership_dropped: int
    def __init__(self, mode: _Optional[_Union[Mode, str]] = ..., num_workers: _Optional[int] = ..., initialized: _Optional[bool] = ..., version: _Optional[int] = ..., round: _Optional[int] = ..., waiting_for: _Optional[_Iterable[int]] = ..., workers: _Optional[_Iterable[_Union[WorkerStatus, _Mapping]]] = ..., pushes_applied: _Optional[int] = ..., examples_applied: _Optional[int] = ..., mean_staleness: _Optional[float] = ..., max_staleness_seen: _Optional[int] = ..., optimizer: _Optional[_Union[OptimizerConfig, _Mapping]] = ..., num_variables: _Optional[int] = ..., num_parameters: _Optional[int] = ..., uptime_s: _Optional[float] = ..., rounds_timed_out: _Optional[int] = ..., last_loss: _Optional[float] = ..., incarnation: _Optional[str] = ..., pushes_dropped: _Optional[int] = ..., pushes_replayed: _Optional[int] = ..., rounds_aborted: _Optional[int] = ..., dead_worker_policy: _Optional[str] = ..., replicas_to_aggregate: _Optional[int] = ..., lease_timeout_s: _Optional[float] = ..., active_workers: _Optional[_Iterable[int]] = ..., last_checkpoint_version: _Optional[int] = ..., checkpoint_age_s: _Optional[float] = ..., staleness: _Optional[int] = ..., max_ahead: _Optional[int] = ..., stale_gradient_policy: _Optional[str] = ..., max_staleness: _Optional[int] = ..., pushes_scaled: _Optional[int] = ..., optimizer_iterations: _Optional[int] = ..., learning_rate_now: _Optional[float] = ..., epoch_examples: _Optional[_Iterable[int]] = ..., num_examples: _Optional[int] = ..., tasks_total: _Optional[int] = ..., tasks_done: _Optional[int] = ..., tasks_held: _Optional[int] = ..., tasks_queued: _Optional[int] = ..., membership: _Optional[_Iterable[_Union[MembershipEvent, _Mapping]]] = ..., membership_dropped: _Optional[int] = ...) -> None: ...

class MembershipEvent(_message.Message):
    __slots__ = ("wall_time", "round", "version", "event", "worker_id", "worker_name")
    WALL_TIME_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    EVENT_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    WORKER_NAME_FIELD_NUMBER: _ClassVar[int]
    wall_time: float
    round: int
    version: int
    event: str
    worker_id: int
    worker_name: str
    def __init__(self, wall_time: _Optional[float] = ..., round: _Optional[int] = ..., version: _Optional[int] = ..., event: _Optional[str] = ..., worker_id: _Optional[int] = ..., worker_name: _Optional[str] = ...) -> None: ...

class BroadcastRequest(_message.Message):
    __slots__ = ("worker_id", "key", "value", "timeout_s")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    worker_id: int
    key: str
    value: bytes
    timeout_s: float
    def __init__(self, worker_id: _Optional[int] = ..., key: _Optional[str] = ..., value: _Optional[bytes] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class BroadcastResponse(_message.Message):
    __slots__ = ("value",)
    VALUE_FIELD_NUMBER: _ClassVar[int]
    value: bytes
    def __init__(self, value: _Optional[bytes] = ...) -> None: ...

class SessionRequest(_message.Message):
    __slots__ = ("call", "pull", "push", "work", "cancel")
    CALL_FIELD_NUMBER: _ClassVar[int]
    PULL_FIELD_NUMBER: _ClassVar[int]
    PUSH_FIELD_NUMBER: _ClassVar[int]
    WORK_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    call: int
    pull: PullRequest
    push: PushRequest
    work: WorkRequest
    cancel: bool
    def __init__(self, call: _Optional[int] = ..., pull: _Optional[_Union[PullRequest, _Mapping]] = ..., push: _Optional[_Union[PushRequest, _Mapping]] = ..., work: _Optional[_Union[WorkRequest, _Mapping]] = ..., cancel: _Optional[bool] = ...) -> None: ...

class CallFailure(_message.Message):
    __slots__ = ("code", "details", "reason")
    CODE_FIELD_NUMBER: _ClassVar[int]
    DETAILS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    code: int
    details: str
    reason: str
    def __init__(self, code: _Optional[int] = ..., details: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class SessionReply(_message.Message):
    __slots__ = ("call", "pull", "push", "work", "failure")
    CALL_FIELD_NUMBER: _ClassVar[int]
    PULL_FIELD_NUMBER: _ClassVar[int]
    PUSH_FIELD_NUMBER: _ClassVar[int]
    WORK_FIELD_NUMBER: _ClassVar[int]
    FAILURE_FIELD_NUMBER: _ClassVar[int]
    call: int
    pull: PullResponse
    push: PushResponse
    work: Assignment
    failure: CallFailure
    def __init__(self, call: _Optional[int] = ..., pull: _Optional[_Union[PullResponse, _Mapping]] = ..., push: _Optional[_Union[PushResponse, _Mapping]] = ..., work: _Optional[_Union[Assignment, _Mapping]] = ..., failure: _Optional[_Union[CallFailure, _Mapping]] = ...) -> None: ...
