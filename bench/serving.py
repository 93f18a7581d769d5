"""Live-traffic serving benchmark: requests arrive over time (Poisson, constant or in bursts) at
one or more request rates, each streamed, and each timed as a user sees it: time to first token
(TTFT), time per output token (TPOT), the gaps between streamed chunks (ITL) and end-to-end
latency; per rate, the percentiles of each, throughput, goodput under latency SLOs and errors
by kind.

Targets, each run in turn on the same seeded request stream:
  --base-url URL     an OpenAI-compatible server (pdserve, SGLang, vLLM, mini-sglang), streamed
                     as server-sent events from /v1/completions or, with --endpoint chat,
                     /v1/chat/completions (mini-sglang's server takes only chat); URL,URL,...
                     is one target of several copies (one per GPU, say), each request sent to
                     the next in turn, as a round-robin balancer would;
  --grpc HOST:PORT   pdserve's gRPC API (GenerationService.Generate, streamed);
  `up` as either's value: the cluster this script starts (`pdserve up --model M --up-args ...`,
  up until the last target is done: a peer on the same GPU needs room beside it); with no
  target at all, `--base-url up`.
--label NAME names the target given just before it. With several targets, each rate's figures
are printed side by side with the ratio first / other for each metric.

Workloads (--workload), lengths drawn from `fixed:N`, `uniform:LO:HI`, `lognormal:MEAN:SIGMA[:MAX]`
(MEAN the lengths' mean, SIGMA of their log) or `exponential:MEAN[:MAX]`:
  random         prompts of --prompt-len random token ids, --output-len tokens each;
  shared-prefix  a chat mix: --prefix-fraction of the requests start with one of --num-prefixes
                 system prompts of --prefix-len tokens, then a user part of --prompt-len;
  multi-turn     conversations of --turns turns; each next turn resends the whole history,
                 the replies included, plus a new message of --prompt-len words, after a think
                 time (--think-time-s, seconds) from the reply's end. Arrivals (and
                 --num-requests) count conversations; every turn is a measured request; a
                 failed turn ends its conversation (requests_sent < requests_planned).
Token ids are drawn below --max-token-id (folded into the model's vocabulary where a target
tells it: gRPC, or `up`). A chat endpoint cannot take token ids: each id becomes a word of a
fixed list (so lengths are in words, about a token each with a BPE vocabulary; the usage's
prompt_tokens is recorded too); multi-turn prompts are such text on every API (the replies
come back as text). Each request asks max_tokens = its drawn output length, with ignore_eos
(--no-ignore-eos for a server that refuses it) and --temperature (default 0). Each rate draws
its own stream (its key: the seed and the rate), so a sweep's later rates find nothing of the
earlier ones in a prefix cache; warm-up requests (--warmup-requests, all at once, not counted)
are drawn apart from both.

What is measured, per request, with time.perf_counter from the moment it is sent:
  TTFT    to the first chunk carrying output (a completions chunk, with or without text: a
          token may bring none; chat: text; gRPC: token ids; a chat reply whose tokens bring no
          text at all, such as special tokens: its first chunk);
  ITL     every gap between consecutive chunks carrying output, one gap per chunk however many
          tokens it carries (a server streaming every k tokens shows gaps of k tokens);
  TPOT    (e2e - TTFT) / (output tokens - 1);
  output tokens: the stream's usage (stream_options include_usage; gRPC's last message), else
          the chunks counted (a peer that sends no usage, as mini-sglang);
  errors  by kind (`http 503`, `grpc UNAVAILABLE`, `stream error: <type>` for an error event
          after the headers, or the exception's class), with the first message of each kind.
Per rate: mean, p50, p90, p99 of each (the p99 of TTFT, TPOT and e2e with its 90% interval,
`p99_ranks`); requests and output tokens per second over the run's
wall time (first send to last byte); the achieved arrival rate (of the sends themselves, so a
lagging load generator shows, as do send_lag_ms and client_cpu_share: this process's CPU
seconds per second of the run); goodput (requests/s meeting both --slo-ttft-ms and
--slo-tpot-ms). One asyncio loop drives every request over one client session (aiohttp, an
unbounded connector unless --max-connections; gRPC: --grpc-channels channels); requests beyond
--max-concurrency in flight wait at the client (their wait counts in send_lag_ms, not TTFT).

--compare A.json --compare B.json sends nothing: it sets the targets of runs made apart (a peer
and pdserve that cannot hold the GPUs at once), saved with --save-requests over the same rates,
side by side as one command's targets would be, each run's goodput recounted from its requests
under this command's --slo-ttft-ms and --slo-tpot-ms.

The JSON (--out): `config` (the flags, and token_id_range), `targets` ([{label, api, address,
model, endpoint, warmup, runs: [one summary a rate, with every request's record under
`requests` given --save-requests]}]) and, with several targets, `comparison` ({baseline,
rates: [{rate, metrics: {name: {label: value}}, ratios: {label: {name: first / label}}}]}).

    python bench/serving.py --model /tmp/q06 --up-args "--kv-cache-gb 40" --rates 4,8,16
    python bench/serving.py --base-url http://127.0.0.1:8000 --rates 8 --duration-s 120 \\
        --workload shared-prefix --num-prefixes 4 --prefix-len 1024 --slo-ttft-ms 500 \\
        --slo-tpot-ms 50 --out bench/results/serving.json
    python bench/serving.py --base-url up --label pdserve --base-url http://127.0.0.1:30000 \\
        --label sglang --model /tmp/q06 --rates 4,8 --arrival poisson   # side by side
    python bench/serving.py --base-url up --label pdserve --base-url http://127.0.0.1:1919 \\
        --label mini-sglang --endpoint chat --model /tmp/q06   # mini-sglang: chat only
    python bench/serving.py --base-url http://127.0.0.1:30000,http://127.0.0.1:30001 \\
        --label peer-x2 --rates 20,40   # two copies of a peer, one per GPU, in turn
    python bench/serving.py --compare peer.json --compare pdserve.json --slo-tpot-ms 7 \\
        --slo-ttft-ms 100   # two earlier runs (--save-requests), goodput at these targets
    python bench/serving.py --grpc 127.0.0.1:50051 --workload multi-turn --turns uniform:2:5 \\
        --think-time-s exponential:2 --rates 1,2 --save-requests
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import itertools
import json
import math
import random
import shlex
import signal
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

# Chat prompts: token id i becomes WORDS[i % len(WORDS)] (short, common words: about one token
# each with a BPE vocabulary).
WORDS = (
    "the of and to in is was for on are with as his they be at one have this from or had by "
    "word but what some we can out other were all there when up use your how said an each she "
    "which do their time if will way about many then them write would like so these her long "
    "make thing see him two has look more day could go come did number sound no most people my "
    "over know water than call first who may down side been now find any new work part take get "
    "place made live where after back little only round man year came show every good me give "
    "our under name very through just form sentence great think say help low line differ turn "
    "cause much mean before move right boy old too same tell does set three want air well also "
    "play small end put home read hand port large spell add even land here must big high such "
    "follow act why ask men change went light kind off need house picture try us again animal "
    "point mother world near build self earth father head stand own page should country found "
    "answer school grow study still learn plant cover food sun four between state keep eye never "
    "last let thought city tree cross farm hard start might story saw far sea draw left late run "
    "while press close night real life few north open seem together next white children begin "
    "got walk example ease paper group always music those both mark often letter until mile "
    "river car feet care second book carry took science eat room friend began idea fish").split()


# --- what to send -------------------------------------------------------------------------------

@dataclass(frozen=True)
class Dist:
    """A length (or seconds) distribution: fixed, uniform, lognormal or exponential."""

    kind: str
    a: float
    b: float = 0.0
    cap: float = math.inf
    spec: str = field(default="", compare=False)

    def __str__(self) -> str:
        return self.spec or self.kind

    @classmethod
    def parse(cls, spec: str) -> Dist:
        """``fixed:N`` (or ``N``), ``uniform:LO:HI``, ``lognormal:MEAN:SIGMA[:MAX]``,
        ``exponential:MEAN[:MAX]``; ValueError with the reason otherwise."""
        kind, *values = spec.split(":")
        if kind.replace(".", "", 1).isdigit():
            kind, values = "fixed", [kind]
        arity = {"fixed": (1, 1), "uniform": (2, 2), "lognormal": (2, 3), "exponential": (1, 2)}
        if kind not in arity:
            raise ValueError(f"unknown distribution {kind!r} (fixed, uniform, lognormal, "
                             "exponential)")
        lo, hi = arity[kind]
        try:
            numbers = [float(v) for v in values]
        except ValueError:
            raise ValueError(f"{spec!r}: the values must be numbers") from None
        if not lo <= len(numbers) <= hi:
            raise ValueError(f"{kind} takes {lo if lo == hi else f'{lo} or {hi}'} values")
        if any(n < 0 for n in numbers):
            raise ValueError(f"{spec!r}: the values must not be negative")
        if kind == "uniform" and numbers[0] > numbers[1]:
            raise ValueError(f"{spec!r}: LO above HI")
        if kind == "lognormal":
            return cls(kind, *numbers[:2], cap=numbers[2] if len(numbers) > 2 else math.inf,
                       spec=spec)
        if kind == "exponential":
            return cls(kind, numbers[0], cap=numbers[1] if len(numbers) > 1 else math.inf,
                       spec=spec)
        return cls(kind, *numbers, spec=spec)

    def sample(self, rng: random.Random) -> float:
        if self.kind == "fixed":
            return self.a
        if self.kind == "uniform":
            return rng.uniform(self.a, self.b)
        if self.kind == "exponential":
            return min(rng.expovariate(1 / self.a) if self.a else 0.0, self.cap)
        mu = math.log(max(self.a, 1e-9)) - self.b ** 2 / 2   # a mean of a: mu + sigma^2/2
        return min(rng.lognormvariate(mu, self.b), self.cap)

    def length(self, rng: random.Random) -> int:
        """A drawn length: at least 1 (uniform bounds inclusive)."""
        if self.kind == "uniform":
            return max(1, rng.randint(int(self.a), int(self.b)))
        return max(1, round(self.sample(rng)))


@dataclass
class Turn:
    ids: list[int]               # the user part (words on a text API)
    output_len: int
    think_s: float = 0.0         # after the previous turn's reply


@dataclass
class Session:
    """One arrival: a request, or a conversation's turns (multi-turn)."""

    at_s: float                  # arrival, from the run's start
    turns: list[Turn]
    prefix: int | None = None    # which shared system prompt starts it


