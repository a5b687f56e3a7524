"""``python -m ts_moe``: the demo, and the kernel build it runs without a GPU.

    python -m ts_moe demo              # the MoE layer end to end; ends in PASS or FAIL
    python -m ts_moe demo --verbose    # ... with each kernel build's PTX statistics
    python -m ts_moe compile           # build every kernel family here, no GPU needed
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
   so, runs the reference path, then builds every kernel family for its arch
   (``compile``, :mod:`ts_moe.compile_cli`: a process per arch, as the DSL takes its
   target arch at import), a line per family, each build through the pre-flight of
   the hardware's rules (``csrc_free_kernels.preflight``: a build that would fault on
   the GPU fails here);
4. ends in ``PASS``, or ``FAIL`` with the error and the tolerance, then says
   what to run next.

Each subcommand is an entry of :data:`COMMANDS`: its help, its arguments, its run.
"""

import argparse
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from . import MoE, cache_cli, compile_cli, info_cli, load_mixtral_experts, make_tiny_moe_checkpoint
from .moe import moe_forward, moe_forward_reference
from .ops import Path as KernelPath
from .ops import kernel_arch

TOLERANCE = 2e-2  # bf16 layer against the fp32 reference
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
        kernels = kernel_arch(index) == "sm_90a"
        _say(f"{torch.cuda.get_device_name(index)} (sm_{major}{minor}): bf16 grouped GEMMs "
             f"run on the "
             f"{KernelPath.KERNEL_SM90.value if kernels else 'path without ts_moe kernels'}.")
    else:
        device, kernels = "cpu", False
        _say("No CUDA GPU found: running the plain-torch reference path on the CPU.")

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
        arches = ", ".join(compile_cli.ARCHES)
        _say(f"building every kernel family for {arches} (no GPU needed; a few minutes on 2 "
             f"CPU cores):")
        failed = compile_cli.build_with_ptx_stats() if verbose else compile_cli.build_in_child()
        if failed:
            return _verdict(False, failed)
        built = f" and every kernel family builds for {arches}"
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
                   help="skip building the kernels on a machine without an sm_90 GPU")
    p.add_argument("--verbose", action="store_true",
                   help="build with the PTX kept and show each build's statistics")


COMMANDS: dict[str, Command] = {
    "demo": Command("run the MoE layer end to end (CPU or GPU); ends in PASS or FAIL",
                    _demo_arguments,
                    lambda args: demo(args.tokens, not args.no_compile, args.verbose)),
    "compile": Command("build every kernel family for its arch without a GPU, each build "
                       "through the pre-flight (nothing is cached)",
                       compile_cli.add_arguments,
                       lambda args: compile_cli.run(args.arch, args.family, args.builds)),
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
