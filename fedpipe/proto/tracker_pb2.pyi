from . import node_pb2 as _node_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class JobState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    JOB_STATE_UNSPECIFIED: _ClassVar[JobState]
    JOB_STATE_PENDING: _ClassVar[JobState]
    JOB_STATE_PLANNING: _ClassVar[JobState]
    JOB_STATE_DEPLOYING: _ClassVar[JobState]
    JOB_STATE_RUNNING: _ClassVar[JobState]
    JOB_STATE_RECOVERING: _ClassVar[JobState]
    JOB_STATE_SUCCEEDED: _ClassVar[JobState]
    JOB_STATE_FAILED: _ClassVar[JobState]
    JOB_STATE_CANCELLED: _ClassVar[JobState]
    JOB_STATE_WAITING: _ClassVar[JobState]
JOB_STATE_UNSPECIFIED: JobState
JOB_STATE_PENDING: JobState
JOB_STATE_PLANNING: JobState
JOB_STATE_DEPLOYING: JobState
JOB_STATE_RUNNING: JobState
JOB_STATE_RECOVERING: JobState
JOB_STATE_SUCCEEDED: JobState
JOB_STATE_FAILED: JobState
JOB_STATE_CANCELLED: JobState
JOB_STATE_WAITING: JobState

class Versions(_message.Message):
    __slots__ = ("fedpipe", "protocol", "python", "torch", "cloudpickle")
    FEDPIPE_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_FIELD_NUMBER: _ClassVar[int]
    PYTHON_FIELD_NUMBER: _ClassVar[int]
    TORCH_FIELD_NUMBER: _ClassVar[int]
    CLOUDPICKLE_FIELD_NUMBER: _ClassVar[int]
    fedpipe: str
    protocol: int
    python: str
    torch: str
    cloudpickle: str
    def __init__(self, fedpipe: _Optional[str] = ..., protocol: _Optional[int] = ..., python: _Optional[str] = ..., torch: _Optional[str] = ..., cloudpickle: _Optional[str] = ...) -> None: ...

class RegisterNodeRequest(_message.Message):
    __slots__ = ("name", "address", "resources", "versions", "boot_id", "data_address", "relay", "node_id")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    RESOURCES_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    BOOT_ID_FIELD_NUMBER: _ClassVar[int]
    DATA_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    RELAY_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    name: str
    address: str
    resources: _node_pb2.Resources
    versions: Versions
    boot_id: str
    data_address: str
    relay: str
    node_id: str
    def __init__(self, name: _Optional[str] = ..., address: _Optional[str] = ..., resources: _Optional[_Union[_node_pb2.Resources, _Mapping]] = ..., versions: _Optional[_Union[Versions, _Mapping]] = ..., boot_id: _Optional[str] = ..., data_address: _Optional[str] = ..., relay: _Optional[str] = ..., node_id: _Optional[str] = ...) -> None: ...

class RegisterNodeReply(_message.Message):
    __slots__ = ("node_id", "lease_seconds", "heartbeat_seconds")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    lease_seconds: float
    heartbeat_seconds: float
    def __init__(self, node_id: _Optional[str] = ..., lease_seconds: _Optional[float] = ..., heartbeat_seconds: _Optional[float] = ...) -> None: ...

class StageRef(_message.Message):
    __slots__ = ("job_id", "replica", "stage", "epoch", "acked")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    ACKED_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    replica: int
    stage: int
    epoch: int
    acked: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, job_id: _Optional[str] = ..., replica: _Optional[int] = ..., stage: _Optional[int] = ..., epoch: _Optional[int] = ..., acked: _Optional[_Iterable[int]] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("node_id", "leaving", "holds", "draining")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    LEAVING_FIELD_NUMBER: _ClassVar[int]
    HOLDS_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    leaving: bool
    holds: _containers.RepeatedCompositeFieldContainer[StageRef]
    draining: bool
    def __init__(self, node_id: _Optional[str] = ..., leaving: _Optional[bool] = ..., holds: _Optional[_Iterable[_Union[StageRef, _Mapping]]] = ..., draining: _Optional[bool] = ...) -> None: ...

