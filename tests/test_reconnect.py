"""Channels between pdserve's own processes try a refusing peer again at least every second.

gRPC's default backoff between connection attempts grows from 1 s toward 120 s, so a router
probing a worker that was down for a minute (restarted by `up`, a rescheduled pod) would find it
again only long after it served, and `up` would see a starting worker ready late. Here a real
channel dials a listener that accepts and drops every connection, and the attempts are counted.
"""
from __future__ import annotations

import asyncio
import socket
import threading

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.grpc_util import RECONNECT_OPTIONS, channel

WINDOW_S = 4.0
# Attempts in WINDOW_S: about 8 with RECONNECT_OPTIONS (waits of 0.1, 0.16, 0.26, 0.41, 0.66 s,
# then 1 s each); at most 3 with gRPC's defaults (1 s, then 1.6 s, 2.6 s, ...).
AT_LEAST = 5


class DroppingListener:
    """Accepts TCP connections and closes them at once: every one is a failed connect."""

    def __init__(self) -> None:
        self.socket = socket.create_server(("127.0.0.1", 0))
        self.socket.settimeout(0.1)
        self.address = "127.0.0.1:%d" % self.socket.getsockname()[1]
        self.attempts = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.socket.accept()
            except TimeoutError:
                continue
            self.attempts += 1
            conn.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.socket.close()


def test_a_refusing_peer_is_tried_again_at_least_every_second():
    listeners = {"internal channel": DroppingListener(),   # router -> workers, KV transfer links
                 "launcher's options": DroppingListener()}   # `up` polling a child's health
    channels = {"internal channel": lambda address: channel(address),
                "launcher's options": lambda address: grpc.aio.insecure_channel(
                    address, options=RECONNECT_OPTIONS)}

    async def wait_on(kind: str) -> None:
        ch = channels[kind](listeners[kind].address)
        try:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await health_pb2_grpc.HealthStub(ch).Check(
                    health_pb2.HealthCheckRequest(), timeout=WINDOW_S, wait_for_ready=True)
            assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        finally:
            await ch.close()

    async def both() -> None:
        await asyncio.gather(*(wait_on(kind) for kind in listeners))

    try:
        asyncio.run(both())
    finally:
        for listener in listeners.values():
            listener.close()
    attempts = {kind: listener.attempts for kind, listener in listeners.items()}
    assert min(attempts.values()) >= AT_LEAST, (
        f"connection attempts in {WINDOW_S} s: {attempts}; a channel backs off longer than a "
        "second")
