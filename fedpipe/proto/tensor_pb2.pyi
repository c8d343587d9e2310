from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    DTYPE_FLOAT32: _ClassVar[DType]
    DTYPE_FLOAT16: _ClassVar[DType]
    DTYPE_BFLOAT16: _ClassVar[DType]
    DTYPE_FLOAT64: _ClassVar[DType]
    DTYPE_INT64: _ClassVar[DType]
    DTYPE_INT32: _ClassVar[DType]
    DTYPE_INT16: _ClassVar[DType]
    DTYPE_INT8: _ClassVar[DType]
    DTYPE_UINT8: _ClassVar[DType]
    DTYPE_BOOL: _ClassVar[DType]

class Codec(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CODEC_UNSPECIFIED: _ClassVar[Codec]
    CODEC_RAW: _ClassVar[Codec]
    CODEC_FP16: _ClassVar[Codec]
    CODEC_BF16: _ClassVar[Codec]
    CODEC_INT8: _ClassVar[Codec]
    CODEC_TOPK: _ClassVar[Codec]
    CODEC_HAD4: _ClassVar[Codec]
    CODEC_HAD2: _ClassVar[Codec]
    CODEC_SPARSELOCO: _ClassVar[Codec]
    CODEC_LOWRANK: _ClassVar[Codec]
    CODEC_LOWRANK8: _ClassVar[Codec]
DTYPE_UNSPECIFIED: DType
DTYPE_FLOAT32: DType
DTYPE_FLOAT16: DType
DTYPE_BFLOAT16: DType
DTYPE_FLOAT64: DType
DTYPE_INT64: DType
DTYPE_INT32: DType
DTYPE_INT16: DType
DTYPE_INT8: DType
DTYPE_UINT8: DType
DTYPE_BOOL: DType
CODEC_UNSPECIFIED: Codec
CODEC_RAW: Codec
CODEC_FP16: Codec
CODEC_BF16: Codec
CODEC_INT8: Codec
CODEC_TOPK: Codec
CODEC_HAD4: Codec
CODEC_HAD2: Codec
CODEC_SPARSELOCO: Codec
CODEC_LOWRANK: Codec
CODEC_LOWRANK8: Codec

class Tensor(_message.Message):
    __slots__ = ("dtype", "shape", "codec", "zstd", "encoded_bytes", "block_size", "k", "value_dtype", "payload", "payload_bytes", "basis", "basis_version")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    ZSTD_FIELD_NUMBER: _ClassVar[int]
    ENCODED_BYTES_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    VALUE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    BASIS_FIELD_NUMBER: _ClassVar[int]
    BASIS_VERSION_FIELD_NUMBER: _ClassVar[int]
    dtype: DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    codec: Codec
    zstd: bool
    encoded_bytes: int
    block_size: int
    k: int
    value_dtype: DType
    payload: bytes
    payload_bytes: int
    basis: bool
    basis_version: int
    def __init__(self, dtype: _Optional[_Union[DType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., codec: _Optional[_Union[Codec, str]] = ..., zstd: _Optional[bool] = ..., encoded_bytes: _Optional[int] = ..., block_size: _Optional[int] = ..., k: _Optional[int] = ..., value_dtype: _Optional[_Union[DType, str]] = ..., payload: _Optional[bytes] = ..., payload_bytes: _Optional[int] = ..., basis: _Optional[bool] = ..., basis_version: _Optional[int] = ...) -> None: ...
