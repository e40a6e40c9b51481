"""The built wheel, installed in a fresh virtualenv, counts a model of a brand-new project.

As a new user would: the wheel is built from the files a clone has (tracked,
or new and not ignored), installed with ``pip`` into a virtualenv of its own
(its dependencies come from pip's configured index), then ``django-admin
startproject``, ``startapp`` with a model and one ``counters.track()`` in its
``AppConfig.ready()``, ``migrate``, rows created, ``manage.py counters_flush``
(the cron line), and every count read: each equal to ``COUNT(*)`` in SQL.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest
from django.db import connection

from counters.base import conf
from tests.procs import ROOT

pytestmark = [
    pytest.mark.redis,
    pytest.mark.serial,
    pytest.mark.timeout(900),
    # The new project has its own SQLite database whatever the suite's: once per Django
    # version is enough, in the SQLite runs of make test and make test-django60.
    pytest.mark.skipif(connection.vendor != "sqlite", reason="runs in the SQLite run of the suite"),
]

MODELS = """\
from django.db import models

import counters


class Customer(models.Model):
    name = models.CharField(max_length=50)


class Order(models.Model):
    customer = models.ForeignKey(Customer, on_delete=models.CASCADE)
    paid = models.BooleanField(default=False)

    objects = counters.CountedManager()


class CustomerStats(models.Model):
    customer = models.OneToOneField(Customer, primary_key=True, on_delete=models.CASCADE)
    paid_orders = models.BigIntegerField(default=0)
"""

APPS = """\
from django.apps import AppConfig
from django.db.models import Q


class ShopConfig(AppConfig):
    default_auto_field = "django.db.models.BigAutoField"
    name = "shop"

    def ready(self):
        import counters

        from .models import Order

        counters.track(
            "paid_orders", Order, key="customer", into="shop.CustomerStats.paid_orders",
            where=Q(paid=True),
        )
"""

ADMIN = """\
from django.contrib import admin

from counters.admin import CounterAdmin

from .models import CustomerStats

admin.site.register(CustomerStats, CounterAdmin)
"""

SETTINGS = """
INSTALLED_APPS += ["counters", "shop"]
ALLOWED_HOSTS = ["testserver"]
COUNTERS_SOCKET_TIMEOUT = 0.2
MIDDLEWARE = ["counters.middleware.AcknowledgeMiddleware", *MIDDLEWARE]
COUNTERS_REDIS_URL = {redis_url!r}
COUNTERS_KEY_PREFIX = {prefix!r}
DATABASES["default"]["OPTIONS"] = {{"transaction_mode": "IMMEDIATE"}}
"""

#: Counts of every customer: get_value, the stored row, and the truth in SQL.
COUNTS = """
import json
import counters
from django.db import connection
from shop.models import Customer, CustomerStats

pks = list(Customer.objects.order_by("pk").values_list("pk", flat=True))
with connection.cursor() as cursor:
    cursor.execute("SELECT customer_id, COUNT(*) FROM shop_order WHERE paid GROUP BY customer_id")
    truth = dict(cursor.fetchall())
stored = dict(CustomerStats.objects.values_list("customer_id", "paid_orders"))
print(json.dumps({
    "value": [counters.get_value("paid_orders", pk) for pk in pks],
    "stored": [stored.get(pk, 0) for pk in pks],
    "truth": [truth.get(pk, 0) for pk in pks],
}))
"""

WRITES = """
from shop.models import Customer, Order

ann, bob, cat = (Customer.objects.create(name=n) for n in ("ann", "bob", "cat"))
for customer, paid in [(ann, True), (ann, True), (ann, True), (ann, False), (bob, True),
                       (bob, True), (cat, False)]:
    Order.objects.create(customer=customer, paid=paid)
Order.objects.filter(customer=ann, paid=False).update(paid=True)
Order.objects.filter(customer=bob).first().delete()
order = Order.objects.get(customer=cat)
order.paid = True
order.save()
"""


#: The admin's columns, its rebuild action, and both template tags, with bob's new order pending.
ADMIN_AND_TAGS = """
import json, re
import counters
from django.contrib.auth.models import User
from django.db import connection
from django.template import engines
from django.test import Client
from shop.models import Customer, CustomerStats, Order

