"""``python -m ts_moe info`` (``ts-moe info``): each kernel family's record
(``csrc_free_kernels.families``) beside whether it loaded and the path its ops take
on this machine's GPU (on a machine without one: the reference), the kernel builds the
pre-flight refused in this process (:func:`lines` called in a process that ran calls),
the DSL toolchain and whether the statuses hold for it (:mod:`ts_moe.toolchain`), then
every setting of ``ts_moe.settings`` and where its value comes from."""

import sys

import torch

from . import toolchain
from .ops import kernels, paths
from .ops.kernels import Family
from .settings import SETTINGS, settings

_SPEC = {s.name: s for s in SETTINGS}


def turned_on(family: Family, code=str) -> str:
    """How ``family`` is turned on, in words (``code`` formats a name: the README's
    backticks): by the ops by default, by its setting (on or off by default), or never."""
    if not family.in_ops:
        return "never by the ops (named in the harness)"
    if not family.setting:
        return "on by default"
    spec = _SPEC[family.setting]
    if spec.default:
        return f"on by default ({code(f'ts_moe.settings.{spec.name} = False')} turns it off)"
    return code(f"ts_moe.settings.{spec.name} = True") + (
        f" (or {code(spec.api + '()')})" if spec.api else "")


def add_arguments(parser) -> None:
    """No arguments."""


def family_path(family: Family, capability: tuple[int, int] | None) -> str:
    """What runs ``family``'s calls on a device of ``capability`` (None: the CPU): "its
    kernels", or what takes them first and why, read from the path table (a call of
    its kernels' first dtype, bf16 where they name none; the settings as they are)."""
    if not family.in_ops:
        return "none: no path of the ops takes it"
    if capability is None or settings.reference:
        why = "no CUDA GPU" if capability is None else "ts_moe.settings.reference is on"
        return f"{paths.Path.REFERENCE.value} ({why})"
    if family.capability != capability:
        major, minor = family.capability
        return f"none: {family.arch} kernels, for capability {major}.{minor} only"
    own, op = paths.kernel_path(family), family.serves[0]
    loaded = kernels.LOADED.get(family.name)
    dtype = loaded.dtypes[0] if loaded is not None and loaded.dtypes else torch.bfloat16
    chain = paths.paths_for(op, capability, dtype, None, 8)
    if chain[0] is own:
        return "its kernels"
    if own in chain:  # behind the kernels of a family of higher precedence
        first = paths.PROVIDER[chain[0], op]
        return (f"its kernels where the {first.name} kernels ({chain[0].value}) decline "
                f"a call")
    why = []
    if family.name not in kernels.LOADED:
        why.append("its import failed")
    if family.setting and not getattr(settings, family.setting):
        why.append(f"ts_moe.settings.{family.setting} is off")
    if not why:
        why.append(f"its kernels take no {str(dtype).removeprefix('torch.')} call of 8 "
                   f"experts")
    return f"{chain[0].value} ({'; '.join(why)})"


def device() -> tuple[str, tuple[int, int] | None]:
    """``(description, capability)`` of this machine's first CUDA GPU, or of the CPU."""
    if not torch.cuda.is_available():
        return "no CUDA GPU: every call takes the plain-torch reference", None
    index = torch.cuda.current_device()
    capability = torch.cuda.get_device_capability(index)
    return f"{torch.cuda.get_device_name(index)} (sm_{capability[0]}{capability[1]})", capability


def lines(description: str, capability: tuple[int, int] | None) -> list[str]:
    rows = [("family", "status", "imported", "turned on", "path on this machine")]
    for f in kernels.FAMILIES:
        imported = "yes" if f.name in kernels.LOADED else "no"
        rows.append((f.name, f.proof.value, imported, turned_on(f), family_path(f, capability)))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    out = [f"device: {description}", ""]
    out += ["  ".join(c.ljust(w) for c, w in zip(r[:4], widths)) + "  " + r[4] for r in rows]
    out += ["", "families:"]
    for f in kernels.FAMILIES:
        out.append(f"  {f.name}: {f.title} ({f.arch}; {f.load.__module__})")
        if f.run:
            out.append(f"      run: {f.run}")
        out.append(f"      evidence: {f.evidence}")
        if f.name in kernels.FAILED:
            out.append(f"      import failed: {kernels.FAILED[f.name]}")
    out += ["", "kernel builds the pre-flight refused in this process (their calls take the "
                "next path):"]
    out += [f"  {r.build}: breaks {', '.join(r.rules)}" for r in kernels.refused()] or ["  none"]
    out += ["", *toolchain.lines()]
    out += ["", "settings (ts_moe.settings):"]
    for s in settings.SETTINGS:
        env = f"  {s.env}" if s.env else ""
        out.append(f"  {s.name} = {getattr(settings, s.name)!r}  ({settings.source(s.name)}){env}")
    return out


def run() -> int:
    """Prints the families and the settings; 2 (and why) where a setting's variable is bad
    (started as a command, ``import ts_moe`` refuses it first, alike: ts_moe/__init__.py)."""
    try:
        text = lines(*device())
    except ValueError as exc:  # a TS_MOE_* variable with a value its setting does not take
        print(f"ts_moe info: {exc}", file=sys.stderr)
        return 2
    print("\n".join(text))
    return 0
