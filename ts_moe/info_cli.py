"""``python -m ts_moe info`` (``ts-moe info``): each kernel family's status
(:mod:`ts_moe.ops.kernel_status`) beside whether it imported and the path its
ops take on this machine's GPU (on a machine without one: the reference), the DSL
toolchain and whether the statuses hold for it (:mod:`ts_moe.toolchain`), then every
setting of ``ts_moe.settings`` and where its value comes from."""

import sys

import torch

from . import toolchain
from .fp8.paths import Fp8Path
from .ops import kernel_status as status
from .ops import kernels, paths
from .settings import settings

_BF16_KERNEL = {status.GEMM_SM90.name: paths.Path.KERNEL_SM90,
                status.GEMM_DW_SM90.name: paths.Path.KERNEL_SM90,
                status.GEMM_SM100.name: paths.Path.KERNEL_SM100}
_CAPABILITY = {"sm_90a": (9, 0), "sm_100a": (10, 0)}
_DEVICE_FAMILIES = {status.ROUTE_SM90.name, status.SWIGLU_SM90.name, status.ROUTER_SM90.name}
_FP8_FAMILIES = {status.GEMM_FP8_SM90.name, status.QUANTIZE_FP8_SM90.name}


def add_arguments(parser) -> None:
    """No arguments."""


def _bf16_path(capability) -> paths.Path:
    """The bf16 GEMMs' path on a device of ``capability`` with the settings as they are."""
    return paths.choose_path(capability, torch.bfloat16, None, 8,
                             kernels_available=capability in paths.KERNEL_MAX_EXPERTS,
                             has_torch_grouped_mm=hasattr(torch, "_grouped_mm"),
                             sm100_opt_in=settings.sm100_kernel)


def family_path(family: status.FamilyStatus, capability: tuple[int, int] | None) -> str:
    """What runs ``family``'s calls on a device of ``capability`` (None: the CPU): "its
    kernels", or what takes them instead and why."""
    if not family.in_ops:
        return "none: no path of the ops takes it"
    if capability is None or settings.reference:
        why = "no CUDA GPU" if capability is None else "ts_moe.settings.reference is on"
        return f"the plain-torch reference ({why})"
    if _CAPABILITY[family.arch] != capability:
        major, minor = _CAPABILITY[family.arch]
        return f"none: {family.arch} kernels, for capability {major}.{minor} only"
    off = []
    if family.name not in kernels.AVAILABLE:
        off.append("its import failed")
    if family.setting and not getattr(settings, family.setting):
        off.append(f"ts_moe.settings.{family.setting} is off")
    bf16 = _bf16_path(capability)
    if family.name in _BF16_KERNEL:
        if bf16 is _BF16_KERNEL[family.name]:
            if not off:
                return "its kernels"
            bf16 = paths.choose_path(capability, torch.bfloat16, None, 8, kernels_available=False,
                                     has_torch_grouped_mm=hasattr(torch, "_grouped_mm"))
        return bf16.value + (f" ({'; '.join(off)})" if off else "")
    if family.name in _DEVICE_FAMILIES:
        if bf16 is not paths.Path.KERNEL_SM90:
            return "the plain-torch reference, on the device (the bf16 GEMMs take no kernel)"
        if not off:
            return "its kernels"
        instead = "F.linear and the one-CTA routing" if family is status.ROUTER_SM90 else \
            "the plain-torch reference, on the device"
        return f"{instead} ({'; '.join(off)})"
    if family.name in _FP8_FAMILIES:
        if not off:
            return "its kernels"
        instead = ("the plain-torch reference, on the device" if family is status.QUANTIZE_FP8_SM90
                   else f"{Fp8Path.TORCH_SCALED.value}, or {Fp8Path.DEQUANTIZE.value}")
        return f"{instead} ({'; '.join(off)})"
    raise NotImplementedError(f"no path rule for the kernel family {family.name!r}")


def device() -> tuple[str, tuple[int, int] | None]:
    """``(description, capability)`` of this machine's first CUDA GPU, or of the CPU."""
    if not torch.cuda.is_available():
        return "no CUDA GPU: every call takes the plain-torch reference", None
    index = torch.cuda.current_device()
    capability = torch.cuda.get_device_capability(index)
    return f"{torch.cuda.get_device_name(index)} (sm_{capability[0]}{capability[1]})", capability


def lines(description: str, capability: tuple[int, int] | None) -> list[str]:
    rows = [("family", "status", "imported", "turned on", "path on this machine")]
    for f in status.STATUS:
        imported = ("not by the ops" if not f.in_ops else
                    "yes" if f.name in kernels.AVAILABLE else "no")
        rows.append((f.name, f.proof.value, imported, f.switch, family_path(f, capability)))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    out = [f"device: {description}", ""]
    out += ["  ".join(c.ljust(w) for c, w in zip(r[:4], widths)) + "  " + r[4] for r in rows]
    out += ["", "families:"]
    for f in status.STATUS:
        out.append(f"  {f.name}: {f.title} ({f.arch}; csrc_free_kernels.{f.module})")
        if f.run:
            out.append(f"      run: {f.run}")
        out.append(f"      evidence: {f.evidence}")
        if f.name in kernels.FAILED:
            out.append(f"      import failed: {kernels.FAILED[f.name]}")
    out += ["", *toolchain.lines()]
    out += ["", "settings (ts_moe.settings):"]
    for s in settings.SETTINGS:
        env = f"  {s.env}" if s.env else ""
        out.append(f"  {s.name} = {getattr(settings, s.name)!r}  ({settings.source(s.name)}){env}")
    return out


def run() -> int:
    """Prints the families and the settings; 2 (and why) where a setting's variable is bad."""
    try:
        text = lines(*device())
    except ValueError as exc:  # a TS_MOE_* variable with a value its setting does not take
        print(f"ts_moe info: {exc}", file=sys.stderr)
        return 2
    print("\n".join(text))
    return 0