@dataclass
class Stream:
    sessions: list[Session]
    prefixes: list[list[int]]


def arrival_times(arrival: str, rate: float, burst_size: int, count: int | None,
                  duration_s: float, rng: random.Random) -> list[float]:
    """Arrival offsets in seconds: ``count`` of them, else those before ``duration_s``. A
    burst is ``burst_size`` arrivals at once, ``burst_size / rate`` apart; rate inf: all at 0."""
    times: list[float] = []
    now = 0.0
    for index in itertools.count():
        if count is not None and index >= count:
            break
        if math.isinf(rate):
            now = 0.0
        elif index:
            if arrival == "poisson":
                now += rng.expovariate(rate)
            elif arrival == "constant":
                now = index / rate
            else:
                now = (index // burst_size) * burst_size / rate
        if count is None and (now >= duration_s or (math.isinf(rate) and index > 0)):
            break
        times.append(now)
    return times


def draw_stream(args: argparse.Namespace, key: str, id_range: int, count: int | None = None,
                rate: float = math.inf) -> Stream:
    """The requests of one run, a function of ``key`` (and the flags) alone: the same for
    every target. ``count`` overrides --num-requests / --duration-s."""
    times = arrival_times(args.arrival, rate, args.burst_size,
                          count if count is not None else args.num_requests, args.duration_s,
                          random.Random(f"{args.seed}:{key}:arrivals"))
    rng = random.Random(f"{args.seed}:{key}:prompts")

    def ids(n: int) -> list[int]:
        return [rng.randrange(id_range) for _ in range(n)]

    shared = args.workload == "shared-prefix"
    prefixes = [ids(args.prefix_len) for _ in range(args.num_prefixes)] if shared else []
    sessions = []
    for at in times:
        prefix = None
        if shared and prefixes and rng.random() < args.prefix_fraction:
            prefix = rng.randrange(len(prefixes))
        turns = args.turns.length(rng) if args.workload == "multi-turn" else 1
        sessions.append(Session(at, [
            Turn(ids(args.prompt_len.length(rng)), args.output_len.length(rng),
                 args.think_time_s.sample(rng) if k else 0.0) for k in range(turns)], prefix))
    return Stream(sessions, prefixes)


def words(ids: list[int]) -> str:
    return " ".join(WORDS[i % len(WORDS)] for i in ids)


# A prompt: (role, content) messages, content token ids or text; a single-turn prompt of ids
# goes to /v1/completions and gRPC as the ids, one after the other.
Messages = list[tuple[str, Any]]


def first_messages(stream: Stream, session: Session, text: bool) -> Messages:
    turn = session.turns[0]
    messages: Messages = []
    if session.prefix is not None:
        prefix = stream.prefixes[session.prefix]
        messages.append(("system", words(prefix) if text else prefix))
    messages.append(("user", words(turn.ids) if text else turn.ids))
    return messages


def as_text(messages: Messages) -> str:
    """A conversation as one completion prompt."""
    lines = [f"{role.capitalize()}: {content if isinstance(content, str) else words(content)}"
             for role, content in messages]
    return "\n\n".join(lines) + "\n\nAssistant:"


# --- what came back -----------------------------------------------------------------------------

@dataclass
class Result:
    """One request as its client saw it: scheduled_s and sent_s on time.perf_counter's clock
    (its record: from the run's start), ttft_s and e2e_s from sent_s."""

    session: int
    turn: int
    prompt_len: int              # drawn: ids or words, system prompt and history included
    output_len: int              # asked (max_tokens)
    scheduled_s: float
    sent_s: float = 0.0
    ttft_s: float | None = None
    e2e_s: float | None = None
    output_tokens: int = 0
    prompt_tokens: int | None = None   # the server's usage
    tokens_from: str = "chunks"        # "usage" or "chunks"
    chunks: int = 0
    finish_reason: str | None = None
    error: str | None = None
    error_message: str | None = None
    copy: int = 0                      # which of the target's URLs served it
    itl_s: list[float] = field(default_factory=list)
    _last: float = field(default=0.0, repr=False)
    _first_choice: float | None = field(default=None, repr=False)
    _counted: int = field(default=0, repr=False)
    _text: list[str] = field(default_factory=list, repr=False)

    def chunk(self, now: float, text: str, tokens: int) -> None:
        """A chunk that carries output (``tokens`` of it, 1 where a chunk tells no count)."""
        if self.ttft_s is None:
            self.ttft_s = now - self.sent_s
        else:
            self.itl_s.append(now - self._last)
        self._last = now
        self.chunks += 1
        self._counted += tokens
        self._text.append(text)

    def usage(self, completion_tokens: int | None, prompt_tokens: int | None) -> None:
        if completion_tokens is not None:
            self.output_tokens, self.tokens_from = int(completion_tokens), "usage"
        if prompt_tokens is not None:
            self.prompt_tokens = int(prompt_tokens)

    def fail(self, kind: str, message: str) -> None:
        if self.error is None:
            self.error, self.error_message = kind, message[:500]

    def choice(self, now: float) -> None:
        """A chunk of a choice, with or without text."""
        if self._first_choice is None:
            self._first_choice = now

    def end(self, now: float) -> None:
        self.e2e_s = now - self.sent_s
        if self.tokens_from == "chunks":
            self.output_tokens = self._counted
        if self.ttft_s is None and self.output_tokens and self._first_choice is not None:
            # tokens without text (special tokens, held-back bytes): their first chunk's time
            self.ttft_s = self._first_choice - self.sent_s

    @property
    def text(self) -> str:
        return "".join(self._text)

    @property
    def tpot_s(self) -> float | None:
        if self.ttft_s is None or self.e2e_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)

    def record(self, start: float) -> dict[str, Any]:
        row = {k: v for k, v in asdict(self).items() if not k.startswith("_")}
        for key in ("scheduled_s", "sent_s"):
            row[key] = round(row[key] - start, 6)
        for key in ("ttft_s", "e2e_s"):
            row[key] = None if row[key] is None else round(row[key], 6)
        row["tpot_s"] = None if self.tpot_s is None else round(self.tpot_s, 6)
        row["itl_s"] = [round(gap, 6) for gap in self.itl_s]
        return row


