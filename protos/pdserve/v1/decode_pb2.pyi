from protos.pdserve.v1 import generate_pb2 as _generate_pb2
from protos.pdserve.v1 import worker_pb2 as _worker_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ReserveRequest(_message.Message):
    __slots__ = ("request_id", "prompt_len", "max_new_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LEN_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_len: int
    max_new_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., prompt_len: _Optional[int] = ..., max_new_tokens: _Optional[int] = ...) -> None: ...

class ReserveResponse(_message.Message):
    __slots__ = ("kv_target",)
    KV_TARGET_FIELD_NUMBER: _ClassVar[int]
    kv_target: _worker_pb2.KVTarget
    def __init__(self, kv_target: _Optional[_Union[_worker_pb2.KVTarget, _Mapping]] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("request_id", "first_token_id", "sampling", "prompt_token_ids", "output_offset", "prefill_here")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_OFFSET_FIELD_NUMBER: _ClassVar[int]
    PREFILL_HERE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    first_token_id: int
    sampling: _worker_pb2.WorkerSampling
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    output_offset: int
    prefill_here: bool
    def __init__(self, request_id: _Optional[str] = ..., first_token_id: _Optional[int] = ..., sampling: _Optional[_Union[_worker_pb2.WorkerSampling, _Mapping]] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., output_offset: _Optional[int] = ..., prefill_here: _Optional[bool] = ...) -> None: ...

class StreamRequest(_message.Message):
    __slots__ = ("start",)
    START_FIELD_NUMBER: _ClassVar[int]
    start: DecodeRequest
    def __init__(self, start: _Optional[_Union[DecodeRequest, _Mapping]] = ...) -> None: ...

class StreamResponse(_message.Message):
    __slots__ = ("request_ids", "token_ids", "finished")
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finished: _containers.RepeatedCompositeFieldContainer[RequestTokens]
    def __init__(self, request_ids: _Optional[_Iterable[str]] = ..., token_ids: _Optional[_Iterable[int]] = ..., finished: _Optional[_Iterable[_Union[RequestTokens, _Mapping]]] = ...) -> None: ...

class RequestTokens(_message.Message):
    __slots__ = ("request_id", "token_ids", "finish_reason", "error_code", "error_message")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: _generate_pb2.FinishReason
    error_code: int
    error_message: str
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[_Union[_generate_pb2.FinishReason, str]] = ..., error_code: _Optional[int] = ..., error_message: _Optional[str] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...
