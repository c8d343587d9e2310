from . import tensor_pb2 as _tensor_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KIND_UNSPECIFIED: _ClassVar[Kind]
    KIND_INPUT: _ClassVar[Kind]
    KIND_TARGET: _ClassVar[Kind]
    KIND_ACTIVATION: _ClassVar[Kind]
    KIND_GRADIENT: _ClassVar[Kind]
    KIND_PROBE: _ClassVar[Kind]
    KIND_REDUCE: _ClassVar[Kind]
    KIND_OUTER: _ClassVar[Kind]
    KIND_NORM: _ClassVar[Kind]
    KIND_SNAPSHOT: _ClassVar[Kind]
    KIND_WEIGHTS: _ClassVar[Kind]
    KIND_TIED: _ClassVar[Kind]
KIND_UNSPECIFIED: Kind
KIND_INPUT: Kind
KIND_TARGET: Kind
KIND_ACTIVATION: Kind
KIND_GRADIENT: Kind
KIND_PROBE: Kind
KIND_REDUCE: Kind
KIND_OUTER: Kind
KIND_NORM: Kind
KIND_SNAPSHOT: Kind
KIND_WEIGHTS: Kind
KIND_TIED: Kind

class Resources(_message.Message):
    __slots__ = ("device", "device_name", "cores", "memory_bytes", "flops", "hostname", "host_id", "host_cores", "host_memory_bytes", "snapshots_on_disk", "codec_speeds")
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_NAME_FIELD_NUMBER: _ClassVar[int]
    CORES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    FLOPS_FIELD_NUMBER: _ClassVar[int]
    HOSTNAME_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    HOST_CORES_FIELD_NUMBER: _ClassVar[int]
    HOST_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOTS_ON_DISK_FIELD_NUMBER: _ClassVar[int]
    CODEC_SPEEDS_FIELD_NUMBER: _ClassVar[int]
    device: str
    device_name: str
    cores: int
    memory_bytes: int
    flops: float
    hostname: str
    host_id: str
    host_cores: int
    host_memory_bytes: int
    snapshots_on_disk: bool
    codec_speeds: _containers.RepeatedCompositeFieldContainer[CodecSpeed]
    def __init__(self, device: _Optional[str] = ..., device_name: _Optional[str] = ..., cores: _Optional[int] = ..., memory_bytes: _Optional[int] = ..., flops: _Optional[float] = ..., hostname: _Optional[str] = ..., host_id: _Optional[str] = ..., host_cores: _Optional[int] = ..., host_memory_bytes: _Optional[int] = ..., snapshots_on_disk: _Optional[bool] = ..., codec_speeds: _Optional[_Iterable[_Union[CodecSpeed, _Mapping]]] = ...) -> None: ...

class CodecSpeed(_message.Message):
    __slots__ = ("codec", "encode_fixed", "encode_per_byte", "decode_fixed", "decode_per_byte")
    CODEC_FIELD_NUMBER: _ClassVar[int]
    ENCODE_FIXED_FIELD_NUMBER: _ClassVar[int]
    ENCODE_PER_BYTE_FIELD_NUMBER: _ClassVar[int]
    DECODE_FIXED_FIELD_NUMBER: _ClassVar[int]
    DECODE_PER_BYTE_FIELD_NUMBER: _ClassVar[int]
    codec: str
    encode_fixed: float
    encode_per_byte: float
    decode_fixed: float
    decode_per_byte: float
    def __init__(self, codec: _Optional[str] = ..., encode_fixed: _Optional[float] = ..., encode_per_byte: _Optional[float] = ..., decode_fixed: _Optional[float] = ..., decode_per_byte: _Optional[float] = ...) -> None: ...

