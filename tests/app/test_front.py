"""``counters`` is the one public import path: lazy, complete, and the only one used outside.

``import counters`` loads no other module of the app; each public name is
imported from its module on first use. The example app, the benchmarks, the
scripts, the project config and the README's code import nothing else of
``counters`` but the paths Django fixes.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import counters
from counters.base import exceptions
from tests.procs import ROOT

#: Where the front must be the only way in (besides Django's fixed paths).
OUTSIDE = ["notifications", "benchmarks", "scripts", "config"]

#: Modules of counters importable outside it, where Django fixes the path (model classes,
#: ``include("counters.urls")``, the admin's ``CounterAdmin``), and the file each other exception
#: is confined to.
DJANGO_PATHS = {"counters.models", "counters.urls", "counters.admin"}
#: Django's way to offer another app's command under a new name is to import its Command.
COMMANDS = ("counters.management.commands", "notifications/management/commands/")
#: The internal parts the benchmarks drive directly, imported in this one module.
BENCH_INTERNALS = "benchmarks/internals.py"


def imported_modules(source: str) -> list[tuple[int, str]]:
    """(line, dotted module) of each ``counters`` import in ``source``; ``from counters
    import x`` gives ``counters.x`` when ``x`` is not a public name."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            if node.module == "counters":
                found += [
                    (node.lineno, f"counters.{alias.name}")
                    for alias in node.names
                    if alias.name not in counters.__all__
                ]
            else:
                found.append((node.lineno, node.module))
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) == "include":
            found += [
                (node.lineno, arg.value)
                for arg in node.args
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str)
            ]
    return [(line, name) for line, name in found if name.startswith("counters.")]


def allowed(path: str, module: str) -> bool:
    if module in DJANGO_PATHS or path == BENCH_INTERNALS:
        return True
    prefix, folder = COMMANDS
    return module.startswith(prefix) and path.startswith(folder)


#: The pages whose Python shows projects how to use the app: the README and every page of
#: the docs site.
USER_DOCS = [
    "README.md",
    *sorted(p.relative_to(ROOT).as_posix() for p in ROOT.glob("docs/**/*.md")),
]


def readme_code(page: str = "README.md") -> str:
    text = (ROOT / page).read_text()
    return "\n".join(re.findall(r"^```python\n(.*?)^```", text, flags=re.M | re.S))


def test_import_counters_loads_the_front_alone():
    env = {k: v for k, v in os.environ.items() if k != "DJANGO_SETTINGS_MODULE"}
    env["PYTHONPATH"] = str(ROOT)
    run = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", "import counters; print(counters.__file__)"],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    assert Path(run.stdout.strip()) == ROOT / "counters" / "__init__.py"
    lines = [line.split("|")[-1].strip() for line in run.stderr.splitlines() if "|" in line]
    loaded = {name for name in lines if name == "counters" or name.startswith("counters.")}
    assert loaded == {"counters"}


@pytest.mark.parametrize("name", counters.__all__)
def test_every_public_name_resolves(name):
    value = getattr(counters, name)
    assert getattr(value, "__name__", name) == name
    assert name in vars(counters)  # kept: the next lookup does not import again


def test_the_map_the_names_and_the_typing_imports_agree():
    tree = ast.parse(Path(counters.__file__).read_text())
    [typing_only] = [
        node
        for node in tree.body
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING"
    ]
    typed = {
        alias.name: node.module
        for node in typing_only.body
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
    }
    assert typed == counters._EXPORTS
    assert counters.__all__ == sorted(counters._EXPORTS)


def test_dir_lists_every_public_name():
    assert set(counters.__all__) <= set(dir(counters))
    assert len(set(counters.__all__)) == len(counters.__all__)


def test_an_unknown_name_raises_attribute_error_naming_it():
    with pytest.raises(AttributeError, match="'no_such_thing'"):
        _ = counters.no_such_thing
    assert not hasattr(counters, "api")


def test_every_exception_is_public():
    defined = {
        name
        for name, value in vars(exceptions).items()
        if inspect.isclass(value)
        and issubclass(value, Exception)
        and value.__module__ == exceptions.__name__
    }
    assert defined <= set(counters.__all__)
    for name in defined:
        assert getattr(counters, name) is getattr(exceptions, name)


def test_no_module_of_counters_is_named_like_a_public_name():
    """Importing ``counters.x.y`` binds ``counters.x``: a public ``x`` would be hidden."""
    package = ROOT / "counters"
    children = {p.stem for p in package.glob("*.py")} | {
        p.parent.name for p in package.glob("*/__init__.py")
    }
    assert children & set(counters.__all__) == set()


def test_public_functions_survive_importing_every_module():
    import counters.flushing.shard
    import counters.tracking.declare

    assert callable(counters.track) and callable(counters.flush)
    assert sys.modules["counters.flushing.shard"].__name__ == "counters.flushing.shard"


def test_nothing_outside_reaches_into_counters():
    wrong = []
    for folder in OUTSIDE:
        for path in sorted((ROOT / folder).rglob("*.py")):
            relative = path.relative_to(ROOT).as_posix()
            for line, module in imported_modules(path.read_text()):
                if not allowed(relative, module):
                    wrong.append(f"{relative}:{line}: {module}")
    for page in USER_DOCS:
        for line, module in imported_modules(readme_code(page)):
            if not allowed(page, module):
                wrong.append(f"{page} (code, line {line}): {module}")
    assert wrong == []


def test_the_check_finds_a_submodule_import():
    source = "from counters.base.utils import batched\nfrom counters import client, add\n"
    assert imported_modules(source) == [(1, "counters.base.utils"), (2, "counters.client")]
    assert imported_modules('path("", include("counters.urls"))') == [(1, "counters.urls")]


def test_the_signals_module_is_reachable_from_the_front():
    signals = importlib.import_module("counters.signals")
    assert counters.__getattr__("signals") is signals
    assert counters.signals.applied is signals.applied
