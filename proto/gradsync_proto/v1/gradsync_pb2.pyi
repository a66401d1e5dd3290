from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    DTYPE_FLOAT32: _ClassVar[DType]
    DTYPE_FLOAT64: _ClassVar[DType]
    DTYPE_FLOAT16: _ClassVar[DType]
    DTYPE_BFLOAT16: _ClassVar[DType]
    DTYPE_INT64: _ClassVar[DType]
    DTYPE_INT32: _ClassVar[DType]
    DTYPE_INT16: _ClassVar[DType]
    DTYPE_INT8: _ClassVar[DType]
    DTYPE_UINT8: _ClassVar[DType]
    DTYPE_BOOL: _ClassVar[DType]

class Encoding(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ENCODING_RAW: _ClassVar[Encoding]
    ENCODING_TOPK2: _ClassVar[Encoding]

class CollectiveOp(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    COLLECTIVE_OP_UNSPECIFIED: _ClassVar[CollectiveOp]
    COLLECTIVE_OP_SUM: _ClassVar[CollectiveOp]
    COLLECTIVE_OP_AVG: _ClassVar[CollectiveOp]
    COLLECTIVE_OP_MIN: _ClassVar[CollectiveOp]
    COLLECTIVE_OP_MAX: _ClassVar[CollectiveOp]
    COLLECTIVE_OP_BROADCAST: _ClassVar[CollectiveOp]
    COLLECTIVE_OP_ALL_GATHER: _ClassVar[CollectiveOp]
    COLLECTIVE_OP_BARRIER: _ClassVar[CollectiveOp]
    COLLECTIVE_OP_PRODUCT: _ClassVar[CollectiveOp]
    COLLECTIVE_OP_REDUCE_SCATTER: _ClassVar[CollectiveOp]
    COLLECTIVE_OP_GATHER: _ClassVar[CollectiveOp]
    COLLECTIVE_OP_SCATTER: _ClassVar[CollectiveOp]
    COLLECTIVE_OP_ALL_TO_ALL: _ClassVar[CollectiveOp]

class AbortReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ABORT_REASON_UNSPECIFIED: _ClassVar[AbortReason]
    ABORT_REASON_MESSAGE_REJECTED: _ClassVar[AbortReason]
    ABORT_REASON_PEER_MESSAGE_REJECTED: _ClassVar[AbortReason]
    ABORT_REASON_PEER_LOST: _ClassVar[AbortReason]
    ABORT_REASON_NONFINITE: _ClassVar[AbortReason]

class EndReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    END_REASON_UNSPECIFIED: _ClassVar[EndReason]
    END_REASON_DECLARED_DEAD: _ClassVar[EndReason]
    END_REASON_CHECKPOINT_FAILED: _ClassVar[EndReason]
    END_REASON_SHUTTING_DOWN: _ClassVar[EndReason]
    END_REASON_JOB_REFUSED: _ClassVar[EndReason]
    END_REASON_PEER_LOST: _ClassVar[EndReason]
    END_REASON_RESOURCE_EXHAUSTED: _ClassVar[EndReason]
    END_REASON_SHARD_LOST: _ClassVar[EndReason]

class StoreOp(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    STORE_OP_UNSPECIFIED: _ClassVar[StoreOp]
    STORE_OP_SET: _ClassVar[StoreOp]
    STORE_OP_GET: _ClassVar[StoreOp]
    STORE_OP_ADD: _ClassVar[StoreOp]
    STORE_OP_COMPARE_SET: _ClassVar[StoreOp]
    STORE_OP_CHECK: _ClassVar[StoreOp]
    STORE_OP_WAIT: _ClassVar[StoreOp]
    STORE_OP_DELETE_KEY: _ClassVar[StoreOp]
    STORE_OP_NUM_KEYS: _ClassVar[StoreOp]
DTYPE_UNSPECIFIED: DType
DTYPE_FLOAT32: DType
DTYPE_FLOAT64: DType
DTYPE_FLOAT16: DType
DTYPE_BFLOAT16: DType
DTYPE_INT64: DType
DTYPE_INT32: DType
DTYPE_INT16: DType
DTYPE_INT8: DType
DTYPE_UINT8: DType
DTYPE_BOOL: DType
ENCODING_RAW: Encoding
ENCODING_TOPK2: Encoding
COLLECTIVE_OP_UNSPECIFIED: CollectiveOp
COLLECTIVE_OP_SUM: CollectiveOp
COLLECTIVE_OP_AVG: CollectiveOp
COLLECTIVE_OP_MIN: CollectiveOp
COLLECTIVE_OP_MAX: CollectiveOp
COLLECTIVE_OP_BROADCAST: CollectiveOp
COLLECTIVE_OP_ALL_GATHER: CollectiveOp
COLLECTIVE_OP_BARRIER: CollectiveOp
COLLECTIVE_OP_PRODUCT: CollectiveOp
COLLECTIVE_OP_REDUCE_SCATTER: CollectiveOp
COLLECTIVE_OP_GATHER: CollectiveOp
COLLECTIVE_OP_SCATTER: CollectiveOp
COLLECTIVE_OP_ALL_TO_ALL: CollectiveOp
ABORT_REASON_UNSPECIFIED: AbortReason
ABORT_REASON_MESSAGE_REJECTED: AbortReason
ABORT_REASON_PEER_MESSAGE_REJECTED: AbortReason
ABORT_REASON_PEER_LOST: AbortReason
ABORT_REASON_NONFINITE: AbortReason
END_REASON_UNSPECIFIED: EndReason
END_REASON_DECLARED_DEAD: EndReason
END_REASON_CHECKPOINT_FAILED: EndReason
END_REASON_SHUTTING_DOWN: EndReason
END_REASON_JOB_REFUSED: EndReason
END_REASON_PEER_LOST: EndReason
END_REASON_RESOURCE_EXHAUSTED: EndReason
END_REASON_SHARD_LOST: EndReason
STORE_OP_UNSPECIFIED: StoreOp
STORE_OP_SET: StoreOp
STORE_OP_GET: StoreOp
STORE_OP_ADD: StoreOp
STORE_OP_COMPARE_SET: StoreOp
STORE_OP_CHECK: StoreOp
STORE_OP_WAIT: StoreOp
STORE_OP_DELETE_KEY: StoreOp
STORE_OP_NUM_KEYS: StoreOp

class TensorSpec(_message.Message):
    __slots__ = ("name", "shape", "dtype")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    name: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: DType
    def __init__(self, name: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[_Union[DType, str]] = ...) -> None: ...

class BucketSpec(_message.Message):
    __slots__ = ("parameter_indices", "dtype", "num_elements", "outer")
    PARAMETER_INDICES_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    NUM_ELEMENTS_FIELD_NUMBER: _ClassVar[int]
    OUTER_FIELD_NUMBER: _ClassVar[int]
    parameter_indices: _containers.RepeatedScalarFieldContainer[int]
    dtype: DType
    num_elements: int
    outer: bool
    def __init__(self, parameter_indices: _Optional[_Iterable[int]] = ..., dtype: _Optional[_Union[DType, str]] = ..., num_elements: _Optional[int] = ..., outer: _Optional[bool] = ...) -> None: ...

class OuterOptimizer(_message.Message):
    __slots__ = ("lr", "momentum", "nesterov", "min_contributors", "round_deadline_s", "merge_late", "max_staleness", "weighted", "answer_dtype", "screen", "round_deadline_auto", "answer_density")
    LR_FIELD_NUMBER: _ClassVar[int]
    MOMENTUM_FIELD_NUMBER: _ClassVar[int]
    NESTEROV_FIELD_NUMBER: _ClassVar[int]
    MIN_CONTRIBUTORS_FIELD_NUMBER: _ClassVar[int]
    ROUND_DEADLINE_S_FIELD_NUMBER: _ClassVar[int]
    MERGE_LATE_FIELD_NUMBER: _ClassVar[int]
    MAX_STALENESS_FIELD_NUMBER: _ClassVar[int]
    WEIGHTED_FIELD_NUMBER: _ClassVar[int]
    ANSWER_DTYPE_FIELD_NUMBER: _ClassVar[int]
    SCREEN_FIELD_NUMBER: _ClassVar[int]
    ROUND_DEADLINE_AUTO_FIELD_NUMBER: _ClassVar[int]
    ANSWER_DENSITY_FIELD_NUMBER: _ClassVar[int]
    lr: float
    momentum: float
    nesterov: bool
    min_contributors: int
    round_deadline_s: float
    merge_late: bool
    max_staleness: int
    weighted: bool
    answer_dtype: DType
    screen: str
    round_deadline_auto: bool
    answer_density: float
    def __init__(self, lr: _Optional[float] = ..., momentum: _Optional[float] = ..., nesterov: _Optional[bool] = ..., min_contributors: _Optional[int] = ..., round_deadline_s: _Optional[float] = ..., merge_late: _Optional[bool] = ..., max_staleness: _Optional[int] = ..., weighted: _Optional[bool] = ..., answer_dtype: _Optional[_Union[DType, str]] = ..., screen: _Optional[str] = ..., round_deadline_auto: _Optional[bool] = ..., answer_density: _Optional[float] = ...) -> None: ...

class ModelSignature(_message.Message):
    __slots__ = ("parameters", "buffers", "buckets", "outer", "screen")
    PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    BUFFERS_FIELD_NUMBER: _ClassVar[int]
    BUCKETS_FIELD_NUMBER: _ClassVar[int]
    OUTER_FIELD_NUMBER: _ClassVar[int]
    SCREEN_FIELD_NUMBER: _ClassVar[int]
    parameters: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    buffers: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    buckets: _containers.RepeatedCompositeFieldContainer[BucketSpec]
    outer: OuterOptimizer
    screen: str
    def __init__(self, parameters: _Optional[_Iterable[_Union[TensorSpec, _Mapping]]] = ..., buffers: _Optional[_Iterable[_Union[TensorSpec, _Mapping]]] = ..., buckets: _Optional[_Iterable[_Union[BucketSpec, _Mapping]]] = ..., outer: _Optional[_Union[OuterOptimizer, _Mapping]] = ..., screen: _Optional[str] = ...) -> None: ...

class Join(_message.Message):
    __slots__ = ("job_id", "rank", "world_size", "signature", "incarnation", "client_version", "host_id", "local_world_size", "position", "heal_relayed", "collective_resume")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    CLIENT_VERSION_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    LOCAL_WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    HEAL_RELAYED_FIELD_NUMBER: _ClassVar[int]
    COLLECTIVE_RESUME_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    rank: int
    world_size: int
    signature: ModelSignature
    incarnation: str
    client_version: str
    host_id: str
    local_world_size: int
    position: Position
    heal_relayed: bool
    collective_resume: CollectiveResume
    def __init__(self, job_id: _Optional[str] = ..., rank: _Optional[int] = ..., world_size: _Optional[int] = ..., signature: _Optional[_Union[ModelSignature, _Mapping]] = ..., incarnation: _Optional[str] = ..., client_version: _Optional[str] = ..., host_id: _Optional[str] = ..., local_world_size: _Optional[int] = ..., position: _Optional[_Union[Position, _Mapping]] = ..., heal_relayed: _Optional[bool] = ..., collective_resume: _Optional[_Union[CollectiveResume, _Mapping]] = ...) -> None: ...

class CollectiveResume(_message.Message):
    __slots__ = ("sequence",)
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    sequence: int
    def __init__(self, sequence: _Optional[int] = ...) -> None: ...

class Position(_message.Message):
    __slots__ = ("step", "digest")
    STEP_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    step: int
    digest: bytes
    def __init__(self, step: _Optional[int] = ..., digest: _Optional[bytes] = ...) -> None: ...

class GradientChunk(_message.Message):
    __slots__ = ("step", "membership_epoch", "bucket_index", "offset", "dtype", "encoding", "payload", "contributors", "covered_ranks", "reply_dtype", "in_segment", "segment_offset", "nonfinite_ranks", "scale", "weight", "merged_late", "staleness", "next_step", "alignment", "screened_ranks", "screen_note")
    STEP_FIELD_NUMBER: _ClassVar[int]
    MEMBERSHIP_EPOCH_FIELD_NUMBER: _ClassVar[int]
    BUCKET_INDEX_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    ENCODING_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    CONTRIBUTORS_FIELD_NUMBER: _ClassVar[int]
    COVERED_RANKS_FIELD_NUMBER: _ClassVar[int]
    REPLY_DTYPE_FIELD_NUMBER: _ClassVar[int]
    IN_SEGMENT_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_OFFSET_FIELD_NUMBER: _ClassVar[int]
    NONFINITE_RANKS_FIELD_NUMBER: _ClassVar[int]
    SCALE_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    MERGED_LATE_FIELD_NUMBER: _ClassVar[int]
    STALENESS_FIELD_NUMBER: _ClassVar[int]
    NEXT_STEP_FIELD_NUMBER: _ClassVar[int]
    ALIGNMENT_FIELD_NUMBER: _ClassVar[int]
    SCREENED_RANKS_FIELD_NUMBER: _ClassVar[int]
    SCREEN_NOTE_FIELD_NUMBER: _ClassVar[int]
    step: int
    membership_epoch: int
    bucket_index: int
    offset: int
    dtype: DType
    encoding: Encoding
    payload: bytes
    contributors: int
    covered_ranks: _containers.RepeatedScalarFieldContainer[int]
    reply_dtype: DType
    in_segment: bool
    segment_offset: int
    nonfinite_ranks: _containers.RepeatedScalarFieldContainer[int]
    scale: float
    weight: float
    merged_late: int
    staleness: int
    next_step: int
    alignment: bytes
    screened_ranks: _containers.RepeatedScalarFieldContainer[int]
    screen_note: str
    def __init__(self, step: _Optional[int] = ..., membership_epoch: _Optional[int] = ..., bucket_index: _Optional[int] = ..., offset: _Optional[int] = ..., dtype: _Optional[_Union[DType, str]] = ..., encoding: _Optional[_Union[Encoding, str]] = ..., payload: _Optional[bytes] = ..., contributors: _Optional[int] = ..., covered_ranks: _Optional[_Iterable[int]] = ..., reply_dtype: _Optional[_Union[DType, str]] = ..., in_segment: _Optional[bool] = ..., segment_offset: _Optional[int] = ..., nonfinite_ranks: _Optional[_Iterable[int]] = ..., scale: _Optional[float] = ..., weight: _Optional[float] = ..., merged_late: _Optional[int] = ..., staleness: _Optional[int] = ..., next_step: _Optional[int] = ..., alignment: _Optional[bytes] = ..., screened_ranks: _Optional[_Iterable[int]] = ..., screen_note: _Optional[str] = ...) -> None: ...

class StateChunk(_message.Message):
    __slots__ = ("offset", "payload")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    offset: int
    payload: bytes
    def __init__(self, offset: _Optional[int] = ..., payload: _Optional[bytes] = ...) -> None: ...

class Heartbeat(_message.Message):
    __slots__ = ("step",)
    STEP_FIELD_NUMBER: _ClassVar[int]
    step: int
    def __init__(self, step: _Optional[int] = ...) -> None: ...

class CheckpointChunk(_message.Message):
    __slots__ = ("step", "offset", "total_bytes", "payload", "heal")
    STEP_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    HEAL_FIELD_NUMBER: _ClassVar[int]
    step: int
    offset: int
    total_bytes: int
    payload: bytes
    heal: bool
    def __init__(self, step: _Optional[int] = ..., offset: _Optional[int] = ..., total_bytes: _Optional[int] = ..., payload: _Optional[bytes] = ..., heal: _Optional[bool] = ...) -> None: ...

class MembershipChanged(_message.Message):
    __slots__ = ("membership_epoch", "ranks", "step", "reason")
    MEMBERSHIP_EPOCH_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    membership_epoch: int
    ranks: _containers.RepeatedScalarFieldContainer[int]
    step: int
    reason: str
    def __init__(self, membership_epoch: _Optional[int] = ..., ranks: _Optional[_Iterable[int]] = ..., step: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class StateRequest(_message.Message):
    __slots__ = ("for_rank", "relay")
    FOR_RANK_FIELD_NUMBER: _ClassVar[int]
    RELAY_FIELD_NUMBER: _ClassVar[int]
    for_rank: int
    relay: bool
    def __init__(self, for_rank: _Optional[int] = ..., relay: _Optional[bool] = ...) -> None: ...

class CheckpointSaved(_message.Message):
    __slots__ = ("step", "durable", "message")
    STEP_FIELD_NUMBER: _ClassVar[int]
    DURABLE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    step: int
    durable: bool
    message: str
    def __init__(self, step: _Optional[int] = ..., durable: _Optional[bool] = ..., message: _Optional[str] = ...) -> None: ...

class AbandonStep(_message.Message):
    __slots__ = ("step", "reason")
    STEP_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    step: int
    reason: str
    def __init__(self, step: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class Leave(_message.Message):
    __slots__ = ("reason",)
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: str
    def __init__(self, reason: _Optional[str] = ...) -> None: ...

class CollectiveChunk(_message.Message):
    __slots__ = ("sequence", "op", "dtype", "total_bytes", "offset", "payload", "root", "contributors", "reduce_op", "send_splits", "receive_splits", "error", "covered_ranks", "covered_waited_s")
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    OP_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    ROOT_FIELD_NUMBER: _ClassVar[int]
    CONTRIBUTORS_FIELD_NUMBER: _ClassVar[int]
    REDUCE_OP_FIELD_NUMBER: _ClassVar[int]
    SEND_SPLITS_FIELD_NUMBER: _ClassVar[int]
    RECEIVE_SPLITS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    COVERED_RANKS_FIELD_NUMBER: _ClassVar[int]
    COVERED_WAITED_S_FIELD_NUMBER: _ClassVar[int]
    sequence: int
    op: CollectiveOp
    dtype: DType
    total_bytes: int
    offset: int
    payload: bytes
    root: int
    contributors: int
    reduce_op: CollectiveOp
    send_splits: _containers.RepeatedScalarFieldContainer[int]
    receive_splits: _containers.RepeatedScalarFieldContainer[int]
    error: str
    covered_ranks: _containers.RepeatedScalarFieldContainer[int]
    covered_waited_s: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, sequence: _Optional[int] = ..., op: _Optional[_Union[CollectiveOp, str]] = ..., dtype: _Optional[_Union[DType, str]] = ..., total_bytes: _Optional[int] = ..., offset: _Optional[int] = ..., payload: _Optional[bytes] = ..., root: _Optional[int] = ..., contributors: _Optional[int] = ..., reduce_op: _Optional[_Union[CollectiveOp, str]] = ..., send_splits: _Optional[_Iterable[int]] = ..., receive_splits: _Optional[_Iterable[int]] = ..., error: _Optional[str] = ..., covered_ranks: _Optional[_Iterable[int]] = ..., covered_waited_s: _Optional[_Iterable[float]] = ...) -> None: ...

class AssemblyProgress(_message.Message):
    __slots__ = ("joined_ranks", "missing_ranks", "waited_s", "heartbeat_interval_s", "refused")
    JOINED_RANKS_FIELD_NUMBER: _ClassVar[int]
    MISSING_RANKS_FIELD_NUMBER: _ClassVar[int]
    WAITED_S_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    joined_ranks: _containers.RepeatedScalarFieldContainer[int]
    missing_ranks: _containers.RepeatedScalarFieldContainer[int]
    waited_s: float
    heartbeat_interval_s: float
    refused: str
    def __init__(self, joined_ranks: _Optional[_Iterable[int]] = ..., missing_ranks: _Optional[_Iterable[int]] = ..., waited_s: _Optional[float] = ..., heartbeat_interval_s: _Optional[float] = ..., refused: _Optional[str] = ...) -> None: ...

class OutOfInputs(_message.Message):
    __slots__ = ("step",)
    STEP_FIELD_NUMBER: _ClassVar[int]
    step: int
    def __init__(self, step: _Optional[int] = ...) -> None: ...

class JoinProgress(_message.Message):
    __slots__ = ("joined_ranks", "all_joined", "last_joiner", "next_step", "next_collective")
    JOINED_RANKS_FIELD_NUMBER: _ClassVar[int]
    ALL_JOINED_FIELD_NUMBER: _ClassVar[int]
    LAST_JOINER_FIELD_NUMBER: _ClassVar[int]
    NEXT_STEP_FIELD_NUMBER: _ClassVar[int]
    NEXT_COLLECTIVE_FIELD_NUMBER: _ClassVar[int]
    joined_ranks: _containers.RepeatedScalarFieldContainer[int]
    all_joined: bool
    last_joiner: int
    next_step: int
    next_collective: int
    def __init__(self, joined_ranks: _Optional[_Iterable[int]] = ..., all_joined: _Optional[bool] = ..., last_joiner: _Optional[int] = ..., next_step: _Optional[int] = ..., next_collective: _Optional[int] = ...) -> None: ...

class WorkerMessage(_message.Message):
    __slots__ = ("join", "gradient", "state", "leave", "heartbeat", "checkpoint", "abandon", "collective", "out_of_inputs", "shard_hello", "local_posted")
    JOIN_FIELD_NUMBER: _ClassVar[int]
    GRADIENT_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    LEAVE_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    ABANDON_FIELD_NUMBER: _ClassVar[int]
    COLLECTIVE_FIELD_NUMBER: _ClassVar[int]
    OUT_OF_INPUTS_FIELD_NUMBER: _ClassVar[int]
    SHARD_HELLO_FIELD_NUMBER: _ClassVar[int]
    LOCAL_POSTED_FIELD_NUMBER: _ClassVar[int]
    join: Join
    gradient: GradientChunk
    state: StateChunk
    leave: Leave
    heartbeat: Heartbeat
    checkpoint: CheckpointChunk
    abandon: AbandonStep
    collective: CollectiveChunk
    out_of_inputs: OutOfInputs
    shard_hello: ShardHello
    local_posted: LocalPosted
    def __init__(self, join: _Optional[_Union[Join, _Mapping]] = ..., gradient: _Optional[_Union[GradientChunk, _Mapping]] = ..., state: _Optional[_Union[StateChunk, _Mapping]] = ..., leave: _Optional[_Union[Leave, _Mapping]] = ..., heartbeat: _Optional[_Union[Heartbeat, _Mapping]] = ..., checkpoint: _Optional[_Union[CheckpointChunk, _Mapping]] = ..., abandon: _Optional[_Union[AbandonStep, _Mapping]] = ..., collective: _Optional[_Union[CollectiveChunk, _Mapping]] = ..., out_of_inputs: _Optional[_Union[OutOfInputs, _Mapping]] = ..., shard_hello: _Optional[_Union[ShardHello, _Mapping]] = ..., local_posted: _Optional[_Union[LocalPosted, _Mapping]] = ...) -> None: ...

class LocalPosted(_message.Message):
    __slots__ = ("step", "bucket_index")
    STEP_FIELD_NUMBER: _ClassVar[int]
    BUCKET_INDEX_FIELD_NUMBER: _ClassVar[int]
    step: int
    bucket_index: int
    def __init__(self, step: _Optional[int] = ..., bucket_index: _Optional[int] = ...) -> None: ...

class ShardHello(_message.Message):
    __slots__ = ("job_id", "rank", "incarnation", "shard_index", "session")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    SHARD_INDEX_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    rank: int
    incarnation: str
    shard_index: int
    session: bytes
    def __init__(self, job_id: _Optional[str] = ..., rank: _Optional[int] = ..., incarnation: _Optional[str] = ..., shard_index: _Optional[int] = ..., session: _Optional[bytes] = ...) -> None: ...

class Welcome(_message.Message):
    __slots__ = ("job_id", "world_size", "membership_epoch", "start_step", "chunk_bytes", "max_message_bytes", "state_bytes", "resume_bytes", "heartbeat_interval_s", "checkpoint_every_steps", "next_collective", "shards", "session", "local_ranks", "local_secret", "payload_socket", "outer_seeded", "outer_replay", "outer_repeat", "restart", "send_state", "continued")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    MEMBERSHIP_EPOCH_FIELD_NUMBER: _ClassVar[int]
    START_STEP_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    STATE_BYTES_FIELD_NUMBER: _ClassVar[int]
    RESUME_BYTES_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_EVERY_STEPS_FIELD_NUMBER: _ClassVar[int]
    NEXT_COLLECTIVE_FIELD_NUMBER: _ClassVar[int]
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    LOCAL_RANKS_FIELD_NUMBER: _ClassVar[int]
    LOCAL_SECRET_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_SOCKET_FIELD_NUMBER: _ClassVar[int]
    OUTER_SEEDED_FIELD_NUMBER: _ClassVar[int]
    OUTER_REPLAY_FIELD_NUMBER: _ClassVar[int]
    OUTER_REPEAT_FIELD_NUMBER: _ClassVar[int]
    RESTART_FIELD_NUMBER: _ClassVar[int]
    SEND_STATE_FIELD_NUMBER: _ClassVar[int]
    CONTINUED_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    world_size: int
    membership_epoch: int
    start_step: int
    chunk_bytes: int
    max_message_bytes: int
    state_bytes: int
    resume_bytes: int
    heartbeat_interval_s: float
    checkpoint_every_steps: int
    next_collective: int
    shards: _containers.RepeatedCompositeFieldContainer[ShardAddress]
    session: bytes
    local_ranks: _containers.RepeatedScalarFieldContainer[int]
    local_secret: bytes
    payload_socket: str
    outer_seeded: bool
    outer_replay: bool
    outer_repeat: bool
    restart: str
    send_state: bool
    continued: bool
    def __init__(self, job_id: _Optional[str] = ..., world_size: _Optional[int] = ..., membership_epoch: _Optional[int] = ..., start_step: _Optional[int] = ..., chunk_bytes: _Optional[int] = ..., max_message_bytes: _Optional[int] = ..., state_bytes: _Optional[int] = ..., resume_bytes: _Optional[int] = ..., heartbeat_interval_s: _Optional[float] = ..., checkpoint_every_steps: _Optional[int] = ..., next_collective: _Optional[int] = ..., shards: _Optional[_Iterable[_Union[ShardAddress, _Mapping]]] = ..., session: _Optional[bytes] = ..., local_ranks: _Optional[_Iterable[int]] = ..., local_secret: _Optional[bytes] = ..., payload_socket: _Optional[str] = ..., outer_seeded: _Optional[bool] = ..., outer_replay: _Optional[bool] = ..., outer_repeat: _Optional[bool] = ..., restart: _Optional[str] = ..., send_state: _Optional[bool] = ..., continued: _Optional[bool] = ...) -> None: ...

class ShardAddress(_message.Message):
    __slots__ = ("index", "address")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    index: int
    address: str
    def __init__(self, index: _Optional[int] = ..., address: _Optional[str] = ...) -> None: ...

class StepAborted(_message.Message):
    __slots__ = ("step", "code", "message", "culprit_rank", "bucket_index", "reason")
    STEP_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    CULPRIT_RANK_FIELD_NUMBER: _ClassVar[int]
    BUCKET_INDEX_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    step: int
    code: int
    message: str
    culprit_rank: int
    bucket_index: int
    reason: AbortReason
    def __init__(self, step: _Optional[int] = ..., code: _Optional[int] = ..., message: _Optional[str] = ..., culprit_rank: _Optional[int] = ..., bucket_index: _Optional[int] = ..., reason: _Optional[_Union[AbortReason, str]] = ...) -> None: ...

class StreamEnd(_message.Message):
    __slots__ = ("reason", "code", "message")
    REASON_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    reason: EndReason
    code: int
    message: str
    def __init__(self, reason: _Optional[_Union[EndReason, str]] = ..., code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class StepReport(_message.Message):
    __slots__ = ("step", "slowest_rank", "slowest_lag_s")
    STEP_FIELD_NUMBER: _ClassVar[int]
    SLOWEST_RANK_FIELD_NUMBER: _ClassVar[int]
    SLOWEST_LAG_S_FIELD_NUMBER: _ClassVar[int]
    step: int
    slowest_rank: int
    slowest_lag_s: float
    def __init__(self, step: _Optional[int] = ..., slowest_rank: _Optional[int] = ..., slowest_lag_s: _Optional[float] = ...) -> None: ...

class CoordinatorMessage(_message.Message):
    __slots__ = ("welcome", "gradient", "state", "step_aborted", "checkpoint_saved", "resume", "membership", "state_request", "stream_end", "collective", "assembly", "join_progress", "step_report")
    WELCOME_FIELD_NUMBER: _ClassVar[int]
    GRADIENT_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    STEP_ABORTED_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_SAVED_FIELD_NUMBER: _ClassVar[int]
    RESUME_FIELD_NUMBER: _ClassVar[int]
    MEMBERSHIP_FIELD_NUMBER: _ClassVar[int]
    STATE_REQUEST_FIELD_NUMBER: _ClassVar[int]
    STREAM_END_FIELD_NUMBER: _ClassVar[int]
    COLLECTIVE_FIELD_NUMBER: _ClassVar[int]
    ASSEMBLY_FIELD_NUMBER: _ClassVar[int]
    JOIN_PROGRESS_FIELD_NUMBER: _ClassVar[int]
    STEP_REPORT_FIELD_NUMBER: _ClassVar[int]
    welcome: Welcome
    gradient: GradientChunk
    state: StateChunk
    step_aborted: StepAborted
    checkpoint_saved: CheckpointSaved
    resume: CheckpointChunk
    membership: MembershipChanged
    state_request: StateRequest
    stream_end: StreamEnd
    collective: CollectiveChunk
    assembly: AssemblyProgress
    join_progress: JoinProgress
    step_report: StepReport
    def __init__(self, welcome: _Optional[_Union[Welcome, _Mapping]] = ..., gradient: _Optional[_Union[GradientChunk, _Mapping]] = ..., state: _Optional[_Union[StateChunk, _Mapping]] = ..., step_aborted: _Optional[_Union[StepAborted, _Mapping]] = ..., checkpoint_saved: _Optional[_Union[CheckpointSaved, _Mapping]] = ..., resume: _Optional[_Union[CheckpointChunk, _Mapping]] = ..., membership: _Optional[_Union[MembershipChanged, _Mapping]] = ..., state_request: _Optional[_Union[StateRequest, _Mapping]] = ..., stream_end: _Optional[_Union[StreamEnd, _Mapping]] = ..., collective: _Optional[_Union[CollectiveChunk, _Mapping]] = ..., assembly: _Optional[_Union[AssemblyProgress, _Mapping]] = ..., join_progress: _Optional[_Union[JoinProgress, _Mapping]] = ..., step_report: _Optional[_Union[StepReport, _Mapping]] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class MemberStatus(_message.Message):
    __slots__ = ("rank", "incarnation", "peer", "last_seen_s", "reported_step", "mean_lag_s")
    RANK_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    PEER_FIELD_NUMBER: _ClassVar[int]
    LAST_SEEN_S_FIELD_NUMBER: _ClassVar[int]
    REPORTED_STEP_FIELD_NUMBER: _ClassVar[int]
    MEAN_LAG_S_FIELD_NUMBER: _ClassVar[int]
    rank: int
    incarnation: str
    peer: str
    last_seen_s: float
    reported_step: int
    mean_lag_s: float
    def __init__(self, rank: _Optional[int] = ..., incarnation: _Optional[str] = ..., peer: _Optional[str] = ..., last_seen_s: _Optional[float] = ..., reported_step: _Optional[int] = ..., mean_lag_s: _Optional[float] = ...) -> None: ...

class LateRank(_message.Message):
    __slots__ = ("rank", "bucket_indices")
    RANK_FIELD_NUMBER: _ClassVar[int]
    BUCKET_INDICES_FIELD_NUMBER: _ClassVar[int]
    rank: int
    bucket_indices: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, rank: _Optional[int] = ..., bucket_indices: _Optional[_Iterable[int]] = ...) -> None: ...

class JobStatus(_message.Message):
    __slots__ = ("job_id", "state", "world_size", "membership_epoch", "open_step", "steps_completed", "members", "late", "step_age_s", "last_checkpoint_step", "ended", "ended_s_ago", "outcome", "nonfinite_contributions", "last_nonfinite", "outer", "outer_rounds", "outer_state_bytes", "outer_state", "restart", "steps_recomputed", "screen", "screened_contributions", "last_screened")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    MEMBERSHIP_EPOCH_FIELD_NUMBER: _ClassVar[int]
    OPEN_STEP_FIELD_NUMBER: _ClassVar[int]
    STEPS_COMPLETED_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    LATE_FIELD_NUMBER: _ClassVar[int]
    STEP_AGE_S_FIELD_NUMBER: _ClassVar[int]
    LAST_CHECKPOINT_STEP_FIELD_NUMBER: _ClassVar[int]
    ENDED_FIELD_NUMBER: _ClassVar[int]
    ENDED_S_AGO_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    NONFINITE_CONTRIBUTIONS_FIELD_NUMBER: _ClassVar[int]
    LAST_NONFINITE_FIELD_NUMBER: _ClassVar[int]
    OUTER_FIELD_NUMBER: _ClassVar[int]
    OUTER_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    OUTER_STATE_BYTES_FIELD_NUMBER: _ClassVar[int]
    OUTER_STATE_FIELD_NUMBER: _ClassVar[int]
    RESTART_FIELD_NUMBER: _ClassVar[int]
    STEPS_RECOMPUTED_FIELD_NUMBER: _ClassVar[int]
    SCREEN_FIELD_NUMBER: _ClassVar[int]
    SCREENED_CONTRIBUTIONS_FIELD_NUMBER: _ClassVar[int]
    LAST_SCREENED_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    state: str
    world_size: int
    membership_epoch: int
    open_step: int
    steps_completed: int
    members: _containers.RepeatedCompositeFieldContainer[MemberStatus]
    late: _containers.RepeatedCompositeFieldContainer[LateRank]
    step_age_s: float
    last_checkpoint_step: int
    ended: bool
    ended_s_ago: float
    outcome: str
    nonfinite_contributions: int
    last_nonfinite: str
    outer: bool
    outer_rounds: int
    outer_state_bytes: int
    outer_state: str
    restart: str
    steps_recomputed: int
    screen: str
    screened_contributions: int
    last_screened: str
    def __init__(self, job_id: _Optional[str] = ..., state: _Optional[str] = ..., world_size: _Optional[int] = ..., membership_epoch: _Optional[int] = ..., open_step: _Optional[int] = ..., steps_completed: _Optional[int] = ..., members: _Optional[_Iterable[_Union[MemberStatus, _Mapping]]] = ..., late: _Optional[_Iterable[_Union[LateRank, _Mapping]]] = ..., step_age_s: _Optional[float] = ..., last_checkpoint_step: _Optional[int] = ..., ended: _Optional[bool] = ..., ended_s_ago: _Optional[float] = ..., outcome: _Optional[str] = ..., nonfinite_contributions: _Optional[int] = ..., last_nonfinite: _Optional[str] = ..., outer: _Optional[bool] = ..., outer_rounds: _Optional[int] = ..., outer_state_bytes: _Optional[int] = ..., outer_state: _Optional[str] = ..., restart: _Optional[str] = ..., steps_recomputed: _Optional[int] = ..., screen: _Optional[str] = ..., screened_contributions: _Optional[int] = ..., last_screened: _Optional[str] = ...) -> None: ...

class StatusReply(_message.Message):
    __slots__ = ("jobs", "heartbeat_timeout_s", "shards", "recovery")
    JOBS_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    RECOVERY_FIELD_NUMBER: _ClassVar[int]
    jobs: _containers.RepeatedCompositeFieldContainer[JobStatus]
    heartbeat_timeout_s: float
    shards: _containers.RepeatedCompositeFieldContainer[ShardStatus]
    recovery: Recovery
    def __init__(self, jobs: _Optional[_Iterable[_Union[JobStatus, _Mapping]]] = ..., heartbeat_timeout_s: _Optional[float] = ..., shards: _Optional[_Iterable[_Union[ShardStatus, _Mapping]]] = ..., recovery: _Optional[_Union[Recovery, _Mapping]] = ...) -> None: ...

class Recovery(_message.Message):
    __slots__ = ("fence", "takeovers", "ranks_lost", "last_detect_s", "last_rank_recover_s", "restarts_continued", "restarts_checkpoint", "steps_recomputed", "last_restart_recover_s")
    FENCE_FIELD_NUMBER: _ClassVar[int]
    TAKEOVERS_FIELD_NUMBER: _ClassVar[int]
    RANKS_LOST_FIELD_NUMBER: _ClassVar[int]
    LAST_DETECT_S_FIELD_NUMBER: _ClassVar[int]
    LAST_RANK_RECOVER_S_FIELD_NUMBER: _ClassVar[int]
    RESTARTS_CONTINUED_FIELD_NUMBER: _ClassVar[int]
    RESTARTS_CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    STEPS_RECOMPUTED_FIELD_NUMBER: _ClassVar[int]
    LAST_RESTART_RECOVER_S_FIELD_NUMBER: _ClassVar[int]
    fence: int
    takeovers: int
    ranks_lost: int
    last_detect_s: float
    last_rank_recover_s: float
    restarts_continued: int
    restarts_checkpoint: int
    steps_recomputed: int
    last_restart_recover_s: float
    def __init__(self, fence: _Optional[int] = ..., takeovers: _Optional[int] = ..., ranks_lost: _Optional[int] = ..., last_detect_s: _Optional[float] = ..., last_rank_recover_s: _Optional[float] = ..., restarts_continued: _Optional[int] = ..., restarts_checkpoint: _Optional[int] = ..., steps_recomputed: _Optional[int] = ..., last_restart_recover_s: _Optional[float] = ...) -> None: ...

class ShardStatus(_message.Message):
    __slots__ = ("index", "address", "alive", "last_seen_s", "bytes_received", "bytes_sent", "buckets_completed", "mean_bucket_s", "buffered_bytes", "connections", "version")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    ALIVE_FIELD_NUMBER: _ClassVar[int]
    LAST_SEEN_S_FIELD_NUMBER: _ClassVar[int]
    BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    BUCKETS_COMPLETED_FIELD_NUMBER: _ClassVar[int]
    MEAN_BUCKET_S_FIELD_NUMBER: _ClassVar[int]
    BUFFERED_BYTES_FIELD_NUMBER: _ClassVar[int]
    CONNECTIONS_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    index: int
    address: str
    alive: bool
    last_seen_s: float
    bytes_received: int
    bytes_sent: int
    buckets_completed: int
    mean_bucket_s: float
    buffered_bytes: int
    connections: int
    version: str
    def __init__(self, index: _Optional[int] = ..., address: _Optional[str] = ..., alive: _Optional[bool] = ..., last_seen_s: _Optional[float] = ..., bytes_received: _Optional[int] = ..., bytes_sent: _Optional[int] = ..., buckets_completed: _Optional[int] = ..., mean_bucket_s: _Optional[float] = ..., buffered_bytes: _Optional[int] = ..., connections: _Optional[int] = ..., version: _Optional[str] = ...) -> None: ...

class ShardRegister(_message.Message):
    __slots__ = ("version", "advertise", "chunk_bytes", "max_message_bytes")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    ADVERTISE_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    version: str
    advertise: str
    chunk_bytes: int
    max_message_bytes: int
    def __init__(self, version: _Optional[str] = ..., advertise: _Optional[str] = ..., chunk_bytes: _Optional[int] = ..., max_message_bytes: _Optional[int] = ...) -> None: ...

class ShardAccepted(_message.Message):
    __slots__ = ("shard_index", "shard_count", "heartbeat_interval_s", "heartbeat_timeout_s", "nonfinite")
    SHARD_INDEX_FIELD_NUMBER: _ClassVar[int]
    SHARD_COUNT_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    NONFINITE_FIELD_NUMBER: _ClassVar[int]
    shard_index: int
    shard_count: int
    heartbeat_interval_s: float
    heartbeat_timeout_s: float
    nonfinite: str
    def __init__(self, shard_index: _Optional[int] = ..., shard_count: _Optional[int] = ..., heartbeat_interval_s: _Optional[float] = ..., heartbeat_timeout_s: _Optional[float] = ..., nonfinite: _Optional[str] = ...) -> None: ...

class ShardMember(_message.Message):
    __slots__ = ("rank", "incarnation", "session")
    RANK_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    rank: int
    incarnation: str
    session: bytes
    def __init__(self, rank: _Optional[int] = ..., incarnation: _Optional[str] = ..., session: _Optional[bytes] = ...) -> None: ...

class ShardJobView(_message.Message):
    __slots__ = ("job_id", "world_size", "membership_epoch", "members", "out_of_inputs", "start_step", "buckets", "chunk_bytes", "shard_count", "local_groups", "outer", "outer_restore", "outer_run", "screen")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    MEMBERSHIP_EPOCH_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    OUT_OF_INPUTS_FIELD_NUMBER: _ClassVar[int]
    START_STEP_FIELD_NUMBER: _ClassVar[int]
    BUCKETS_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHARD_COUNT_FIELD_NUMBER: _ClassVar[int]
    LOCAL_GROUPS_FIELD_NUMBER: _ClassVar[int]
    OUTER_FIELD_NUMBER: _ClassVar[int]
    OUTER_RESTORE_FIELD_NUMBER: _ClassVar[int]
    OUTER_RUN_FIELD_NUMBER: _ClassVar[int]
    SCREEN_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    world_size: int
    membership_epoch: int
    members: _containers.RepeatedCompositeFieldContainer[ShardMember]
    out_of_inputs: _containers.RepeatedScalarFieldContainer[int]
    start_step: int
    buckets: _containers.RepeatedCompositeFieldContainer[BucketSpec]
    chunk_bytes: int
    shard_count: int
    local_groups: _containers.RepeatedCompositeFieldContainer[LocalGroup]
    outer: OuterOptimizer
    outer_restore: bool
    outer_run: str
    screen: str
    def __init__(self, job_id: _Optional[str] = ..., world_size: _Optional[int] = ..., membership_epoch: _Optional[int] = ..., members: _Optional[_Iterable[_Union[ShardMember, _Mapping]]] = ..., out_of_inputs: _Optional[_Iterable[int]] = ..., start_step: _Optional[int] = ..., buckets: _Optional[_Iterable[_Union[BucketSpec, _Mapping]]] = ..., chunk_bytes: _Optional[int] = ..., shard_count: _Optional[int] = ..., local_groups: _Optional[_Iterable[_Union[LocalGroup, _Mapping]]] = ..., outer: _Optional[_Union[OuterOptimizer, _Mapping]] = ..., outer_restore: _Optional[bool] = ..., outer_run: _Optional[str] = ..., screen: _Optional[str] = ...) -> None: ...

class LocalGroup(_message.Message):
    __slots__ = ("ranks",)
    RANKS_FIELD_NUMBER: _ClassVar[int]
    ranks: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ranks: _Optional[_Iterable[int]] = ...) -> None: ...

class ShardAbort(_message.Message):
    __slots__ = ("job_id", "step")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    step: int
    def __init__(self, job_id: _Optional[str] = ..., step: _Optional[int] = ...) -> None: ...

class ShardJobEnd(_message.Message):
    __slots__ = ("job_id", "code", "message")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    code: int
    message: str
    def __init__(self, job_id: _Optional[str] = ..., code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class LeaderMessage(_message.Message):
    __slots__ = ("accepted", "job", "abort", "job_end", "heartbeat", "stream_end")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    JOB_FIELD_NUMBER: _ClassVar[int]
    ABORT_FIELD_NUMBER: _ClassVar[int]
    JOB_END_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    STREAM_END_FIELD_NUMBER: _ClassVar[int]
    accepted: ShardAccepted
    job: ShardJobView
    abort: ShardAbort
    job_end: ShardJobEnd
    heartbeat: Heartbeat
    stream_end: StreamEnd
    def __init__(self, accepted: _Optional[_Union[ShardAccepted, _Mapping]] = ..., job: _Optional[_Union[ShardJobView, _Mapping]] = ..., abort: _Optional[_Union[ShardAbort, _Mapping]] = ..., job_end: _Optional[_Union[ShardJobEnd, _Mapping]] = ..., heartbeat: _Optional[_Union[Heartbeat, _Mapping]] = ..., stream_end: _Optional[_Union[StreamEnd, _Mapping]] = ...) -> None: ...

class ShardRejected(_message.Message):
    __slots__ = ("job_id", "rank", "step", "bucket_index", "code", "message", "reason", "via_local_leader")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    BUCKET_INDEX_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    VIA_LOCAL_LEADER_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    rank: int
    step: int
    bucket_index: int
    code: int
    message: str
    reason: AbortReason
    via_local_leader: bool
    def __init__(self, job_id: _Optional[str] = ..., rank: _Optional[int] = ..., step: _Optional[int] = ..., bucket_index: _Optional[int] = ..., code: _Optional[int] = ..., message: _Optional[str] = ..., reason: _Optional[_Union[AbortReason, str]] = ..., via_local_leader: _Optional[bool] = ...) -> None: ...

class ShardNonFinite(_message.Message):
    __slots__ = ("job_id", "rank", "step", "bucket_index", "message", "via_local_leader")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    BUCKET_INDEX_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    VIA_LOCAL_LEADER_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    rank: int
    step: int
    bucket_index: int
    message: str
    via_local_leader: bool
    def __init__(self, job_id: _Optional[str] = ..., rank: _Optional[int] = ..., step: _Optional[int] = ..., bucket_index: _Optional[int] = ..., message: _Optional[str] = ..., via_local_leader: _Optional[bool] = ...) -> None: ...

class ShardStats(_message.Message):
    __slots__ = ("bytes_received", "bytes_sent", "buckets_completed", "mean_bucket_s", "buffered_bytes", "connections")
    BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    BUCKETS_COMPLETED_FIELD_NUMBER: _ClassVar[int]
    MEAN_BUCKET_S_FIELD_NUMBER: _ClassVar[int]
    BUFFERED_BYTES_FIELD_NUMBER: _ClassVar[int]
    CONNECTIONS_FIELD_NUMBER: _ClassVar[int]
    bytes_received: int
    bytes_sent: int
    buckets_completed: int
    mean_bucket_s: float
    buffered_bytes: int
    connections: int
    def __init__(self, bytes_received: _Optional[int] = ..., bytes_sent: _Optional[int] = ..., buckets_completed: _Optional[int] = ..., mean_bucket_s: _Optional[float] = ..., buffered_bytes: _Optional[int] = ..., connections: _Optional[int] = ...) -> None: ...

class ShardMessage(_message.Message):
    __slots__ = ("register", "rejected", "stats", "nonfinite")
    REGISTER_FIELD_NUMBER: _ClassVar[int]
    REJECTED_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    NONFINITE_FIELD_NUMBER: _ClassVar[int]
    register: ShardRegister
    rejected: ShardRejected
    stats: ShardStats
    nonfinite: ShardNonFinite
    def __init__(self, register: _Optional[_Union[ShardRegister, _Mapping]] = ..., rejected: _Optional[_Union[ShardRejected, _Mapping]] = ..., stats: _Optional[_Union[ShardStats, _Mapping]] = ..., nonfinite: _Optional[_Union[ShardNonFinite, _Mapping]] = ...) -> None: ...

class FramePortRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class FramePortReply(_message.Message):
    __slots__ = ("port",)
    PORT_FIELD_NUMBER: _ClassVar[int]
    port: int
    def __init__(self, port: _Optional[int] = ...) -> None: ...

class StoreRequest(_message.Message):
    __slots__ = ("op", "namespace", "keys", "value", "expected", "amount", "timeout_ms")
    OP_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_FIELD_NUMBER: _ClassVar[int]
    AMOUNT_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    op: StoreOp
    namespace: str
    keys: _containers.RepeatedScalarFieldContainer[str]
    value: bytes
    expected: bytes
    amount: int
    timeout_ms: int
    def __init__(self, op: _Optional[_Union[StoreOp, str]] = ..., namespace: _Optional[str] = ..., keys: _Optional[_Iterable[str]] = ..., value: _Optional[bytes] = ..., expected: _Optional[bytes] = ..., amount: _Optional[int] = ..., timeout_ms: _Optional[int] = ...) -> None: ...

class StoreReply(_message.Message):
    __slots__ = ("value", "number", "found")
    VALUE_FIELD_NUMBER: _ClassVar[int]
    NUMBER_FIELD_NUMBER: _ClassVar[int]
    FOUND_FIELD_NUMBER: _ClassVar[int]
    value: bytes
    number: int
    found: bool
    def __init__(self, value: _Optional[bytes] = ..., number: _Optional[int] = ..., found: _Optional[bool] = ...) -> None: ...

class BeatRequest(_message.Message):
    __slots__ = ("job_id", "rank", "sequence", "step", "proof")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    PROOF_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    rank: int
    sequence: int
    step: int
    proof: bytes
    def __init__(self, job_id: _Optional[str] = ..., rank: _Optional[int] = ..., sequence: _Optional[int] = ..., step: _Optional[int] = ..., proof: _Optional[bytes] = ...) -> None: ...

class BeatReply(_message.Message):
    __slots__ = ("member",)
    MEMBER_FIELD_NUMBER: _ClassVar[int]
    member: bool
    def __init__(self, member: _Optional[bool] = ...) -> None: ...