class StageAssignment(_message.Message):
    __slots__ = ("replica", "stage", "node_id", "address", "layer_start", "layer_end", "activation_codec", "gradient_codec", "node_name", "data_address", "recompute", "snapshots_on_disk", "relay", "predicted_compute_seconds", "predicted_send_seconds")
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    LAYER_START_FIELD_NUMBER: _ClassVar[int]
    LAYER_END_FIELD_NUMBER: _ClassVar[int]
    ACTIVATION_CODEC_FIELD_NUMBER: _ClassVar[int]
    GRADIENT_CODEC_FIELD_NUMBER: _ClassVar[int]
    NODE_NAME_FIELD_NUMBER: _ClassVar[int]
    DATA_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    RECOMPUTE_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOTS_ON_DISK_FIELD_NUMBER: _ClassVar[int]
    RELAY_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_COMPUTE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_SEND_SECONDS_FIELD_NUMBER: _ClassVar[int]
    replica: int
    stage: int
    node_id: str
    address: str
    layer_start: int
    layer_end: int
    activation_codec: str
    gradient_codec: str
    node_name: str
    data_address: str
    recompute: bool
    snapshots_on_disk: bool
    relay: str
    predicted_compute_seconds: float
    predicted_send_seconds: float
    def __init__(self, replica: _Optional[int] = ..., stage: _Optional[int] = ..., node_id: _Optional[str] = ..., address: _Optional[str] = ..., layer_start: _Optional[int] = ..., layer_end: _Optional[int] = ..., activation_codec: _Optional[str] = ..., gradient_codec: _Optional[str] = ..., node_name: _Optional[str] = ..., data_address: _Optional[str] = ..., recompute: _Optional[bool] = ..., snapshots_on_disk: _Optional[bool] = ..., relay: _Optional[str] = ..., predicted_compute_seconds: _Optional[float] = ..., predicted_send_seconds: _Optional[float] = ...) -> None: ...

class ReplicaInfo(_message.Message):
    __slots__ = ("microbatches", "samples", "predicted_seconds")
    MICROBATCHES_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_SECONDS_FIELD_NUMBER: _ClassVar[int]
    microbatches: int
    samples: int
    predicted_seconds: float
    def __init__(self, microbatches: _Optional[int] = ..., samples: _Optional[int] = ..., predicted_seconds: _Optional[float] = ...) -> None: ...

class Plan(_message.Message):
    __slots__ = ("stages", "predicted_step_seconds", "summary", "replicas", "sync_seconds", "epoch", "calibrated")
    STAGES_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_STEP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SUMMARY_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    SYNC_SECONDS_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    CALIBRATED_FIELD_NUMBER: _ClassVar[int]
    stages: _containers.RepeatedCompositeFieldContainer[StageAssignment]
    predicted_step_seconds: float
    summary: str
    replicas: _containers.RepeatedCompositeFieldContainer[ReplicaInfo]
    sync_seconds: float
    epoch: int
    calibrated: bool
    def __init__(self, stages: _Optional[_Iterable[_Union[StageAssignment, _Mapping]]] = ..., predicted_step_seconds: _Optional[float] = ..., summary: _Optional[str] = ..., replicas: _Optional[_Iterable[_Union[ReplicaInfo, _Mapping]]] = ..., sync_seconds: _Optional[float] = ..., epoch: _Optional[int] = ..., calibrated: _Optional[bool] = ...) -> None: ...

