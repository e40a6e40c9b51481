"""counters.base.conf lookup order and types; the system checks of counters.checks."""

from __future__ import annotations

import pytest
from django.core.checks import Error, Warning, registry, run_checks

from counters.base import conf
from counters.checks import POSITIVE, check_metrics_dir, check_redis_reachable, check_settings

UNREACHABLE = "redis://127.0.0.1:1/0"


@pytest.fixture(autouse=True)
def clean_config(settings, monkeypatch):
    """No COUNTERS_* Django setting and no COUNTERS_* environment variable."""
    for name in conf.SETTINGS:
        monkeypatch.delenv(name, raising=False)
        if hasattr(settings, name):
            delattr(settings, name)
    settings.REDIS_URL = "redis://127.0.0.1:6379/0"


# -- conf.get -----------------------------------------------------------------------

DEFAULTS = {
    "COUNTERS_REDIS_URL": None,
    "COUNTERS_REDIS_CLUSTER": False,
    "COUNTERS_REDIS_SENTINELS": None,
    "COUNTERS_REDIS_SENTINEL_SERVICE": "mymaster",
    "COUNTERS_KEY_PREFIX": "counters",
    "COUNTERS_SHARDS": 16,
    "COUNTERS_BATCH_SIZE": 5000,
    "COUNTERS_FLUSH_INTERVAL": 10,
    "COUNTERS_FLUSH_TIME_BUDGET": 30.0,
    "COUNTERS_LEASE_TIMEOUT": 30.0,
    "COUNTERS_SOCKET_TIMEOUT": 2.0,
    "COUNTERS_LEDGER_RETENTION": 604_800,
    "COUNTERS_AUTO_REBUILD": True,
    "COUNTERS_DATABASES": None,
    "COUNTERS_FLUSH_PARALLELISM": 1,
    "COUNTERS_FLUSH_LANES": 2,
    "COUNTERS_METRICS": False,
    "COUNTERS_AUDIT_INTERVAL": 10,
    "COUNTERS_AUDIT_SLICE": 1000,
    "COUNTERS_AUDIT_RETENTION": 7_776_000,
    "COUNTERS_DURABLE": False,
    "COUNTERS_OUTBOX_GRACE": 30.0,
    "COUNTERS_SEND_DELAY_MS": 200.0,
    "COUNTERS_SEND_BATCH": 500,
    "COUNTERS_DEFER_ACKS": True,
    "COUNTERS_WRITE_BATCH": 1,
}


def test_every_setting_is_known_with_its_default():
    assert {name: conf.get(name) for name in conf.SETTINGS} == DEFAULTS


