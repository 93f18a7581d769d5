from protos.pdserve.v1 import worker_pb2 as _worker_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class HandshakeRequest(_message.Message):
    __slots__ = ("layout", "host", "engines", "gpu_uuid", "visible_gpu_uuids")
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    ENGINES_FIELD_NUMBER: _ClassVar[int]
    GPU_UUID_FIELD_NUMBER: _ClassVar[int]
    VISIBLE_GPU_UUIDS_FIELD_NUMBER: _ClassVar[int]
    layout: _worker_pb2.KVLayout
    host: str
    engines: _containers.RepeatedScalarFieldContainer[str]
    gpu_uuid: str
    visible_gpu_uuids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, layout: _Optional[_Union[_worker_pb2.KVLayout, _Mapping]] = ..., host: _Optional[str] = ..., engines: _Optional[_Iterable[str]] = ..., gpu_uuid: _Optional[str] = ..., visible_gpu_uuids: _Optional[_Iterable[str]] = ...) -> None: ...

class HandshakeResponse(_message.Message):
    __slots__ = ("engine", "reason", "engine_metadata", "host", "gpu_uuid", "lease_timeout_s")
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    ENGINE_METADATA_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    GPU_UUID_FIELD_NUMBER: _ClassVar[int]
    LEASE_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    engine: str
    reason: str
    engine_metadata: bytes
    host: str
    gpu_uuid: str
    lease_timeout_s: float
    def __init__(self, engine: _Optional[str] = ..., reason: _Optional[str] = ..., engine_metadata: _Optional[bytes] = ..., host: _Optional[str] = ..., gpu_uuid: _Optional[str] = ..., lease_timeout_s: _Optional[float] = ...) -> None: ...

class PageChunk(_message.Message):
    __slots__ = ("request_id", "page_ids", "data")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PAGE_IDS_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    page_ids: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    def __init__(self, request_id: _Optional[str] = ..., page_ids: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ...) -> None: ...

class WritePagesResponse(_message.Message):
    __slots__ = ("bytes_written",)
    BYTES_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    bytes_written: int
    def __init__(self, bytes_written: _Optional[int] = ...) -> None: ...

class Commit(_message.Message):
    __slots__ = ("request_id", "num_tokens", "writes_pending")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    WRITES_PENDING_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    num_tokens: int
    writes_pending: bool
    def __init__(self, request_id: _Optional[str] = ..., num_tokens: _Optional[int] = ..., writes_pending: _Optional[bool] = ...) -> None: ...

class ReportRequest(_message.Message):
    __slots__ = ("commits", "landed")
    COMMITS_FIELD_NUMBER: _ClassVar[int]
    LANDED_FIELD_NUMBER: _ClassVar[int]
    commits: _containers.RepeatedCompositeFieldContainer[Commit]
    landed: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, commits: _Optional[_Iterable[_Union[Commit, _Mapping]]] = ..., landed: _Optional[_Iterable[str]] = ...) -> None: ...

class ReportError(_message.Message):
    __slots__ = ("request_id", "landed", "code", "message")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    LANDED_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    landed: bool
    code: int
    message: str
    def __init__(self, request_id: _Optional[str] = ..., landed: _Optional[bool] = ..., code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class ReportResponse(_message.Message):
    __slots__ = ("errors",)
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    errors: _containers.RepeatedCompositeFieldContainer[ReportError]
    def __init__(self, errors: _Optional[_Iterable[_Union[ReportError, _Mapping]]] = ...) -> None: ...

class AbandonRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class AbandonResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RenewRequest(_message.Message):
    __slots__ = ("request_ids",)
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, request_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class RenewResponse(_message.Message):
    __slots__ = ("gone",)
    GONE_FIELD_NUMBER: _ClassVar[int]
    gone: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, gone: _Optional[_Iterable[str]] = ...) -> None: ...
