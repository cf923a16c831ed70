"""Regenerate the Python stubs in core/src/rollstream/v1 from proto/rollstream/v1/*.proto.

    python scripts/gen_protos.py            # write the stubs
    python scripts/gen_protos.py --check    # exit 1 if the committed stubs are stale

tests/unit/test_protos.py runs the check, so a .proto edit without regenerating fails CI.
"""

from __future__ import annotations

import argparse
import filecmp
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROTO_ROOT = ROOT / "proto"
STUB_ROOT = ROOT / "core" / "src"
STUB_DIR = STUB_ROOT / "rollstream" / "v1"


def generate(out_root: Path) -> list[Path]:
    """Run protoc (from grpcio-tools) over every .proto; return the generated files."""
    import grpc_tools
    from grpc_tools import protoc  # dev dependency: only needed to regenerate

    protos = sorted(PROTO_ROOT.glob("rollstream/v1/*.proto"))
    include = Path(grpc_tools.__file__).parent / "_proto"
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={out_root}",
        f"--pyi_out={out_root}",
        f"--grpc_python_out={out_root}",
        *[str(p.relative_to(PROTO_ROOT)) for p in protos],
    ]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed: " + " ".join(args))
    out_dir = out_root / "rollstream" / "v1"
    # Stubs import each other as `rollstream.v1.x_pb2`; `rollstream` is a namespace package
    # shared by core and the services, so the only __init__.py belongs to `v1`.
    (out_dir / "__init__.py").write_text(
        '"""Generated from proto/rollstream/v1 by scripts/gen_protos.py; do not edit."""\n'
    )
    return sorted(out_dir.iterdir())


def stale_files() -> list[str]:
    """Names of stubs that differ from a fresh generation (or are missing / extra)."""
    with tempfile.TemporaryDirectory() as tmp:
        fresh = {p.name: p for p in generate(Path(tmp)) if p.is_file()}
        have = {p.name: p for p in STUB_DIR.glob("*") if p.is_file() and p.suffix in {".py", ".pyi"}}
        names = sorted(set(fresh) | set(have))
        return [
            n for n in names if n not in fresh or n not in have or not filecmp.cmp(fresh[n], have[n], shallow=False)
        ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="only check that the stubs are current")
    args = parser.parse_args()
    if args.check:
        stale = stale_files()
        if stale:
            print("stale stubs (run python scripts/gen_protos.py):", ", ".join(stale))
            return 1
        print("stubs are current")
        return 0
    STUB_DIR.mkdir(parents=True, exist_ok=True)
    for p in STUB_DIR.glob("*_pb2*.py*"):
        p.unlink()
    files = generate(STUB_ROOT)
    print("\n".join(str(p.relative_to(ROOT)) for p in files))
    return 0


if __name__ == "__main__":
    sys.exit(main())
