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
import textwrap
from pathlib import Path

try:
    import torch
except ImportError as exc:  # the shebang's python3 is not the project's environment
    sys.exit(f"{Path(__file__).name}: {exc}: run it with the Python that ts_moe is installed "
             f"in (activate its environment, or: path/to/python {sys.argv[0]} ...)")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from bench import backends, cases  # noqa: E402
from bench.timing import nvtx_range  # noqa: E402


USAGE = "\n".join([
    "usage: scripts/profile_case.py MODEL GEMM T ROUTING BACKEND [BACKEND ...]",
    f"  MODEL    {', '.join(cases.MODELS)} (or a unique prefix)",
    f"  GEMM     {', '.join(cases.GEMMS)}",
    "  T        token count",
    f"  ROUTING  {', '.join(cases.ROUTINGS)}",
    *textwrap.wrap(f"{', '.join(backends.BACKENDS)}, or ts_moe:FIELD=VALUE:... as in "
                   f"python -m bench", 88, initial_indent="  BACKEND  ",
                   subsequent_indent=" " * 11)])


def _usage_error(message: str) -> int:
    print(f"{USAGE}\nscripts/profile_case.py: error: {message}", file=sys.stderr)
    return 2


def main(argv) -> int:
    if argv[:1] in (["-h"], ["--help"]):
        print(f"{__doc__}\n{USAGE}\n\nNeeds a CUDA GPU.")
        return 0
    if len(argv) < 5:
        return _usage_error(f"{len(argv)} arguments, need MODEL GEMM T ROUTING and a backend")
    model, gemm, tokens, routing, *names = argv
    models = [m for m in cases.MODELS if m.startswith(model.lower())]
    if len(models) != 1:
        return _usage_error(f"model {model!r} matches {models or 'nothing'}")
    if gemm not in cases.GEMMS:
        return _usage_error(f"gemm {gemm!r} is not one of {', '.join(cases.GEMMS)}")
    if not tokens.isdigit() or int(tokens) < 1:
        return _usage_error(f"T {tokens!r} is not a token count >= 1")
    if routing not in cases.ROUTINGS:
        return _usage_error(f"routing {routing!r} is not one of {', '.join(cases.ROUTINGS)}")
    registry = backends.Registry(backends.BACKENDS)
    try:
        unknown = [name for name in names if name not in registry]
    except ValueError as exc:  # a malformed ts_moe:... variant
        return _usage_error(str(exc))
    if unknown:
        return _usage_error(f"unknown backends {unknown}")
    if not torch.cuda.is_available():
        print("scripts/profile_case.py: needs a CUDA GPU; torch sees none here", file=sys.stderr)
        return 2
    (full,) = models
    case = cases.make_case(cases.MODELS[full], gemm, int(tokens), routing)
    device = torch.device("cuda")
    inp = backends.make_gemm_inputs(case, device)
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
