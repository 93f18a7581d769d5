"""`pdserve generate`: a small streaming client of the public API."""
from __future__ import annotations

import argparse
import sys

import grpc

from protos.pdserve.v1 import generate_pb2, generate_pb2_grpc


def generate_to_terminal(args: argparse.Namespace) -> int:
    sampling = generate_pb2.SamplingParams(
        max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
        top_k=args.top_k, stop=args.stop)
    if args.seed is not None:
        sampling.seed = args.seed
    request = generate_pb2.GenerateRequest(text=args.text, sampling=sampling, stream=True)
    if args.tls_ca_file:
        with open(args.tls_ca_file, "rb") as ca:
            channel = grpc.secure_channel(args.addr, grpc.ssl_channel_credentials(ca.read()))
    else:
        channel = grpc.insecure_channel(args.addr)
    with channel:
        stub = generate_pb2_grpc.GenerationServiceStub(channel)
        try:
            for response in stub.Generate(request, timeout=args.timeout_s):
                sys.stdout.write(response.text)
                sys.stdout.flush()
                if response.finish_reason:
                    reason = generate_pb2.FinishReason.Name(response.finish_reason)
                    print(f"\n[{reason.removeprefix('FINISH_REASON_').lower()}: "
                          f"{response.usage.prompt_tokens} prompt + "
                          f"{response.usage.completion_tokens} generated tokens]", file=sys.stderr)
        except grpc.RpcError as err:
            print(f"\nerror: {err.code().name}: {err.details()}", file=sys.stderr)
            return 1
    return 0
