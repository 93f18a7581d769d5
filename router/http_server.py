"""The router's OpenAI-compatible HTTP front (aiohttp, on the router's event loop beside gRPC):
``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``, ``GET /health``.

It validates like the gRPC front (the same GenerationJob checks, after the OpenAI body is
parsed) and runs the same pipeline (router/generation.py), so cancellation, retries, resumption
and metrics are the same; a client that disconnects cancels its choices, and each frees its
pages on both sides as a cancelled gRPC call does. Streams are server-sent events ending with
``data: [DONE]``.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import ssl
import time
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import web

from pdserve.chat_template import ChatTemplate
from pdserve.errors import InvalidRequest, PdserveError
from router.generation import Generation
from router.openai_protocol import (
    ModelNotFound,
    OpenAIRequest,
    check_model,
    choice_body,
    error_body,
    parse_chat,
    parse_completion,
    response_body,
    usage,
)
from router.output import Chunk
from router.validation import INLINE_VALIDATION_BYTES, GenerationJob

log = logging.getLogger(__name__)

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
               "X-Accel-Buffering": "no"}


class StreamFailed(Exception):
    """A stream that failed after its headers were sent (its error went out as an event)."""

    def __init__(self, error: PdserveError, response: web.StreamResponse) -> None:
        super().__init__(str(error))
        self.error = error
        self.response = response


def _no_deadline() -> None:
    return None


def _sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


class OpenAIServer:
    def __init__(self, generation: Generation, served_model: str,
                 template: ChatTemplate | None, max_request_bytes: int) -> None:
        self.generation = generation
        self.model = generation.model
        self.served_model = served_model
        self.template = template
        self.metrics = generation.metrics
        self.max_request_bytes = max_request_bytes
        self.started_at = int(time.time())
        self._runner: web.AppRunner | None = None

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.max_request_bytes)
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/v1/models/{model}", self.model_info)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        return app

    async def start(self, host: str, port: int, ssl_context: ssl.SSLContext | None = None,
                    shutdown_grace_s: float = 5.0, share_port: bool = False) -> int:
        """Serves on ``host:port`` (0: any free port), over TLS with ``ssl_context``; returns
        the port. A busy port raises OSError (SO_REUSEPORT off: never shared) unless
        ``share_port`` (several router processes on one port)."""
        # handler_cancellation: a client that disconnects cancels its handler, and with it
        # every choice it was generating.
        self._runner = web.AppRunner(self.app(), handler_cancellation=True, access_log=None,
                                     shutdown_timeout=shutdown_grace_s)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port, reuse_port=share_port,
                           ssl_context=ssl_context)
        await site.start()
        return site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    async def stop(self) -> None:
        """Stops taking connections, lets requests in flight finish for up to the grace given
        to ``start``, then cancels the rest (which frees their pages)."""
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()   # waits up to the runner's shutdown_timeout

    # --- read-only endpoints ---------------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        workers = self.generation.workers
        ready = bool(workers.healthy("prefill")) and bool(workers.healthy("decode"))
        return web.json_response({"status": "ok" if ready else "waiting for workers"},
                                 status=200 if ready else 503)

    def _model_card(self) -> dict[str, Any]:
        return {"id": self.served_model, "object": "model", "created": self.started_at,
                "owned_by": "pdserve", "max_model_len": self.model.max_model_len}

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [self._model_card()]})

    async def model_info(self, request: web.Request) -> web.Response:
        try:
            check_model(request.match_info["model"], self.served_model)
        except ModelNotFound as err:
            status, body = error_body(err)
            return web.json_response(body, status=status)
        return web.json_response(self._model_card())

    # --- generation -------------------------------------------------------------------------

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, "completion")

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, "chat")

    async def _serve(self, http: web.Request, kind: str) -> web.StreamResponse:
        started = time.monotonic()
        outcome = "error"
        self.metrics.running.inc()
        try:
            try:
                raw = await http.read()
            except web.HTTPRequestEntityTooLarge:
                outcome = "resource_exhausted"
                return web.json_response({"error": {
                    "message": f"request body larger than {self.max_request_bytes} bytes "
                               "(--max-request-bytes)", "type": "invalid_request_error",
                    "param": None, "code": "request_too_large"}}, status=413)
            if len(raw) > INLINE_VALIDATION_BYTES:
                request, jobs = await asyncio.to_thread(self._checked, raw, kind)
            else:
                request, jobs = self._checked(raw, kind)
            if request.stream:
                response = await self._stream(http, request, jobs, started)
            else:
                response = await self._whole(request, jobs, started)
            outcome = "finished"
            self.metrics.e2e.observe(time.monotonic() - started)
            return response
        except StreamFailed as failed:
            outcome = failed.error.code.name.lower()
            return failed.response
        except PdserveError as err:
            outcome = err.code.name.lower()
            status, body = error_body(err)
            return web.json_response(body, status=status)
        except asyncio.CancelledError:   # the client went away (handler cancelled)
            outcome = "cancelled"
            raise
        except ConnectionResetError:     # ... noticed while writing to it
            outcome = "cancelled"
            return web.Response(status=499)
        finally:
            self.metrics.running.dec()
            self.metrics.request_done(outcome)

    def _checked(self, raw: bytes, kind: str) -> tuple[OpenAIRequest, list[GenerationJob]]:
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise InvalidRequest(f"the request body is not valid JSON: {err}") from err
        if kind == "chat":
            request = parse_chat(body, self.served_model, self.template)
        else:
            request = parse_completion(body, self.served_model)
        jobs = []
        for index, choice in enumerate(request.choices):
            choice.request_id = f"{request.id}-{index}"
            jobs.append(self.generation.check(choice))
        return request, jobs

    def _prompt_tokens(self, request: OpenAIRequest, jobs: list[GenerationJob]) -> int:
        per_prompt = len(jobs) // request.prompt_count
        return sum(len(jobs[i].prompt_ids) for i in range(0, len(jobs), per_prompt))

    async def _chunks(self, jobs: list[GenerationJob],
                      started: float) -> AsyncIterator[tuple[int, Chunk]]:
        """Every choice's chunks as they come, tagged with the choice's index; the first
        failure ends them all (the others are cancelled, freeing their pages)."""
        if len(jobs) == 1:
            async with contextlib.aclosing(self.generation.run(jobs[0], _no_deadline,
                                                               started)) as chunks:
                async for chunk in chunks:
                    yield 0, chunk
            return
        queue: asyncio.Queue[tuple[int, Chunk | None, BaseException | None]] = asyncio.Queue()

        async def pump(index: int, job: GenerationJob) -> None:
            try:
                async for chunk in self.generation.run(job, _no_deadline, started):
                    queue.put_nowait((index, chunk, None))
            except Exception as err:  # noqa: BLE001 - handed to the reader, which raises it
                queue.put_nowait((index, None, err))
                return
            queue.put_nowait((index, None, None))

        tasks = [asyncio.create_task(pump(i, job)) for i, job in enumerate(jobs)]
        try:
            running = len(tasks)
            while running:
                index, chunk, error = await queue.get()
                if error is not None:
                    raise error
                if chunk is None:
                    running -= 1
                    continue
                yield index, chunk
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _whole(self, request: OpenAIRequest, jobs: list[GenerationJob],
                     started: float) -> web.Response:
        texts = [""] * len(jobs)
        finish: list[str | None] = [None] * len(jobs)
        completion_tokens = [0] * len(jobs)
        async with contextlib.aclosing(self._chunks(jobs, started)) as chunks:
            async for index, chunk in chunks:
                texts[index] += chunk.text
                finish[index] = chunk.finish_reason or finish[index]
                completion_tokens[index] = chunk.completion_tokens
        choices = [choice_body(request, i, texts[i], finish[i], streamed=False)
                   for i in range(len(jobs))]
        body = response_body(request, choices, usage(self._prompt_tokens(request, jobs),
                                                     sum(completion_tokens)), streamed=False)
        return web.json_response(body)

    async def _stream(self, http: web.Request, request: OpenAIRequest,
                      jobs: list[GenerationJob], started: float) -> web.StreamResponse:
        response = web.StreamResponse(headers=SSE_HEADERS)
        await response.prepare(http)
        first = [True] * len(jobs)
        completion_tokens = [0] * len(jobs)
        try:
            async with contextlib.aclosing(self._chunks(jobs, started)) as chunks:
                async for index, chunk in chunks:
                    completion_tokens[index] = chunk.completion_tokens
                    if not chunk.text and not chunk.finish_reason and not first[index]:
                        continue   # tokens that release no text yet (a held-back stop prefix)
                    choice = choice_body(request, index, chunk.text, chunk.finish_reason,
                                         streamed=True, first=first[index])
                    first[index] = False
                    await response.write(_sse(response_body(request, [choice], None,
                                                            streamed=True)))
        except PdserveError as err:
            # The headers are sent: the error travels as an event, then the stream ends.
            await response.write(_sse(error_body(err)[1]))
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
            raise StreamFailed(err, response) from err
        if request.include_usage:
            await response.write(_sse(response_body(
                request, [], usage(self._prompt_tokens(request, jobs), sum(completion_tokens)),
                streamed=True)))
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response