def _error_text(body: str) -> str:
    with contextlib.suppress(ValueError, AttributeError, TypeError):
        error = json.loads(body)
        error = error.get("error", error)
        return str(error.get("message", error) if isinstance(error, dict) else error)
    return body


class HttpClient:
    """An OpenAI-compatible server: one aiohttp session for every request."""

    def __init__(self, base_url: str, endpoint: str, args: argparse.Namespace) -> None:
        bases = [url.strip().rstrip("/").removesuffix("/v1") for url in base_url.split(",")]
        self.base_url = bases[0]   # its /v1/models names the model for every copy
        self.endpoint, self.args = endpoint, args
        path = "chat/completions" if endpoint == "chat" else "completions"
        self.urls = [f"{base}/v1/{path}" for base in bases]
        self._next = itertools.count()
        self.model = args.model_name
        self.session: Any = None

    async def __aenter__(self) -> HttpClient:
        import aiohttp

        headers = {"Authorization": f"Bearer {self.args.api_key}"} if self.args.api_key else {}
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=self.args.max_connections, limit_per_host=0),
            timeout=aiohttp.ClientTimeout(total=self.args.request_timeout_s or None),
            headers=headers, read_bufsize=1 << 20)
        if not self.model:
            try:
                async with self.session.get(f"{self.base_url}/v1/models") as reply:
                    reply.raise_for_status()
                    self.model = (await reply.json())["data"][0]["id"]
            except Exception as e:   # noqa: BLE001 - any failure: say which server and why
                await self.session.close()
                raise SystemExit(f"bench/serving.py: {self.base_url}/v1/models: {e!r} (give "
                                 "--model-name if the server lists no models)") from None
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.session.close()

    def body(self, messages: Messages, output_len: int) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.model, "max_tokens": output_len, "stream": True,
                                "temperature": self.args.temperature}
        if self.endpoint == "chat":
            body["messages"] = [{"role": role, "content": c if isinstance(c, str) else words(c)}
                                for role, c in messages]
        elif all(isinstance(c, list) for _, c in messages):
            body["prompt"] = [t for _, ids in messages for t in ids]
        else:
            body["prompt"] = as_text(messages)
        if self.args.ignore_eos:
            body["ignore_eos"] = True
        if self.args.stream_usage:
            body["stream_options"] = {"include_usage": True}
        return {**body, **self.args.extra_body}

    async def request(self, messages: Messages, output_len: int, result: Result) -> None:
        body = self.body(messages, output_len)
        chat = self.endpoint == "chat"
        result.copy = next(self._next) % len(self.urls)
        result.sent_s = time.perf_counter()
        try:
            async with self.session.post(self.urls[result.copy], json=body) as reply:
                if reply.status != 200:
                    result.fail(f"http {reply.status}", _error_text(await reply.text()))
                    return
                async for line in reply.content:
                    now = time.perf_counter()
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        break
                    event = json.loads(data)
                    if "error" in event:
                        error = event["error"] if isinstance(event["error"], dict) else {}
                        result.fail(f"stream error: {error.get('type') or error.get('code')}",
                                    str(error.get("message", event["error"])))
                        break
                    usage = event.get("usage")
                    if usage:
                        result.usage(usage.get("completion_tokens"), usage.get("prompt_tokens"))
                    for choice in event.get("choices") or ():
                        result.choice(now)
                        if chat:
                            delta = choice.get("delta") or {}
                            text = delta.get("content") or delta.get("reasoning_content") or ""
                        else:
                            text = choice.get("text") or ""
                        # A completions chunk is the server's output so far even without text
                        # (a token the tokenizer has no text for); a chat delta may be a role.
                        finish = choice.get("finish_reason")
                        if text or (not chat and not finish):
                            result.chunk(now, text, 1)
                        result.finish_reason = finish or result.finish_reason
        except Exception as e:   # noqa: BLE001 - every failure is a measured outcome
            result.fail(type(e).__name__, str(e) or repr(e))
        finally:
            result.end(time.perf_counter())


