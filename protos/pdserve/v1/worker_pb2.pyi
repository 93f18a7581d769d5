from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WorkerSampling(_message.Message):
    __slots__ = ("max_new_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "seed", "stop_token_ids")
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    repetition_penalty: float
    seed: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, max_new_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., seed: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class KVLayout(_message.Message):
    __slots__ = ("model", "dtype", "page_size", "num_layers", "num_kv_heads", "head_dim")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    model: str
    dtype: str
    page_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    def __init__(self, model: _Optional[str] = ..., dtype: _Optional[str] = ..., page_size: _Optional[int] = ..., num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ...) -> None: ...

class KVTarget(_message.Message):
    __slots__ = ("address", "request_id", "page_ids", "signature")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PAGE_IDS_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    address: str
    request_id: str
    page_ids: _containers.RepeatedScalarFieldContainer[int]
    signature: bytes
    def __init__(self, address: _Optional[str] = ..., request_id: _Optional[str] = ..., page_ids: _Optional[_Iterable[int]] = ..., signature: _Optional[bytes] = ...) -> None: ...

class GetWorkerInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerInfo(_message.Message):
    __slots__ = ("role", "worker_id", "layout", "vocab_size", "max_model_len", "total_pages", "free_pages", "running_requests", "queued_requests", "reservations", "attention_backend", "kv_transfer_engines", "fenced_pages", "leaked_pages", "device", "queued_tokens", "cached_pages", "evictable_pages", "gpu_uuid")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    TOTAL_PAGES_FIELD_NUMBER: _ClassVar[int]
    FREE_PAGES_FIELD_NUMBER: _ClassVar[int]
    RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    RESERVATIONS_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_BACKEND_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_ENGINES_FIELD_NUMBER: _ClassVar[int]
    FENCED_PAGES_FIELD_NUMBER: _ClassVar[int]
    LEAKED_PAGES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    QUEUED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_PAGES_FIELD_NUMBER: _ClassVar[int]
    EVICTABLE_PAGES_FIELD_NUMBER: _ClassVar[int]
    GPU_UUID_FIELD_NUMBER: _ClassVar[int]
    role: str
    worker_id: str
    layout: KVLayout
    vocab_size: int
    max_model_len: int
    total_pages: int
    free_pages: int
    running_requests: int
    queued_requests: int
    reservations: int
    attention_backend: str
    kv_transfer_engines: _containers.RepeatedScalarFieldContainer[str]
    fenced_pages: int
    leaked_pages: int
    device: str
    queued_tokens: int
    cached_pages: int
    evictable_pages: int
    gpu_uuid: str
    def __init__(self, role: _Optional[str] = ..., worker_id: _Optional[str] = ..., layout: _Optional[_Union[KVLayout, _Mapping]] = ..., vocab_size: _Optional[int] = ..., max_model_len: _Optional[int] = ..., total_pages: _Optional[int] = ..., free_pages: _Optional[int] = ..., running_requests: _Optional[int] = ..., queued_requests: _Optional[int] = ..., reservations: _Optional[int] = ..., attention_backend: _Optional[str] = ..., kv_transfer_engines: _Optional[_Iterable[str]] = ..., fenced_pages: _Optional[int] = ..., leaked_pages: _Optional[int] = ..., device: _Optional[str] = ..., queued_tokens: _Optional[int] = ..., cached_pages: _Optional[int] = ..., evictable_pages: _Optional[int] = ..., gpu_uuid: _Optional[str] = ...) -> None: ...
