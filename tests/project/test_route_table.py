"""Each line of the path table (docs/tracking.md) names the test that drives its route."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def table_lines() -> list[str]:
    text = (ROOT / "docs" / "tracking.md").read_text()
    start = text.index("| Path | How it is counted | Test |")
    table = text[start : text.index("\n\n", start)].splitlines()
    return table[2:]


def test_every_line_of_the_path_table_names_an_existing_test():
    routes = (ROOT / "tests/tracking/test_routes.py").read_text()
    lines = table_lines()
    assert len(lines) >= 15
    for line in lines:
        names = re.findall(r"`([^`]+)`", line.rsplit("|", 2)[1])
        assert names, line
        for name in names:
            if "/" in name:
                assert (ROOT / name).is_file(), line
            else:
                assert re.search(rf"^def (test_)?{name}\w*\(", routes, re.M), (name, line)
