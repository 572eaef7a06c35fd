#!/usr/bin/env python
"""Regenerate (or check) the Python modules of torchheal's wire protocol.

The generated ``*_pb2.py`` and ``*_pb2_grpc.py`` modules are committed so that installing
torchheal never needs protoc. Run this after editing ``torchheal/_wire/torchft.proto`` (the
reference's protocol) or ``torchheal/_wire/session.proto`` (torchheal's own)::

    python scripts/gen_proto.py          # rewrite the committed modules
    python scripts/gen_proto.py --check  # exit 1 if they are stale

It needs ``grpcio-tools`` (a test dependency). Output depends on the grpcio-tools version (it
embeds the protobuf and grpc versions it was made with), so regenerate with the version pinned
in the test extras when in doubt.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
WIRE_DIR = Path("torchheal") / "_wire"
PROTOS = (WIRE_DIR / "torchft.proto", WIRE_DIR / "session.proto")
GENERATED = ("torchft_pb2.py", "torchft_pb2_grpc.py", "session_pb2.py", "session_pb2_grpc.py")


def generate(out_dir: Path) -> list[Path]:
    """Run protoc on the committed .proto, writing the modules under ``out_dir``.

    The include root is the repository root, so the generated grpc module imports
    ``torchheal._wire.torchft_pb2`` by its absolute name and needs no post-processing.

    Args:
        out_dir: directory that receives ``torchheal/_wire/<generated files>``.

    Returns:
        The paths of the generated files, in ``GENERATED`` order.

    Raises:
        RuntimeError: protoc failed.
    """
    # Imported here so that --help works without grpcio-tools installed.
    import grpc_tools
    from grpc_tools import protoc

    well_known = Path(grpc_tools.__file__).parent / "_proto"
    (out_dir / WIRE_DIR).mkdir(parents=True, exist_ok=True)
    args = [
        "grpc_tools.protoc",
        f"-I{REPO}",
        f"-I{well_known}",
        f"--python_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *(str(REPO / proto) for proto in PROTOS),
    ]
    rc = protoc.main(args)
    if rc != 0:
        raise RuntimeError(f"protoc failed with exit code {rc}")
    return [out_dir / WIRE_DIR / name for name in GENERATED]


def stale_files(committed_dir: Path | None = None) -> list[str]:
    """Return the names of committed generated modules that differ from a fresh generation.

    Args:
        committed_dir: directory holding the committed modules (default: ``torchheal/_wire``).

    Returns:
        Names of missing or differing files; empty when everything is up to date.
    """
    committed_dir = committed_dir or REPO / WIRE_DIR
    with tempfile.TemporaryDirectory() as tmp:
        fresh = generate(Path(tmp))
        stale = []
        for path in fresh:
            committed = committed_dir / path.name
            if not committed.exists() or committed.read_bytes() != path.read_bytes():
                stale.append(path.name)
        return stale


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point.

    Args:
        argv: arguments (default: ``sys.argv[1:]``).

    Returns:
        Process exit code: 0 on success, 1 when ``--check`` finds stale modules.
    """
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--check",
        action="store_true",
        help="do not write anything; exit 1 if the committed modules are stale",
    )
    args = parser.parse_args(argv)
    if args.check:
        stale = stale_files()
        if stale:
            print(
                f"stale generated modules: {', '.join(stale)}; run python scripts/gen_proto.py",
                file=sys.stderr,
            )
            return 1
        print("generated modules are up to date")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        for path in generate(Path(tmp)):
            shutil.copyfile(path, REPO / WIRE_DIR / path.name)
            print(f"wrote {WIRE_DIR / path.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
