#!/usr/bin/env python3
"""One bench case, each backend called once inside a profiler range: for Nsight Compute.

    ncu --clock-control none --profile-from-start off --metrics ... \\
        python scripts/profile_case.py mixtral gate_up 16384 skewed ts_moe ts_moe:band_m=8

Each backend is bound and run once outside the range (compilation, autotuning),
then once inside it, under an NVTX range named after it, so every kernel ncu
reports belongs to exactly one backend call.  The inputs are the harness's
(``torch.randn``, the same tensors for every backend).
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from bench import backends, cases  # noqa: E402
from bench.timing import nvtx_range  # noqa: E402


def main(argv) -> int:
    if len(argv) < 5 or argv[0] in ("-h", "--help"):
        print(__doc__, file=sys.stderr)
        return 0 if argv[:1] in (["-h"], ["--help"]) else 2
    if not torch.cuda.is_available():
        print("scripts/profile_case.py: needs a CUDA GPU; torch sees none here", file=sys.stderr)
        return 2
    model, gemm, tokens, routing, *names = argv
    models = [m for m in cases.MODELS if m.startswith(model)]
    if len(models) != 1:
        print(f"model {model!r} matches {models or 'nothing'}; known: {', '.join(cases.MODELS)}",
              file=sys.stderr)
        return 2
    (full,) = models
    case = cases.make_case(cases.MODELS[full], gemm, int(tokens), routing)
    device = torch.device("cuda")
    inp = backends.make_gemm_inputs(case, device)
    registry = backends.Registry(backends.BACKENDS)
    runs = {name: registry[name](case, device)(inp) for name in names}
    for run in runs.values():
        run()
    torch.cuda.synchronize()
    print(case.describe(), file=sys.stderr)
    torch.cuda.profiler.start()
    for name, run in runs.items():
        with nvtx_range(name):
            run()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
