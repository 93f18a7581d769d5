"""KV hand-off bandwidth and latency per engine, for prompts of llama3-8b's KV shape.

    python bench/transfer.py --tokens 512,2048,8192

`copy_kernel` is what the cuda_ipc engine runs (one Triton launch per transfer, GPU to GPU);
`indexing` is `dst[:, :, d] = src[:, :, s]` for comparison; `peer_copy` (with two GPUs) is what
cuda_ipc runs between pools on two GPUs (gather, peer copy, scatter on the other GPU); `grpc` is the whole grpc engine
(device to host, gRPC stream, host to device, commit) between two pools through a real server.
Bandwidth is payload bytes per second; the device copy limit is measured alongside.
"""
from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import copy_bandwidth_bytes_per_s, cuda_time_ms, write_results  # noqa: E402

from decode_service.reservations import ReservationTable  # noqa: E402
from kv_transfer.base import KVTarget  # noqa: E402
from kv_transfer.copy_kernel import copy_pages  # noqa: E402
from kv_transfer.link import DecodeLinks  # noqa: E402
from kv_transfer.service import KVTransferServicer  # noqa: E402
from pdserve.grpc_util import Server  # noqa: E402
from pdserve.kvcache.pool import KVLayout, KVPool  # noqa: E402
from protos.pdserve.v1 import kv_transfer_pb2_grpc  # noqa: E402

LAYOUT = KVLayout("llama3-8b", "bfloat16", 16, 32, 8, 128)


def _pool(num_pages: int) -> KVPool:
    return KVPool(LAYOUT, num_pages, torch.bfloat16, torch.device("cuda"))


async def _grpc_ms(src: KVPool, dst: KVPool, pages: int, iters: int) -> float:
    table = ReservationTable(dst, max_queued=4, wait_s=5, lease_timeout_s=60,
                             unseen_writes_possible=False)
    server = Server("127.0.0.1", 0)
    server.add(kv_transfer_pb2_grpc.add_KVTransferServiceServicer_to_server,
               KVTransferServicer(dst, table, "grpc"), [])
    await server.start()
    links = DecodeLinks(src, timeout_s=60)
    total = 0.0
    try:
        link = await links.get(f"127.0.0.1:{server.port}")
        for i in range(iters + 1):
            res = await table.reserve(f"r{i}", pages * 16, 1)
            target = KVTarget(f"127.0.0.1:{server.port}", f"r{i}", res.pages[:pages])
            torch.cuda.synchronize()
            started = time.perf_counter()
            await link.send(target, list(range(1, pages + 1)), pages * 16)
            torch.cuda.synchronize()
            if i:  # the first one warms the path up
                total += time.perf_counter() - started
            table.release(f"r{i}")
    finally:
        await links.close()
        await server.stop(0)
    return total / iters * 1e3


def _peer_ms(src: KVPool, pages: int, iters: int = 10) -> float:
    """Pages from ``src`` (cuda:0) into a pool on cuda:1 through cuda_ipc's PeerCopier."""
    from kv_transfer.cuda_ipc_engine import PeerCopier

    dst = torch.zeros(LAYOUT.num_layers, 2, pages + 1, LAYOUT.page_size, LAYOUT.num_kv_heads,
                      LAYOUT.head_dim, dtype=torch.bfloat16, device="cuda:1")
    copier = PeerCopier(torch.cuda.Stream("cuda:0"), src.tensor, dst)
    s = torch.arange(1, pages + 1, device="cuda:0")
    d = torch.arange(1, pages + 1, device="cuda:1")
    total = 0.0
    for i in range(iters + 1):
        torch.cuda.synchronize("cuda:0")
        torch.cuda.synchronize("cuda:1")
        started = time.perf_counter()
        copier.copy(src.tensor, dst, s, d)
        copier.remote_stream.synchronize()
        if i:
            total += time.perf_counter() - started
    assert torch.equal(dst[:, :, 1:].cpu(), src.tensor[:, :, 1:pages + 1].cpu())
    return total / iters * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="512,2048,8192")
    parser.add_argument("--out", default="bench/results/transfer.json")
    args = parser.parse_args()
    limit = copy_bandwidth_bytes_per_s()
    rows = []
    for tokens in [int(t) for t in args.tokens.split(",")]:
        pages = tokens // LAYOUT.page_size
        src, dst = _pool(pages + 1), _pool(2 * pages + 2)
        src.tensor.normal_()
        payload = pages * src.bytes_per_page
        s = torch.arange(1, pages + 1, device="cuda")
        d = torch.arange(pages + 2, 2 * pages + 2, device="cuda")
        kernel_ms = cuda_time_ms(lambda: copy_pages(src.tensor, dst.tensor, s, d))
        assert torch.equal(dst.tensor[:, :, d], src.tensor[:, :, s])

        def indexing() -> None:
            dst.tensor[:, :, d] = src.tensor[:, :, s]

        index_ms = cuda_time_ms(indexing)
        grpc_ms = asyncio.run(_grpc_ms(src, dst, pages, iters=3))
        row = {"tokens": tokens, "payload_bytes": payload}
        timings = [("copy_kernel", kernel_ms), ("indexing", index_ms), ("grpc", grpc_ms)]
        if torch.cuda.device_count() > 1:
            timings.append(("peer_copy", _peer_ms(src, pages)))
        for name, ms in timings:
            row[name] = {"ms": round(ms, 4), "payload_tb_per_s": round(payload / (ms / 1e3) / 1e12, 3)}
        rows.append(row)
        print(f"{tokens:5d} tokens ({payload / 2**20:7.1f} MiB): copy kernel {kernel_ms:7.3f} ms "
              f"({row['copy_kernel']['payload_tb_per_s']} TB/s) | indexing {index_ms:7.3f} ms "
              f"({row['indexing']['payload_tb_per_s']} TB/s) | grpc {grpc_ms:8.2f} ms"
              + (f" | two GPUs {row['peer_copy']['ms']:7.3f} ms "
                 f"({row['peer_copy']['payload_tb_per_s']} TB/s)" if "peer_copy" in row else ""))
    write_results(args.out, "kv_transfer", {"layout": LAYOUT.__dict__,
                                            "device_copy_bytes_per_s": limit, "results": rows})


if __name__ == "__main__":
    main()
