"""counters/ uses only the public APIs of Django, asgiref, redis-py and hiredis.

A scan of the source (its syntax tree, so comments and docstrings may name
anything) fails on:

- an import of an underscore name, or from an underscore module, of one of
  those libraries or of ``asyncio`` (``from redis._parsers import Encoder``,
  ``from asyncio import _get_running_loop``);
- a read of an attribute on the deny-list below, however it is spelled
  (``conn.run_on_commit``, ``getattr(connections, "_connections")``);
- a read of a private attribute of a library object held by another object
  (``self.stderr._out``: the command's ``OutputWrapper``).

The checker is tested on snippets holding each pattern, so the scan cannot
pass by seeing nothing.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SOURCE = ROOT / "counters"

#: Libraries whose private names counters/ must not import.
LIBRARIES = {"django", "asgiref", "redis", "hiredis", "asyncio"}
#: Private attributes of those libraries, each read once by the app and replaced since:
#: Django's connection handler (asgiref's storage), its list of on_commit callbacks, its
#: MySQL feature flag, redis-py's parsers module, asyncio's loop lookup, QuerySet's check,
#: a redis-py connection's socket, QuerySet's ``values()`` fields and write flag.
DENIED = {
    "_connections",
    "_storage",
    "run_on_commit",
    "_parsers",
    "_mysql_storage_engine",
    "_get_running_loop",
    "_not_support_combined_queries",
    "_sock",
    "_fields",
    "_for_write",
}
#: A QuerySet's cache: a subclass may clear its own (``self._result_cache = None``, as
#: Django's ``update()`` does), never read one.
DENIED_READS = {"_result_cache"}
#: Private attributes read through another object than ``self``: a Django
#: ``OutputWrapper``'s stream.
DENIED_ELSEWHERE = {"_out"}


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def violations(source: str, filename: str = "<snippet>") -> list[str]:
    """What ``source`` does that the rules above forbid, one line each."""
    found = []

    def flag(node: ast.AST, what: str) -> None:
        found.append(f"{filename}:{getattr(node, 'lineno', 0)}: {what}")

    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            parts = node.module.split(".")
            if parts[0] in LIBRARIES:
                if any(_private(part) for part in parts):
                    flag(node, f"import from private module {node.module}")
                for alias in node.names:
                    if _private(alias.name):
                        flag(node, f"import of private {node.module}.{alias.name}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] in LIBRARIES and any(_private(part) for part in parts):
                    flag(node, f"import of private module {alias.name}")
        elif isinstance(node, ast.Attribute):
            read = not isinstance(node.ctx, ast.Store)
            if node.attr in DENIED or (node.attr in DENIED_READS and read):
                flag(node, f"read of private attribute {node.attr}")
            elif node.attr in DENIED_ELSEWHERE and not (
                isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")
            ):
                flag(node, f"read of private attribute {node.attr} of another object")
        elif isinstance(node, ast.Name) and node.id in DENIED:
            flag(node, f"use of private name {node.id}")
        elif (
            isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in DENIED
        ):
            flag(node, f"private attribute named as a string: {node.value!r}")
    return found


def _sources() -> list[Path]:
    return sorted(SOURCE.rglob("*.py"))


def test_counters_reads_no_private_attribute_of_its_libraries():
    files = _sources()
    assert len(files) > 100  # the whole app, its subpackages and commands included
    assert SOURCE / "write" / "transactions.py" in files
    found = [line for path in files for line in violations(path.read_text(), str(path))]
    assert found == []


@pytest.mark.parametrize(
    "snippet",
    [
        "from asyncio import _get_running_loop",
        "from redis._parsers import Encoder",
        "import redis._parsers.encoders",
        "from django.db.models.query import _Foo",
        "from hiredis import _private_thing",
        "from asgiref.local import _CVar",
        "storage = connections._connections._storage",
        "storage = getattr(getattr(connections, '_connections', None), '_storage', None)",
        "conn.run_on_commit.append((set(), func, True))",
        "engine = conn.features._mysql_storage_engine",
        "qs._not_support_combined_queries('update')",
        "Progress(self.stderr._out, True)",
        "sock = self.connection._sock",
        "sock = getattr(connection, '_sock')",
        "if objs._result_cache is None: pass",
        "if self._fields is not None: pass",
        "self._for_write = True",
    ],
    ids=lambda snippet: snippet.split("(")[0].split(" = ")[-1][:40],
)
def test_the_checker_flags_each_forbidden_pattern(snippet):
    assert violations(snippet) != []


@pytest.mark.parametrize(
    "snippet",
    [
        "conn = connections[using]",
        "transaction.on_commit(func, using=using, robust=True)",
        "manual = not conn.in_atomic_block and not conn.get_autocommit()",
        "fields = model._meta.concrete_fields",
        "from redis.connection import ConnectionPool",
        "encoder = ConnectionPool().get_encoder()",
        "from __future__ import annotations",
        "self._out = []",
        "self._result_cache = None",
        "'''Reads no run_on_commit: a docstring may name it.'''",
    ],
)
def test_the_checker_lets_public_uses_pass(snippet):
    assert violations(snippet) == []
