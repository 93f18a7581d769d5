"""The OpenAI API's request bodies as pdserve inputs, and its response shapes.

A body becomes a list of GenerateInput, one per choice (prompts x n), or InvalidField naming
the field that is wrong. Every field of OpenAI's completions and chat completions requests is
either honoured or refused with 400 naming it; none is ignored silently. Responses are plain
dicts in OpenAI's shapes (completions, chat completions, their streamed chunks, errors).
"""
from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import grpc

from pdserve.chat_template import ChatTemplate
from pdserve.errors import InvalidRequest, PdserveError
from router.validation import GenerateInput

MAX_N = 64                 # choices per request (prompts x n)

# Sampling fields both endpoints take: OpenAI's, and the extensions vLLM and SGLang take too.
_COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop",
           "repetition_penalty", "ignore_eos", "n", "stream", "stream_options", "logprobs",
           "top_logprobs", "presence_penalty", "frequency_penalty", "logit_bias", "user",
           "stop_token_ids", "best_of"}
COMPLETION_FIELDS = _COMMON | {"prompt", "echo", "suffix"}
CHAT_FIELDS = _COMMON | {"messages", "max_completion_tokens", "add_generation_prompt",
                         "chat_template_kwargs", "response_format", "tools", "tool_choice",
                         "parallel_tool_calls", "functions", "function_call"}


