"""The one way a member of the library's enums is read from user input."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import TypeVar

__all__ = ["parse_enum"]

E = TypeVar("E", bound=enum.Enum)


def parse_enum(
    cls: type[E],
    value: object,
    argument: str,
    *,
    also: str = "",
    among: Sequence[E] | None = None,
) -> E:
    """``value`` as a member of ``cls``: a member itself, a member of another enum with the
    same value, or a value.

    Args:
        argument: the argument's name in the error.
        also: other accepted spellings to list in the error (e.g. ``" or 'auto'"``).
        among: the members accepted (default all), e.g. the collective ``Strategy`` members.

    Raises:
        ValueError: naming ``argument``, every option and the value given.
    """
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
