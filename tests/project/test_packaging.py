"""The wheel ships the two apps and the buffer's Lua scripts, not the settings or the benchmark."""

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


def test_the_wheel_ships_the_buffer_lua_scripts():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    globs = config["tool"]["setuptools"]["package-data"]["counters.buffer"]
    package = ROOT / "counters" / "buffer"
    scripts = {p.relative_to(package) for p in package.rglob("*.lua")}
    assert scripts
    assert scripts <= {p.relative_to(package) for glob in globs for p in package.glob(glob)}


def test_the_wheel_ships_every_subpackage_of_counters():
    folders = {
        ".".join(path.parent.relative_to(ROOT).parts)
        for path in (ROOT / "counters").rglob("*.py")
        if "__pycache__" not in path.parts
    }
    assert folders <= shipped()
