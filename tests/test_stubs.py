"""Generated stubs are fresh, and import under the oldest supported grpcio."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from protos.pdserve.v1 import generate_pb2

ROOT = Path(__file__).resolve().parent.parent


def test_generated_stubs_are_not_stale():
    pytest.importorskip("grpc_tools", reason="the generator (grpcio-tools, the test extra)")
    result = subprocess.run([sys.executable, "-m", "protos.generate_stubs", "--check"], cwd=ROOT,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_stubs_need_no_newer_grpcio_than_1_84():
    for path in (ROOT / "protos" / "pdserve" / "v1").glob("*_pb2_grpc.py"):
        assert "GRPC_GENERATED_VERSION = '1.84.0'" in path.read_text(), path.name
    assert tuple(int(x) for x in grpc.__version__.split(".")[:2]) >= (1, 84)


def test_public_api_is_the_documented_one():
    service = generate_pb2.DESCRIPTOR.services_by_name["GenerationService"]
    assert service.full_name == "pdserve.v1.GenerationService"
    assert [m.name for m in service.methods] == ["Generate", "GetModelInfo"]
    fields = generate_pb2.SamplingParams.DESCRIPTOR.fields_by_name
    assert [(f.name, f.number) for f in generate_pb2.SamplingParams.DESCRIPTOR.fields] == [
        ("max_new_tokens", 1), ("temperature", 2), ("top_p", 3), ("top_k", 4), ("min_p", 5),
        ("repetition_penalty", 6), ("seed", 7), ("stop", 8), ("stop_token_ids", 9),
        ("ignore_eos", 10)]
    assert fields["seed"].has_presence
