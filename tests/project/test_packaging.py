"""The wheel ships the counters app alone, with its Lua scripts and ``py.typed``.

The example project (``notifications``, ``config``, ``benchmarks``) stays out: its
``notifications`` label would collide with django-notifications-hq's in a user's
project. ``tests/project/test_wheel.py`` builds the wheel and installs it.
"""

from __future__ import annotations

import tomllib

from setuptools import find_packages

from tests.procs import ROOT


def shipped() -> set[str]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    find = config["tool"]["setuptools"]["packages"]["find"]
    return set(find_packages(str(ROOT), include=find["include"]))


def test_the_wheel_ships_the_app_with_its_commands_and_migrations_and_no_example():
    packages = shipped()
    assert {"counters", "counters.management.commands", "counters.migrations"} <= packages
    assert {p.split(".")[0] for p in packages} == {"counters"}


def test_the_distribution_is_named_django_tally():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert config["project"]["name"] == "django-tally"


def test_the_wheel_ships_py_typed():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert (ROOT / "counters" / "py.typed").is_file()
    assert "py.typed" in config["tool"]["setuptools"]["package-data"]["counters"]


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


def test_the_license_is_mit_and_ships_in_the_sdist_and_the_wheel():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    text = (ROOT / "LICENSE").read_text()
    assert text.startswith("MIT License\n\nCopyright (c) 2026 The Tally authors\n")
    assert config["project"]["license"] == "MIT"
    assert config["project"]["license-files"] == ["LICENSE"]
