"""Names every experiment kind shares: donor->recipient directions and folder slugs.

A direction reads ``DONOR->RECIPIENT`` (arm names of the spec's ``[arms]``); it is parsed
and validated here and nowhere else, and it names its folders ``DONOR-RECIPIENT``.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from statelab.errors import ConfigError
from statelab.paths import slug  # noqa: F401 (the folder slug every kind imports from here)


@dataclass(frozen=True)
class Direction:
    donor: str
    recipient: str

    @property
    def label(self) -> str:
        return f"{self.donor}->{self.recipient}"

    @property
    def folder(self) -> str:
        return f"{self.donor}-{self.recipient}"

    def __iter__(self):  # donor, recipient = direction
        return iter((self.donor, self.recipient))

    @classmethod
    def parse(cls, text: str) -> "Direction":
        """The one parser of directions: ``"A->R"`` -> Direction("A", "R"); a ConfigError names the expected form."""
        parts = [x.strip() for x in str(text).split("->")]
        if len(parts) != 2 or not all(parts):
            raise ConfigError(f"direction {text!r} must read DONOR->RECIPIENT, e.g. \"A->R\"")
        return cls(*parts)


def parse_directions(items: Iterable[str], arms: Iterable[str], err: Callable[[str], Exception]) -> list[Direction]:
    """A spec's ``directions``: each well formed, naming two different defined arms, none twice."""
    arms = list(arms)
    out: list[Direction] = []
    for d in items:
        try:
            direc = Direction.parse(d)
        except ConfigError as e:
            raise err(str(e)) from None
        for a in direc:
            if a not in arms:
                raise err(f"direction {d!r} names arm {a!r}, which [arms] does not define (arms: {', '.join(arms)})")
        if direc.donor == direc.recipient:
            raise err(f"direction {d!r} has the same donor and recipient")
        if direc in out:
            raise err(f"direction {d!r} is listed twice")
        out.append(direc)
    return out
