"""The layout of counters/ stays small: short modules, small folders, short functions.

Each limit names its offenders. Import cycles and the order of the layers are
``lint-imports``' (``make lint``, the contracts in pyproject.toml).
"""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "counters"

#: Lines of one module.
MODULE_LINES = 450
#: Modules (``__init__.py`` included) of one folder; a subpackage is a folder of its own.
FOLDER_MODULES = 16
#: Lines of one function or method, from its ``def`` to its last line, docstring included.
FUNCTION_LINES = 70
#: Folders whose modules Django adds one at a time (a migration per schema change): their
#: number is left to squashing, their length to the limits above.
GENERATED = {"migrations"}


def modules() -> list[Path]:
    found = sorted(PACKAGE.rglob("*.py"))
    # As many as counters/ held when the limits were set, give or take: a scan that finds
    # far fewer is looking in the wrong place.
    assert len(found) >= 100, f"only {len(found)} modules found under {PACKAGE}"
    return found


def name(path: Path) -> str:
    return str(path.relative_to(ROOT))


def test_no_module_is_longer_than_the_limit():
    lengths = {name(p): len(p.read_text().splitlines()) for p in modules()}
    too_long = {n: lines for n, lines in lengths.items() if lines > MODULE_LINES}
    assert not too_long, f"modules over {MODULE_LINES} lines: {too_long}"
    assert max(lengths.values()) > MODULE_LINES / 2  # the lengths read are the files'


def test_no_folder_holds_more_modules_than_the_limit():
    per_folder = Counter(name(p.parent) for p in modules() if p.parent.name not in GENERATED)
    assert len(per_folder) >= 12
    crowded = {folder: n for folder, n in per_folder.items() if n > FOLDER_MODULES}
    assert not crowded, f"folders over {FOLDER_MODULES} modules: {crowded}"


def test_no_function_is_longer_than_the_limit():
    lengths: dict[str, int] = {}
    for path in modules():
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                where = f"{name(path)}:{node.lineno} {node.name}"
                lengths[where] = node.end_lineno - node.lineno + 1  # type: ignore[operator]
    assert len(lengths) >= 800, f"only {len(lengths)} functions found"
    too_long = {f: n for f, n in sorted(lengths.items()) if n > FUNCTION_LINES}
    assert not too_long, f"functions over {FUNCTION_LINES} lines: {too_long}"