class GrpcClient:
    """pdserve's gRPC API over ``channels`` channels, requests spread over them in turn."""

    def __init__(self, address: str, args: argparse.Namespace) -> None:
        self.address, self.args = address, args
        self.model = ""
        self.channels: list[Any] = []
        self._next = itertools.count()

    async def __aenter__(self) -> GrpcClient:
        import grpc

        from protos.pdserve.v1 import generate_pb2, generate_pb2_grpc

        self.pb = generate_pb2
        self.channels = [grpc.aio.insecure_channel(self.address, options=[
            ("grpc.max_receive_message_length", 64 << 20), ("grpc.use_local_subchannel_pool", 1)])
            for _ in range(self.args.grpc_channels)]
        self.stubs = [generate_pb2_grpc.GenerationServiceStub(c) for c in self.channels]
        for stub in self.stubs:   # connected before the first request
            info = await stub.GetModelInfo(generate_pb2.GetModelInfoRequest(), timeout=60)
        self.model = info.model
        return self

    async def __aexit__(self, *exc: object) -> None:
        for channel in self.channels:
            await channel.close()

    async def request(self, messages: Messages, output_len: int, result: Result) -> None:
        import grpc

        pb = self.pb
        sampling = pb.SamplingParams(max_new_tokens=output_len, temperature=self.args.temperature,
                                     ignore_eos=self.args.ignore_eos)
        if all(isinstance(c, list) for _, c in messages):
            prompt = {"token_ids": pb.TokenIds(ids=[t for _, ids in messages for t in ids])}
        else:
            prompt = {"text": as_text(messages)}
        request = pb.GenerateRequest(sampling=sampling, stream=True, **prompt)
        stub = self.stubs[next(self._next) % len(self.stubs)]
        result.sent_s = time.perf_counter()
        try:
            async for response in stub.Generate(request,
                                                timeout=self.args.request_timeout_s or None):
                now = time.perf_counter()
                if response.token_ids:
                    result.chunk(now, response.text, len(response.token_ids))
                if response.HasField("usage"):
                    result.usage(response.usage.completion_tokens, response.usage.prompt_tokens)
                if response.finish_reason:
                    result.finish_reason = pb.FinishReason.Name(
                        response.finish_reason).removeprefix("FINISH_REASON_").lower()
        except grpc.aio.AioRpcError as e:
            result.fail(f"grpc {e.code().name}", e.details() or "")
        except Exception as e:   # noqa: BLE001
            result.fail(type(e).__name__, str(e) or repr(e))
        finally:
            result.end(time.perf_counter())


# --- a run --------------------------------------------------------------------------------------

async def run_stream(client: HttpClient | GrpcClient, stream: Stream, text: bool,
                     max_concurrency: int) -> tuple[list[Result], dict[str, float]]:
    """Sends ``stream`` at its arrival times; the results (in completion order) and the run's
    clock: its start, the largest concurrency and this process's CPU seconds meanwhile."""
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else contextlib.nullcontext()
    results: list[Result] = []
    in_flight = {"now": 0, "max": 0}
    cpu_s = time.process_time()
    start = time.perf_counter() + 0.01

    async def conversation(index: int, session: Session) -> None:
        history: Messages = []
        scheduled = start + session.at_s
        for k, turn in enumerate(session.turns):
            if k:
                scheduled = time.perf_counter() + turn.think_s
                await asyncio.sleep(turn.think_s)
                history.append(("user", words(turn.ids)))
            else:
                history = first_messages(stream, session, text)
            prompt_len = sum(len(c.split() if isinstance(c, str) else c) for _, c in history)
            result = Result(index, k, prompt_len, turn.output_len, scheduled)
            async with limit:
                in_flight["now"] += 1
                in_flight["max"] = max(in_flight["max"], in_flight["now"])
                await client.request(history, turn.output_len, result)
                in_flight["now"] -= 1
            results.append(result)
            if result.error:
                break   # the conversation's later turns are not sent
            history.append(("assistant", result.text))

    tasks = []
    for index, session in enumerate(stream.sessions):
        delay = start + session.at_s - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(conversation(index, session)))
    await asyncio.gather(*tasks)
    return results, {"start": start, "max_in_flight": in_flight["max"],
                     "client_cpu_s": time.process_time() - cpu_s}


# The confidence of the p99's interval: a p99 over a few hundred requests is its few slowest.
P99_CONFIDENCE = 0.90


def p99_ranks(n: int, confidence: float = P99_CONFIDENCE) -> tuple[int | None, int | None]:
    """The 0-based ranks in ``n`` sorted values of a distribution-free interval holding the
    true p99 with at least ``confidence``: the count of values above it is binomial (n, 0.01),
    each side may miss with (1 - confidence) / 2. None for a side too few values can bound
    (the high side needs 0.99^n <= that, n >= 299 at 90%)."""
    tail = (1 - confidence) / 2
    log_pmf = n * math.log(0.99)            # in logs: 0.99^n underflows past 70k values
    cdf = math.exp(log_pmf)
    k05 = -1 if cdf > tail else 0           # the most values above it that is still unlikely
    k = 0
    while cdf < 1 - tail and k < n:
        k += 1
        log_pmf += math.log((n - k + 1) / k * (0.01 / 0.99))
        cdf += math.exp(log_pmf)
        if cdf <= tail:
            k05 = k
    low = n - 1 - k                          # at most k values above it: 1 - tail likely
    return (low if low >= 0 else None), (n - 1 - k05 if k05 >= 0 else None)


