"""The path policy is the families' records: a family for a new arch, for a new op
family, or a second family for an op an arch already serves (at another precedence)
takes its place in the paths, ``info`` and the ops with no edit of ts_moe's path code;
records a call could not choose between are refused when the package is imported,
saying which and why."""

import json
import subprocess
import sys

import pytest
import torch

from csrc_free_kernels.common.family import Family, Op, Proof, check
from csrc_free_kernels.families import FAMILIES
from ts_moe.ops import paths

from .helpers import kernel_package

# Two throwaway families sharing one launch module: a Blackwell-desktop (sm_120a) family
# serving the combine and a new op family, and a second sm_90a routing family, tried
# before the shipped one (precedence 1).
RECORDS = '''
from ..common.family import Family, Op, Proof


def _sm120():
    from . import toy_launch
    return toy_launch.SM120


def _first():
    from . import toy_launch
    return toy_launch.FIRST


TOY_SM120 = Family("toy_sm120", "a new arch's family", "sm_120a", Proof.COMPILED, "a test's",
                   _sm120, serves=(Op.ROW_SUM, Op.TOY_OP))
TOY_FIRST = Family("toy_route_first", "a second routing family", "sm_90a", Proof.COMPILED,
                   "a test's", _first, serves=(Op.ROUTE_SLOTS,), precedence=1)
'''
LAUNCH = '''
import torch

from ..common.family import Kernels, Op
from ..common.kernel_config import Declined


class Toy:
    """Takes a call of an odd first dim and answers 7s; declines the others."""

    def choose_config(self, x, *args):
        return "toy" if x.shape[0] % 2 else Declined("a toy takes odd sizes only")

    def run(self, x, *args):
        return (torch.full_like(x, 7.0),)


SM120 = Kernels(backends={Op.ROW_SUM: Toy(), Op.TOY_OP: Toy()}, builds=lambda: ())
FIRST = Kernels(backends={Op.ROUTE_SLOTS: Toy()}, builds=lambda: ())
'''
CHECK = """
import json
import torch
import ts_moe
from csrc_free_kernels.families import BY_NAME
from ts_moe import info_cli
from ts_moe.ops import Op, paths, routing

P = paths.Path
first = paths.backends(Op.ROUTE_SLOTS, (9, 0))[0]
paths.device_capability = lambda t: (9, 0)  # CPU tensors take an H100's paths
logits = torch.randn(3, 8)
taken = routing._route_slots_impl(logits, 2)
rows = {line.split()[0]: line for line in info_cli.lines("a GPU", (12, 0))[3:]
        if line.split()}
print(json.dumps({
    "sm120": P.KERNEL_SM120.value,
    "p1": P.KERNEL_SM90_P1.value,
    "row_sum_120": [p.name for p in paths.paths_for(Op.ROW_SUM, (12, 0))],
    "toy_op_120": [p.name for p in paths.paths_for(Op.TOY_OP, (12, 0))],
    "route_120": [p.name for p in paths.paths_for(Op.ROUTE_SLOTS, (12, 0))],
    "route_90": [p.name for p in paths.paths_for(Op.ROUTE_SLOTS, (9, 0))],
    "gemm_90": [p.name for p in paths.paths_for(Op.GROUPED_GEMM, (9, 0), torch.bfloat16)],
    "first": type(first).__name__,
    "taken": torch.equal(taken[0], torch.full_like(logits, 7.0)),
    "info_120": [info_cli.family_path(BY_NAME[n], (12, 0)) for n in ("toy_sm120", "gemm_sm90")],
    "info_90": [info_cli.family_path(BY_NAME[n], (9, 0))
                for n in ("toy_route_first", "route_sm90", "toy_sm120")],
    "info_row": rows["toy_sm120"],
}))
"""


def _run(tmp_path, code, packages, records, op=None):
    env = kernel_package(tmp_path, packages, records, op)
    return subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)


