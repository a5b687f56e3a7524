"""The base of every kernel family's configuration class, and what a backend answers
for a call it does not take (:class:`Declined`)."""

from dataclasses import dataclass


@dataclass(frozen=True)
class KernelConfig:
    """One compiled configuration of a kernel, frozen and named.

    Equal configurations share their name, so a configuration hashes by its
    name alone: the launchers' caches hash one on every call, and the name's
    str hash is cached where a hash over all the fields is not.  Subclasses
    are frozen dataclasses too; :meth:`__init_subclass__` gives each this
    hash (``dataclass`` would otherwise write its own over every field).
    """

    name: str

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        cls.__hash__ = KernelConfig.__hash__

    def __hash__(self) -> int:
        return hash(self.name)


@dataclass(frozen=True)
class Declined:
    """What a backend's ``choose_config`` returns for a call it does not take, with the
    reason: falsy, so that a caller asks ``if config:``, and the reason says which
    limit the call met (the next backend then takes it)."""

    reason: str

    def __bool__(self) -> bool:
        return False

    def __str__(self) -> str:
        return self.reason
