"""The docs document every setting the code has and show the real Procfiles; the docs site
holds every page, each short; the README stays a pitch, a quick start and links.

Each check reads the page that holds its subject: the settings and the
environment in docs/configuration.md, the Procfiles and the API's limits in
docs/example.md, the module map in docs/development.md, the site's pages in
mkdocs.yml. `make lint` builds the site strictly (broken links and anchors fail it).
"""

import re
from pathlib import Path

import pytest
import yaml

from counters.base import conf

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
CONFIGURATION = (ROOT / "docs" / "configuration.md").read_text()
EXAMPLE = (ROOT / "docs" / "example.md").read_text()
DEVELOPMENT = (ROOT / "docs" / "development.md").read_text()
#: The README's length at most: a pitch, a quick start and links.
README_LINES = 150
#: A page of the docs site at most, and the benchmarks page at most.
PAGE_LINES = 600
BENCHMARKS_LINES = 250

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


def section(title: str, text: str = README) -> str:
    """The text under ``## title`` up to the next ``## `` heading (in the README by default)."""
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else None]


def table_names(text: str) -> set[str]:
    """Names in backticks in the first cell of each table row of ``text``."""
    names: set[str] = set()
    for line in text.splitlines():
        if line.startswith("| `"):
            names.update(re.findall(r"`([^`]+)`", line.split("|")[1]))
    return names


def fenced_block_after(marker: str, text: str) -> str:
    """The first fenced code block of ``text`` after the first line containing ``marker``."""
    start = text.index(marker)
    match = re.compile(r"^```[^\n]*\n(.*?)^```$", re.S | re.M).search(text, start)
    assert match is not None, f"no code block after {marker!r}"
    return match[1]


@pytest.mark.parametrize("name", sorted(conf.SETTINGS))
def test_every_setting_is_in_the_settings_table(name):
    assert f"| `{name}` |" in section("Settings", CONFIGURATION)


def test_the_sources_read_environment_variables():
    # Guards the patterns above: if they stopped matching, every check below would pass.
    assert {"DATABASE_URL", "SECRET_KEY", "DEBUG", "PORT", "TEST_POSTGRES_URL"} <= set(READ)


@pytest.mark.parametrize("name", READ)
def test_every_environment_variable_is_in_the_configuration_table(name):
    # the environment's table, or the settings' (a COUNTERS_* setting may come from the
    # environment variable of its name)
    assert name in table_names(CONFIGURATION), f"{name} is not in docs/configuration.md"


@pytest.mark.parametrize("procfile", ["Procfile", "Procfile.production"])
def test_the_example_shows_the_real_procfile(procfile):
    marker = "Processes (`Procfile`):" if procfile == "Procfile" else f"(`{procfile}`"
    assert fenced_block_after(marker, EXAMPLE) == (ROOT / procfile).read_text()


def test_the_example_states_the_api_limits():
    from notifications.inbox import MAX_PAGE, MAX_PAGE_SIZE

    assert f"`page` ≤ {MAX_PAGE}, `page_size` ≤ {MAX_PAGE_SIZE}" in EXAMPLE


def module_map(text: str) -> dict[str, str]:
    """The module map of ``counters/`` in ``text``, as ``{name: line}``.

    It is the fenced block holding a line that starts with ``counters/``: the
    lines indented under that one (docs/development.md's map is that block alone). A
    name is the line's first word, without a trailing ``/``; the line of
    Django's names (a list with commas) is left out.
    """
    for block in re.findall(r"^```[^\n]*\n(.*?)^```$", text, re.S | re.M):
        lines = block.splitlines()
        heads = [i for i, line in enumerate(lines) if line.split()[:1] == ["counters/"]]
        if heads:
            break
    else:
        raise AssertionError("no module map (a fenced block with a line 'counters/')")
    names: dict[str, str] = {}
    for line in lines[heads[0] + 1 :]:
        if not line.startswith(" "):
            break
        first = line.split()[0] if line.split() else ""
        if first and "," not in first:
            names[first.rstrip("/")] = line
    return names


