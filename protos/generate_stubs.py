"""Generates the Python stubs for every .proto under protos/ (the only way they are made).

Usage (from the repository root):
    python -m protos.generate_stubs          # rewrite the stubs in place
    python -m protos.generate_stubs --check  # exit 1 if the committed stubs are stale

Stubs are generated with grpcio-tools 1.84.x: generated ``*_pb2_grpc.py`` refuses to import
under a grpcio older than the grpcio-tools that made it, and 1.84 is the oldest grpcio we
support (the GPU machine's).
"""
from __future__ import annotations

import argparse
import filecmp
import shutil
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = REPO_ROOT / "protos" / "pdserve" / "v1"
REQUIRED_TOOLS_SERIES = "1.84."


def proto_files() -> list[Path]:
    return sorted(PROTO_DIR.glob("*.proto"))


def generate(out_root: Path) -> list[Path]:
    """Writes stubs for all protos under ``out_root`` (mirroring protos/...); returns them."""
    import grpc_tools
    from grpc_tools import protoc

    version = getattr(grpc_tools, "__version__", None)
    if version is None:
        from importlib.metadata import version as dist_version

        version = dist_version("grpcio-tools")
    if not version.startswith(REQUIRED_TOOLS_SERIES):
        raise SystemExit(f"grpcio-tools {REQUIRED_TOOLS_SERIES}x required, found {version}")
    include = Path(grpc_tools.__file__).parent / "_proto"
    rel = [str(p.relative_to(REPO_ROOT)) for p in proto_files()]
    args = ["protoc", f"-I{REPO_ROOT}", f"-I{include}", f"--python_out={out_root}",
            f"--pyi_out={out_root}", f"--grpc_python_out={out_root}", *rel]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    return sorted((out_root / "protos" / "pdserve" / "v1").glob("*_pb2*.py*"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if the stubs are stale")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        fresh = generate(Path(tmp))
        committed = sorted(PROTO_DIR.glob("*_pb2*.py*"))
        if args.check:
            names = {p.name for p in fresh}
            stale = [p.name for p in fresh if not (PROTO_DIR / p.name).exists()
                     or not filecmp.cmp(p, PROTO_DIR / p.name, shallow=False)]
            stale += [p.name for p in committed if p.name not in names]
            if stale:
                print("stale generated stubs: " + ", ".join(stale)
                      + "\nrun: python -m protos.generate_stubs", file=sys.stderr)
                return 1
            print("generated stubs are up to date")
            return 0
        for old in committed:
            old.unlink()
        for path in fresh:
            shutil.copy(path, PROTO_DIR / path.name)
        print(f"wrote {len(fresh)} files to {PROTO_DIR.relative_to(REPO_ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
