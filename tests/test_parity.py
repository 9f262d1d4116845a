import json
import shutil

import pytest

from kestrel_backend import parity
from conftest import fixture_dirs


@pytest.mark.parametrize("folder", fixture_dirs(), ids=lambda p: f"{p.parent.parent.name}/{p.name}")
def test_parity_passes_on_golden_fixtures(folder, capsys):
    assert parity.main([str(folder)]) == 0
    out = capsys.readouterr().out
    assert "0 failed" in out.splitlines()[-1]


def test_parity_fails_when_a_golden_token_differs(tiny_dir, tmp_path, capsys):
    copy = tmp_path / "md2-tiny"
    shutil.copytree(tiny_dir, copy)
    cases = json.loads((copy / "cases.json").read_text())
    case = next(c for c in cases["cases"] if c["name"] == "query_small")
    case["tokens"][5] = (case["tokens"][5] + 1) % 51200
    (copy / "cases.json").write_text(json.dumps(cases))
    assert parity.main([str(copy)]) == 1
    out = capsys.readouterr().out
    assert "FAIL query_small" in out
    assert out.splitlines()[-1].endswith("1 failed")
