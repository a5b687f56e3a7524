"""``python -m ts_moe demo``: the MoE layer end to end on whatever this machine has.

1. writes the MoE tensors of a tiny random Mixtral checkpoint in the real
   sharded format (:func:`ts_moe.make_tiny_moe_checkpoint`: no optional extra
   needed), loads its experts with :func:`ts_moe.load_mixtral_experts` and
   runs a layer;
2. runs a Mixtral-shaped layer (Mixtral-8x7B's E=8, top-2 and H:I ratio,
   scaled down) and checks it against the per-token reference;
3. on an sm_90 GPU that is the CuTeDSL kernel path, timed; elsewhere it says
   so and runs the reference path, then compiles the kernels for sm_90a
   (no GPU needed) to show that they build.
"""

import argparse
import sys
import tempfile
import time

import torch

from . import MoE, load_mixtral_experts, make_tiny_moe_checkpoint
from . import cache_cli
from .moe import moe_forward, moe_forward_reference
from .ops import Path, cuda_path


TOLERANCE = 2e-2  # bf16 layer against the fp32 reference


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


def demo(tokens: int, compile_kernels: bool) -> int:
    if torch.cuda.is_available():
        device = "cuda"
        index = torch.cuda.current_device()
        major, minor = torch.cuda.get_device_capability(index)
        path = cuda_path(index, torch.bfloat16)[0]
        print(f"{torch.cuda.get_device_name(index)} (sm_{major}{minor}): bf16 grouped GEMMs "
              f"run on the {path.value}.")
    else:
        device, path = "cpu", Path.REFERENCE
        print("No CUDA GPU found: running the plain-torch reference path on the CPU.")
    kernels = path is Path.KERNEL_SM90

    with tempfile.TemporaryDirectory() as ckpt:
        make_tiny_moe_checkpoint(ckpt, layers=2, hidden=64, intermediate=128, experts=4, top_k=2)
        layers = load_mixtral_experts(ckpt, device=device)
        layer = MoE.from_weights(layers[1], top_k=2)
        x = torch.randn(7, 64, device=device, dtype=layer.router.dtype)
        print(f"tiny checkpoint: {len(layers)} layers loaded, layer 1 -> "
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
    print(f"Mixtral-shaped layer T={tokens} H={h} I={inter} E={e} top-{k}: "
          f"relative error vs fp32 reference {err:.2e}")
    if not err < TOLERANCE:
        print(f"FAILED: the layer's output differs from the fp32 per-token reference by "
              f"{err:.2e} (relative), over the bf16 tolerance {TOLERANCE:.0e}", file=sys.stderr)
        return 1
    if kernels:
        for _ in range(3):
            moe_forward(hidden, router, gate_up, down, k)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(20):
            moe_forward(hidden, router, gate_up, down, k)
        torch.cuda.synchronize()
        print(f"  {(time.perf_counter() - start) / 20 * 1e3:.3f} ms per layer call")

    if compile_kernels and not kernels:
        from csrc_free_kernels import ptx_dump

        names = [n for n in ptx_dump.BUILDS if n.startswith(("gemm", "swiglu", "dw"))]
        print(f"compiling {len(names)} kernel configurations for sm_90a (no GPU needed)...")
        with tempfile.TemporaryDirectory() as d:
            start = time.perf_counter()
            ptx = ptx_dump.dump("sm_90a", names, d)
            for name in names:
                text = ptx[name]
                print(f"  {name:26s} {text.count('wgmma.mma_async'):2d} wgmma, "
                      f"{text.count('cp.async.bulk.tensor'):d} TMA loads, "
                      f"{text.count('expect_tx')} expect_tx, {len(text) // 1024} KB PTX")
            print(f"  built in {time.perf_counter() - start:.1f} s")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ts_moe")
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="run the MoE layer end to end (CPU or GPU)")
    d.add_argument("--tokens", type=_positive_int, default=64,
                   help="tokens through the Mixtral-shaped layer (default 64)")
    d.add_argument("--no-compile", action="store_true",
                   help="skip compiling the sm_90a kernels on a machine without one")
    cache_cli.add_parser(sub)
    args = parser.parse_args(argv)
    if args.command == "cache":
        return cache_cli.run(args.clear)
    return demo(args.tokens, not args.no_compile)


if __name__ == "__main__":
    sys.exit(main())