def percentiles(values: list[float], scale: float = 1e3,
                interval: bool = False) -> dict[str, float | None]:
    """Mean, p50, p90, p99 (linear between ranks) of ``values`` times ``scale``; with
    ``interval`` (values that are independent draws, one a request) also ``p99_low`` and
    ``p99_high``, the P99_CONFIDENCE interval of the p99 (`p99_ranks`; None: unbounded)."""
    keys = ("mean", "p50", "p90", "p99") + (("p99_low", "p99_high") if interval else ())
    if not values:
        return dict.fromkeys(keys)
    ordered = sorted(values)

    def at(q: float) -> float:
        rank = q / 100 * (len(ordered) - 1)
        low = math.floor(rank)
        high = min(low + 1, len(ordered) - 1)
        return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)

    row = {"mean": sum(ordered) / len(ordered), **{f"p{q}": at(q) for q in (50, 90, 99)}}
    if interval:
        low, high = p99_ranks(len(ordered))
        row |= {"p99_low": None if low is None else ordered[low],
                "p99_high": None if high is None else ordered[high]}
    return {k: None if v is None else round(v * scale, 3) for k, v in row.items()}


# First tokens closer together than this came out of one prompt step (a step takes milliseconds).
SAME_STEP_S = 0.001


def first_token_shared(results: list[Result]) -> float | None:
    """The share of requests whose first token came within SAME_STEP_S of another's: prompts
    prefilled in one step, the earlier ones waiting for the later ones' compute."""
    firsts = sorted(r.sent_s + r.ttft_s for r in results if not r.error and r.ttft_s is not None)
    if not firsts:
        return None
    shared = sum(1 for i, t in enumerate(firsts)
                 if (i and t - firsts[i - 1] < SAME_STEP_S)
                 or (i + 1 < len(firsts) and firsts[i + 1] - t < SAME_STEP_S))
    return round(shared / len(firsts), 3)


def summarize(args: argparse.Namespace, rate: float, stream: Stream, results: list[Result],
              clock: dict[str, float]) -> dict[str, Any]:
    start = clock["start"]
    ok = [r for r in results if not r.error]
    errors: dict[str, dict[str, Any]] = {}
    for r in results:
        if r.error:
            kind = errors.setdefault(r.error, {"count": 0, "first_message": r.error_message})
            kind["count"] += 1
    firsts = sorted(r.sent_s for r in results if r.turn == 0)
    span = firsts[-1] - firsts[0] if firsts else 0.0
    wall_s = max((r.sent_s + (r.e2e_s or 0) for r in results), default=start) - start
    out_tokens = sum(r.output_tokens for r in ok)
    good = None
    if args.slo_ttft_ms or args.slo_tpot_ms:
        good = sum(1 for r in ok
                   if (not args.slo_ttft_ms or (r.ttft_s is not None
                                                and r.ttft_s * 1e3 <= args.slo_ttft_ms))
                   and (not args.slo_tpot_ms or r.tpot_s is None
                        or r.tpot_s * 1e3 <= args.slo_tpot_ms))
    lag = [r.sent_s - r.scheduled_s for r in results if r.turn == 0]
    prompt_tokens = [r.prompt_tokens for r in ok if r.prompt_tokens is not None]
    return {
        "rate": "inf" if math.isinf(rate) else rate,
        "arrivals": len(stream.sessions),
        "requests_planned": sum(len(s.turns) for s in stream.sessions),
        "requests_sent": len(results),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": errors,
        "wall_s": round(wall_s, 3),
        "achieved_rate_rps": round((len(firsts) - 1) / span, 3) if span > 0 else None,
        "request_throughput_rps": round(len(ok) / wall_s, 3) if wall_s > 0 else None,
        "output_throughput_tok_s": round(out_tokens / wall_s, 1) if wall_s > 0 else None,
        "goodput_rps": None if good is None else round(good / wall_s, 3) if wall_s > 0 else 0.0,
        "slo_met": good,
        "output_tokens": out_tokens,
        "output_tokens_expected": sum(r.output_len for r in ok),
        "prompt_len_drawn": sum(r.prompt_len for r in ok),
        "prompt_tokens": sum(prompt_tokens) if prompt_tokens else None,
        "tokens_from": sorted({r.tokens_from for r in ok}),
        "tokens_per_chunk": round(out_tokens / max(sum(r.chunks for r in ok), 1), 3),
        "max_in_flight": clock["max_in_flight"],
        # near 1: the load generator itself may be what limits (see send_lag_ms too)
        "client_cpu_share": round(clock["client_cpu_s"] / wall_s, 3) if wall_s > 0 else None,
        "send_lag_ms": {"p99": percentiles(lag)["p99"], "max": round(max(lag, default=0) * 1e3, 3)},
        "ttft_ms": percentiles([r.ttft_s for r in ok if r.ttft_s is not None], interval=True),
        "first_token_shared": first_token_shared(ok),
        "tpot_ms": percentiles([r.tpot_s for r in ok if r.tpot_s is not None], interval=True),
        "itl_ms": percentiles([gap for r in ok for gap in r.itl_s]),
        "e2e_ms": percentiles([r.e2e_s for r in ok if r.e2e_s is not None], interval=True),
        # for compare(): each request's (TTFT, TPOT); not written
        "_latencies": [(r.ttft_s, r.tpot_s) for r in ok if r.ttft_s is not None],
    }


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _interval(figures: dict[str, float | None]) -> str:
    """The p99's interval as printed: " (90%: low-high)", high "?" where unbounded."""
    if figures.get("p99_low") is None:
        return ""
    high = figures["p99_high"]
    return (f" ({P99_CONFIDENCE:.0%}: {_ms(figures['p99_low'])}-"
            f"{'?' if high is None else _ms(high)})")


