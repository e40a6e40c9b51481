"""The wheel ships the two apps, not the project settings or the benchmark."""

from __future__ import annotations

import tomllib

from setuptools import find_packages

from tests.procs import ROOT


def shipped() -> set[str]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    find = config["tool"]["setuptools"]["packages"]["find"]
    return set(find_packages(str(ROOT), include=find["include"]))


def test_the_wheel_ships_the_apps_with_their_commands_and_migrations():
    packages = shipped()
    assert {
        "counters",
        "counters.management.commands",
        "counters.migrations",
        "notifications",
        "notifications.management.commands",
        "notifications.migrations",
    } <= packages
    assert {p.split(".")[0] for p in packages} == {"counters", "notifications"}