class HeartbeatReply(_message.Message):
    __slots__ = ("known", "lease_seconds", "heartbeat_seconds", "drop", "drop_jobs", "drain", "drained", "revoked", "checkpoints")
    class CheckpointsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    DROP_FIELD_NUMBER: _ClassVar[int]
    DROP_JOBS_FIELD_NUMBER: _ClassVar[int]
    DRAIN_FIELD_NUMBER: _ClassVar[int]
    DRAINED_FIELD_NUMBER: _ClassVar[int]
    REVOKED_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINTS_FIELD_NUMBER: _ClassVar[int]
    known: bool
    lease_seconds: float
    heartbeat_seconds: float
    drop: _containers.RepeatedCompositeFieldContainer[StageRef]
    drop_jobs: _containers.RepeatedScalarFieldContainer[str]
    drain: bool
    drained: bool
    revoked: _containers.RepeatedCompositeFieldContainer[RevokedCert]
    checkpoints: _containers.ScalarMap[str, int]
    def __init__(self, known: _Optional[bool] = ..., lease_seconds: _Optional[float] = ..., heartbeat_seconds: _Optional[float] = ..., drop: _Optional[_Iterable[_Union[StageRef, _Mapping]]] = ..., drop_jobs: _Optional[_Iterable[str]] = ..., drain: _Optional[bool] = ..., drained: _Optional[bool] = ..., revoked: _Optional[_Iterable[_Union[RevokedCert, _Mapping]]] = ..., checkpoints: _Optional[_Mapping[str, int]] = ...) -> None: ...

class RevokedCert(_message.Message):
    __slots__ = ("serial", "name", "revoked_at")
    SERIAL_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    REVOKED_AT_FIELD_NUMBER: _ClassVar[int]
    serial: str
    name: str
    revoked_at: float
    def __init__(self, serial: _Optional[str] = ..., name: _Optional[str] = ..., revoked_at: _Optional[float] = ...) -> None: ...

class NodeInfo(_message.Message):
    __slots__ = ("node_id", "name", "address", "resources", "alive", "last_heartbeat", "registered", "draining", "lost_reason", "data_address", "relay")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    RESOURCES_FIELD_NUMBER: _ClassVar[int]
    ALIVE_FIELD_NUMBER: _ClassVar[int]
    LAST_HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    REGISTERED_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    LOST_REASON_FIELD_NUMBER: _ClassVar[int]
    DATA_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    RELAY_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    name: str
    address: str
    resources: _node_pb2.Resources
    alive: bool
    last_heartbeat: float
    registered: float
    draining: bool
    lost_reason: str
    data_address: str
    relay: str
    def __init__(self, node_id: _Optional[str] = ..., name: _Optional[str] = ..., address: _Optional[str] = ..., resources: _Optional[_Union[_node_pb2.Resources, _Mapping]] = ..., alive: _Optional[bool] = ..., last_heartbeat: _Optional[float] = ..., registered: _Optional[float] = ..., draining: _Optional[bool] = ..., lost_reason: _Optional[str] = ..., data_address: _Optional[str] = ..., relay: _Optional[str] = ...) -> None: ...

class ListNodesRequest(_message.Message):
    __slots__ = ("include_lost",)
    INCLUDE_LOST_FIELD_NUMBER: _ClassVar[int]
    include_lost: bool
    def __init__(self, include_lost: _Optional[bool] = ...) -> None: ...

class ListNodesReply(_message.Message):
    __slots__ = ("nodes", "links")
    NODES_FIELD_NUMBER: _ClassVar[int]
    LINKS_FIELD_NUMBER: _ClassVar[int]
    nodes: _containers.RepeatedCompositeFieldContainer[NodeInfo]
    links: _containers.RepeatedCompositeFieldContainer[_node_pb2.LinkMeasurement]
    def __init__(self, nodes: _Optional[_Iterable[_Union[NodeInfo, _Mapping]]] = ..., links: _Optional[_Iterable[_Union[_node_pb2.LinkMeasurement, _Mapping]]] = ...) -> None: ...