@pytest.mark.parametrize(
    ("helper", "name"),
    [
        (conf.redis_cluster, "COUNTERS_REDIS_CLUSTER"),
        (conf.key_prefix, "COUNTERS_KEY_PREFIX"),
        (conf.shards, "COUNTERS_SHARDS"),
        (conf.batch_size, "COUNTERS_BATCH_SIZE"),
        (conf.flush_interval, "COUNTERS_FLUSH_INTERVAL"),
        (conf.flush_time_budget, "COUNTERS_FLUSH_TIME_BUDGET"),
        (conf.lease_timeout, "COUNTERS_LEASE_TIMEOUT"),
        (conf.socket_timeout, "COUNTERS_SOCKET_TIMEOUT"),
        (conf.ledger_retention, "COUNTERS_LEDGER_RETENTION"),
        (conf.flush_parallelism, "COUNTERS_FLUSH_PARALLELISM"),
        (conf.flush_lanes, "COUNTERS_FLUSH_LANES"),
        (conf.metrics_enabled, "COUNTERS_METRICS"),
        (conf.audit_interval, "COUNTERS_AUDIT_INTERVAL"),
        (conf.audit_slice, "COUNTERS_AUDIT_SLICE"),
        (conf.audit_retention, "COUNTERS_AUDIT_RETENTION"),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_helpers_read_their_setting(helper, name):
    assert helper() == DEFAULTS[name]


def test_unknown_name_is_a_key_error():
    with pytest.raises(KeyError):
        conf.get("COUNTERS_NOPE")


def test_environment_beats_default(monkeypatch):
    monkeypatch.setenv("COUNTERS_SHARDS", "4")
    assert conf.shards() == 4


def test_django_setting_beats_environment(settings, monkeypatch):
    monkeypatch.setenv("COUNTERS_SHARDS", "4")
    settings.COUNTERS_SHARDS = 8
    assert conf.shards() == 8


def test_setting_is_read_at_call_time(settings):
    settings.COUNTERS_BATCH_SIZE = 5
    assert conf.batch_size() == 5
    settings.COUNTERS_BATCH_SIZE = 7
    assert conf.batch_size() == 7


def test_django_setting_set_to_none_is_not_replaced_by_environment(settings, monkeypatch):
    monkeypatch.setenv("COUNTERS_REDIS_URL", "redis://env:6379/0")
    settings.COUNTERS_REDIS_URL = None
    assert conf.get("COUNTERS_REDIS_URL") is None


@pytest.mark.parametrize(
    ("name", "raw", "expected"),
    [
        ("COUNTERS_SHARDS", "32", 32),
        ("COUNTERS_BATCH_SIZE", " 250 ", 250),
        ("COUNTERS_FLUSH_TIME_BUDGET", "2.5", 2.5),
        ("COUNTERS_LEASE_TIMEOUT", "3", 3.0),
        ("COUNTERS_SOCKET_TIMEOUT", "0.25", 0.25),
        ("COUNTERS_LEDGER_RETENTION", "60", 60),
        ("COUNTERS_FLUSH_PARALLELISM", "4", 4),
        ("COUNTERS_KEY_PREFIX", "tally", "tally"),
        ("COUNTERS_REDIS_URL", "redis://env:6379/2", "redis://env:6379/2"),
    ],
    ids=lambda v: str(v),
)
def test_environment_strings_are_converted(monkeypatch, name, raw, expected):
    monkeypatch.setenv(name, raw)
    value = conf.get(name)
    assert value == expected
    assert type(value) is type(expected)


def test_django_setting_values_are_converted_too(settings):
    settings.COUNTERS_LEASE_TIMEOUT = 3
    settings.COUNTERS_SHARDS = "12"
    assert (conf.lease_timeout(), conf.shards()) == (3.0, 12)
    assert type(conf.lease_timeout()) is float


@pytest.mark.parametrize("raw", ["abc", "1.5", ""], ids=["word", "float", "empty"])
def test_invalid_environment_integer_raises(monkeypatch, raw):
    monkeypatch.setenv("COUNTERS_SHARDS", raw)
    with pytest.raises(ValueError, match="invalid literal for int"):
        conf.shards()


@pytest.mark.parametrize(
    ("raw", "expected"),
    [("1", True), ("TRUE", True), (" yes ", True), ("on", True), ("0", False), ("no", False)],
    ids=lambda v: repr(v),
)
def test_parse_bool_strings(raw, expected):
    setting = conf.Setting("COUNTERS_FLAG", bool, False, "")
    assert conf.parse(setting, raw) is expected


def test_redis_url_falls_back_to_redis_url_setting(settings, monkeypatch):
    settings.REDIS_URL = "redis://from-setting:6379/3"
    assert conf.redis_url() == "redis://from-setting:6379/3"
    monkeypatch.setenv("COUNTERS_REDIS_URL", "redis://from-env:6379/4")
    assert conf.redis_url() == "redis://from-env:6379/4"
    settings.COUNTERS_REDIS_URL = "redis://counters:6379/5"
    assert conf.redis_url() == "redis://counters:6379/5"
    del settings.REDIS_URL
    settings.COUNTERS_REDIS_URL = ""
    assert conf.redis_url() == "redis://127.0.0.1:6379/0"


# -- check_settings -----------------------------------------------------------------


def test_checks_are_registered():
    assert check_settings in registry.registry.get_checks()
    assert check_redis_reachable not in registry.registry.get_checks()
    assert check_redis_reachable in registry.registry.get_checks(include_deployment_checks=True)


def test_valid_configuration_has_no_errors(settings):
    assert check_settings() == []
    settings.COUNTERS_SHARDS = 1
    settings.COUNTERS_FLUSH_TIME_BUDGET = 0.5
    settings.COUNTERS_KEY_PREFIX = "app:counters"
    settings.COUNTERS_REDIS_URL = "unix:///run/redis.sock"
    assert check_settings() == []
    settings.COUNTERS_REDIS_URL = "rediss://cache:6380/1"
    assert check_settings() == []
    settings.COUNTERS_REDIS_URL = "valkeys://cache:6380/1"
    assert check_settings() == []


@pytest.mark.parametrize(
    ("name", "check_id"), sorted(POSITIVE.items()), ids=[n for n in sorted(POSITIVE)]
)
@pytest.mark.parametrize("value", [0, -1], ids=["zero", "negative"])
def test_non_positive_number_is_an_error(settings, name, check_id, value):
    setattr(settings, name, value)
    setting = conf.SETTINGS[name]
    assert check_settings() == [
        Error(
            f"{name} must be a finite number greater than 0 (got {setting.type(value)!r}).",
            id=check_id,
        )
    ]


@pytest.mark.parametrize(
    ("name", "check_id"), sorted(POSITIVE.items()), ids=[n for n in sorted(POSITIVE)]
)
def test_non_number_from_environment_is_an_error(monkeypatch, name, check_id):
    # A context, so conftest's teardown (which reads the socket timeout) sees a valid value.
    with monkeypatch.context() as env:
        env.setenv(name, "ten")
        errors = check_settings()
    assert [e.id for e in errors] == [check_id]
    assert errors[0].msg.startswith(f"{name} is not a valid number: ")
    assert "'ten'" in errors[0].msg


def test_every_positive_check_has_its_own_id():
    assert sorted(POSITIVE.values()) == [
        *(f"counters.E00{i}" for i in range(1, 8)),
        "counters.E017",
        "counters.E020",
        "counters.E021",
        "counters.E030",
        "counters.E031",
        "counters.E093",
    ]
    assert set(POSITIVE) == set(conf.SETTINGS) - {
        "COUNTERS_REDIS_URL",
        "COUNTERS_REDIS_CLUSTER",
        "COUNTERS_REDIS_SENTINELS",  # host:port entries: E080
        "COUNTERS_REDIS_SENTINEL_SERVICE",  # a name: E081
        "COUNTERS_KEY_PREFIX",
        "COUNTERS_AUTO_REBUILD",
        "COUNTERS_DATABASES",
        "COUNTERS_METRICS",
        "COUNTERS_AUDIT_INTERVAL",  # 0 is allowed: E022
        "COUNTERS_DURABLE",  # a boolean: E023
        "COUNTERS_OUTBOX_GRACE",  # positive, and below the push id lifetime: E024, E025
        "COUNTERS_SEND_DELAY_MS",  # 0 is allowed: E029
        "COUNTERS_DEFER_ACKS",  # a boolean: E026
    }


@pytest.mark.parametrize("value", [0, None, 1, 3600], ids=["zero", "none", "one", "hour"])
def test_audit_interval_may_be_0_or_none_for_off(settings, value):
    settings.COUNTERS_AUDIT_INTERVAL = value
    assert check_settings() == []
    assert conf.audit_interval() == (value or 0)


def test_negative_audit_interval_is_e022(settings):
    settings.COUNTERS_AUDIT_INTERVAL = -10
    assert check_settings() == [
        Error(
            "COUNTERS_AUDIT_INTERVAL must be 0 (off) or a number of seconds greater than 0 "
            "(got -10).",
            id="counters.E022",
        )
    ]


def test_audit_interval_that_is_no_number_is_e022(monkeypatch):
    with monkeypatch.context() as env:
        env.setenv("COUNTERS_AUDIT_INTERVAL", "hourly")
        errors = check_settings()
    assert [e.id for e in errors] == ["counters.E022"]
    assert errors[0].msg.startswith("COUNTERS_AUDIT_INTERVAL is not a valid number: ")


@pytest.mark.parametrize("value", [0, 0.5, 5, 1000])
def test_send_delay_may_be_0_for_off_up_to_a_second(settings, value):
    settings.COUNTERS_SEND_DELAY_MS = value
    assert check_settings() == []
    assert conf.send_delay() == value / 1000


@pytest.mark.parametrize("value", [-1, 1001, float("inf"), "soon"])
def test_send_delay_out_of_range_is_e029(settings, value):
    settings.COUNTERS_SEND_DELAY_MS = value
    errors = check_settings()
    assert [e.id for e in errors] == ["counters.E029"]
    assert errors[0].msg.startswith("COUNTERS_SEND_DELAY_MS ")


def test_several_errors_are_reported_together(settings):
    settings.COUNTERS_SHARDS = 0
    settings.COUNTERS_BATCH_SIZE = -5
    settings.COUNTERS_KEY_PREFIX = ""
    assert [e.id for e in check_settings()] == ["counters.E001", "counters.E002", "counters.E008"]


@pytest.mark.parametrize(
    "prefix", ["", "{s0}", "a}b", "two words", None], ids=["empty", "tag", "brace", "space", "none"]
)
def test_bad_key_prefix_is_e008(settings, prefix):
    settings.COUNTERS_KEY_PREFIX = prefix
    assert check_settings() == [
        Error(
            f"COUNTERS_KEY_PREFIX {prefix!r} must be non-empty, without braces or spaces.",
            id="counters.E008",
        )
    ]


@pytest.mark.parametrize(
    "url", ["http://cache:6379/0", "127.0.0.1:6379", "REDIS://x"], ids=["http", "bare", "upper"]
)
def test_non_redis_url_is_e009(settings, url):
    settings.COUNTERS_REDIS_URL = url
    assert check_settings() == [
        Error(f"COUNTERS_REDIS_URL {url!r} is not a redis URL.", id="counters.E009")
    ]


def test_bad_redis_url_setting_fallback_is_e009_too(settings):
    settings.REDIS_URL = "memcached://cache"
    assert [e.id for e in check_settings()] == ["counters.E009"]


def test_none_number_is_an_error_not_a_crash(settings):
    settings.COUNTERS_SHARDS = None
    assert [e.id for e in check_settings()] == ["counters.E001"]


# -- durable mode: E023-E025 ----------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "expected"),
    [("1", True), ("on", True), ("TRUE", True), ("0", False), ("off", False), ("", False)],
)
def test_counters_durable_from_the_environment(monkeypatch, raw, expected):
    monkeypatch.setenv("COUNTERS_DURABLE", raw)
    assert conf.durable() is expected
    assert check_settings() == []


@pytest.mark.parametrize("raw", ["enabled", "2", "durable"])
def test_counters_durable_not_a_boolean_is_e023(monkeypatch, raw):
    monkeypatch.setenv("COUNTERS_DURABLE", raw)
    assert [e.id for e in check_settings()] == ["counters.E023"]
    assert raw in check_settings()[0].msg


def test_counters_durable_setting_true_passes(settings):
    settings.COUNTERS_DURABLE = True
    assert conf.durable() is True
    assert check_settings() == []


@pytest.mark.parametrize("grace", [0, -1, float("nan"), None, "soon"])
def test_bad_outbox_grace_is_e024(settings, grace):
    settings.COUNTERS_OUTBOX_GRACE = grace
    assert [e.id for e in check_settings()] == ["counters.E024"]


def test_outbox_grace_too_close_to_the_push_id_lifetime_is_e025(settings):
    settings.COUNTERS_OUTBOX_GRACE = 100
    settings.COUNTERS_FLUSH_INTERVAL = 20  # 120 s: a row could be pushed after its id is gone
    errors = check_settings()
    assert [e.id for e in errors] == ["counters.E025"]
    assert "120" in errors[0].msg
    settings.COUNTERS_FLUSH_INTERVAL = 19
    assert check_settings() == []


def test_outbox_grace_from_the_environment(monkeypatch):
    monkeypatch.setenv("COUNTERS_OUTBOX_GRACE", "2.5")
    assert conf.outbox_grace() == 2.5
    monkeypatch.setenv("COUNTERS_OUTBOX_GRACE", "500")
    assert [e.id for e in check_settings()] == ["counters.E025"]


# -- check_metrics_dir: E018 ----------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "ids"),
    [
        pytest.param(None, [], id="unset"),
        pytest.param("dir", [], id="a-directory"),
        pytest.param("missing", ["counters.E018"], id="missing"),
        pytest.param("file", ["counters.E018"], id="a-file"),
    ],
)
def test_multiprocess_dir(monkeypatch, tmp_path, value, ids):
    """counters.E018: PROMETHEUS_MULTIPROC_DIR, when set, must be a writable directory."""
    (tmp_path / "dir").mkdir()
    (tmp_path / "file").write_text("")
    if value is None:
        monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    else:
        monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path / value))
    assert [e.id for e in check_metrics_dir()] == ids


