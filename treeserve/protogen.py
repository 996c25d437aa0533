"""Generate the Python stubs of `protos/` into the importable package `treeserve.v1`.

`python -m treeserve.protogen` rewrites the committed stubs; `generate(out_dir)` writes them
elsewhere (the freshness test compares the two).
"""
from __future__ import annotations

import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "protos"
PROTOS = sorted(p.relative_to(PROTO_DIR).as_posix() for p in PROTO_DIR.rglob("*.proto"))


def generate(out_dir: pathlib.Path) -> None:
    from grpc_tools import protoc
    import grpc_tools

    include = pathlib.Path(grpc_tools.__file__).parent / "_proto"
    args = [
        "protoc",
        f"-I{PROTO_DIR}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *PROTOS,
    ]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed on " + " ".join(PROTOS))


if __name__ == "__main__":
    generate(ROOT)
    sys.exit(0)