class JobConfig(_message.Message):
    __slots__ = ("steps", "microbatches", "schedule", "optimizer", "loss_fn", "activation_compression", "stages", "gradient_compression", "max_staleness", "replica_sync", "outer_every", "outer_lr", "outer_momentum", "outer_compression", "replicas", "batch_size", "lr_scheduler", "clip_grad_norm", "checkpoint_every", "client_timeout", "rebalance", "min_replicas", "weights", "recompute", "precision", "optimizer_kind", "cuts", "libraries", "outer_feedback_decay")
    class LibrariesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    STEPS_FIELD_NUMBER: _ClassVar[int]
    MICROBATCHES_FIELD_NUMBER: _ClassVar[int]
    SCHEDULE_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    LOSS_FN_FIELD_NUMBER: _ClassVar[int]
    ACTIVATION_COMPRESSION_FIELD_NUMBER: _ClassVar[int]
    STAGES_FIELD_NUMBER: _ClassVar[int]
    GRADIENT_COMPRESSION_FIELD_NUMBER: _ClassVar[int]
    MAX_STALENESS_FIELD_NUMBER: _ClassVar[int]
    REPLICA_SYNC_FIELD_NUMBER: _ClassVar[int]
    OUTER_EVERY_FIELD_NUMBER: _ClassVar[int]
    OUTER_LR_FIELD_NUMBER: _ClassVar[int]
    OUTER_MOMENTUM_FIELD_NUMBER: _ClassVar[int]
    OUTER_COMPRESSION_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    LR_SCHEDULER_FIELD_NUMBER: _ClassVar[int]
    CLIP_GRAD_NORM_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_EVERY_FIELD_NUMBER: _ClassVar[int]
    CLIENT_TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    REBALANCE_FIELD_NUMBER: _ClassVar[int]
    MIN_REPLICAS_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    RECOMPUTE_FIELD_NUMBER: _ClassVar[int]
    PRECISION_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_KIND_FIELD_NUMBER: _ClassVar[int]
    CUTS_FIELD_NUMBER: _ClassVar[int]
    LIBRARIES_FIELD_NUMBER: _ClassVar[int]
    OUTER_FEEDBACK_DECAY_FIELD_NUMBER: _ClassVar[int]
    steps: int
    microbatches: int
    schedule: str
    optimizer: bytes
    loss_fn: bytes
    activation_compression: str
    stages: int
    gradient_compression: str
    max_staleness: int
    replica_sync: str
    outer_every: int
    outer_lr: float
    outer_momentum: float
    outer_compression: str
    replicas: int
    batch_size: int
    lr_scheduler: bytes
    clip_grad_norm: float
    checkpoint_every: int
    client_timeout: float
    rebalance: str
    min_replicas: int
    weights: WeightsConfig
    recompute: str
    precision: str
    optimizer_kind: str
    cuts: _containers.RepeatedScalarFieldContainer[int]
    libraries: _containers.ScalarMap[str, str]
    outer_feedback_decay: float
    def __init__(self, steps: _Optional[int] = ..., microbatches: _Optional[int] = ..., schedule: _Optional[str] = ..., optimizer: _Optional[bytes] = ..., loss_fn: _Optional[bytes] = ..., activation_compression: _Optional[str] = ..., stages: _Optional[int] = ..., gradient_compression: _Optional[str] = ..., max_staleness: _Optional[int] = ..., replica_sync: _Optional[str] = ..., outer_every: _Optional[int] = ..., outer_lr: _Optional[float] = ..., outer_momentum: _Optional[float] = ..., outer_compression: _Optional[str] = ..., replicas: _Optional[int] = ..., batch_size: _Optional[int] = ..., lr_scheduler: _Optional[bytes] = ..., clip_grad_norm: _Optional[float] = ..., checkpoint_every: _Optional[int] = ..., client_timeout: _Optional[float] = ..., rebalance: _Optional[str] = ..., min_replicas: _Optional[int] = ..., weights: _Optional[_Union[WeightsConfig, _Mapping]] = ..., recompute: _Optional[str] = ..., precision: _Optional[str] = ..., optimizer_kind: _Optional[str] = ..., cuts: _Optional[_Iterable[int]] = ..., libraries: _Optional[_Mapping[str, str]] = ..., outer_feedback_decay: _Optional[float] = ...) -> None: ...

class WeightsConfig(_message.Message):
    __slots__ = ("source", "seed", "init_fn", "path", "digests", "names", "ties", "tie_sources")
    class TieSourcesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: bytes
        def __init__(self, key: _Optional[int] = ..., value: _Optional[bytes] = ...) -> None: ...
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    INIT_FN_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    DIGESTS_FIELD_NUMBER: _ClassVar[int]
    NAMES_FIELD_NUMBER: _ClassVar[int]
    TIES_FIELD_NUMBER: _ClassVar[int]
    TIE_SOURCES_FIELD_NUMBER: _ClassVar[int]
    source: str
    seed: int
    init_fn: bytes
    path: str
    digests: _containers.RepeatedScalarFieldContainer[str]
    names: bytes
    ties: _containers.RepeatedCompositeFieldContainer[TiedGroup]
    tie_sources: _containers.ScalarMap[int, bytes]
    def __init__(self, source: _Optional[str] = ..., seed: _Optional[int] = ..., init_fn: _Optional[bytes] = ..., path: _Optional[str] = ..., digests: _Optional[_Iterable[str]] = ..., names: _Optional[bytes] = ..., ties: _Optional[_Iterable[_Union[TiedGroup, _Mapping]]] = ..., tie_sources: _Optional[_Mapping[int, bytes]] = ...) -> None: ...

class TiedGroup(_message.Message):
    __slots__ = ("copies",)
    COPIES_FIELD_NUMBER: _ClassVar[int]
    copies: _containers.RepeatedCompositeFieldContainer[TiedCopy]
    def __init__(self, copies: _Optional[_Iterable[_Union[TiedCopy, _Mapping]]] = ...) -> None: ...

class TiedCopy(_message.Message):
    __slots__ = ("layer", "name")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    layer: int
    name: str
    def __init__(self, layer: _Optional[int] = ..., name: _Optional[str] = ...) -> None: ...

class ProbeRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LoadStageRequest(_message.Message):
    __slots__ = ("job_id", "replica", "stage", "layers", "plan", "config", "resume_step", "snapshot_sources", "owner", "job_signature", "client_cert", "layer_digests", "snapshot_wait_seconds", "snapshot_pieces", "predicted_memory_bytes", "snapshot_peers")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    PLAN_FIELD_NUMBER: _ClassVar[int]
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    RESUME_STEP_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_SOURCES_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    JOB_SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    CLIENT_CERT_FIELD_NUMBER: _ClassVar[int]
    LAYER_DIGESTS_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_PIECES_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_PEERS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    replica: int
    stage: int
    layers: _containers.RepeatedScalarFieldContainer[bytes]
    plan: Plan
    config: JobConfig
    resume_step: int
    snapshot_sources: _containers.RepeatedScalarFieldContainer[str]
    owner: str
    job_signature: bytes
    client_cert: bytes
    layer_digests: _containers.RepeatedScalarFieldContainer[bytes]
    snapshot_wait_seconds: float
    snapshot_pieces: _containers.RepeatedCompositeFieldContainer[SnapshotPiece]
    predicted_memory_bytes: int
    snapshot_peers: _containers.RepeatedCompositeFieldContainer[Peer]
    def __init__(self, job_id: _Optional[str] = ..., replica: _Optional[int] = ..., stage: _Optional[int] = ..., layers: _Optional[_Iterable[bytes]] = ..., plan: _Optional[_Union[Plan, _Mapping]] = ..., config: _Optional[_Union[JobConfig, _Mapping]] = ..., resume_step: _Optional[int] = ..., snapshot_sources: _Optional[_Iterable[str]] = ..., owner: _Optional[str] = ..., job_signature: _Optional[bytes] = ..., client_cert: _Optional[bytes] = ..., layer_digests: _Optional[_Iterable[bytes]] = ..., snapshot_wait_seconds: _Optional[float] = ..., snapshot_pieces: _Optional[_Iterable[_Union[SnapshotPiece, _Mapping]]] = ..., predicted_memory_bytes: _Optional[int] = ..., snapshot_peers: _Optional[_Iterable[_Union[Peer, _Mapping]]] = ...) -> None: ...

class LoadStageReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SnapshotPiece(_message.Message):
    __slots__ = ("replica", "stage", "layer_start", "layer_end", "sources")
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    LAYER_START_FIELD_NUMBER: _ClassVar[int]
    LAYER_END_FIELD_NUMBER: _ClassVar[int]
    SOURCES_FIELD_NUMBER: _ClassVar[int]
    replica: int
    stage: int
    layer_start: int
    layer_end: int
    sources: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, replica: _Optional[int] = ..., stage: _Optional[int] = ..., layer_start: _Optional[int] = ..., layer_end: _Optional[int] = ..., sources: _Optional[_Iterable[str]] = ...) -> None: ...

class StopJobRequest(_message.Message):
    __slots__ = ("job_id", "reason", "release", "before_epoch", "replicas")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    BEFORE_EPOCH_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    reason: str
    release: bool
    before_epoch: int
    replicas: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, job_id: _Optional[str] = ..., reason: _Optional[str] = ..., release: _Optional[bool] = ..., before_epoch: _Optional[int] = ..., replicas: _Optional[_Iterable[int]] = ...) -> None: ...

class StopJobReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Envelope(_message.Message):
    __slots__ = ("job_id", "replica", "stage", "kind", "step", "microbatch", "batch_size", "epoch", "microbatches")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    MICROBATCH_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    MICROBATCHES_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    replica: int
    stage: int
    kind: Kind
    step: int
    microbatch: int
    batch_size: int
    epoch: int
    microbatches: int
    def __init__(self, job_id: _Optional[str] = ..., replica: _Optional[int] = ..., stage: _Optional[int] = ..., kind: _Optional[_Union[Kind, str]] = ..., step: _Optional[int] = ..., microbatch: _Optional[int] = ..., batch_size: _Optional[int] = ..., epoch: _Optional[int] = ..., microbatches: _Optional[int] = ...) -> None: ...

class Frame(_message.Message):
    __slots__ = ("envelope", "tensor", "chunk", "name", "fetch", "pad")
    ENVELOPE_FIELD_NUMBER: _ClassVar[int]
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    FETCH_FIELD_NUMBER: _ClassVar[int]
    PAD_FIELD_NUMBER: _ClassVar[int]
    envelope: Envelope
    tensor: _tensor_pb2.Tensor
    chunk: bytes
    name: str
    fetch: int
    pad: bytes
    def __init__(self, envelope: _Optional[_Union[Envelope, _Mapping]] = ..., tensor: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., chunk: _Optional[bytes] = ..., name: _Optional[str] = ..., fetch: _Optional[int] = ..., pad: _Optional[bytes] = ...) -> None: ...

class SendReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class FetchStateRequest(_message.Message):
    __slots__ = ("job_id", "replica", "stage")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    replica: int
    stage: int
    def __init__(self, job_id: _Optional[str] = ..., replica: _Optional[int] = ..., stage: _Optional[int] = ...) -> None: ...

class FetchSnapshotRequest(_message.Message):
    __slots__ = ("job_id", "replica", "stage", "step", "layer_start", "layer_end")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    LAYER_START_FIELD_NUMBER: _ClassVar[int]
    LAYER_END_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    replica: int
    stage: int
    step: int
    layer_start: int
    layer_end: int
    def __init__(self, job_id: _Optional[str] = ..., replica: _Optional[int] = ..., stage: _Optional[int] = ..., step: _Optional[int] = ..., layer_start: _Optional[int] = ..., layer_end: _Optional[int] = ...) -> None: ...

class Peer(_message.Message):
    __slots__ = ("node_id", "name", "address", "data_address", "relay")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    DATA_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    RELAY_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    name: str
    address: str
    data_address: str
    relay: str
    def __init__(self, node_id: _Optional[str] = ..., name: _Optional[str] = ..., address: _Optional[str] = ..., data_address: _Optional[str] = ..., relay: _Optional[str] = ...) -> None: ...

class MeasureLinksRequest(_message.Message):
    __slots__ = ("peers", "pings", "max_probe_bytes", "probe_seconds")
    PEERS_FIELD_NUMBER: _ClassVar[int]
    PINGS_FIELD_NUMBER: _ClassVar[int]
    MAX_PROBE_BYTES_FIELD_NUMBER: _ClassVar[int]
    PROBE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    peers: _containers.RepeatedCompositeFieldContainer[Peer]
    pings: int
    max_probe_bytes: int
    probe_seconds: float
    def __init__(self, peers: _Optional[_Iterable[_Union[Peer, _Mapping]]] = ..., pings: _Optional[int] = ..., max_probe_bytes: _Optional[int] = ..., probe_seconds: _Optional[float] = ...) -> None: ...

class LinkMeasurement(_message.Message):
    __slots__ = ("src_id", "dst_id", "bandwidth", "latency", "measured_at", "error")
    SRC_ID_FIELD_NUMBER: _ClassVar[int]
    DST_ID_FIELD_NUMBER: _ClassVar[int]
    BANDWIDTH_FIELD_NUMBER: _ClassVar[int]
    LATENCY_FIELD_NUMBER: _ClassVar[int]
    MEASURED_AT_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    src_id: str
    dst_id: str
    bandwidth: float
    latency: float
    measured_at: float
    error: str
    def __init__(self, src_id: _Optional[str] = ..., dst_id: _Optional[str] = ..., bandwidth: _Optional[float] = ..., latency: _Optional[float] = ..., measured_at: _Optional[float] = ..., error: _Optional[str] = ...) -> None: ...

class MeasureLinksReply(_message.Message):
    __slots__ = ("links",)
    LINKS_FIELD_NUMBER: _ClassVar[int]
    links: _containers.RepeatedCompositeFieldContainer[LinkMeasurement]
    def __init__(self, links: _Optional[_Iterable[_Union[LinkMeasurement, _Mapping]]] = ...) -> None: ...

class PingRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PingReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HoldAtRequest(_message.Message):
    __slots__ = ("job_id", "epoch", "step")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    epoch: int
    step: int
    def __init__(self, job_id: _Optional[str] = ..., epoch: _Optional[int] = ..., step: _Optional[int] = ...) -> None: ...

class HoldAtReply(_message.Message):
    __slots__ = ("accepted", "done")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    done: int
    def __init__(self, accepted: _Optional[bool] = ..., done: _Optional[int] = ...) -> None: ...

class AssignJobRequest(_message.Message):
    __slots__ = ("job_id", "epoch", "owner", "node_names", "stages")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    NODE_NAMES_FIELD_NUMBER: _ClassVar[int]
    STAGES_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    epoch: int
    owner: str
    node_names: _containers.RepeatedScalarFieldContainer[str]
    stages: _containers.RepeatedCompositeFieldContainer[StageAssignment]
    def __init__(self, job_id: _Optional[str] = ..., epoch: _Optional[int] = ..., owner: _Optional[str] = ..., node_names: _Optional[_Iterable[str]] = ..., stages: _Optional[_Iterable[_Union[StageAssignment, _Mapping]]] = ...) -> None: ...

class AssignJobReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
