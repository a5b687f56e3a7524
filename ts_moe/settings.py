"""``ts_moe.settings``: every switch and environment variable of the package, in
one object read at call time.

    import ts_moe
    ts_moe.settings.router_kernel = True       # or ts_moe.use_router_kernel()
    with ts_moe.settings.override(decode_graphs=False):
        ...
    print(ts_moe.settings)                     # every setting and its value now

Each attribute answers, when it is read: the value set from code, else its
environment variable as it is now, else its default
(:mod:`csrc_free_kernels.common.settings` has the rules, the machinery, and why the
kernels' part lives there).  :data:`settings` here is a :class:`Settings`,
the kernels' settings (``pdl``, ``disk_cache``, ``cache_dir``) and the op
layer's below, sharing its values with ``csrc_free_kernels.common.settings.settings``,
which the kernels read.  ``ts_moe.use_sm100_kernel``, ``use_router_kernel``
and ``use_fp8_kernels`` are setters of ``sm100_kernel``, ``router_kernel`` and
``fp8_kernels``.  No other module of the package reads ``os.environ`` for a
setting; the README's table of settings is generated from :data:`SETTINGS`.

``ts_moe.settings`` is the object, not this module (``import ts_moe.settings as
x`` binds the object too); the class is ``from ts_moe.settings import Settings``.
"""

from csrc_free_kernels.common import settings as _kernels
from csrc_free_kernels.common.settings import Setting, setting_property

REFERENCE = Setting(
    "reference", False, env="TS_MOE_REFERENCE", values={"0": False, "1": True},
    does="every call takes the plain-torch reference (a host sync per call on a GPU), "
         "whatever the device",
    read="at each call")
DECODE_GRAPHS = Setting(
    "decode_graphs", True, env="TS_MOE_DECODE_GRAPHS", values={"0": False, "1": True},
    does="an eager layer call of at most 128 tokens, no gradient wanted, replays a CUDA "
         "graph of itself (`ts_moe.decode_graphs.graphs.enable()`/`disable()` outrank it)",
    read="at each call")
SM100_KERNEL = Setting(
    "sm100_kernel", False, api="ts_moe.use_sm100_kernel",
    does="bf16/fp16 calls on Blackwell (sm_100) run ts_moe's sm_100a kernel instead of "
         "`torch._grouped_mm`",
    read="at each call")
ROUTER_KERNEL = Setting(
    "router_kernel", False, api="ts_moe.use_router_kernel",
    does="on sm_90, the router logits of small batches run ts_moe's router kernel "
         "instead of `F.linear`, and the routing of large batches runs on many CTAs",
    read="at each call (the decode graphs key on it; a `torch.compile` graph keeps "
         "what it was traced with)")
FP8_KERNELS = Setting(
    "fp8_kernels", True, api="ts_moe.use_fp8_kernels",
    does="FP8 calls on sm_90 run ts_moe's FP8 GEMM and quantizer kernels; off, "
         "`torch._scaled_grouped_mm` (rowwise) or the dequantize path",
    read="at each call (the decode graphs key on it)")
VLLM = Setting(
    "vllm", False, env="TS_MOE_VLLM", values={"0": False, "1": True},
    does="vLLM's plugin entry point (`ts_moe.integrations.vllm`) puts ts_moe's experts "
         "under vLLM's MoE layers: bf16/fp16 ones through vLLM's unquantized MoE method and "
         "block-FP8 ones by replacing vLLM's `fp8` quantization config for the process; "
         "off, the entry point registers nothing",
    read="when vLLM loads its plugins, once per process")


class Settings(_kernels.KernelSettings):
    """The kernels' settings and the op layer's (module docstring)."""

    __slots__ = ()
    SETTINGS = _kernels.KernelSettings.SETTINGS + (
        REFERENCE, DECODE_GRAPHS, SM100_KERNEL, ROUTER_KERNEL, FP8_KERNELS, VLLM)
    reference = setting_property(REFERENCE)
    decode_graphs = setting_property(DECODE_GRAPHS)
    sm100_kernel = setting_property(SM100_KERNEL)
    router_kernel = setting_property(ROUTER_KERNEL)
    fp8_kernels = setting_property(FP8_KERNELS)
    vllm = setting_property(VLLM)


SETTINGS = Settings.SETTINGS
settings = Settings(_kernels.settings)
"""The package's settings: ``ts_moe.settings``."""
