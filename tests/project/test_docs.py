"""The README documents every setting the code has, and shows the real Procfiles."""

import re
from pathlib import Path

import pytest

from counters.base import conf

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()

#: Environment variables read by Python code: os.environ.get("X"), os.environ["X"], env_bool("X").
PY_ENV = re.compile(r"""(?:os\.environ\.get|os\.getenv|env_bool)\(\s*["']([A-Z][A-Z0-9_]*)["']""")
PY_ENV_ITEM = re.compile(r"""os\.environ\[\s*["']([A-Z][A-Z0-9_]*)["']\s*\]""")
#: Variables a shell command line expands: $X or ${X...}.
SHELL_ENV = re.compile(r"\$\{?([A-Z][A-Z0-9_]*)")
#: Make variables the environment (or the command line) can set: X ?= default.
MAKE_ENV = re.compile(r"^([A-Z][A-Z0-9_]*)\s*\?=", re.M)
#: Read by the environment of every Django project, not by Tally.
STANDARD = {"DJANGO_SETTINGS_MODULE", "PATH"}


def env_names(path: Path) -> set[str]:
    text = path.read_text()
    if path.suffix == ".py":
        return set(PY_ENV.findall(text)) | set(PY_ENV_ITEM.findall(text))
    if path.name == "Makefile":
        return set(MAKE_ENV.findall(text))
    return set(SHELL_ENV.findall(text))


SOURCES = [
    ROOT / "config" / "settings.py",
    *sorted((ROOT / "scripts").glob("*.py")),
    ROOT / "Procfile",
    ROOT / "Procfile.production",
    ROOT / "Makefile",
]
READ = sorted({name for source in SOURCES for name in env_names(source)} - STANDARD)


def section(title: str) -> str:
    """The README's text under ``## title`` up to the next ``## `` heading."""
    start = README.index(f"\n## {title}\n")
    end = README.find("\n## ", start + 1)
    return README[start : end if end != -1 else None]


def table_names(text: str) -> set[str]:
    """Names in backticks in the first cell of each table row of ``text``."""
    names: set[str] = set()
    for line in text.splitlines():
        if line.startswith("| `"):
            names.update(re.findall(r"`([^`]+)`", line.split("|")[1]))
    return names


def fenced_block_after(marker: str) -> str:
    """The first fenced code block after the first line containing ``marker``."""
    start = README.index(marker)
    match = re.compile(r"^```[^\n]*\n(.*?)^```$", re.S | re.M).search(README, start)
    assert match is not None, f"no code block after {marker!r}"
    return match[1]


@pytest.mark.parametrize("name", sorted(conf.SETTINGS))
def test_every_setting_is_in_the_readme_table(name):
    assert f"| `{name}` |" in README


def test_the_sources_read_environment_variables():
    # Guards the patterns above: if they stopped matching, every check below would pass.
    assert {"DATABASE_URL", "SECRET_KEY", "DEBUG", "PORT", "TEST_POSTGRES_URL"} <= set(READ)


@pytest.mark.parametrize("name", READ)
def test_every_environment_variable_is_in_the_configuration_table(name):
    assert name in table_names(section("Configuration")), f"{name} is not in the README table"


@pytest.mark.parametrize("procfile", ["Procfile", "Procfile.production"])
def test_readme_shows_the_real_procfile(procfile):
    marker = "Processes (`Procfile`):" if procfile == "Procfile" else f"(`{procfile}`"
    assert fenced_block_after(marker) == (ROOT / procfile).read_text()


def test_readme_states_the_api_limits():
    from notifications.inbox import MAX_PAGE, MAX_PAGE_SIZE

    assert f"`page` ≤ {MAX_PAGE}, `page_size` ≤ {MAX_PAGE_SIZE}" in README


def module_map(text: str) -> dict[str, str]:
    """The module map: the fenced block whose first line is ``counters/``, as ``{name: line}``."""
    block = re.search(r"```\ncounters/\n(.*?)```", text, re.S)
    assert block, "no module map (a fenced block starting with 'counters/')"
    names: dict[str, str] = {}
    for line in block.group(1).splitlines():
        first = line.split()[0] if line.split() else ""
        if first and "," not in first:
            names[first] = line
    return names


def code_layout() -> set[str]:
    """The subpackages of counters/ (as ``name/``) and its modules, but Django's fixed names."""
    package = ROOT / "counters"
    subpackages = {
        f"{path.parent.name}/"
        for path in package.glob("*/__init__.py")
        if path.parent.name not in DJANGO_NAMES
    }
    modules = {
        path.stem
        for path in package.glob("*.py")
        if path.stem not in DJANGO_NAMES and not path.stem.startswith("_")
    }
    return subpackages | modules | {"__init__"}


#: Django's fixed names, listed together on one line of the map.
DJANGO_NAMES = {
    "apps",
    "admin",
    "checks",
    "models",
    "signals",
    "tasks",
    "urls",
    "migrations",
    "management",
}


def test_readme_module_map_matches_the_code():
    assert set(module_map(README)) == code_layout()
