"""The one way a member of the library's enums is read from user input."""

from __future__ import annotations

import enum
from typing import TypeVar

__all__ = ["parse_enum"]

E = TypeVar("E", bound=enum.Enum)


def parse_enum(cls: type[E], value: object, argument: str, *, also: str = "") -> E:
    """``value`` as a member of ``cls``: a member itself, a member of another enum with the
    same value (the registry's ``Strategy`` for a ``CollectiveStrategy``), or a value.

    Args:
        argument: the argument's name in the error.
        also: other accepted spellings to list in the error (e.g. ``" or 'auto'"``).

    Raises:
        ValueError: naming ``argument``, every option and the value given.
    """
    if isinstance(value, cls):
        return value
    raw = value.value if isinstance(value, enum.Enum) else value
    try:
        return cls(raw)
    except ValueError:
        options = ", ".join(repr(m.value) for m in cls)
        raise ValueError(f"{argument} must be one of {options}{also}; got {raw!r}") from None
