"""The base of every kernel family's configuration class."""

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