def test_a_new_arch_op_family_and_precedence_need_only_their_records(tmp_path):
    done = _run(tmp_path, CHECK, {"toy": {"__init__.py": RECORDS, "toy_launch.py": LAUNCH}},
                [("toy", "TOY_SM120"), ("toy", "TOY_FIRST")], op="toy_op")
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    # a new arch: its own path, for its capability alone
    assert got["sm120"] == "ts_moe CuTeDSL kernels (sm_120a; never run on hardware here)"
    assert got["row_sum_120"] == ["KERNEL_SM120", "REFERENCE"]
    assert got["route_120"] == ["REFERENCE"]  # nothing of sm_90a's on another capability
    # a new op family: the kernel path of the family that serves it (no reference)
    assert got["toy_op_120"] == ["KERNEL_SM120"]
    # a second family for an op sm_90 serves: its path first, the shipped one next
    assert got["p1"] == ("ts_moe CuTeDSL kernels (sm_90a; precedence 1; never run on "
                         "hardware here)")
    assert got["route_90"] == ["KERNEL_SM90_P1", "KERNEL_SM90", "REFERENCE"]
    assert got["gemm_90"] == ["KERNEL_SM90", "TORCH_GROUPED_MM"]  # the others unchanged
    assert got["first"] == "Toy" and got["taken"]  # the op takes it first
    # info: each family's path and the reason where another comes first
    assert got["info_120"] == ["its kernels", "none: sm_90a kernels, for capability 9.0 only"]
    toy_first, shipped, toy_120 = got["info_90"]
    assert toy_first == "its kernels"
    assert toy_120 == "none: sm_120a kernels, for capability 12.0 only"
    assert shipped == ("its kernels where the toy_route_first kernels "
                       f"({got['p1']}) decline a call")
    assert got["info_row"].endswith("its kernels")


CONFLICT = '''
from ..common.family import Family, Op, Proof


def _load():
    raise AssertionError("never loaded: the records are refused first")


TOY = Family("toy_row_sum", "a second combine", "sm_90a", Proof.COMPILED, "a test's", _load,
             serves=(Op.ROW_SUM,))
'''


def test_a_record_a_call_could_not_choose_is_refused_at_import(tmp_path):
    done = _run(tmp_path, "import ts_moe", {"toy": {"__init__.py": CONFLICT}},
                [("toy", "TOY")])
    assert done.returncode != 0
    said = done.stderr.strip().splitlines()[-1]
    assert said == (
        "ValueError: kernel families 'toy_row_sum' (sm_90a) and 'route_sm90' (sm_90a) both "
        "serve row_sum on compute capability 9.0 at precedence 0: a call could take either; "
        "give one a higher precedence (Family.precedence: the higher is tried first) or "
        "drop one")


def _record(name, arch="sm_90a", serves=(Op.ROW_SUM,), precedence=0):
    return Family(name, "a test's", arch, Proof.COMPILED, "a test's", lambda: None,
                  serves=serves, precedence=precedence)


def test_check_refuses_conflicts_and_malformed_records():
    check(FAMILIES)  # the shipped records
    check([_record("a"), _record("b", precedence=1), _record("c", arch="sm_100a")])
    with pytest.raises(ValueError, match="'a' .* and 'b' .* both serve row_sum on compute "
                                         "capability 9.0 at precedence 0"):
        check([_record("a"), _record("b")])
    with pytest.raises(ValueError, match="'a' .* and 'b' .* both serve row_sum on compute "
                                         "capability 9.0"):
        check([_record("a", arch="sm_90"), _record("b")])  # two archs, one device
    with pytest.raises(ValueError, match="two kernel families named 'a'"):
        check([_record("a"), _record("a", serves=(Op.SORT_SLOTS,))])
    with pytest.raises(ValueError, match="arch 'hopper' is not a target"):
        _record("a", arch="hopper")
    with pytest.raises(ValueError, match="precedence -1 is not an int >= 0"):
        _record("a", precedence=-1)
    assert _record("a", arch="sm_100a").capability == (10, 0)
    assert _record("a", arch="sm_120a").capability == (12, 0)


def test_the_shipped_paths_are_their_records():
    """The kernel paths: one per capability and precedence of the shipped records, each
    holding its families' backends."""
    assert {(k.capability, k.precedence) for k in paths.KERNEL_PATHS.values()} == \
        {(f.capability, f.precedence) for f in FAMILIES if f.in_ops}
    for path, kernel in paths.KERNEL_PATHS.items():
        assert {paths.PROVIDER[path, op] for op in paths.TABLE[path]} == set(kernel.families)