class InvalidField(InvalidRequest):
    """A request field that is wrong or not supported; ``param`` names it."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass
class OpenAIRequest:
    """A checked body: the inputs of its choices and how to answer."""

    kind: str                          # "completion" or "chat"
    model: str
    choices: list[GenerateInput]       # index i = prompt i // n, sample i % n
    prompt_count: int
    stream: bool
    include_usage: bool
    id: str                            # cmpl-... or chatcmpl-...
    created: int = field(default_factory=lambda: int(time.time()))


def _typed(body: dict[str, Any], name: str, kinds: type | tuple[type, ...],
           default: Any = None) -> Any:
    """``body[name]`` if it is one of ``kinds`` (absent or null: ``default``), else
    InvalidField."""
    value = body.get(name)
    if value is None:
        return default
    allowed = kinds if isinstance(kinds, tuple) else (kinds,)
    # bool is an int in Python: a number field must not take true/false.
    if not isinstance(value, allowed) or (isinstance(value, bool) and bool not in allowed):
        names = " or ".join("a string" if k is str else k.__name__ for k in allowed)
        raise InvalidField(name, f"'{name}' must be {names}")
    if isinstance(value, float) and not math.isfinite(value):
        raise InvalidField(name, f"'{name}' must be a finite number")
    return value


def _refuse_unsupported(body: dict[str, Any], allowed: set[str]) -> None:
    for name in body:
        if name not in allowed:
            raise InvalidField(name, f"unrecognized request argument: '{name}'")
    if body.get("logprobs") not in (None, False):
        raise InvalidField("logprobs", "'logprobs' is not supported by this server")
    if body.get("top_logprobs") not in (None, 0):
        raise InvalidField("top_logprobs", "'top_logprobs' is not supported by this server")
    for name in ("presence_penalty", "frequency_penalty"):
        if _typed(body, name, (int, float), 0) != 0:
            raise InvalidField(name, f"'{name}' is not supported by this server (use "
                                     "repetition_penalty)")
    if body.get("logit_bias"):
        raise InvalidField("logit_bias", "'logit_bias' is not supported by this server")
    if body.get("echo"):
        raise InvalidField("echo", "'echo' is not supported by this server")
    if body.get("suffix"):
        raise InvalidField("suffix", "'suffix' is not supported by this server")
    for name in ("tools", "functions"):
        if body.get(name):
            raise InvalidField(name, f"'{name}' (tool calling) is not supported by this server")
    for name in ("tool_choice", "function_call"):
        if body.get(name) not in (None, "none"):
            raise InvalidField(name, f"'{name}' (tool calling) is not supported by this server")
    response_format = body.get("response_format")
    if response_format not in (None, {"type": "text"}):
        raise InvalidField("response_format", "only response_format {\"type\": \"text\"} is "
                                              "supported by this server")
    _typed(body, "user", str)


def _sampling(body: dict[str, Any], max_tokens_field: str) -> dict[str, Any]:
    """GenerateInput's sampling fields from the body (OpenAI's defaults: temperature 1)."""
    max_tokens = _typed(body, max_tokens_field, int)
    if max_tokens is None and max_tokens_field != "max_tokens":
        max_tokens = _typed(body, "max_tokens", int)
    if max_tokens is not None and max_tokens < 1:
        raise InvalidField(max_tokens_field, f"'{max_tokens_field}' must be at least 1")
    temperature = _typed(body, "temperature", (int, float), 1.0)
    if not 0 <= temperature <= 2:
        raise InvalidField("temperature", "'temperature' must be in [0, 2]")
    top_p = _typed(body, "top_p", (int, float), 1.0)
    if not 0 < top_p <= 1:
        raise InvalidField("top_p", "'top_p' must be in (0, 1]")
    top_k = _typed(body, "top_k", int, 0)
    if top_k < -1:
        raise InvalidField("top_k", "'top_k' must be -1 or 0 (off) or positive")
    min_p = _typed(body, "min_p", (int, float), 0.0)
    if not 0 <= min_p <= 1:
        raise InvalidField("min_p", "'min_p' must be in [0, 1]")
    repetition_penalty = _typed(body, "repetition_penalty", (int, float), 1.0)
    if repetition_penalty <= 0:
        raise InvalidField("repetition_penalty", "'repetition_penalty' must be > 0")
    seed = _typed(body, "seed", int)
    if seed is not None and not 0 <= seed < 1 << 63:
        raise InvalidField("seed", "'seed' must be in [0, 2^63)")
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is None:
        stop = []
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise InvalidField("stop", "'stop' must be a string or a list of strings")
    stop_token_ids = _typed(body, "stop_token_ids", list, [])
    if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in stop_token_ids):
        raise InvalidField("stop_token_ids", "'stop_token_ids' must be a list of token ids")
    return dict(max_new_tokens=max_tokens or 0, temperature=float(temperature),
                top_p=float(top_p), top_k=max(top_k, 0), min_p=float(min_p),
                repetition_penalty=float(repetition_penalty), seed=seed, stop=stop,
                stop_token_ids=stop_token_ids,
                ignore_eos=bool(_typed(body, "ignore_eos", bool, False)))


def _stream_flags(body: dict[str, Any]) -> tuple[bool, bool]:
    stream = bool(_typed(body, "stream", bool, False))
    options = _typed(body, "stream_options", dict, {})
    unknown = set(options) - {"include_usage", "continuous_usage_stats"}
    if unknown:
        raise InvalidField("stream_options", f"unrecognized stream option: '{sorted(unknown)[0]}'")
    if options and not stream:
        raise InvalidField("stream_options", "'stream_options' is only allowed with stream")
    if options.get("continuous_usage_stats"):
        raise InvalidField("stream_options", "continuous_usage_stats is not supported")
    return stream, bool(options.get("include_usage"))


def _n(body: dict[str, Any], prompts: int) -> int:
    n = _typed(body, "n", int, 1)
    best_of = _typed(body, "best_of", int)
    if n < 1:
        raise InvalidField("n", "'n' must be at least 1")
    if best_of is not None and best_of != n:
        raise InvalidField("best_of", "'best_of' other than n is not supported by this server")
    if n * prompts > MAX_N:
        raise InvalidField("n", f"at most {MAX_N} choices per request (prompts x n), got "
                                f"{n * prompts}")
    return n


def _choices(prompts: list[dict[str, Any]], n: int, sampling: dict[str, Any],
             stream: bool) -> list[GenerateInput]:
    """One input per prompt and sample; sample j of a seeded request takes seed + j, so the
    choices differ and each is reproducible."""
    seed = sampling["seed"]
    return [GenerateInput(**prompt, **{**sampling, "seed": None if seed is None else seed + j},
                          stream=stream)
            for prompt in prompts for j in range(n)]


def parse_completion(body: Any, served_model: str) -> OpenAIRequest:
    if not isinstance(body, dict):
        raise InvalidField("", "the request body must be a JSON object")
    _refuse_unsupported(body, COMPLETION_FIELDS)
    model = _model(body, served_model)
    prompt = body.get("prompt")
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt
                                   and all(isinstance(t, int) for t in prompt)):
        prompt = [prompt]
    if not isinstance(prompt, list) or not prompt:
        raise InvalidField("prompt", "'prompt' must be a string, a list of token ids, or a "
                                     "non-empty list of either")
    prompts = []
    for item in prompt:
        if isinstance(item, str) and item:
            prompts.append({"text": item})
        elif (isinstance(item, list) and item
              and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in item)):
            prompts.append({"token_ids": item})
        else:
            raise InvalidField("prompt", "each prompt must be a non-empty string or a "
                                         "non-empty list of token ids")
    stream, include_usage = _stream_flags(body)
    n = _n(body, len(prompts))
    choices = _choices(prompts, n, _sampling(body, "max_tokens"), stream)
    return OpenAIRequest("completion", model, choices, len(prompts), stream, include_usage,
                         id=f"cmpl-{uuid.uuid4().hex}")


def _message_text(message: dict[str, Any], index: int) -> str:
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" \
                    or not isinstance(part.get("text"), str):
                raise InvalidField(f"messages[{index}].content",
                                   "only text content parts are supported by this server")
            parts.append(part["text"])
        return "\n".join(parts)
    raise InvalidField(f"messages[{index}].content", "content must be a string or a list of "
                                                     "text parts")


def parse_chat(body: Any, served_model: str, template: ChatTemplate | None) -> OpenAIRequest:
    if not isinstance(body, dict):
        raise InvalidField("", "the request body must be a JSON object")
    _refuse_unsupported(body, CHAT_FIELDS)
    model = _model(body, served_model)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidField("messages", "'messages' must be a non-empty list")
    plain = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise InvalidField(f"messages[{i}]", "each message needs a 'role' string")
        if message["role"] not in ("system", "developer", "user", "assistant"):
            raise InvalidField(f"messages[{i}].role",
                               f"role '{message['role']}' is not supported by this server")
        extra = set(message) - {"role", "content", "name"}
        if extra:
            raise InvalidField(f"messages[{i}].{sorted(extra)[0]}",
                               f"message field '{sorted(extra)[0]}' is not supported")
        plain.append({"role": message["role"], "content": _message_text(message, i)})
    if template is None:
        raise InvalidField("messages", "this model has no chat template (none in its "
                                       "tokenizer_config.json or chat_template.jinja): start the "
                                       "router with --chat-template FILE, or use /v1/completions")
    kwargs = _typed(body, "chat_template_kwargs", dict, {})
    add_generation_prompt = _typed(body, "add_generation_prompt", bool, True)
    text = template.render(plain, add_generation_prompt=add_generation_prompt, **kwargs)
    stream, include_usage = _stream_flags(body)
    n = _n(body, 1)
    sampling = _sampling(body, "max_completion_tokens")
    # The template writes the special tokens it wants; a chat without max tokens may fill the
    # context.
    prompt = {"text": text, "special_tokens": False,
              "fill_context": sampling["max_new_tokens"] == 0}
    choices = _choices([prompt], n, sampling, stream)
    return OpenAIRequest("chat", model, choices, 1, stream, include_usage,
                         id=f"chatcmpl-{uuid.uuid4().hex}")


def _model(body: dict[str, Any], served_model: str) -> str:
    return check_model(_typed(body, "model", str, served_model), served_model)


def check_model(model: str, served_model: str) -> str:
    """``model`` if this server serves it, else ModelNotFound (404, model_not_found)."""
    if model != served_model:
        raise ModelNotFound(f"the model '{model}' does not exist (this server serves "
                            f"'{served_model}')")
    return model


class ModelNotFound(PdserveError):
    code = grpc.StatusCode.NOT_FOUND


# gRPC status (of our typed errors, or a worker's) -> HTTP status and OpenAI error type.
HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "server_overloaded"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout"),
    grpc.StatusCode.CANCELLED: (499, "cancelled"),
}


def error_body(err: PdserveError) -> tuple[int, dict[str, Any]]:
    """HTTP status and OpenAI's error JSON for ``err``."""
    status, kind = HTTP_STATUS.get(err.code, (500, "server_error"))
    code = "model_not_found" if isinstance(err, ModelNotFound) else None
    return status, {"error": {"message": str(err), "type": kind,
                              "param": getattr(err, "param", None) or None, "code": code}}


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def choice_body(request: OpenAIRequest, index: int, text: str, finish_reason: str | None,
                streamed: bool, first: bool = False) -> dict[str, Any]:
    """One choice of a response (``streamed``: of a chunk, with a delta for chat)."""
    if request.kind == "completion":
        return {"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason}
    if streamed:
        delta: dict[str, Any] = {"role": "assistant", "content": text} if first else \
            ({"content": text} if text else {})
        return {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
    return {"index": index, "message": {"role": "assistant", "content": text},
            "logprobs": None, "finish_reason": finish_reason}


def response_body(request: OpenAIRequest, choices: list[dict[str, Any]],
                  usage_body: dict[str, int] | None, streamed: bool) -> dict[str, Any]:
    kind = {("completion", False): "text_completion", ("completion", True): "text_completion",
            ("chat", False): "chat.completion", ("chat", True): "chat.completion.chunk"}
    body = {"id": request.id, "object": kind[request.kind, streamed], "created": request.created,
            "model": request.model, "system_fingerprint": None, "choices": choices}
    if not streamed or request.include_usage:
        body["usage"] = usage_body
    return body