def one_line(label: str, row: dict[str, Any]) -> str:
    rate = row["rate"] if row["rate"] == "inf" else f"{row['rate']:g}"
    goodput = "" if row["goodput_rps"] is None else f", goodput {row['goodput_rps']:.2f} req/s"
    achieved = row["achieved_rate_rps"]
    return (f"[{label}] rate {rate}/s: {row['completed']}/{row['requests_sent']} ok, "
            f"{row['failed']} errors, achieved {'-' if achieved is None else f'{achieved:.2f}'}"
            f"/s | {row['request_throughput_rps'] or 0:.2f} req/s, "
            f"{row['output_throughput_tok_s'] or 0:.1f} out tok/s{goodput} | "
            + " | ".join(f"{name} p50 {_ms(row[key]['p50'])} p99 {_ms(row[key]['p99'])}"
                         f"{_interval(row[key])} ms"
                         for name, key in (("TTFT", "ttft_ms"), ("TPOT", "tpot_ms"),
                                           ("ITL", "itl_ms"), ("e2e", "e2e_ms")))
            + _grouped(row))


# More tokens a message than a router that falls behind groups (--max-stream-interval).
GROUPED_TOKENS = 16


def _grouped(row: dict[str, Any]) -> str:
    """A warning where messages carry many tokens each: ITL is then a message's, not a token's
    (most often a tokenizer that gives the sampled ids no text: bench/vocab_tokenizer.py)."""
    if (row.get("tokens_per_chunk") or 0) <= GROUPED_TOKENS:
        return ""
    return (f" | {row['tokens_per_chunk']:.0f} tokens a message: ITL is per message (ids "
            "without text? bench/vocab_tokenizer.py)")


# What several targets set side by side: (key in the JSON's comparison, name printed, the summary's
# key, its percentile or None).
COMPARED = (("request_throughput_rps", "req/s", "request_throughput_rps", None),
            ("output_throughput_tok_s", "out tok/s", "output_throughput_tok_s", None),
            ("goodput_rps", "goodput req/s", "goodput_rps", None),
            *((f"{key[:-3]}_{q}_ms", f"{key[:-3].upper()} {q} ms", key, q)
              for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms") for q in ("p50", "p99")))


def goodput_at(run: dict[str, Any], ttft_ms: float | None, tpot_ms: float | None) -> float | None:
    """Requests/s of ``run`` that met both limits (a request without a TPOT: its TTFT alone)."""
    if ttft_ms is None or tpot_ms is None or not run["completed"]:
        return None
    met = sum(1 for ttft_s, tpot_s in run["_latencies"]
              if ttft_s * 1e3 <= ttft_ms and (tpot_s is None or tpot_s * 1e3 <= tpot_ms))
    # the share that met them of what was served: the same wall time as the throughput's
    return round((run["request_throughput_rps"] or 0) * met / run["completed"], 3)


def compare(targets: list[dict[str, Any]]) -> dict[str, Any]:
    """Each rate's figures side by side, and first / other for each metric; printed as a
    table. Besides COMPARED, every target's goodput with each target's own TTFT and TPOT p99 as
    the limits (`goodput_at_<label>_p99_rps`: a peer's p99 as the SLO)."""
    labels = [t["label"] for t in targets]
    rates = []
    for k, first in enumerate(targets[0]["runs"]):
        runs = {t["label"]: t["runs"][k] for t in targets}
        printed = {name: shown for name, shown, _, _ in COMPARED}
        metrics = {name: {label: (run[key] if q is None else run[key][q])
                          for label, run in runs.items()} for name, _, key, q in COMPARED}
        for limits in labels:
            name = f"goodput_at_{limits}_p99_rps"
            printed[name] = f"good@{limits} p99"
            ttft_ms, tpot_ms = runs[limits]["ttft_ms"]["p99"], runs[limits]["tpot_ms"]["p99"]
            metrics[name] = {label: goodput_at(run, ttft_ms, tpot_ms)
                             for label, run in runs.items()}
        intervals = {f"{key[:-3]}_p99_interval_ms": {
            label: [run[key].get("p99_low"), run[key].get("p99_high")]
            for label, run in runs.items()} for key in ("ttft_ms", "tpot_ms")}
        ratios = {label: {name: (round(values[labels[0]] / values[label], 3)
                                 if values[labels[0]] is not None and values[label] else None)
                          for name, values in metrics.items()} for label in labels[1:]}
        rates.append({"rate": first["rate"], "metrics": metrics, "ratios": ratios,
                      "p99_intervals": intervals})
        heads = labels + [f"{labels[0]}/{label}" for label in labels[1:]]
        width = max(len(h) for h in heads) + 2
        title = f"rate {first['rate']}/s"
        print(f"\n{title:<18}" + "".join(f"{h:>{width}}" for h in heads))
        for name, values in metrics.items():
            cells = [_ms(values[label]) for label in labels]
            cells += ["-" if ratios[label][name] is None else f"{ratios[label][name]:.3f}"
                      for label in labels[1:]]
            print(f"{printed[name]:<18}" + "".join(f"{c:>{width}}" for c in cells))
        for name, values in intervals.items():   # where the p99s may lie: overlapping, a tie
            cells = ["-" if low is None else f"{_ms(low)}-{'?' if high is None else _ms(high)}"
                     for low, high in values.values()]
            shown = f"{name.split('_')[0].upper()} p99 {P99_CONFIDENCE:.0%}"
            print(f"{shown:<18}" + "".join(f"{c:>{width}}" for c in cells))
    return {"baseline": labels[0], "rates": rates}


def table(targets: list[dict[str, Any]]) -> None:
    heads = ("target", "rate", "ok", "err", "req/s", "tok/s", "good/s", "TTFT50", "TTFT99",
             "TPOT50", "TPOT99", "ITL50", "ITL99", "e2e50", "e2e99")
    width = max(len(t["label"]) for t in targets) + 2
    print(f"\n{heads[0]:<{width}}" + "".join(f"{h:>10}" for h in heads[1:]))
    for target in targets:
        for row in target["runs"]:
            cells = [row["rate"], row["completed"], row["failed"],
                     _ms(row["request_throughput_rps"]), _ms(row["output_throughput_tok_s"]),
                     _ms(row["goodput_rps"]),
                     *(_ms(row[key][q]) for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms")
                       for q in ("p50", "p99"))]
            print(f"{target['label']:<{width}}" + "".join(f"{c:>10}" for c in cells))


async def bench_target(args: argparse.Namespace, target: dict[str, Any],
                       id_range: int) -> dict[str, Any]:
    """The warm-up, then every rate of the sweep, against one target."""
    http = target["api"] == "http"
    client = HttpClient(target["address"], args.endpoint, args) if http \
        else GrpcClient(target["address"], args)
    text = args.workload == "multi-turn" or (http and args.endpoint == "chat")
    async with client:
        row: dict[str, Any] = {"label": target["label"], "api": target["api"],
                               "address": target["address"], "model": client.model,
                               "endpoint": args.endpoint if http else None, "runs": []}
        if args.warmup_requests:
            warm = draw_stream(args, "warmup", id_range, count=args.warmup_requests)
            for session in warm.sessions:
                del session.turns[1:]
            results, _ = await run_stream(client, warm, text, args.max_concurrency)
            failed = [r for r in results if r.error]
            row["warmup"] = {"requests": len(results), "failed": len(failed)}
            if failed:
                print(f"[{target['label']}] warm-up: {len(failed)} of {len(results)} failed: "
                      f"{failed[0].error}: {failed[0].error_message}", file=sys.stderr)
        for k, rate in enumerate(args.rates):
            stream = draw_stream(args, f"{rate:g}#{args.rates[:k].count(rate)}", id_range,
                                 rate=rate)
            gc.collect()
            gc.freeze()
            gc.disable()   # a full collection mid-run would show as the server's latency
            try:
                results, clock = await run_stream(client, stream, text, args.max_concurrency)
            finally:
                gc.enable()
                gc.unfreeze()
            summary = summarize(args, rate, stream, results, clock)
            print(one_line(target["label"], summary), flush=True)
            if args.save_requests:
                summary["requests"] = [r.record(clock["start"]) for r in
                                       sorted(results, key=lambda r: (r.session, r.turn))]
            row["runs"].append(summary)
    return row


async def bench_targets(args: argparse.Namespace, targets: list[dict[str, Any]],
                        id_range: int) -> list[dict[str, Any]]:
    """Each target in turn, on one event loop."""
    return [await bench_target(args, target, id_range) for target in targets]


# --- the command --------------------------------------------------------------------------------

class _AddTarget(argparse.Action):
    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 value: Any, option: str | None = None) -> None:
        namespace.targets = [*(namespace.targets or []), {
            "api": "grpc" if option == "--grpc" else "http", "address": value, "label": ""}]


class _Label(argparse.Action):
    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 value: Any, option: str | None = None) -> None:
        if not namespace.targets:
            parser.error("--label names the --base-url or --grpc given before it")
        namespace.targets[-1]["label"] = value


