"""Project settings derived from the environment."""

import pytest

from config.settings import _redis_db


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/1"),
        ("redis://:secret@cache.internal:6380/4", "redis://:secret@cache.internal:6380/1"),
        ("rediss://cache.internal:6380/0", "rediss://cache.internal:6380/1"),
    ],
    ids=["default", "password", "tls"],
)
def test_celery_broker_defaults_to_database_1_of_the_redis_server(url, expected):
    assert _redis_db(url, 1) == expected


def test_broker_url_without_a_database_number_gets_one():
    assert _redis_db("redis://127.0.0.1:6379", 1) == "redis://127.0.0.1:6379/1"


def test_non_redis_broker_is_left_alone():
    assert _redis_db("amqp://guest@127.0.0.1//", 1) == "amqp://guest@127.0.0.1//"


def test_a_unix_socket_broker_is_database_1_of_the_same_socket():
    url = _redis_db("unix:///run/redis/redis.sock?db=0", 1)
    assert url == "redis+socket:///run/redis/redis.sock?virtual_host=1"
