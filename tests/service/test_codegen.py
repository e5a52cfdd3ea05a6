"""The committed generated code matches protos/tfps.proto.

    python -m pytest tests/service/test_codegen.py -q

Rule (STYLE.md, "One wire contract"): "Generated code is never edited by hand;
a check regenerates it and fails on any difference."
"""

import pathlib
import shutil
import subprocess
import sys

import pytest

from protos import generate

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_committed_generated_code_is_fresh():
    proc = subprocess.run(
        [sys.executable, "-m", "protos.generate", "--check"],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 0, f"stale generated code:\n{proc.stdout}{proc.stderr}"


@pytest.fixture
def protos_copy(tmp_path, monkeypatch):
    """A copy of protos/ that generate.py treats as the real one."""
    copy = tmp_path / "protos"
    shutil.copytree(ROOT / "protos", copy, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(generate, "ROOT", tmp_path)
    monkeypatch.setattr(generate, "PROTO_DIR", copy)
    return copy


def test_check_passes_on_an_untouched_copy(protos_copy):
    assert generate.stale_files() == []


@pytest.mark.parametrize("name", ["tfps_pb2.py", "tfps_pb2.pyi", "tfps_pb2_grpc.py"])
def test_check_detects_a_hand_edited_generated_file(protos_copy, name):
    path = protos_copy / name
    path.write_text(path.read_text() + "\n# edited by hand\n")
    assert generate.stale_files() == [name]
    assert generate.main(["--check"]) == 1


def test_check_detects_a_proto_change_not_regenerated(protos_copy):
    proto = protos_copy / "tfps.proto"
    text = proto.read_text()
    assert "message LeaveResponse {}" in text
    proto.write_text(text.replace("message LeaveResponse {}", "message LeaveResponse {\n  bool ok = 1;\n}"))
    stale = generate.stale_files()
    assert "tfps_pb2.py" in stale and "tfps_pb2.pyi" in stale


def test_check_detects_a_missing_generated_file(protos_copy):
    (protos_copy / "tfps_pb2_grpc.py").unlink()
    assert generate.stale_files() == ["tfps_pb2_grpc.py"]


def test_check_detects_a_leftover_generated_file(protos_copy):
    (protos_copy / "old_pb2.py").write_text("# generated from a .proto since deleted\n")
    assert generate.stale_files() == ["old_pb2.py"]