class ListJobsRequest(_message.Message):
    __slots__ = ("limit",)
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    limit: int
    def __init__(self, limit: _Optional[int] = ...) -> None: ...

class ListJobsReply(_message.Message):
    __slots__ = ("jobs",)
    JOBS_FIELD_NUMBER: _ClassVar[int]
    jobs: _containers.RepeatedCompositeFieldContainer[JobInfo]
    def __init__(self, jobs: _Optional[_Iterable[_Union[JobInfo, _Mapping]]] = ...) -> None: ...

class LayerProfile(_message.Message):
    __slots__ = ("name", "flops", "activation_bytes", "parameter_bytes", "activation_width")
    NAME_FIELD_NUMBER: _ClassVar[int]
    FLOPS_FIELD_NUMBER: _ClassVar[int]
    ACTIVATION_BYTES_FIELD_NUMBER: _ClassVar[int]
    PARAMETER_BYTES_FIELD_NUMBER: _ClassVar[int]
    ACTIVATION_WIDTH_FIELD_NUMBER: _ClassVar[int]
    name: str
    flops: float
    activation_bytes: int
    parameter_bytes: int
    activation_width: int
    def __init__(self, name: _Optional[str] = ..., flops: _Optional[float] = ..., activation_bytes: _Optional[int] = ..., parameter_bytes: _Optional[int] = ..., activation_width: _Optional[int] = ...) -> None: ...

class ModelProfile(_message.Message):
    __slots__ = ("layers", "input_bytes")
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    INPUT_BYTES_FIELD_NUMBER: _ClassVar[int]
    layers: _containers.RepeatedCompositeFieldContainer[LayerProfile]
    input_bytes: int
    def __init__(self, layers: _Optional[_Iterable[_Union[LayerProfile, _Mapping]]] = ..., input_bytes: _Optional[int] = ...) -> None: ...

class SubmitJobRequest(_message.Message):
    __slots__ = ("name", "layers", "config", "profile", "pending_timeout", "owner", "job_signature", "client_cert", "layer_digests")
    NAME_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    PROFILE_FIELD_NUMBER: _ClassVar[int]
    PENDING_TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    JOB_SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    CLIENT_CERT_FIELD_NUMBER: _ClassVar[int]
    LAYER_DIGESTS_FIELD_NUMBER: _ClassVar[int]
    name: str
    layers: _containers.RepeatedScalarFieldContainer[bytes]
    config: _node_pb2.JobConfig
    profile: ModelProfile
    pending_timeout: float
    owner: str
    job_signature: bytes
    client_cert: bytes
    layer_digests: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, name: _Optional[str] = ..., layers: _Optional[_Iterable[bytes]] = ..., config: _Optional[_Union[_node_pb2.JobConfig, _Mapping]] = ..., profile: _Optional[_Union[ModelProfile, _Mapping]] = ..., pending_timeout: _Optional[float] = ..., owner: _Optional[str] = ..., job_signature: _Optional[bytes] = ..., client_cert: _Optional[bytes] = ..., layer_digests: _Optional[_Iterable[bytes]] = ...) -> None: ...

