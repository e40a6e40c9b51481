"""Django settings for Tally.

Twelve-factor: everything that differs between machines comes from the
environment. With no environment at all the project runs on an SQLite file in
``var/`` and the Redis server at ``redis://127.0.0.1:6379/0``.

``COUNTERS_*`` settings are not set here on purpose: ``counters.base.conf`` reads an
environment variable of the same name when a setting is absent, so
``COUNTERS_BATCH_SIZE=500 make run`` just works.
"""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import dj_database_url

BASE_DIR = Path(__file__).resolve().parent.parent
VAR_DIR = Path(os.environ.get("TALLY_VAR_DIR", BASE_DIR / "var"))


def env_bool(name: str, default: bool) -> bool:
    value = os.environ.get(name)
    if value is None:
        return default
    return value.strip().lower() in {"1", "true", "yes", "on"}


SECRET_KEY = os.environ.get("SECRET_KEY", "django-insecure-tally-development-key-change-me")
DEBUG = env_bool("DEBUG", True)
ALLOWED_HOSTS = [h for h in os.environ.get("ALLOWED_HOSTS", "localhost,127.0.0.1").split(",") if h]

# HTTPS in production: every one is off by default (plain HTTP in development)
# and turned on from the environment; `manage.py check --deploy` tells which are missing.
SECURE_SSL_REDIRECT = env_bool("SECURE_SSL_REDIRECT", False)
SECURE_HSTS_SECONDS = int(os.environ.get("SECURE_HSTS_SECONDS", "0"))
SECURE_HSTS_INCLUDE_SUBDOMAINS = env_bool("SECURE_HSTS_INCLUDE_SUBDOMAINS", False)
SECURE_HSTS_PRELOAD = env_bool("SECURE_HSTS_PRELOAD", False)
SESSION_COOKIE_SECURE = env_bool("SESSION_COOKIE_SECURE", False)
CSRF_COOKIE_SECURE = env_bool("CSRF_COOKIE_SECURE", False)
CSRF_TRUSTED_ORIGINS = [o for o in os.environ.get("CSRF_TRUSTED_ORIGINS", "").split(",") if o]
if env_bool("SECURE_PROXY_SSL_HEADER", False):
    # Only behind a proxy that sets X-Forwarded-Proto itself and drops the client's.
    SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "whitenoise.runserver_nostatic",
    "django.contrib.staticfiles",
    "django_celery_beat",
    "counters",
    "notifications",
    "benchmarks",
]

MIDDLEWARE = [
    "counters.middleware.AcknowledgeMiddleware",
    "django.middleware.security.SecurityMiddleware",
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

ROOT_URLCONF = "config.urls"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

WSGI_APPLICATION = "config.wsgi.application"
ASGI_APPLICATION = "config.asgi.application"

DATABASES = {
    "default": dj_database_url.parse(
        os.environ.get("DATABASE_URL") or f"sqlite:///{VAR_DIR / 'tally.sqlite3'}",
        conn_max_age=int(os.environ.get("CONN_MAX_AGE", "0")),
    )
}
if DATABASES["default"]["ENGINE"] == "django.db.backends.sqlite3":
    Path(DATABASES["default"]["NAME"]).parent.mkdir(parents=True, exist_ok=True)
    # Web, worker and beat share one file: WAL lets readers run beside the
    # writer, IMMEDIATE takes the write lock up front (no upgrade deadlocks),
    # and the timeout makes writers queue instead of failing.
    DATABASES["default"]["OPTIONS"] = {
        "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;",
        "transaction_mode": "IMMEDIATE",
        "timeout": 30,
    }
    # A file, not memory, so subprocesses started by tests see the test database;
    # one per test run, so runs side by side do not share it.
    DATABASES["default"]["TEST"] = {"NAME": str(VAR_DIR / f"test-tally-{os.getpid()}.sqlite3")}
elif DATABASES["default"]["ENGINE"].startswith("django.db.backends.postgresql"):
    # One test database per test run, so two checkouts testing at once never share one.
    DATABASES["default"]["TEST"] = {"NAME": f"test_tally_{os.getpid()}"}
elif DATABASES["default"]["ENGINE"] == "django.db.backends.mysql":
    # MySQL/MariaDB: utf8mb4 (Django's "utf8" is the 3-byte utf8mb3 there), and Django's
    # default isolation level, READ COMMITTED, which the counters app needs (check E081).
    DATABASES["default"]["OPTIONS"] = {
        "charset": "utf8mb4",
        **DATABASES["default"].get("OPTIONS", {}),
    }
    DATABASES["default"]["TEST"] = {"NAME": f"test_tally_{os.getpid()}", "CHARSET": "utf8mb4"}

DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.UserAttributeSimilarityValidator"},
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
    {"NAME": "django.contrib.auth.password_validation.NumericPasswordValidator"},
]

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

STATIC_URL = "static/"
STATIC_ROOT = VAR_DIR / "static"
STATIC_ROOT.mkdir(parents=True, exist_ok=True)
# Static files are served by whitenoise, from the apps' static/ folders unless
# `collectstatic` has filled STATIC_ROOT; nothing is loaded from elsewhere.
STORAGES = {
    "default": {"BACKEND": "django.core.files.storage.FileSystemStorage"},
    "staticfiles": {"BACKEND": "whitenoise.storage.CompressedStaticFilesStorage"},
}
WHITENOISE_USE_FINDERS = True

LOGIN_URL = "login"
LOGIN_REDIRECT_URL = "/"
LOGOUT_REDIRECT_URL = "login"

# Redis: the counter buffer uses REDIS_URL; Celery's broker defaults to
# database 1 of the same server.
REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")


def _redis_db(url: str, db: int) -> str:
    """``url`` pointing at database ``db`` of the same Redis server (a ``valkey://`` or
    ``valkeys://`` URL written ``redis://`` or ``rediss://``, and a ``unix://`` socket
    ``redis+socket://``, which Celery reads)."""
    parts = urlsplit(url)
    if parts.scheme == "unix":
        return f"redis+socket://{parts.netloc}{parts.path}?virtual_host={db}"
    scheme = {"valkey": "redis", "valkeys": "rediss"}.get(parts.scheme, parts.scheme)
    if scheme not in ("redis", "rediss"):
        return url
    return urlunsplit(parts._replace(scheme=scheme, path=f"/{db}"))


CELERY_BROKER_URL = os.environ.get("CELERY_BROKER_URL", _redis_db(REDIS_URL, 1))
CELERY_TASK_IGNORE_RESULT = True
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
CELERY_WORKER_HIJACK_ROOT_LOGGER = False
CELERY_BEAT_SCHEDULER = "django_celery_beat.schedulers:DatabaseScheduler"
CELERY_TIMEZONE = TIME_ZONE

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s %(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "root": {"handlers": ["console"], "level": os.environ.get("LOG_LEVEL", "WARNING")},
    "loggers": {
        "counters": {"level": os.environ.get("COUNTERS_LOG_LEVEL", "INFO")},
        "notifications": {"level": os.environ.get("COUNTERS_LOG_LEVEL", "INFO")},
    },
}
