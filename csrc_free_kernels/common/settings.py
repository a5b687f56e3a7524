"""The switches and environment variables of the kernels, and the machinery of
``ts_moe.settings``, the one object that owns every switch of the package.

A setting is declared once, as a :class:`Setting`: its attribute, its
environment variable (or none: set from code only), its default, what it
does and when it is read.  A settings object answers each attribute at the
moment it is read: the value set from code (``settings.pdl = False``), else
its environment variable as it is now, else the default.  ``del
settings.pdl`` (or :meth:`SettingsBase.reset`) goes back to the environment.
A variable holding a value the setting does not take raises ``ValueError``
naming the variable, where it is read (and ``import ts_moe`` reads them all,
so that a bad one fails the same on every device); an empty one reads as
unset.

Why here: data flows down, ``ts_moe -> csrc_free_kernels -> ts_pipeline``, and
the kernels read switches of their own (PDL at each build, the disk cache at
each load and store).  So this module, which imports nothing of the package,
holds the machinery and :data:`settings`, the kernels' part
(:class:`KernelSettings`); ``ts_moe.settings`` is a
:class:`ts_moe.settings.Settings`, a subclass that adds the op layer's
switches and shares this object's values, so that setting ``pdl`` on either
object is seen by both.  Nothing here imports ``cutlass``.

Not settings: the DSL's own ``CUTE_DSL_*`` variables (the target arch, kept
PTX, dump directories), which ``cutlass`` reads once at import and the build
tooling sets for its child processes (``python -m ts_moe compile``,
:mod:`.ptx_dump`, and :func:`.compile.codegen_environment`, which keys the
cache on the values the DSL read).
"""

import contextlib
import dataclasses
import os
import warnings

_UNSET = object()
# os.environ's own store, by encoded key: an op reads a setting at every call, and
# os.environ.get encodes the key and decodes the value each time (0.7 us against
# 0.04 us here, on the CPU of this project's CI); os.environ keeps the store current
_STORE = getattr(os.environ, "_data", None)
_ENCODE = getattr(os.environ, "encodekey", None)
_DECODE = getattr(os.environ, "decodevalue", None)
_KEYS: dict = {}
_unknown: set = set()  # TS_MOE_* variables of no setting, warned about in this process
SHOWN = 80  # characters of a value an error quotes


def shown(value) -> str:
    """``repr(value)`` for an error message, its first :data:`SHOWN` characters where it is
    longer (a variable may hold any amount of text), saying how long it is."""
    text = value if isinstance(value, str) else repr(value)
    if len(text) <= SHOWN:
        return repr(value)
    return f"{text[:SHOWN]!r}... ({len(text)} characters)"


def _environ_get(name: str) -> str | None:
    """``os.environ.get(name)``, without its per-call encoding where the store allows."""
    if _STORE is None or _ENCODE is None or _DECODE is None:
        return os.environ.get(name)
    key = _KEYS.get(name)
    if key is None:
        key = _KEYS[name] = _ENCODE(name)
    raw = _STORE.get(key)
    return None if raw is None else _DECODE(raw)


@dataclasses.dataclass(frozen=True)
class Setting:
    """One setting: ``name`` (the attribute), ``default``, what it ``does`` and when
    it is ``read``; ``env``: its environment variable, or None (code only);
    ``values``: the variable's accepted texts and what each means (None: any
    text, a path); ``api``: the function that sets it too, if any."""

    name: str
    default: object
    does: str
    read: str
    env: str | None = None
    values: dict | None = None
    api: str | None = None

    @property
    def kind(self) -> type:
        return type(self.default) if self.default is not None else str

    def from_environment(self):
        """Its value from the environment as it is now (the default where unset or empty)."""
        raw = _environ_get(self.env) if self.env else None
        if not raw:
            return self.default
        if self.values is None:
            return raw
        try:
            return self.values[raw]
        except KeyError:
            accepted = ", ".join(f"{k} ({'on' if v else 'off'})" for k, v in self.values.items())
            raise ValueError(f"{self.env}={shown(raw)}: {self.name} takes {accepted}; "
                             f"unset means {self.default_text()}") from None

    def check(self, value):
        """``value`` as set from code, or ``TypeError``/``ValueError`` naming the setting."""
        if self.kind is bool:
            if type(value) is not bool:
                raise TypeError(f"settings.{self.name} takes True or False, got {shown(value)}")
            return value
        if value is None:
            return None
        if not isinstance(value, (str, os.PathLike)):
            raise TypeError(f"settings.{self.name} takes a path or None, got {shown(value)}")
        try:
            path = os.fspath(value)
        except TypeError:  # a __fspath__ that returns neither str nor bytes
            path = None
        if not isinstance(path, str):  # bytes too: the cache's paths are str
            raise TypeError(f"settings.{self.name} takes a str path or None, got {shown(value)}, "
                            f"whose path is {type(path).__name__}")
        if "\0" in path:
            raise ValueError(f"settings.{self.name} takes a path without a NUL byte, got "
                             f"{shown(path)}")
        if not os.path.isabs(path):
            raise ValueError(f"settings.{self.name} takes an absolute path, got {shown(path)}")
        return path

    def default_text(self) -> str:
        if self.kind is bool:
            return "on" if self.default else "off"
        return "unset" if self.default is None else repr(self.default)