class SubmitJobReply(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class JobInfo(_message.Message):
    __slots__ = ("job_id", "name", "state", "reason", "plan", "step", "steps", "loss", "created", "epoch", "checkpoint_step", "resume_step", "recoveries", "checkpoint_every", "owner", "feeder", "replica_version", "replica_members", "replica_ready", "stage_times")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    PLAN_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    CREATED_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_STEP_FIELD_NUMBER: _ClassVar[int]
    RESUME_STEP_FIELD_NUMBER: _ClassVar[int]
    RECOVERIES_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_EVERY_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    FEEDER_FIELD_NUMBER: _ClassVar[int]
    REPLICA_VERSION_FIELD_NUMBER: _ClassVar[int]
    REPLICA_MEMBERS_FIELD_NUMBER: _ClassVar[int]
    REPLICA_READY_FIELD_NUMBER: _ClassVar[int]
    STAGE_TIMES_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    name: str
    state: JobState
    reason: str
    plan: _node_pb2.Plan
    step: int
    steps: int
    loss: float
    created: float
    epoch: int
    checkpoint_step: int
    resume_step: int
    recoveries: _containers.RepeatedCompositeFieldContainer[Recovery]
    checkpoint_every: int
    owner: str
    feeder: str
    replica_version: int
    replica_members: _containers.RepeatedCompositeFieldContainer[ReplicaMember]
    replica_ready: _containers.RepeatedScalarFieldContainer[int]
    stage_times: _containers.RepeatedCompositeFieldContainer[StageTiming]
    def __init__(self, job_id: _Optional[str] = ..., name: _Optional[str] = ..., state: _Optional[_Union[JobState, str]] = ..., reason: _Optional[str] = ..., plan: _Optional[_Union[_node_pb2.Plan, _Mapping]] = ..., step: _Optional[int] = ..., steps: _Optional[int] = ..., loss: _Optional[float] = ..., created: _Optional[float] = ..., epoch: _Optional[int] = ..., checkpoint_step: _Optional[int] = ..., resume_step: _Optional[int] = ..., recoveries: _Optional[_Iterable[_Union[Recovery, _Mapping]]] = ..., checkpoint_every: _Optional[int] = ..., owner: _Optional[str] = ..., feeder: _Optional[str] = ..., replica_version: _Optional[int] = ..., replica_members: _Optional[_Iterable[_Union[ReplicaMember, _Mapping]]] = ..., replica_ready: _Optional[_Iterable[int]] = ..., stage_times: _Optional[_Iterable[_Union[StageTiming, _Mapping]]] = ...) -> None: ...

class ReplicaMember(_message.Message):
    __slots__ = ("replica", "since")
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    SINCE_FIELD_NUMBER: _ClassVar[int]
    replica: int
    since: int
    def __init__(self, replica: _Optional[int] = ..., since: _Optional[int] = ...) -> None: ...

class ReplicaQuorumRequest(_message.Message):
    __slots__ = ("job_id", "epoch", "replica", "stage", "node_id", "step", "version", "reduced", "wait_seconds", "next_step")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    REDUCED_FIELD_NUMBER: _ClassVar[int]
    WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    NEXT_STEP_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    epoch: int
    replica: int
    stage: int
    node_id: str
    step: int
    version: int
    reduced: bool
    wait_seconds: float
    next_step: int
    def __init__(self, job_id: _Optional[str] = ..., epoch: _Optional[int] = ..., replica: _Optional[int] = ..., stage: _Optional[int] = ..., node_id: _Optional[str] = ..., step: _Optional[int] = ..., version: _Optional[int] = ..., reduced: _Optional[bool] = ..., wait_seconds: _Optional[float] = ..., next_step: _Optional[int] = ...) -> None: ...

class ReplicaQuorumReply(_message.Message):
    __slots__ = ("step", "version", "members", "committed", "dropped", "donate_to", "plan", "next_members")
    STEP_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    DONATE_TO_FIELD_NUMBER: _ClassVar[int]
    PLAN_FIELD_NUMBER: _ClassVar[int]
    NEXT_MEMBERS_FIELD_NUMBER: _ClassVar[int]
    step: int
    version: int
    members: _containers.RepeatedScalarFieldContainer[int]
    committed: bool
    dropped: bool
    donate_to: _containers.RepeatedScalarFieldContainer[int]
    plan: _node_pb2.Plan
    next_members: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, step: _Optional[int] = ..., version: _Optional[int] = ..., members: _Optional[_Iterable[int]] = ..., committed: _Optional[bool] = ..., dropped: _Optional[bool] = ..., donate_to: _Optional[_Iterable[int]] = ..., plan: _Optional[_Union[_node_pb2.Plan, _Mapping]] = ..., next_members: _Optional[_Iterable[int]] = ...) -> None: ...