def _parsed(parser: argparse.ArgumentParser, flag: str, parse: Any, spec: str) -> Any:
    try:
        return parse(spec)
    except ValueError as e:
        parser.error(f"{flag} {spec}: {e}")


def _rates(spec: str) -> list[float]:
    rates = [float(part) for part in spec.split(",")]
    if not rates or any(not r > 0 for r in rates):
        raise ValueError("each rate must be above 0 (inf: all at once)")
    return rates


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.set_defaults(targets=None)
    target = parser.add_argument_group("targets")
    target.add_argument("--base-url", action=_AddTarget, metavar="URL",
                        help="an OpenAI-compatible server (http://host:port), or `up`; repeat "
                             "to compare; URL,URL,...: copies of one server, sent to in turn")
    target.add_argument("--grpc", action=_AddTarget, metavar="HOST:PORT",
                        help="pdserve's gRPC API, or `up`; repeat to compare")
    target.add_argument("--label", action=_Label, help="name of the target given before it")
    target.add_argument("--endpoint", default="completions", choices=("completions", "chat"),
                        help="the HTTP endpoint (chat: text prompts)")
    target.add_argument("--model", default="tiny", help="model folder or preset for `up`")
    target.add_argument("--up-args", default="", help="more flags for pdserve up (one flag "
                        "alone: --up-args=--prefill-on-decode)")
    target.add_argument("--model-name", default="", help="the `model` of HTTP bodies (default: "
                        "the first of the server's /v1/models)")
    target.add_argument("--api-key", default="", help="sent as a bearer token over HTTP")
    target.add_argument("--extra-body", type=json.loads, default={}, metavar="JSON",
                        help="fields added to every HTTP body")
    target.add_argument("--max-connections", type=int, default=0,
                        help="HTTP connections at most (0: unbounded)")
    target.add_argument("--grpc-channels", type=int, default=4)
    target.add_argument("--request-timeout-s", type=float, default=3600,
                        help="a request's limit (0: none)")
    traffic = parser.add_argument_group("traffic")
    traffic.add_argument("--arrival", default="poisson", choices=("poisson", "constant", "burst"))
    traffic.add_argument("--rates", default="2,4,8", help="requests/s, comma-separated, one run "
                         "each (inf: all at once)")
    traffic.add_argument("--burst-size", type=int, default=8, help="arrivals per burst")
    traffic.add_argument("--duration-s", type=float, default=60.0, help="arrivals per rate: "
                         "those of this many seconds")
    traffic.add_argument("--num-requests", type=int, default=None, help="arrivals per rate: "
                         "this many (instead of --duration-s)")
    traffic.add_argument("--max-concurrency", type=int, default=0, help="requests in flight at "
                         "most, the others wait at the client (0: no limit)")
    traffic.add_argument("--warmup-requests", type=int, default=0,
                         help="requests sent at once before each target's sweep, not counted")
    traffic.add_argument("--seed", type=int, default=0)
    work = parser.add_argument_group("workload")
    work.add_argument("--workload", default="random",
                      choices=("random", "shared-prefix", "multi-turn"))
    work.add_argument("--prompt-len", default="uniform:256:1024",
                      help="prompt (user part) length distribution")
    work.add_argument("--output-len", default="uniform:64:256")
    work.add_argument("--num-prefixes", type=int, default=8, help="shared-prefix: system prompts")
    work.add_argument("--prefix-len", type=int, default=1024, help="shared-prefix: their length")
    work.add_argument("--prefix-fraction", type=float, default=0.9,
                      help="shared-prefix: the share of requests that start with one")
    work.add_argument("--turns", default="uniform:2:4", help="multi-turn: turns per conversation")
    work.add_argument("--think-time-s", default="exponential:1",
                      help="multi-turn: seconds from a reply to the next turn")
    work.add_argument("--max-token-id", type=int, default=10000,
                      help="prompt token ids are drawn below this (and the vocabulary's size)")
    work.add_argument("--temperature", type=float, default=0.0)
    work.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True)
    work.add_argument("--stream-usage", action=argparse.BooleanOptionalAction, default=True,
                      help="ask HTTP servers for the usage (stream_options include_usage)")
    out = parser.add_argument_group("results")
    out.add_argument("--slo-ttft-ms", type=float, default=0.0, help="goodput's TTFT limit")
    out.add_argument("--slo-tpot-ms", type=float, default=0.0, help="goodput's TPOT limit")
    out.add_argument("--out", default="bench/results/serving.json")
    out.add_argument("--save-requests", action="store_true",
                     help="every request's record in the JSON")
    out.add_argument("--compare", action="append", default=[], metavar="JSON",
                     help="send nothing: set the targets of earlier runs' JSON (saved with "
                          "--save-requests, the same rates) side by side, goodput under "
                          "--slo-ttft-ms/--slo-tpot-ms recounted from their requests; repeat")
    args = parser.parse_args(argv)
    args.rates = _parsed(parser, "--rates", _rates, args.rates)
    for flag in ("prompt_len", "output_len", "turns", "think_time_s"):
        setattr(args, flag, _parsed(parser, f"--{flag.replace('_', '-')}", Dist.parse,
                                    getattr(args, flag)))
    if args.num_requests is not None and args.num_requests < 1:
        parser.error("--num-requests must be at least 1")
    if args.num_requests is None and math.isinf(max(args.rates)):
        parser.error("a rate of inf needs --num-requests")
    if min(args.burst_size, args.grpc_channels, args.max_token_id) < 1 \
            or min(args.max_connections, args.max_concurrency, args.warmup_requests) < 0:
        parser.error("--burst-size, --grpc-channels and --max-token-id must be at least 1; "
                     "--max-connections, --max-concurrency, --warmup-requests at least 0")
    if not isinstance(args.extra_body, dict):
        parser.error("--extra-body must be a JSON object")
    if args.workload == "shared-prefix" and (args.num_prefixes < 1 or args.prefix_len < 1):
        parser.error("shared-prefix needs --num-prefixes and --prefix-len of at least 1")
    if not 0 <= args.prefix_fraction <= 1:
        parser.error("--prefix-fraction must be in [0, 1]")
    args.targets = args.targets or [{"api": "http", "address": "up", "label": ""}]
    return args


