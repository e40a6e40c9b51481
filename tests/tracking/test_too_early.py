"""``counters.track()`` at import time gives one clear error naming ``AppConfig.ready()``.

A project of its own (settings and one app written here) calls ``track()`` at
module level in the app's ``models.py``, the mistake a new user makes; Django
starts in a subprocess, as ``manage.py`` would.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from django.core.exceptions import AppRegistryNotReady
from django.db.models import Q

import counters
from tests.procs import ROOT

MODELS = """\
from django.db import models

import counters


class Post(models.Model):
    pass


class Comment(models.Model):
    post = models.ForeignKey(Post, on_delete=models.CASCADE)
    objects = counters.CountedManager()


class PostStats(models.Model):
    post = models.OneToOneField(Post, primary_key=True, on_delete=models.CASCADE)
    comments = models.BigIntegerField(default=0)


counters.track("comments", Comment, key="post", into="early.PostStats.comments")
"""

SETTINGS = """\
SECRET_KEY = "test"
INSTALLED_APPS = ["django.contrib.contenttypes", "django.contrib.auth", "counters", "early"]
DATABASES = {"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"}}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
"""


def test_track_in_models_py_raises_one_error_naming_appconfig_ready(tmp_path: Path):
    (tmp_path / "early").mkdir()
    (tmp_path / "early" / "__init__.py").write_text("")
    (tmp_path / "early" / "models.py").write_text(MODELS)
    (tmp_path / "early_settings.py").write_text(SETTINGS)
    env = {
        **os.environ,
        "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}",
        "DJANGO_SETTINGS_MODULE": "early_settings",
    }
    run = subprocess.run(
        [sys.executable, "-c", "import django; django.setup()"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 1
    last = run.stderr.strip().splitlines()[-1]
    assert last == (
        "counters.base.exceptions.TrackedTooEarly: counters.track('comments') was called before "
        "Django's app registry is ready (at import time, e.g. at module level in models.py): "
        "call it from your app's AppConfig.ready()"
    )
    assert run.stderr.count("Traceback") == 1  # one error, nothing chained to it
    assert "Models aren't loaded yet" not in run.stderr
    assert 'early/models.py", line 20' in run.stderr  # it points at the call


def test_the_error_is_the_registrys_own_kind_and_a_counters_error():
    error = counters.TrackedTooEarly("comments")
    assert isinstance(error, AppRegistryNotReady) and isinstance(error, counters.CountersError)
    assert error.counter == "comments"


@pytest.mark.django_db
def test_track_after_the_registry_is_ready_is_not_refused_as_too_early():
    # the blog's declaration, made again in a test: the registry is ready, so it is accepted
    from tests.blog.models import Comment

    tracker = counters.track(
        "post_points",
        Comment,
        key="post",
        into="blog.PostStats.points",
        where=Q(approved=True),
        amount="points",
    )
    assert tracker.name == "post_points"