def code_layout() -> set[str]:
    """The subpackages and modules of counters/, but Django's fixed names and ``_private``."""
    package = ROOT / "counters"
    subpackages = {
        path.parent.name
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


def test_the_module_map_matches_the_code():
    assert set(module_map(DEVELOPMENT)) == code_layout()


#: Where the code departs from the starting cut of ../shared/DESIGN.md, which invites it
#: ("improve it where the code says so"), and why. A name on the left is DESIGN.md's.
DESIGN_DEPARTURES = {
    # counters.track() and counters.flush() are functions of the public front: once a
    # subpackage of the same name is imported, Python sets it as that attribute of the
    # package, and ``counters.track(...)`` would call a module.
    "track": "tracking",
    "flush": "flushing",
}
#: In the code and not in DESIGN.md's cut: the front itself (DESIGN.md names it on the line
#: of counters/), and the Django layer over the buffer (settings → Redis client and Buffer).
#: DESIGN.md puts "the Redis client" in base, the lowest layer; it builds a Buffer, so it
#: stands above buffer/, at the root.
#: And the middleware of deferred acknowledgements, which the cut predates (a middleware is a
#: Django name at the root, as Django's own apps keep theirs).
DESIGN_ADDED = {"__init__", "client", "middleware"}


def test_design_layout_matches_the_code():
    design = ROOT.parent / "shared" / "DESIGN.md"
    if not design.exists():
        pytest.skip("../shared/DESIGN.md is not beside this checkout")
    names = set(module_map(design.read_text()))
    assert {DESIGN_DEPARTURES.get(name, name) for name in names} | DESIGN_ADDED == code_layout()
    # Each departure still departs: when DESIGN.md or the code changes, the tables follow.
    assert not (set(DESIGN_DEPARTURES.values()) | DESIGN_ADDED) & names


def test_module_maps_see_the_real_layouts():
    # Guards the parser: a map it read as empty would match nothing, and fail loudly above.
    assert {"base", "buffer", "write", "read", "verify", "ops"} <= set(module_map(DEVELOPMENT))


def test_the_readme_is_a_pitch_a_quick_start_and_links():
    assert len(README.splitlines()) <= README_LINES
    # the quick start is two commands
    assert fenced_block_after("## Quick start", README).splitlines() == [
        "make run    # .venv, install, migrate (SQLite in var/), then web + worker + beat",
        "make test   # install, then the suite on SQLite, PostgreSQL, MariaDB and Valkey",
    ]


def test_the_quick_start_says_how_to_log_in():
    # seed_demo --admin creates the demo users and a superuser, and prints their logins
    quick_start = section("Quick start")
    assert "manage.py seed_demo --admin" in quick_start
    assert "/accounts/login/" in quick_start and "/admin/" in quick_start
    seed_demo = (ROOT / "notifications" / "management" / "commands" / "seed_demo.py").read_text()
    assert '"--admin"' in seed_demo and "Log in at /accounts/login/ as:" in seed_demo


def test_the_readme_first_tells_an_existing_project_what_to_do():
    match = re.search(r"^## (.+)$", README, re.M)
    assert match is not None
    first = section(match[1])
    for step in (
        "pip install django-tally",
        '"counters"',  # INSTALLED_APPS
        "counters.middleware.AcknowledgeMiddleware",
        "COUNTERS_REDIS_URL",
        "manage.py migrate",
        "AppConfig.ready()",
        "counters.track(",
        "counters.CountedManager()",
        "counters: flush buffered deltas",  # the beat entry
        "manage.py counters_flush",  # the cron line
        "(docs/tutorial.md)",
        "| Python |",
        "| Django |",
        "| Databases |",
        "| Redis servers |",
    ):
        assert step in first, step


def test_the_support_table_states_what_the_package_and_ci_declare():
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["requires-python"] == ">=3.11"
    assert "Django>=5.2,<6.1" in project["dependencies"]
    djangos = {c.rsplit(" :: ", 1)[1] for c in project["classifiers"] if "Django :: " in c}
    assert djangos == {"5.2", "6.0"}
    row = next(line for line in README.splitlines() if line.startswith("| Django |"))
    assert "5.2 LTS, 6.0" in row
    assert "5.2 on PostgreSQL, SQLite and MariaDB; 6.0 on PostgreSQL" in row
    assert "| Python | 3.11+ |" in README
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^DJANGO60_DATABASES \?= postgres$", makefile, re.M)
    assert "make test-django60" in (ROOT / ".ci" / "run").read_text()


def test_every_relative_link_of_the_docs_resolves():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("**/*.md"))]
    broken = []
    for page in pages:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue
            path = (page.parent / target.split("#")[0]).resolve()
            if not path.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert broken == []


