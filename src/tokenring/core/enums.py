"""The one way a member of the library's enums is read from user input."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import TypeVar

__all__ = ["parse_enum"]

E = TypeVar("E", bound=enum.Enum)


def parse_enum(
    cls: type[E], value: object, argument: str, *, also: str = "", among: Sequence[E] | None = None
) -> E:
    """``value`` (a member, a member of another enum with the same value, or a value) as a
    member of ``cls`` among ``among`` (default all); else ValueError naming ``argument``, the
    options (and ``also``, e.g. ``" or 'auto'"``) and the value."""
    options = tuple(cls) if among is None else tuple(among)
    if isinstance(value, cls) and value in options:
        return value
    raw = value.value if isinstance(value, enum.Enum) else value
    try:
        member: E | None = cls(raw)
    except ValueError:
        member = None
    if member is None or member not in options:
        names = ", ".join(repr(m.value) for m in options)
        raise ValueError(f"{argument} must be one of {names}{also}; got {raw!r}")
    return member
