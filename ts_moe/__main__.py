"""``python -m ts_moe``: the demo, and the kernel build it runs without a GPU.

    python -m ts_moe demo              # the MoE layer end to end; ends in PASS or FAIL
    python -m ts_moe demo --verbose    # ... with each kernel build's PTX statistics
    python -m ts_moe compile           # build the sm_90a kernels here, no GPU needed
    python -m ts_moe info              # each kernel family's status and path here; the settings
    python -m ts_moe cache             # the compiled-kernel cache (--clear empties it)

``demo``:

1. writes the MoE tensors of a tiny random Mixtral checkpoint in the real
   sharded format (:func:`ts_moe.make_tiny_moe_checkpoint`: no optional extra
   needed), loads its experts with :func:`ts_moe.load_mixtral_experts` and
   runs a layer;
2. runs a Mixtral-shaped layer (Mixtral-8x7B's E=8, top-2 and H:I ratio,
   scaled down) and checks it against the fp32 per-token reference;
3. on an sm_90 GPU that is the CuTeDSL kernel path, timed; elsewhere it says
   so, runs the reference path, then builds the kernels for sm_90a (``compile``,
   in a process of its own: the DSL takes its target arch at import), a line
   per kernel family, each build through the pre-flight of the hardware's rules
   (``csrc_free_kernels.preflight.rules``: a build that would fault on the GPU fails here);
4. ends in ``PASS``, or ``FAIL`` with the error and the tolerance, then says
   what to run next.

Each subcommand is an entry of :data:`COMMANDS`: its help, its arguments, its run.
"""

import argparse
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from . import cache_cli, info_cli
from . import MoE, load_mixtral_experts, make_tiny_moe_checkpoint
from .moe import moe_forward, moe_forward_reference
from .ops import Path as KernelPath, cuda_path
from .settings import settings

TOLERANCE = 2e-2  # bf16 layer against the fp32 reference
ARCH = "sm_90a"
KEEP = "ptx,cubin"  # what the DSL keeps of each build for the pre-flight
NEXT_STEPS = (
    ("python -m pytest -q", "the tests (about 7 min on 2 CPU cores; "
                            "pip install -e '.[dev,hf]' first)"),
    ("python -m bench --help", "the benchmark harness, from a checkout (without a GPU: a "
                               "CPU smoke suite)"),
    ("README.md, \"Use\"", "the layer in your model, and the Hugging Face swap "
                           "(ts_moe.integrations.transformers)"),
)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def _rel_err(out, ref) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def _say(text: str = "") -> None:
    print(text, flush=True)


# ------------------------------------------------------------------ compile

def kernel_families() -> list[tuple[str, list[Callable[[], object]]]]:
    """The kernel families the layer runs on sm_90, each as thunks that compile one
    configuration through the path the op takes (bf16; the layer's K-major weights)."""
    from csrc_free_kernels.hopper import grouped_gemm_dw_sm90_config as dw_configs
    from csrc_free_kernels.hopper import grouped_gemm_dw_sm90_launch as dw
    from csrc_free_kernels.fp8 import grouped_gemm_fp8_sm90_config as fp8_configs
    from csrc_free_kernels.fp8 import grouped_gemm_fp8_sm90_launch as fp8
    from csrc_free_kernels.hopper import grouped_gemm_sm90 as gemm_classes
    from csrc_free_kernels.hopper import grouped_gemm_sm90_config as gemm_configs
    from csrc_free_kernels.hopper import grouped_gemm_sm90_launch as gemm
    from csrc_free_kernels.fp8 import quantize_fp8_sm90_launch as quantize
    from csrc_free_kernels.hopper import swiglu_sm90_launch as act

    bf16 = torch.bfloat16
    return [
        ("grouped GEMM", [partial(gemm.compiled_kernel, c, bf16, bf16, False)
                          for c in gemm_configs.CONFIGS.values()]),
        ("grouped GEMM + SwiGLU", [partial(gemm.compiled_kernel, c, bf16, bf16, False,
                                           gemm_classes.GroupedGemmSwigluSm90)
                                   for c in gemm_configs.CONFIGS.values()]),
        ("k-grouped GEMM (weight gradient)", [partial(dw.compiled_kernel, c, bf16, bf16)
                                              for c in dw_configs.CONFIGS.values()]),
        ("SwiGLU activation and its gradient", [partial(act.compiled_kernel, bf16, backward)
                                                for backward in (False, True)]),
        ("FP8 grouped GEMM, blockwise (plain and SwiGLU), and the quantizer",
         [partial(fp8.compiled_kernel, c, "blockwise", bf16, swiglu)
          for c in fp8_configs.CONFIGS.values() for swiglu in (False, True)]
         + [partial(quantize.compiled_kernel, "blockwise_1x128", bf16)]),
    ]


