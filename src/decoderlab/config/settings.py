"""The base of every settings dataclass (``ModelConfig``, ``TrainConfig``, ``RLConfig``): plain data written to and
read from JSON the one way -- :meth:`Settings.to_dict`, :meth:`Settings.from_dict` (an unknown key refused,
naming the known ones) and :meth:`Settings.replace`."""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

S = TypeVar("S", bound="Settings")


class Settings:
    """A mixin for a ``@dataclass`` of settings. ``to_dict`` gives its fields as JSON-ready values (a tuple as a
    list); ``from_dict`` builds one back, refusing unknown keys; ``replace`` is :func:`dataclasses.replace`."""

    def to_dict(self) -> dict[str, Any]:
        """The fields as a dict (``dataclasses.asdict``), a tuple field as a list (as JSON holds it)."""
        return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(self).items()}

    @classmethod
    def from_dict(cls: type[S], d: dict[str, Any]) -> S:
        """Build from a dict.

        Raises:
            ValueError: a key that is no field, listing the known ones.
        """
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown {cls.__name__} field(s) {unknown}; known: {', '.join(sorted(known))}")
        return cls(**d)

    def replace(self: S, **changes) -> S:
        """A copy with ``changes`` (field -> value); no check beyond the dataclass's own (``validate`` is the
        caller's)."""
        return dataclasses.replace(self, **changes)
