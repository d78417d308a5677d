"""Generate Python stubs for proto/meshrl/v1/*.proto into a package directory.

protoc writes `from meshrl.v1 import x_pb2`; we rewrite those imports so the stubs live under
`services.common.contracts` and need no sys.path changes.
"""

from __future__ import annotations

import argparse
import pathlib
import re
import sys

from grpc_tools import protoc

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"
PACKAGE = "services.common.contracts"
DEFAULT_OUT = ROOT / "services" / "common" / "contracts"


def generate(out_dir: pathlib.Path) -> list[pathlib.Path]:
    protos = sorted(str(p.relative_to(PROTO_ROOT)) for p in PROTO_ROOT.rglob("*.proto"))
    include = pathlib.Path(protoc.__file__).parent / "_proto"
    out_dir.mkdir(parents=True, exist_ok=True)
    args = ["protoc", f"-I{PROTO_ROOT}", f"-I{include}", f"--python_out={out_dir}", f"--pyi_out={out_dir}",
            f"--grpc_python_out={out_dir}", *protos]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    written = []
    for path in sorted(out_dir.rglob("*.py*")):
        if path.suffix not in (".py", ".pyi"):
            continue
        text = re.sub(r"^from meshrl\.v1 import", f"from {PACKAGE}.meshrl.v1 import", path.read_text(), flags=re.M)
        path.write_text(text)
        written.append(path)
    for pkg in {out_dir / "meshrl", out_dir / "meshrl" / "v1"}:
        (pkg / "__init__.py").touch()
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=pathlib.Path, default=DEFAULT_OUT)
    ns = parser.parse_args()
    files = generate(ns.out)
    print(f"generated {len(files)} files into {ns.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