ann, bob = Customer.objects.get(name="ann"), Customer.objects.get(name="bob")
Order.objects.create(customer=bob, paid=True)
client = Client()
client.force_login(User.objects.create_superuser("admin", "admin@example.com", "pw"))
page = client.get("/admin/shop/customerstats/").content.decode()
parts = ("stored", "pending", "exact", "truth")
cells = {p: re.findall(rf'<td class="field-paid_orders_{p}">(.*?)</td>', page) for p in parts}
columns = {p: values[::-1] for p, values in cells.items()}  # newest row first: ann first
with connection.cursor() as cursor:
    cursor.execute(
        "UPDATE shop_customerstats SET paid_orders = 40 WHERE customer_id = %s", [ann.pk]
    )
rows = [s.pk for s in CustomerStats.objects.all()]
done = client.post(
    "/admin/shop/customerstats/",
    {"action": "rebuild_selected", "_selected_action": rows},
    follow=True,
)
template = engines["django"].from_string(
    '{% load counters %}{% counters "paid_orders" customers as paid %}'
    '{% for c in customers %}{{ c.name }}={% counter "paid_orders" c %}/{{ paid|get:c }} '
    '{% endfor %}'
)
customers = [*Customer.objects.order_by("pk"), Customer.objects.create(name="dan")]
print(json.dumps({
    "columns": columns,
    "message": re.findall(r"\\d+ counters checked[^<]*", done.content.decode()),
    "ann": counters.get_value("paid_orders", ann.pk),
    "rendered": template.render({"customers": customers}),
    "ann_key": ann.pk,
}))
"""


def clone(dest: Path) -> Path:
    """The files a clone of this checkout has: tracked, or new and not ignored."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    for name in filter(None, (n.decode() for n in listed)):
        if (ROOT / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, dest / name)
    return dest


def clean_env(venv: Path | None = None) -> dict[str, str]:
    """This environment without what points at the test project."""
    dropped = {"DJANGO_SETTINGS_MODULE", "PYTHONPATH", "DATABASE_URL", "REDIS_URL", "VIRTUAL_ENV"}
    env = {
        k: v for k, v in os.environ.items() if k not in dropped and not k.startswith("COUNTERS_")
    }
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    if venv is not None:
        env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env['PATH']}"
    return env