def setting_property(spec: Setting) -> property:
    """The attribute of ``spec`` on a :class:`SettingsBase` subclass."""

    def get(self):
        value = self._values.get(spec.name, _UNSET)
        return spec.from_environment() if value is _UNSET else value

    def set_(self, value):
        self._values[spec.name] = spec.check(value)

    def delete(self):
        self._values.pop(spec.name, None)

    return property(get, set_, delete, doc=f"{spec.does} (read {spec.read})")


class SettingsBase:
    """Settings read at call time (module docstring); ``SETTINGS`` lists the
    :class:`Setting` of each attribute.  ``shared``: an object whose values this
    one reads and writes (one set of values, two views)."""

    __slots__ = ("_values",)
    SETTINGS: tuple = ()

    def __init__(self, shared: "SettingsBase | None" = None):
        self._values = shared._values if shared is not None else {}

    def reset(self, *names: str) -> None:
        """Forget the values set from code (of ``names``, else all): the
        environment and the defaults answer again."""
        known = {s.name for s in self.SETTINGS}
        for name in names:
            if name not in known:
                raise AttributeError(f"no setting {name!r}; known: {', '.join(sorted(known))}")
        for name in names or known:
            self._values.pop(name, None)

    @contextlib.contextmanager
    def override(self, **values):
        """Set ``values`` for the ``with`` block, then put back what was there."""
        saved = {name: self._values.get(name, _UNSET) for name in values}
        try:
            for name, value in values.items():
                if name not in {s.name for s in self.SETTINGS}:
                    raise AttributeError(f"no setting {name!r}")
                setattr(self, name, value)
            yield self
        finally:
            for name, value in saved.items():
                if value is _UNSET:
                    self._values.pop(name, None)
                else:
                    self._values[name] = value

    def check_environment(self) -> None:
        """Read every setting's variable now: ``ValueError`` naming the first that holds a
        value its setting does not take.  A ``TS_MOE_*`` variable that is no setting's
        (a misspelling, or a setting set from code only) would be ignored without a
        word: it costs one warning per process, naming the variables there are."""
        for spec in self.SETTINGS:
            spec.from_environment()
        known = {s.env for s in self.SETTINGS if s.env}
        for name in sorted(os.environ):
            if name.startswith("TS_MOE_") and name not in known and name not in _unknown:
                _unknown.add(name)
                warnings.warn(self._unknown_variable(name, known), UserWarning, stacklevel=2)

    def _unknown_variable(self, name: str, known: set) -> str:
        message = (f"{name} is not a ts_moe setting's variable and is ignored; the variables "
                   f"are {', '.join(sorted(known))}")
        for spec in self.SETTINGS:
            if spec.env is None and name == f"TS_MOE_{spec.name.upper()}":
                value = not spec.default  # the switch away from the default
                call = "()" if value else f"({value})"
                setter = f"{spec.api}{call} or " if spec.api else ""
                message += (f"; {spec.name} is set from code only "
                            f"({setter}ts_moe.settings.{spec.name} = {value})")
        return message

    def source(self, name: str) -> str:
        """Where ``name``'s value comes from now: "code", its variable, or "default"."""
        spec = next(s for s in self.SETTINGS if s.name == name)
        if name in self._values:
            return "code"
        if spec.env and os.environ.get(spec.env):
            return spec.env
        return "default"

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{s.name}={getattr(self, s.name)!r}' for s in self.SETTINGS)})"


PDL = Setting(
    "pdl", True, env="TS_MOE_PDL", values={"0": False, "1": True},
    does="the sm_90 kernels use programmatic dependent launch (a kernel may start "
         "while the one ahead of it in the stream finishes)",
    read="at each kernel build: a kernel already built in the process keeps what it was "
         "built with")
DISK_CACHE = Setting(
    "disk_cache", True, env="TS_MOE_NO_DISK_CACHE", values={"0": True, "1": False},
    does="compiled kernels are kept on disk for the next process (`1` in the variable "
         "keeps them in memory only)",
    read="at each kernel load and store")
CACHE_DIR = Setting(
    "cache_dir", None, env="TS_MOE_CACHE_DIR",
    does="the disk cache's directory, an absolute path (unset: `~/.cache/ts_moe`); a "
         "relative path in the variable costs a warning and keeps kernels in memory",
    read="at each kernel load and store")


class KernelSettings(SettingsBase):
    """The kernels' settings (``csrc_free_kernels`` reads them)."""

    __slots__ = ()
    SETTINGS = (PDL, DISK_CACHE, CACHE_DIR)
    pdl = setting_property(PDL)
    disk_cache = setting_property(DISK_CACHE)
    cache_dir = setting_property(CACHE_DIR)


settings = KernelSettings()
"""The kernels' settings; ``ts_moe.settings`` shares its values."""
