"""Turns a request (gRPC's GenerateRequest or an OpenAI HTTP body, each first made a plain
GenerateInput by its front) into a checked GenerationJob, or says clearly what is wrong."""
from __future__ import annotations

import os
import uuid
from dataclasses import dataclass, field, replace

from pdserve.errors import InvalidRequest
from pdserve.models.config import ModelConfig
from pdserve.sampling_params import SamplingParams, check_sampling, check_token_ids
from pdserve.tokenizer import Tokenizer
from protos.pdserve.v1 import generate_pb2

MAX_STOP_STRING_CHARS = 256
MAX_REQUEST_ID_CHARS = 256
INLINE_VALIDATION_BYTES = 64 << 10   # larger requests are checked off the event loop (fronts)


@dataclass
class GenerateInput:
    """A request as a front received it, before any check: the fields of the public API
    (unset sampling fields as the API's zero values: 0 means the default or off)."""

    request_id: str = ""
    text: str | None = None
    token_ids: list[int] | None = None
    max_new_tokens: int = 0
    temperature: float = 0.0
    top_p: float = 0.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    stream: bool = True
    special_tokens: bool = True   # text: add the tokenizer's special tokens (a BOS) if absent
    fill_context: bool = False    # max_new_tokens 0: up to max_model_len (else the default)

    @classmethod
    def from_proto(cls, request: generate_pb2.GenerateRequest) -> GenerateInput:
        s = request.sampling
        kind = request.WhichOneof("input")
        return cls(request_id=request.request_id,
                   text=request.text if kind == "text" else None,
                   token_ids=list(request.token_ids.ids) if kind == "token_ids" else None,
                   max_new_tokens=s.max_new_tokens, temperature=s.temperature, top_p=s.top_p,
                   top_k=s.top_k, min_p=s.min_p, repetition_penalty=s.repetition_penalty,
                   seed=s.seed if s.HasField("seed") else None, stop=list(s.stop),
                   stop_token_ids=list(s.stop_token_ids), ignore_eos=s.ignore_eos,
                   stream=request.stream)


@dataclass(frozen=True)
class GenerationJob:
    request_id: str            # the client's, or one we assigned
    prompt_ids: list[int]
    params: SamplingParams     # defaults resolved, seed fixed, eos folded into stop ids
    stop_strings: tuple[str, ...]
    stream: bool
    output_offset: int = 0     # tokens generated before prompt_ids ended (a resumed job)

    def resumed(self, generated: list[int]) -> GenerationJob:
        """The rest of this job after ``generated``, as a new job for another worker pair:
        the generated tokens join the prompt, and seeded sampling continues where it was."""
        return replace(self, prompt_ids=self.prompt_ids + generated,
                       params=replace(self.params,
                                      max_new_tokens=self.params.max_new_tokens - len(generated)),
                       output_offset=self.output_offset + len(generated))


def _prompt(request: GenerateInput, model: ModelConfig, tokenizer: Tokenizer) -> list[int]:
    if request.text is None and request.token_ids is None:
        raise InvalidRequest("no input: set text or token_ids")
    if request.text is not None:
        if not request.text:
            raise InvalidRequest("text is empty")
        ids = tokenizer.encode(request.text, add_special_tokens=request.special_tokens)
        if not ids:
            raise InvalidRequest("text encodes to no tokens")
        return ids
    ids = list(request.token_ids or [])
    if not ids:
        raise InvalidRequest("token_ids is empty")
    check_token_ids(ids, model.vocab_size)
    return ids


def validate(request: GenerateInput, model: ModelConfig, tokenizer: Tokenizer,
             default_max_new_tokens: int, max_stop_strings: int) -> GenerationJob:
    """Checks every field; raises InvalidRequest naming the first field that is wrong."""
    if len(request.request_id) > MAX_REQUEST_ID_CHARS:
        raise InvalidRequest(f"request_id longer than {MAX_REQUEST_ID_CHARS} characters")
    prompt = _prompt(request, model, tokenizer)
    s = request
    room = model.max_model_len - len(prompt)
    if room < 1:
        raise InvalidRequest(f"prompt of {len(prompt)} tokens leaves no room to generate "
                             f"(max_model_len {model.max_model_len})")
    if s.max_new_tokens == 0:
        max_new = room if s.fill_context else min(default_max_new_tokens, room)
    elif s.max_new_tokens > room:
        raise InvalidRequest(f"prompt ({len(prompt)} tokens) + max_new_tokens ({s.max_new_tokens}) "
                             f"exceeds max_model_len {model.max_model_len}")
    else:
        max_new = s.max_new_tokens
    if len(s.stop) > max_stop_strings:
        raise InvalidRequest(f"at most {max_stop_strings} stop strings, got {len(s.stop)}")
    for stop in s.stop:
        if not stop or len(stop) > MAX_STOP_STRING_CHARS:
            raise InvalidRequest(f"stop strings must have 1 to {MAX_STOP_STRING_CHARS} characters")
    check_token_ids(s.stop_token_ids, model.vocab_size, "stop token id")
    stop_ids = set(s.stop_token_ids)
    if not s.ignore_eos:
        stop_ids.update(model.eos_token_ids)
    seed = s.seed if s.seed is not None else int.from_bytes(os.urandom(8), "little")
    if not 0 <= seed < 1 << 64:
        raise InvalidRequest(f"seed must be in [0, 2^64), got {seed}")
    if s.top_p < 0 or s.repetition_penalty < 0:  # before 0 turns into "off"
        raise InvalidRequest("top_p must be in [0, 1] and repetition_penalty > 0 (0 = off); got "
                             f"{s.top_p} and {s.repetition_penalty}")
    params = SamplingParams(
        max_new_tokens=max_new, temperature=s.temperature, top_p=s.top_p or 1.0, top_k=s.top_k,
        min_p=s.min_p, repetition_penalty=s.repetition_penalty or 1.0, seed=seed,
        stop_token_ids=tuple(sorted(stop_ids)))
    check_sampling(params, model.vocab_size)
    request_id = request.request_id or uuid.uuid4().hex
    return GenerationJob(request_id=request_id, prompt_ids=prompt, params=params, stop_strings=tuple(s.stop),
                         stream=request.stream)
