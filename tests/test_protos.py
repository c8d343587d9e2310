"""The committed generated code matches protos/ (run `make protos` after editing a .proto)."""
import importlib.util
import pathlib

import pytest

pytestmark = pytest.mark.timeout(60)
ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_generated_code_is_fresh(tmp_path):
    spec = importlib.util.spec_from_file_location("gen_protos", ROOT / "tools" / "gen_protos.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    fresh = {p.name: p.read_text() for p in gen.generate(tmp_path)}
    committed = {p.name: p.read_text() for p in (ROOT / "fedpipe" / "proto").glob("*_pb2*.py*")}
    assert set(fresh) == set(committed), "generated file set differs: run `make protos`"
    stale = sorted(name for name in fresh if fresh[name] != committed[name])
    assert not stale, f"stale generated code {stale}: run `make protos`"