# -- check_redis_reachable (deploy) ---------------------------------------------------


@pytest.mark.parametrize(
    ("name", "value", "check_id"),
    [
        pytest.param("COUNTERS_LEASE_TIMEOUT", float("nan"), "counters.E005", id="nan"),
        pytest.param("COUNTERS_FLUSH_TIME_BUDGET", float("inf"), "counters.E004", id="inf"),
        pytest.param("COUNTERS_SHARDS", 1.9, "counters.E001", id="fractional-int"),
    ],
)
def test_non_finite_or_fractional_numbers_are_errors(settings, name, value, check_id):
    setattr(settings, name, value)
    assert [e.id for e in check_settings()] == [check_id]


def test_unreachable_redis_is_w001(settings):
    settings.COUNTERS_REDIS_URL = UNREACHABLE
    warnings = check_redis_reachable()
    assert [(type(w), w.id) for w in warnings] == [(Warning, "counters.W001")]
    assert warnings[0].msg.startswith(f"Redis is unreachable at {UNREACHABLE}: ")
    assert warnings[0].hint == "Counter deltas fall back to direct DB writes until it is back."


def test_unreachable_redis_is_reported_by_deploy_checks_only(settings):
    settings.COUNTERS_REDIS_URL = UNREACHABLE
    assert run_checks(tags=["counters"]) == []
    found = run_checks(tags=["counters"], include_deployment_checks=True)
    assert [w.id for w in found] == ["counters.W001"]


def test_reachable_redis_has_no_warning(fake_redis):
    assert check_redis_reachable() == []
