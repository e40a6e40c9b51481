"""Counter specs: a name mapped to the model, key field and value field it updates."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from numbers import Number
from typing import Any, Protocol, cast

from django.apps import apps
from django.core import validators
from django.core.exceptions import ValidationError
from django.db import DEFAULT_DB_ALIAS, models

from counters.base.exceptions import InvalidKey, UnknownCounter
from counters.base.keys import KeyCodec
from counters.base.utils import model_field, target_field, to_str


class TruthSource(Protocol):
    """Where a counter's true values come from, for rebuilds.

    ``using`` is the database alias whose counters are being rebuilt: the
    truth must be read from that database.
    """

    def keys_after(
        self, after: Any | None, limit: int, *, using: str = DEFAULT_DB_ALIAS
    ) -> list[Any]:
        """Up to ``limit`` keys greater than ``after`` (None: from the start), in order.

        Keyset pagination: never OFFSET, so the cost per page stays flat.
        """
        ...

    def count_for(self, keys: list[Any], *, using: str = DEFAULT_DB_ALIAS) -> dict[Any, int]:
        """The true value of each key (keys left out are 0)."""
        ...

    def estimate(self, *, using: str = DEFAULT_DB_ALIAS) -> int:
        """About how many keys ``keys_after`` will yield in all (for progress)."""
        ...


@dataclass(frozen=True)
class CounterSpec:
    """One counter: rows of ``model`` keyed by ``key_field`` holding ``value_field``.

    ``key_field`` must be unique (usually the primary key). When it is a foreign
    key, deltas for keys whose target row is gone are dropped instead of
    creating a counter row for it. A ``non_negative`` counter is never read
    below zero (see ``counters.write.negatives``).
    """

    name: str
    model_label: str
    #: A field name; a tuple of them for a composite key (:mod:`counters.base.keys`).
    key_field: str | tuple[str, ...] = "pk"
    value_field: str = "count"
    source: TruthSource | None = field(default=None, compare=False)
    non_negative: bool = False

    @cached_property
    def model(self) -> type[models.Model]:
        return apps.get_model(self.model_label)

    @cached_property
    def codec(self) -> KeyCodec | None:
        """The parts of a composite key; None for a key of one field."""
        if isinstance(self.key_field, str):
            return None
        return KeyCodec([model_field(self.model, name) for name in self.key_field])

    @cached_property
    def key_model_field(self) -> models.Field[Any, Any]:
        """The key field (a composite key's first part)."""
        if self.codec is not None:
            return self.codec.fields[0]
        return model_field(self.model, cast(str, self.key_field))

    @cached_property
    def key_attname(self) -> str:
        return self.key_model_field.attname

    @cached_property
    def target_model(self) -> type[models.Model] | None:
        """The model a foreign-key key field points to, else None (and for a composite key)."""
        if self.codec is not None:
            return None
        remote = self.key_model_field.remote_field
        return remote.model if remote is not None else None

    @cached_property
    def to_key(self) -> Callable[[Any], Any]:
        """Converts a key read back from Redis (a string) to the field's Python value.

        Plain ``int`` for integer keys (the common case, and the flush's hot loop),
        else the field's ``to_python``.
        """
        if self.codec is not None:
            return self.codec.normalize
        field = self.key_model_field
        target = target_field(field) if field.is_relation else field
        if not isinstance(target, models.IntegerField):  # Auto and BigAuto fields are
            return field.to_python

        def to_int(raw: Any) -> Any:
            try:
                return int(raw)
            except ValueError:
                return field.to_python(raw)  # raises the field's ValidationError

        return to_int

    @cached_property
    def _bounds(self) -> list[Callable[[Any], None]]:
        """The key field's range and length validators: a key outside them cannot be stored."""
        field = self.key_model_field
        target = target_field(field) if field.is_relation else field
        kinds = (
            validators.MinValueValidator,
            validators.MaxValueValidator,
            validators.MaxLengthValidator,
            validators.ProhibitNullCharactersValidator,
        )
        return [v for v in target.validators if isinstance(v, kinds)]

    def normalize(self, key: Any) -> Any:
        """``key`` as the key field's Python value (``"7"`` → ``7`` for an integer key).

        Every path turns keys into members through this, so ``"7"`` and ``7``
        are one counter. Raises :class:`InvalidKey` for a model instance, None,
        a value the field cannot hold, or a number the field would change
        (``2.7`` for an integer key, which would be 2).
        """
        if isinstance(key, models.Model):
            raise InvalidKey(self.name, key, "a model instance is not a key; pass obj.pk")
        if key is None:
            raise InvalidKey(self.name, key, "None is not a key")
        if self.codec is not None:
            return self._composite(key)
        try:
            value = self.to_key(key)
            for check in self._bounds:
                check(value)
        except (ValidationError, TypeError, ValueError, OverflowError) as exc:
            reason = "; ".join(exc.messages) if isinstance(exc, ValidationError) else str(exc)
            raise InvalidKey(self.name, key, reason) from None
        if value is None:
            raise InvalidKey(self.name, key, "None is not a key")
        if isinstance(key, Number) and not isinstance(key, int) and value != key:
            # int(2.7) is 2: another counter than the one meant
            raise InvalidKey(
                self.name, key, f"not exactly a value of the key field (it would be {value!r})"
            )
        return value

    def _composite(self, key: Any) -> Any:
        """``key`` as a :class:`~counters.base.keys.CompositeKey`; else raises InvalidKey."""
        try:
            return cast(KeyCodec, self.codec).normalize(key)
        except (ValidationError, TypeError, ValueError, OverflowError) as exc:
            reason = "; ".join(exc.messages) if isinstance(exc, ValidationError) else str(exc)
            raise InvalidKey(self.name, key, reason) from None

    @cached_property
    def int_range(self) -> tuple[int, int]:
        """``(lowest, highest)`` ``int`` key that is its own normal form (:meth:`member`'s
        shortcut): the bounds of a key of one integer field whose only validators are
        bounds. An empty range (``(1, 0)``) when :meth:`normalize` must decide each key."""
        if self.codec is not None:
            return _NO_INTS
        field = self.key_model_field
        target = target_field(field) if field.is_relation else field
        if not isinstance(target, models.IntegerField):
            return _NO_INTS
        low, high = -(2**63), 2**63 - 1
        for check in self._bounds:
            if not isinstance(check, validators.MinValueValidator | validators.MaxValueValidator):
                return _NO_INTS
            limit = check.limit_value
            if isinstance(limit, bool) or not isinstance(limit, int):
                return _NO_INTS
            if isinstance(check, validators.MinValueValidator):
                low = max(low, limit)
            else:
                high = min(high, limit)
        return low, high

    def member(self, key: Any) -> str:
        """The Redis member of ``key`` (normalised first; see :meth:`normalize`).

        An ``int`` within :attr:`int_range` is its own normal form: it is used
        as is, without the validators' calls.
        """
        low, high = self.int_range
        if type(key) is int and low <= key <= high:
            return f"{self.name}:{key}"
        return f"{self.name}:{self.normalize(key)}"


#: :attr:`CounterSpec.int_range` of a key whose every value :meth:`~CounterSpec.normalize`
#: decides.
_NO_INTS = (1, 0)
_registry: dict[str, CounterSpec] = {}


def register(
    name: str,
    model: str | type[models.Model],
    *,
    key_field: str | tuple[str, ...] = "pk",
    value_field: str = "count",
    source: TruthSource | None = None,
    non_negative: bool = False,
) -> CounterSpec:
    """Register a counter. ``model`` is a label ("app.Model") or a model class.

    ``source`` tells rebuilds how to recompute the true values; a counter
    without one can be flushed but not rebuilt. ``non_negative=True`` (a
    count of things) makes reads show 0 instead of a negative value, which
    only drift can cause; such a key is logged and queued for repair.

    Registering the same name twice with the same arguments is harmless; with
    different arguments it is an error.
    """
    if ":" in name:
        raise ValueError(f"counter name {name!r} must not contain ':'")
    label = model if isinstance(model, str) else model._meta.label
    spec = CounterSpec(name, label, key_field, value_field, source, non_negative)
    existing = _registry.get(name)
    if existing is not None and existing != spec:
        raise ValueError(f"counter {name!r} is already registered as {existing}")
    _registry.setdefault(name, spec)
    return _registry[name]


def get_spec(name: str) -> CounterSpec:
    try:
        return _registry[name]
    except KeyError:
        raise UnknownCounter(name) from None


def all_specs() -> list[CounterSpec]:
    return list(_registry.values())


def parse_member(member: str | bytes) -> tuple[CounterSpec, Any]:
    """Split a Redis member "<name>:<key>" into its spec and typed key."""
    text = to_str(member)
    name, _, raw_key = text.partition(":")
    spec = get_spec(name)
    return spec, spec.to_key(raw_key)