def run(*args: str | Path, cwd: Path, env: dict[str, str], timeout: float = 300) -> str:
    done = subprocess.run(
        [str(a) for a in args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert done.returncode == 0, f"{args}: {done.stdout[-3000:]}{done.stderr[-3000:]}"
    return done.stdout


def last_json(out: str) -> dict:
    """The JSON line a script printed last (the shell may print lines of its own first)."""
    return json.loads(out.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel, built from a clone (without build isolation: setuptools is installed)."""
    source = clone(tmp_path_factory.mktemp("clone"))
    out = tmp_path_factory.mktemp("dist")
    run(
        sys.executable,
        *("-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", "-w", out),
        source,
        cwd=source,
        env=clean_env(),
    )
    [built] = out.glob("*.whl")
    return built


@pytest.fixture(scope="module")
def sdist(tmp_path_factory) -> Path:
    """The source distribution, built from a clone like the wheel."""
    source = clone(tmp_path_factory.mktemp("clone"))
    out = tmp_path_factory.mktemp("sdist")
    code = "from setuptools import build_meta as b; import sys; b.build_sdist(sys.argv[1])"
    run(sys.executable, "-c", code, out, cwd=source, env=clean_env())
    [built] = out.glob("*.tar.gz")
    return built


def test_the_wheel_holds_the_app_alone_with_every_file_it_needs(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    assert wheel.name.startswith("django_tally-")
    tops = {name.split("/")[0] for name in names}
    assert tops == {"counters", f"{wheel.name.split('-')[0]}-{wheel.name.split('-')[1]}.dist-info"}
    package = ROOT / "counters"
    files = {
        path.relative_to(ROOT).as_posix()
        for path in package.rglob("*")
        if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc"
    }
    assert files - names == set()  # migrations, Lua, py.typed, templates: everything
    assert {"counters/py.typed", "counters/migrations/0001_initial.py"} <= names
    assert len([n for n in names if n.startswith("counters/buffer/lua/")]) == len(
        list((package / "buffer" / "lua").glob("*.lua"))
    )
    metadata = zipfile.ZipFile(wheel).read(
        next(n for n in names if n.endswith(".dist-info/METADATA"))
    )
    assert b"\nName: django-tally\n" in metadata
    assert b"\nLicense-Expression: MIT\n" in metadata
    assert b"\nLicense-File: LICENSE\n" in metadata
    [license] = [n for n in names if n.endswith(".dist-info/licenses/LICENSE")]
    assert zipfile.ZipFile(wheel).read(license) == (ROOT / "LICENSE").read_bytes()


def test_the_sdist_holds_the_license(sdist):
    with tarfile.open(sdist) as archive:
        names = archive.getnames()
        [license] = [n for n in names if n.count("/") == 1 and n.endswith("/LICENSE")]
        extracted = archive.extractfile(license)
        assert extracted is not None and extracted.read() == (ROOT / "LICENSE").read_bytes()
    assert any(n.endswith("/counters/buffer/lua/push.lua") for n in names)


def test_a_new_project_counts_with_the_installed_wheel(wheel, tmp_path, counters_prefix):
    venv = tmp_path / "venv"
    run(sys.executable, "-m", "venv", venv, cwd=tmp_path, env=clean_env())
    env = clean_env(venv)
    python = venv / "bin" / "python"
    run(python, "-m", "pip", "install", "--quiet", wheel, cwd=tmp_path, env=env, timeout=600)
    run(python, "-m", "pip", "check", cwd=tmp_path, env=env)
    site = tmp_path / "site"
    site.mkdir()
    run(venv / "bin" / "django-admin", "startproject", "mysite", site, cwd=tmp_path, env=env)
    run(python, "manage.py", "startapp", "shop", cwd=site, env=env)
    (site / "shop" / "models.py").write_text(MODELS)
    (site / "shop" / "apps.py").write_text(APPS)
    (site / "shop" / "admin.py").write_text(ADMIN)
    with (site / "mysite" / "settings.py").open("a") as settings:
        settings.write(SETTINGS.format(redis_url=conf.redis_url(), prefix=counters_prefix))
    env["DJANGO_SETTINGS_MODULE"] = "mysite.settings"
    manage = (python, "manage.py")
    assert "no issues" in run(*manage, "check", cwd=site, env=env)
    run(*manage, "makemigrations", "shop", cwd=site, env=env)
    run(*manage, "migrate", "--noinput", cwd=site, env=env)
    run(*manage, "shell", "-c", WRITES, cwd=site, env=env)

    before = last_json(run(*manage, "shell", "-c", COUNTS, cwd=site, env=env))
    assert before == {"value": [4, 1, 1], "stored": [0, 0, 0], "truth": [4, 1, 1]}
    flushed = run(*manage, "counters_flush", cwd=site, env=env)
    assert flushed.startswith("flushed "), flushed
    after = last_json(run(*manage, "shell", "-c", COUNTS, cwd=site, env=env))
    assert after == {"value": [4, 1, 1], "stored": [4, 1, 1], "truth": [4, 1, 1]}

    used = last_json(run(*manage, "shell", "-c", ADMIN_AND_TAGS, cwd=site, env=env))
    assert used["columns"] == {  # bob's new paid order is pending
        "stored": ["4", "1", "1"],
        "pending": ["0", "1", "0"],
        "exact": ["4", "2", "1"],
        "truth": ["4", "2", "1"],
    }
    assert used["message"] == [
        f"3 counters checked; 1 repaired (paid_orders {used['ann_key']}: 40 → 4)."
    ]
    assert used["ann"] == 4
    assert used["rendered"] == "ann=4/4 bob=2/2 cat=1/1 dan=0/0 "
