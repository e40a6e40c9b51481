"""Template tags: ``{% load counters %}``, then a counter's exact value in a template.

::

    {% counter "post_comments" post %}                 the exact value (0 for a new key)
    {% counter "post_comments" post.pk as n %}         the same, kept in ``n``
    {% counters "post_comments" posts as comments %}   every post's value, in one read
    {% for post in posts %}{{ comments|get:post }}{% endfor %}
    {% for pk, n in comments.items %}...{% endfor %}

A key is what :func:`counters.get_value` takes; a model instance stands for its
primary key. ``{% counters %}`` reads every key of the list at once
(:func:`counters.get_values`) and gives a :class:`CounterValues`, looked up by
an object or by its key.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from django import template
from django.db import DEFAULT_DB_ALIAS, models

from counters.read.values import get_values

register = template.Library()


def _key(item: Any) -> Any:
    """A model instance stands for its primary key; anything else is a key already."""
    return item.pk if isinstance(item, models.Model) else item


class CounterValues(Mapping[Any, int]):
    """The values of one counter for the objects of a list, read at once.

    ``values[post]`` and ``values[post.pk]`` are the same value; iterating gives
    the keys in the list's order, ``items()`` (key, value) pairs; ``objects`` is the list.
    """

    def __init__(self, objects: list[Any], values: dict[Any, int]) -> None:
        self.objects = objects
        self._values = values

    def __getitem__(self, item: Any) -> int:
        return self._values[_key(item)]

    def __iter__(self) -> Iterator[Any]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __contains__(self, item: object) -> bool:
        return _key(item) in self._values

    def __repr__(self) -> str:
        return f"CounterValues({self._values!r})"


@register.simple_tag
def counter(name: str, key: Any, using: str = DEFAULT_DB_ALIAS) -> int:
    """``{% counter "post_comments" post %}``: the exact value, as :func:`counters.get_value`
    gives it (stored + buffered; 0 for a key with no row and nothing buffered)."""
    return get_values(name, [_key(key)], using=using)[_key(key)]


@register.simple_tag(name="counters")
def counters_tag(name: str, objects: Iterable[Any], using: str = DEFAULT_DB_ALIAS) -> CounterValues:
    """``{% counters "post_comments" posts as comments %}``: every object's value, one read."""
    listed = list(objects)
    return CounterValues(listed, get_values(name, [_key(o) for o in listed], using=using))


@register.filter
def get(mapping: Any, item: Any) -> Any:
    """``{{ comments|get:post }}``: the value of ``post`` (or of a key); None if absent."""
    try:
        return mapping[item]
    except (KeyError, IndexError, TypeError):
        return None
