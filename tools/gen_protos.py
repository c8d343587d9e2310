"""Generate fedpipe/proto/*_pb2(_grpc).py from protos/fedpipe/v1/*.proto.

Usage: python tools/gen_protos.py [OUT_DIR]   (default: fedpipe/proto)

grpc_tools writes ``from fedpipe.v1 import x_pb2``; the files live in the
package ``fedpipe.proto``, so those imports are rewritten to relative ones.
``tests/test_protos.py`` regenerates into a temporary folder and fails when the
committed files differ.
"""
from __future__ import annotations

import pathlib
import re
import sys
import tempfile

from grpc_tools import protoc
import grpc_tools

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"
SOURCES = sorted((PROTO_ROOT / "fedpipe" / "v1").glob("*.proto"))


def generate(out_dir: pathlib.Path) -> list[pathlib.Path]:
    """Write the generated modules into ``out_dir``; return their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    include = pathlib.Path(grpc_tools.__file__).parent / "_proto"
    with tempfile.TemporaryDirectory() as tmp:
        args = ["protoc", f"-I{PROTO_ROOT}", f"-I{include}", f"--python_out={tmp}",
                f"--pyi_out={tmp}", f"--grpc_python_out={tmp}"]
        args += [str(p.relative_to(PROTO_ROOT)) for p in SOURCES]
        if protoc.main(args) != 0:
            raise SystemExit("protoc failed")
        written = []
        for path in sorted((pathlib.Path(tmp) / "fedpipe" / "v1").iterdir()):
            text = path.read_text()
            text = re.sub(r"^from fedpipe\.v1 import ", "from . import ", text, flags=re.M)
            target = out_dir / path.name
            target.write_text(text)
            written.append(target)
    return written


if __name__ == "__main__":
    out = pathlib.Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "fedpipe" / "proto"
    for p in generate(out):
        print(p.relative_to(ROOT) if p.is_relative_to(ROOT) else p)