def compile_kernels() -> int:
    """Compile every family for :data:`ARCH` in this process, a line per family, and run
    the pre-flight of the hardware's rules on each build (``csrc_free_kernels.preflight.rules``)
    from the PTX and cubin the DSL keeps; a violation fails the build step."""
    dump_dir = os.environ.get("CUTE_DSL_DUMP_DIR")
    if (os.environ.get("CUTE_DSL_ARCH") != ARCH or not dump_dir
            or os.environ.get("CUTE_DSL_KEEP") != KEEP):
        # the DSL reads these once, when imported (with ts_moe's ops): a fresh process
        with tempfile.TemporaryDirectory(prefix="ts_moe_build_") as scratch:
            return subprocess.call([sys.executable, "-m", "ts_moe", "compile"],
                                   env=_child_env(scratch))
    from csrc_free_kernels import preflight

    settings.disk_cache = False  # build only: nothing written to the cache
    start = time.perf_counter()
    built = 0
    for name, builds in kernel_families():
        _say(f"  [{time.perf_counter() - start:5.1f} s] {name}: {len(builds)} configurations")
        for build in builds:
            what = getattr(build.args[0], "name", build.args[0]) if build.args else ""
            try:
                with preflight.recording() as facts:
                    build()
                found = preflight.check(f"{name} {what}",
                                        preflight.collect(dump_dir, facts), facts)
            except Exception as exc:  # say which build, then fail
                print(f"{name} {what}: {type(exc).__name__}: {exc}", file=sys.stderr)
                return 1
            if found:
                print("the pre-flight of the hardware's rules failed:", file=sys.stderr)
                for violation in found:
                    print(violation, file=sys.stderr)
                return 1
        built += len(builds)
    _say(f"  [{time.perf_counter() - start:5.1f} s] {built} configurations built for {ARCH}, "
         f"each through the pre-flight ({', '.join(preflight.RULES)}): no violation")
    return 0


def _root() -> str:
    """The directory this ts_moe package is in: the child imports the same code."""
    return str(Path(__file__).resolve().parent.parent)


def _child_env(dump_dir: str) -> dict:
    """This environment, the DSL's arch and its PTX and cubin kept in ``dump_dir`` for
    the pre-flight (read when ``cutlass`` is imported, which ``import ts_moe`` does), and
    this checkout first on the path."""
    return dict(os.environ, CUTE_DSL_ARCH=ARCH, CUTE_DSL_KEEP=KEEP, CUTE_DSL_DUMP_DIR=dump_dir,
                PYTHONPATH=os.pathsep.join([_root(),
                                            *filter(None, [os.environ.get("PYTHONPATH")])]))


def build_in_child(args=("-m", "ts_moe", "compile")) -> str | None:
    """``python -m ts_moe compile`` in a fresh process, its lines shown as they come;
    None on success, else what went wrong."""
    with tempfile.TemporaryFile("w+") as stderr, \
            tempfile.TemporaryDirectory(prefix="ts_moe_build_") as scratch:
        # stderr a file: a full pipe would block the child
        proc = subprocess.Popen([sys.executable, *args], env=_child_env(scratch),
                                stdout=subprocess.PIPE, stderr=stderr, text=True)
        for line in proc.stdout:
            _say(line.rstrip("\n"))
        if proc.wait() == 0:
            return None
        stderr.seek(0)
        err = stderr.read()
    tail = "\n".join(err.strip().splitlines()[-15:])
    return f"the {ARCH} build failed (exit status {proc.returncode}):\n{tail}"


def build_with_ptx_stats() -> str | None:
    """``--verbose``: each family built with its PTX kept, and each build's statistics."""
    from csrc_free_kernels import ptx_dump

    families = (("grouped GEMM", "gemm_"), ("grouped GEMM + SwiGLU", "swiglu_"),
                ("k-grouped GEMM (weight gradient)", "dw_"))
    start = time.perf_counter()
    for family, prefix in families:
        names = [n for n in ptx_dump.BUILDS
                 if n.startswith(prefix) and not n.startswith("swiglu_ew")]
        _say(f"  [{time.perf_counter() - start:5.1f} s] {family}: {len(names)} builds, PTX kept")
        with tempfile.TemporaryDirectory() as d:
            try:
                ptx = ptx_dump.dump(ARCH, names, d)
            except RuntimeError as exc:
                return str(exc)
            for name in names:
                text = ptx[name]
                _say(f"      {name:30s} {text.count('wgmma.mma_async'):2d} wgmma, "
                     f"{text.count('cp.async.bulk.tensor'):d} TMA loads, "
                     f"{text.count('expect_tx')} expect_tx, {len(text) // 1024} KB PTX")
    _say(f"  [{time.perf_counter() - start:5.1f} s] built for {ARCH}")
    return None


# ------------------------------------------------------------------ demo

def _verdict(ok: bool, text: str) -> int:
    _say(f"{'PASS' if ok else 'FAIL'}: {text}")
    _say("next:")
    steps = NEXT_STEPS if ok else (("python -m pytest -q", "the tests say which op is "
                                                          "wrong"),)
    for command, what in steps:
        _say(f"  {command:24s} {what}")
    return 0 if ok else 1


