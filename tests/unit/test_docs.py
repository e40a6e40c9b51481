"""The README documents every setting the code has."""

from pathlib import Path

import pytest

from counters import conf

README = (Path(__file__).resolve().parents[2] / "README.md").read_text()


@pytest.mark.parametrize("name", sorted(conf.SETTINGS))
def test_every_setting_is_in_the_readme_table(name):
    assert f"| `{name}` |" in README
