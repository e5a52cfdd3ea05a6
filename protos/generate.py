"""Regenerate the Python code for the wire contract.

    python -m protos.generate          # rewrite protos/*_pb2*.py(i) from protos/*.proto
    python -m protos.generate --check  # exit 1 if the committed code is stale

Generated files are never edited by hand. The output depends on the exact
grpcio-tools version (it stamps it into the files), which pyproject.toml pins.
"""

from __future__ import annotations

import argparse
import filecmp
import pathlib
import shutil
import subprocess
import sys
import tempfile

PROTO_DIR = pathlib.Path(__file__).resolve().parent
ROOT = PROTO_DIR.parent
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def proto_files() -> list[pathlib.Path]:
    return sorted(PROTO_DIR.glob("*.proto"))


def generate(out_dir: pathlib.Path) -> list[pathlib.Path]:
    """Run protoc (from grpcio-tools) on every .proto into out_dir/protos/.

    protoc runs in its own interpreter: in-process it shares protobuf's native
    symbols with whatever else is loaded (TensorFlow, say) and can crash.
    """
    (out_dir / "protos").mkdir(parents=True, exist_ok=True)
    rels = [str(p.relative_to(ROOT)) for p in proto_files()]
    args = [
        sys.executable,
        "-m",
        "grpc_tools.protoc",
        f"-I{ROOT}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *rels,
    ]
    run = subprocess.run(args, capture_output=True, text=True)
    if run.returncode != 0:
        raise SystemExit(f"protoc failed on {rels}: {run.stderr.strip()}")
    return sorted(
        p for p in (out_dir / "protos").iterdir() if p.name.endswith(GENERATED_SUFFIXES)
    )


def stale_files() -> list[str]:
    """Names of generated files that differ from what protoc produces now."""
    with tempfile.TemporaryDirectory() as tmp:
        fresh = generate(pathlib.Path(tmp))
        stale = []
        for f in fresh:
            committed = PROTO_DIR / f.name
            if not committed.exists() or not filecmp.cmp(f, committed, shallow=False):
                stale.append(f.name)
        committed = {p.name for p in PROTO_DIR.iterdir() if p.name.endswith(GENERATED_SUFFIXES)}
        stale += sorted(committed - {f.name for f in fresh})
        return stale


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m protos.generate", description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if the committed generated code is stale")
    args = parser.parse_args(argv)
    if args.check:
        stale = stale_files()
        if stale:
            print(f"stale generated code: {', '.join(stale)}; run: python -m protos.generate", file=sys.stderr)
            return 1
        print("generated code is fresh")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        for f in generate(pathlib.Path(tmp)):
            shutil.copyfile(f, PROTO_DIR / f.name)
            print(f"wrote protos/{f.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