def demo(tokens: int, build: bool, verbose: bool = False) -> int:
    start = time.perf_counter()
    if torch.cuda.is_available():
        device = "cuda"
        index = torch.cuda.current_device()
        major, minor = torch.cuda.get_device_capability(index)
        path = cuda_path(index, torch.bfloat16)[0]
        _say(f"{torch.cuda.get_device_name(index)} (sm_{major}{minor}): bf16 grouped GEMMs "
             f"run on the {path.value}.")
    else:
        device, path = "cpu", KernelPath.REFERENCE
        _say("No CUDA GPU found: running the plain-torch reference path on the CPU.")
    kernels = path is KernelPath.KERNEL_SM90

    with tempfile.TemporaryDirectory() as ckpt:
        make_tiny_moe_checkpoint(ckpt, layers=2, hidden=64, intermediate=128, experts=4, top_k=2)
        layers = load_mixtral_experts(ckpt, device=device)
        layer = MoE.from_weights(layers[1], top_k=2)
        x = torch.randn(7, 64, device=device, dtype=layer.router.dtype)
        _say(f"tiny checkpoint: {len(layers)} layers loaded, layer 1 -> "
             f"{tuple(layer(x).shape)} (E={layer.gate_up_proj.shape[0]}, top-2)")

    # Mixtral-8x7B's shape scaled by 1/8 (H 4096 -> 512, I 14336 -> 1792)
    g = torch.Generator(device).manual_seed(0)
    h, inter, e, k = 512, 1792, 8, 2
    kw = {"generator": g, "device": device, "dtype": torch.bfloat16}
    hidden = torch.randn(tokens, h, **kw)
    router = torch.randn(e, h, **kw) * h**-0.5
    gate_up = torch.randn(e, 2 * inter, h, **kw) * h**-0.5
    down = torch.randn(e, h, inter, **kw) * inter**-0.5
    out = moe_forward(hidden, router, gate_up, down, k)
    ref = moe_forward_reference(hidden, router, gate_up, down, k)
    err = _rel_err(out, ref)
    check = f"relative error {err:.2e} against the fp32 per-token reference, tolerance " \
            f"{TOLERANCE:.0e}"
    _say(f"Mixtral-shaped layer T={tokens} H={h} I={inter} E={e} top-{k}: {check}")
    if not err < TOLERANCE:
        return _verdict(False, f"the layer's output is wrong: {check}")
    if kernels:
        for _ in range(3):
            moe_forward(hidden, router, gate_up, down, k)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(20):
            moe_forward(hidden, router, gate_up, down, k)
        torch.cuda.synchronize()
        _say(f"  {(time.perf_counter() - t0) / 20 * 1e3:.3f} ms per layer call")

    built = ""
    if build and not kernels:
        _say(f"building the {ARCH} kernels (no GPU needed; about a minute on 2 CPU cores):")
        failed = build_with_ptx_stats() if verbose else build_in_child()
        if failed:
            return _verdict(False, failed)
        built = f" and the {ARCH} kernels build"
    return _verdict(True, f"the layer matches the fp32 reference ({err:.2e} < {TOLERANCE:.0e})"
                          f"{built} ({time.perf_counter() - start:.0f} s)")


# ------------------------------------------------------------------ commands

@dataclass(frozen=True)
class Command:
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


def _demo_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tokens", type=_positive_int, default=64,
                   help="tokens through the Mixtral-shaped layer (default 64)")
    p.add_argument("--no-compile", action="store_true",
                   help=f"skip building the {ARCH} kernels on a machine without an sm_90 GPU")
    p.add_argument("--verbose", action="store_true",
                   help="build with the PTX kept and show each build's statistics")


COMMANDS: dict[str, Command] = {
    "demo": Command("run the MoE layer end to end (CPU or GPU); ends in PASS or FAIL",
                    _demo_arguments,
                    lambda args: demo(args.tokens, not args.no_compile, args.verbose)),
    "compile": Command(f"build every {ARCH} kernel configuration the layer runs, without a "
                       f"GPU (nothing is cached)",
                       lambda p: None, lambda args: compile_kernels()),
    "cache": Command("show the compiled-kernel cache (--clear empties it)",
                     cache_cli.add_arguments, lambda args: cache_cli.run(args.clear)),
    "info": Command("each kernel family's status, whether it imported and the path this "
                    "machine's GPU gets; every setting and its value",
                    info_cli.add_arguments, lambda args: info_cli.run()),
}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ts_moe")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, command in COMMANDS.items():
        command.add_arguments(sub.add_parser(name, help=command.help,
                                             description=command.help))
    args = parser.parse_args(argv)
    return COMMANDS[args.command].run(args)


if __name__ == "__main__":
    sys.exit(main())
