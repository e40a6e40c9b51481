"""counters.E018: PROMETHEUS_MULTIPROC_DIR, when set, must be a writable directory."""

from __future__ import annotations

import pytest

from counters.checks import check_metrics_dir


@pytest.mark.parametrize(
    ("value", "ids"),
    [
        pytest.param(None, [], id="unset"),
        pytest.param("dir", [], id="a-directory"),
        pytest.param("missing", ["counters.E018"], id="missing"),
        pytest.param("file", ["counters.E018"], id="a-file"),
    ],
)
def test_multiprocess_dir(monkeypatch, tmp_path, value, ids):
    (tmp_path / "dir").mkdir()
    (tmp_path / "file").write_text("")
    if value is None:
        monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    else:
        monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path / value))
    assert [e.id for e in check_metrics_dir()] == ids