class JoinReplicaRequest(_message.Message):
    __slots__ = ("job_id", "replica", "step")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    replica: int
    step: int
    def __init__(self, job_id: _Optional[str] = ..., replica: _Optional[int] = ..., step: _Optional[int] = ...) -> None: ...

class JoinReplicaReply(_message.Message):
    __slots__ = ("accepted", "reason", "job")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    JOB_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    reason: str
    job: JobInfo
    def __init__(self, accepted: _Optional[bool] = ..., reason: _Optional[str] = ..., job: _Optional[_Union[JobInfo, _Mapping]] = ...) -> None: ...

class StageTiming(_message.Message):
    __slots__ = ("replica", "stage", "compute_seconds", "wait_seconds", "send_seconds", "peak_memory_bytes", "predicted_memory_bytes")
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SEND_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PEAK_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    replica: int
    stage: int
    compute_seconds: float
    wait_seconds: float
    send_seconds: float
    peak_memory_bytes: int
    predicted_memory_bytes: int
    def __init__(self, replica: _Optional[int] = ..., stage: _Optional[int] = ..., compute_seconds: _Optional[float] = ..., wait_seconds: _Optional[float] = ..., send_seconds: _Optional[float] = ..., peak_memory_bytes: _Optional[int] = ..., predicted_memory_bytes: _Optional[int] = ...) -> None: ...

class Recovery(_message.Message):
    __slots__ = ("time", "lost", "checkpoint_step", "steps_recomputed", "detect_seconds", "replan_seconds", "restore_seconds", "epoch", "cause", "bytes_moved", "moved_from", "moved_to")
    TIME_FIELD_NUMBER: _ClassVar[int]
    LOST_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_STEP_FIELD_NUMBER: _ClassVar[int]
    STEPS_RECOMPUTED_FIELD_NUMBER: _ClassVar[int]
    DETECT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    REPLAN_SECONDS_FIELD_NUMBER: _ClassVar[int]
    RESTORE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    CAUSE_FIELD_NUMBER: _ClassVar[int]
    BYTES_MOVED_FIELD_NUMBER: _ClassVar[int]
    MOVED_FROM_FIELD_NUMBER: _ClassVar[int]
    MOVED_TO_FIELD_NUMBER: _ClassVar[int]
    time: float
    lost: str
    checkpoint_step: int
    steps_recomputed: int
    detect_seconds: float
    replan_seconds: float
    restore_seconds: float
    epoch: int
    cause: str
    bytes_moved: int
    moved_from: str
    moved_to: str
    def __init__(self, time: _Optional[float] = ..., lost: _Optional[str] = ..., checkpoint_step: _Optional[int] = ..., steps_recomputed: _Optional[int] = ..., detect_seconds: _Optional[float] = ..., replan_seconds: _Optional[float] = ..., restore_seconds: _Optional[float] = ..., epoch: _Optional[int] = ..., cause: _Optional[str] = ..., bytes_moved: _Optional[int] = ..., moved_from: _Optional[str] = ..., moved_to: _Optional[str] = ...) -> None: ...

class GetJobRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class CancelJobRequest(_message.Message):
    __slots__ = ("job_id", "reason", "keep_weights")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    KEEP_WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    reason: str
    keep_weights: bool
    def __init__(self, job_id: _Optional[str] = ..., reason: _Optional[str] = ..., keep_weights: _Optional[bool] = ...) -> None: ...

class RestoreJobRequest(_message.Message):
    __slots__ = ("job_id", "step")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    step: int
    def __init__(self, job_id: _Optional[str] = ..., step: _Optional[int] = ...) -> None: ...

class WatchJobRequest(_message.Message):
    __slots__ = ("job_id", "after_seq", "feeder", "take_over")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    AFTER_SEQ_FIELD_NUMBER: _ClassVar[int]
    FEEDER_FIELD_NUMBER: _ClassVar[int]
    TAKE_OVER_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    after_seq: int
    feeder: str
    take_over: bool
    def __init__(self, job_id: _Optional[str] = ..., after_seq: _Optional[int] = ..., feeder: _Optional[str] = ..., take_over: _Optional[bool] = ...) -> None: ...