def nav_pages(nav: list) -> list[str]:
    """The pages of mkdocs.yml's ``nav``, in order, as paths under docs/."""
    pages: list[str] = []
    for item in nav:
        for value in item.values() if isinstance(item, dict) else [item]:
            pages += nav_pages(value) if isinstance(value, list) else [value]
    return pages


MKDOCS = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
SITE_PAGES = nav_pages(MKDOCS["nav"])


def test_the_site_has_the_parts_a_reader_looks_for():
    sections = [next(iter(item)) for item in MKDOCS["nav"]]
    for part in (
        "Overview",
        "Installation",
        "Tutorial",
        "How-to guides",
        "Reference",
        "Operations",
        "Benchmarks",
        "FAQ",
        "Troubleshooting",
        "Changelog",
    ):
        assert part in sections, part
    assert len(nav_pages(MKDOCS["nav"][sections.index("How-to guides")]["How-to guides"])) >= 12


def test_every_page_of_the_docs_is_in_the_site():
    pages = {p.relative_to(ROOT / "docs").as_posix() for p in (ROOT / "docs").glob("**/*.md")}
    assert pages == set(SITE_PAGES)
    assert len(SITE_PAGES) == len(set(SITE_PAGES))


@pytest.mark.parametrize("page", SITE_PAGES)
def test_each_page_is_short(page):
    limit = BENCHMARKS_LINES if page == "benchmarks.md" else PAGE_LINES
    assert len((ROOT / "docs" / page).read_text().splitlines()) <= limit


def test_the_changelog_page_includes_the_changelog():
    assert (ROOT / "docs" / "changelog.md").read_text() == '--8<-- "CHANGELOG.md"\n'


def test_the_readme_links_every_page_of_the_site():
    linked = set(re.findall(r"\]\(docs/([^)#]+\.md)", section("Documentation")))
    assert set(SITE_PAGES) - {"changelog.md"} <= linked
    assert "(CHANGELOG.md)" in section("Documentation")


def test_lint_builds_the_site_strictly():
    makefile = (ROOT / "Makefile").read_text()
    lint = makefile[makefile.index("\nlint:") : makefile.index("\n\n", makefile.index("\nlint:"))]
    assert "mkdocs build --strict" in lint
    assert MKDOCS["strict"] is True
    assert "make lint" in (ROOT / ".ci" / "run").read_text()


def test_the_api_page_documents_every_public_name():
    import counters

    api = (ROOT / "docs" / "reference" / "api.md").read_text()
    for name in counters.__all__:
        module = counters._EXPORTS[name]
        assert f"::: {module}.{name}\n" in api or (
            f"::: {module}\n" in api and f"        - {name}\n" in api
        ), name


def test_the_checks_page_lists_every_check_id():
    source = "\n".join(p.read_text() for p in sorted((ROOT / "counters").glob("**/*.py")))
    ids = set(re.findall(r"counters\.[EW]\d{3}", source))
    assert len(ids) >= 50  # the pattern still matches the code's ids
    checks = (ROOT / "docs" / "reference" / "checks.md").read_text()
    assert {i for i in ids if f"| `{i}` |" not in checks} == set()


@pytest.mark.parametrize(
    "setting", [s for s in conf.SETTINGS.values() if s.default is not None], ids=lambda s: s.name
)
def test_the_settings_table_states_each_default(setting):
    default = f"{setting.default:g}" if isinstance(setting.default, float) else setting.default
    assert f"| `{setting.name}` | `{default}` |" in section("Settings", CONFIGURATION)