def vocab_size(address: str) -> int:
    import grpc

    from protos.pdserve.v1 import generate_pb2, generate_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        stub = generate_pb2_grpc.GenerationServiceStub(channel)
        return stub.GetModelInfo(generate_pb2.GetModelInfoRequest(), timeout=60).vocab_size


def name_targets(targets: list[dict[str, Any]]) -> None:
    ups = [t for t in targets if t["address"] == "up"]
    for t in targets:
        if not t["label"]:
            t["label"] = (f"pdserve-{t['api']}" if len(ups) > 1 else "pdserve") \
                if t in ups else t["address"]
    seen: dict[str, int] = {}
    for t in targets:
        seen[t["label"]] = seen.get(t["label"], 0) + 1
        if seen[t["label"]] > 1:
            t["label"] += f"#{seen[t['label']]}"


def saved_targets(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The targets of the --compare files, each run's goodput recounted under this command's
    SLOs from its saved requests (a target's own p99s need them too)."""
    targets: list[dict[str, Any]] = []
    for path in args.compare:
        try:
            saved = json.loads(Path(path).read_text())["targets"]
        except (OSError, ValueError, KeyError) as e:
            raise SystemExit(f"bench/serving.py: --compare {path}: {e!r}") from None
        for target in saved:
            for run in target["runs"]:
                if "requests" not in run:
                    raise SystemExit(f"bench/serving.py: --compare {path}: target "
                                     f"{target['label']!r} was run without --save-requests")
                run["_latencies"] = [(r["ttft_s"], r["tpot_s"]) for r in run["requests"]
                                     if r["error"] is None and r["ttft_s"] is not None]
                for key, name in (("ttft_ms", "ttft_s"), ("tpot_ms", "tpot_s")):
                    # files written before the intervals: the same figures, with them
                    run[key] = percentiles([r[name] for r in run["requests"] if r["error"] is
                                            None and r[name] is not None], interval=True)
                slo = (args.slo_ttft_ms or math.inf, args.slo_tpot_ms or math.inf)
                run["goodput_rps"] = (goodput_at(run, *slo)
                                      if args.slo_ttft_ms or args.slo_tpot_ms else None)
            targets.append(target)
    rates = [[run["rate"] for run in t["runs"]] for t in targets]
    if any(r != rates[0] for r in rates):
        raise SystemExit(f"bench/serving.py: --compare: the targets ran different rates {rates}")
    name_targets(targets)
    return targets


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.compare:
        rows = saved_targets(args)
        table(rows)
        write(args.out, {"compare": args.compare, "slo_ttft_ms": args.slo_ttft_ms,
                         "slo_tpot_ms": args.slo_tpot_ms}, rows)
        return
    targets = args.targets
    name_targets(targets)
    process = None
    try:
        if any(t["address"] == "up" for t in targets):
            from common import start_up

            process, router, metrics = start_up(["--model", args.model,
                                                 *shlex.split(args.up_args)])
            for t in targets:
                if t["address"] == "up":
                    t["address"] = metrics["http"] if t["api"] == "http" else router
                    t["up"] = True
        # Ids the vocabulary has, from the targets that tell it: one stream for all.
        known = [vocab_size(router if t["api"] == "http" else t["address"])
                 for t in targets if t["api"] == "grpc" or t.get("up")]
        id_range = min([args.max_token_id, *known])
        rows = asyncio.run(bench_targets(args, targets, id_range))
    finally:
        if process is not None:
            process.send_signal(signal.SIGTERM)
            process.wait(120)
    table(rows)
    config = {k: (str(v) if isinstance(v, Dist) else v) for k, v in vars(args).items()
              if k not in ("targets", "base_url", "grpc", "label")}
    config["rates"] = ["inf" if math.isinf(r) else r for r in args.rates]
    config["token_id_range"] = id_range
    write(args.out, config, rows)


def write(path: str, config: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    """The JSON: the config, the targets and, with several, their comparison."""
    result = {"config": config, "targets": rows}
    if len(rows) > 1:
        result["comparison"] = compare(rows)
    for row in rows:
        for run in row["runs"]:
            del run["_latencies"]
    from common import write_results

    write_results(path, "serving", result)


if __name__ == "__main__":
    main()
