"""Generate rollout_pb2.py from the repository's proto/rollstream/v1/rollout.proto.

    pip install -r requirements.txt
    python generate_stubs.py [--proto-dir ../../proto] [--out generated]

rollout.proto imports nothing, so it compiles on its own into one flat module,
`rollout_pb2`. Its messages keep their full names (rollstream.v1.RolloutGroup, ...),
which is what the `type` field of every stream entry carries.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def generate(proto_dir: Path, out: Path) -> Path:
    from grpc_tools import protoc

    source = proto_dir / "rollstream" / "v1"
    out.mkdir(parents=True, exist_ok=True)
    code = protoc.main(["protoc", f"-I{source}", f"--python_out={out}", str(source / "rollout.proto")])
    if code != 0:
        raise RuntimeError(f"protoc failed ({code}) on {source / 'rollout.proto'}")
    return out / "rollout_pb2.py"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--proto-dir", type=Path, default=HERE.parents[1] / "proto")
    parser.add_argument("--out", type=Path, default=HERE / "generated")
    args = parser.parse_args()
    print(generate(args.proto_dir, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