class JobEvent(_message.Message):
    __slots__ = ("seq", "time", "state", "reason", "step", "loss", "samples_per_second", "checkpoint_step", "epoch")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    TIME_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_STEP_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    seq: int
    time: float
    state: JobState
    reason: str
    step: int
    loss: float
    samples_per_second: float
    checkpoint_step: int
    epoch: int
    def __init__(self, seq: _Optional[int] = ..., time: _Optional[float] = ..., state: _Optional[_Union[JobState, str]] = ..., reason: _Optional[str] = ..., step: _Optional[int] = ..., loss: _Optional[float] = ..., samples_per_second: _Optional[float] = ..., checkpoint_step: _Optional[int] = ..., epoch: _Optional[int] = ...) -> None: ...

class StageReport(_message.Message):
    __slots__ = ("job_id", "replica", "stage", "node_id", "status", "step", "loss", "samples", "seconds", "error", "compute_seconds", "wait_seconds", "send_seconds", "epoch", "peer", "peak_memory_bytes", "predicted_memory_bytes")
    class Status(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        STATUS_UNSPECIFIED: _ClassVar[StageReport.Status]
        STATUS_STEP: _ClassVar[StageReport.Status]
        STATUS_DONE: _ClassVar[StageReport.Status]
        STATUS_FAILED: _ClassVar[StageReport.Status]
        STATUS_CHECKPOINT: _ClassVar[StageReport.Status]
        STATUS_SUSPECT: _ClassVar[StageReport.Status]
    STATUS_UNSPECIFIED: StageReport.Status
    STATUS_STEP: StageReport.Status
    STATUS_DONE: StageReport.Status
    STATUS_FAILED: StageReport.Status
    STATUS_CHECKPOINT: StageReport.Status
    STATUS_SUSPECT: StageReport.Status
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SEND_SECONDS_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    PEER_FIELD_NUMBER: _ClassVar[int]
    PEAK_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    replica: int
    stage: int
    node_id: str
    status: StageReport.Status
    step: int
    loss: float
    samples: int
    seconds: float
    error: str
    compute_seconds: float
    wait_seconds: float
    send_seconds: float
    epoch: int
    peer: str
    peak_memory_bytes: int
    predicted_memory_bytes: int
    def __init__(self, job_id: _Optional[str] = ..., replica: _Optional[int] = ..., stage: _Optional[int] = ..., node_id: _Optional[str] = ..., status: _Optional[_Union[StageReport.Status, str]] = ..., step: _Optional[int] = ..., loss: _Optional[float] = ..., samples: _Optional[int] = ..., seconds: _Optional[float] = ..., error: _Optional[str] = ..., compute_seconds: _Optional[float] = ..., wait_seconds: _Optional[float] = ..., send_seconds: _Optional[float] = ..., epoch: _Optional[int] = ..., peer: _Optional[str] = ..., peak_memory_bytes: _Optional[int] = ..., predicted_memory_bytes: _Optional[int] = ...) -> None: ...

class StageReportReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DrainNodeRequest(_message.Message):
    __slots__ = ("node",)
    NODE_FIELD_NUMBER: _ClassVar[int]
    node: str
    def __init__(self, node: _Optional[str] = ...) -> None: ...

class DrainNodeReply(_message.Message):
    __slots__ = ("node", "jobs", "drained")
    NODE_FIELD_NUMBER: _ClassVar[int]
    JOBS_FIELD_NUMBER: _ClassVar[int]
    DRAINED_FIELD_NUMBER: _ClassVar[int]
    node: NodeInfo
    jobs: _containers.RepeatedScalarFieldContainer[str]
    drained: bool
    def __init__(self, node: _Optional[_Union[NodeInfo, _Mapping]] = ..., jobs: _Optional[_Iterable[str]] = ..., drained: _Optional[bool] = ...) -> None: ...
