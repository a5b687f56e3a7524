"""A new user's first steps on a CPU machine: the demo with only the base
dependencies, its arguments, the transformers-free tiny checkpoint, and the
loader's device default and path errors."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import ts_moe
from ts_moe import __main__ as demo_main
from ts_moe import checkpoint, loaders

REPO = Path(__file__).resolve().parents[1]
# run a module as `python -m` would, with transformers unimportable
NO_TRANSFORMERS = ("import runpy, sys; sys.modules['transformers'] = None; "
                   "sys.argv = ['ts_moe'] + sys.argv[1:]; "
                   "runpy.run_module('ts_moe', run_name='__main__')")


def _demo(*args):
    return subprocess.run([sys.executable, "-c", NO_TRANSFORMERS, "demo", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=600)


def test_demo_runs_without_transformers():
    proc = _demo("--no-compile", "--tokens", "8")
    assert proc.returncode == 0, proc.stderr
    assert "tiny checkpoint: 2 layers loaded, layer 1 -> (7, 64)" in proc.stdout
    err = float(proc.stdout.split("relative error ")[1].split()[0])
    assert err < demo_main.TOLERANCE
    lines = proc.stdout.splitlines()
    verdict = lines.index(next(line for line in lines if line.startswith(("PASS", "FAIL"))))
    assert lines[verdict].startswith(f"PASS: the layer matches the fp32 reference "
                                     f"({err:.2e} < 2e-02) (")
    assert lines[verdict + 1:] == ["next:", *(f"  {command:24s} {what}"
                                              for command, what in demo_main.NEXT_STEPS)]
    assert "building" not in proc.stdout  # --no-compile
    assert "Failed to initialize NumPy" not in proc.stderr


@pytest.fixture
def cpu_demo(monkeypatch):
    """The demo in this process as on a machine without CUDA, with the kernel builds
    (a child process per arch, minutes) replaced by a recorder."""
    from ts_moe import compile_cli

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    builds = []

    def fake_build():
        builds.append("child")
        print("  [  0.0 s] gemm_sm90 (bf16/fp16 grouped GEMM): 10 builds")

    monkeypatch.setattr(compile_cli, "build_in_child", fake_build)
    return builds


def _verdict(out: str) -> str:
    return next(line for line in out.splitlines() if line.startswith(("PASS", "FAIL")))


def test_demo_builds_the_kernels_unless_told_not_to(cpu_demo, capsys):
    assert demo_main.main(["demo", "--tokens", "4"]) == 0
    assert cpu_demo == ["child"]
    out = capsys.readouterr().out
    assert "building every kernel family for sm_90a, sm_100a (no GPU needed" in out
    assert "] gemm_sm90 (bf16/fp16 grouped GEMM): 10 builds" in out
    assert re.fullmatch(r"PASS: the layer matches the fp32 reference \(\S+ < 2e-02\) and "
                        r"every kernel family builds for sm_90a, sm_100a \(\d+ s\)", _verdict(out))
    assert demo_main.main(["demo", "--tokens", "4", "--no-compile"]) == 0
    assert cpu_demo == ["child"]  # not built again
    out = capsys.readouterr().out
    assert "building" not in out and "builds for" not in _verdict(out)


@pytest.mark.parametrize("wrong,shown", [
    (lambda out: 2 * out, "relative error 1.00e+00"),
    (lambda out: torch.full_like(out, float("nan")), "relative error nan"),
])
def test_demo_says_what_failed(cpu_demo, capsys, monkeypatch, wrong, shown):
    real = demo_main.moe_forward
    monkeypatch.setattr(demo_main, "moe_forward", lambda *a: wrong(real(*a)))
    assert demo_main.main(["demo", "--tokens", "4"]) == 1
    out = capsys.readouterr().out
    assert _verdict(out) == (f"FAIL: the layer's output is wrong: {shown} against the fp32 "
                             f"per-token reference, tolerance {demo_main.TOLERANCE:.0e}")
    assert out.splitlines()[-2:] == ["next:", f"  {'python -m pytest -q':24s} the tests say "
                                              "which op is wrong"]
    assert not cpu_demo  # failed before the build


def test_a_failed_build_is_a_fail(monkeypatch, capsys):
    """The child's progress lines pass through; its exit status and last words end the demo."""
    from ts_moe import compile_cli

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    child = "import sys; print('  [  0.1 s] gemm_sm90: 10 builds'); sys.exit('ValueError: no such tile')"
    real = compile_cli.subprocess.Popen
    monkeypatch.setattr(compile_cli.subprocess, "Popen",
                        lambda args, **kw: real([sys.executable, "-c", child], **kw))
    assert demo_main.main(["demo", "--tokens", "4"]) == 1
    out = capsys.readouterr().out
    assert "  [  0.1 s] gemm_sm90: 10 builds\n" in out
    assert "FAIL: the sm_90a build failed (exit status 1):\nValueError: no such tile" in out


def test_verbose_shows_each_builds_ptx(monkeypatch, capsys):
    from csrc_free_kernels import ptx_dump
    from csrc_free_kernels.families import FAMILIES
    from ts_moe import compile_cli

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    dumped = []

    def fake_dump(arch, names, out_dir, timeout=600, check=False):
        assert check  # every build through the pre-flight, as without --verbose
        dumped.append((arch, list(names)))
        return {n: "wgmma.mma_async cp.async.bulk.tensor expect_tx" for n in names}

    monkeypatch.setattr(ptx_dump, "dump", fake_dump)
    monkeypatch.setattr(compile_cli, "build_in_child", lambda: pytest.fail("built twice"))
    assert demo_main.main(["demo", "--tokens", "4", "--verbose"]) == 0
    assert [arch for arch, _ in dumped] == [f.arch for f in FAMILIES
                                            if f.arch == "sm_90a"] + ["sm_100a"]
    names = [n for _, family in dumped for n in family]
    assert "gemm_decode" in names and "swiglu_decode_bk" in names and "dw_128x256" in names
    assert "route_slots" in names and "sm100_gemm_n256" in names  # every family
    out = capsys.readouterr().out
    assert " 1 MMAs, 1 TMA loads, 1 expect_tx" in out
    assert _verdict(out).startswith("PASS")


def test_compile_command_builds_a_family_on_its_arch(tmp_path):
    """``python -m ts_moe compile --family swiglu_sm90``: a line for the family with the
    elapsed time, the arch set before the DSL is imported, every build through the
    pre-flight, no PTX tool, no cache."""
    code = ("import os, sys; import ts_moe.__main__ as m\n"
            "rc = m.main(['compile', '--family', 'swiglu_sm90'])\n"
            "print(os.environ['CUTE_DSL_ARCH'], 'csrc_free_kernels.ptx_dump' in sys.modules)\n"
            "sys.exit(rc)\n")
    # the arch as the demo's child process gets it: set before ts_moe imports the DSL
    env = {**os.environ, "TS_MOE_CACHE_DIR": str(tmp_path), "PYTHONPATH": str(REPO),
           "CUTE_DSL_ARCH": "sm_90a", "CUTE_DSL_KEEP": "ptx,cubin",
           "CUTE_DSL_DUMP_DIR": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert re.fullmatch(r"  \[ +\d+\.\d s\] swiglu_sm90 \(SwiGLU activation and its gradient, "
                        r"elementwise\): 4 builds", lines[0])
    assert re.fullmatch(r"  \[ +\d+\.\d s\] 4 builds for sm_90a, each through the pre-flight "
                        r"\((?:[a-z0-9-]+, )+[a-z0-9-]+\): no violation", lines[1])
    assert lines[2] == "sm_90a False"
    assert list(tmp_path.iterdir()) == []  # nothing cached, the kept PTX and cubin read


def test_compile_command_fails_a_build_the_preflight_refuses(tmp_path):
    """A build that breaks a hardware rule fails the build step, naming the rule and the
    instruction (here the pre-flight is handed a setmaxnreg past the register pool)."""
    code = (
        "import sys; import ts_moe.__main__ as m\n"
        "from csrc_free_kernels import preflight\n"
        "collect = preflight.collect\n"
        "def broken(d, facts):\n"
        "    return collect(d, facts).replace('setmaxnreg.inc.sync.aligned.u32 \\t240;',\n"
        "                                     'setmaxnreg.inc.sync.aligned.u32 \\t244;')\n"
        "preflight.collect = broken\n"
        "from ts_moe import compile_cli\n"
        "real = compile_cli.builds\n"
        "compile_cli.builds = lambda arch, only=None, which='checked': [(f, [b for b in bs "
        "if b.name == 'gemm_decode16']) for f, bs in real(arch, 'gemm_sm90')]\n"
        "sys.exit(m.main(['compile', '--family', 'gemm_sm90']))\n")
    env = {**os.environ, "TS_MOE_CACHE_DIR": str(tmp_path), "PYTHONPATH": str(REPO),
           "CUTE_DSL_ARCH": "sm_90a", "CUTE_DSL_KEEP": "ptx,cubin",
           "CUTE_DSL_DUMP_DIR": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1
    assert "pre-flight of the hardware's rules failed" in proc.stderr
    assert "gemm_decode16" in proc.stderr and "setmaxnreg" in proc.stderr


# a module of the caller's directory that must never be imported in torch's place
PLANTED_TORCH = ("import pathlib, sys\n"
                 "pathlib.Path(__file__).with_name('imported').write_text(sys.argv[0])\n"
                 "raise SystemExit(97)\n")


def _up_to_the_import(args: list[str]) -> list[str]:
    """A build child's command, asked for its help only: it imports ts_moe (and torch)
    as the build does, and stops there."""
    return [*args[:args.index("ts_moe") + 1], "--help"]


def test_the_build_children_import_nothing_from_the_callers_directory(tmp_path,
                                                                       monkeypatch):
    """``ts-moe compile`` and the demo's build start ``python -m ts_moe compile``
    children: a ``torch.py`` in the directory they are run from is never imported
    (``python -m`` puts its working directory first on the path)."""
    from ts_moe import compile_cli

    (tmp_path / "torch.py").write_text(PLANTED_TORCH)
    monkeypatch.chdir(tmp_path)
    started = []

    def call(args, **kwargs):
        started.append(kwargs)
        with real_popen(_up_to_the_import(args), **kwargs, stdout=subprocess.DEVNULL) as proc:
            return proc.wait()

    def popen(args, **kwargs):
        started.append(kwargs)
        return real_popen(_up_to_the_import(args), **kwargs)

    real_popen = subprocess.Popen  # of the module compile_cli uses, which call starts too
    monkeypatch.setattr(compile_cli.subprocess, "call", call)
    monkeypatch.setattr(compile_cli.subprocess, "Popen", popen)
    assert compile_cli.run(family="swiglu_sm90") == 0  # ts-moe compile --family ...
    assert compile_cli.build_in_child() is None  # the demo's build, each arch
    assert not (tmp_path / "imported").exists()
    assert len(started) == 1 + len(compile_cli.ARCHES)
    assert all(Path(kw["cwd"]) != tmp_path and kw["env"]["PYTHONSAFEPATH"] == "1"
               for kw in started)


def test_compile_refuses_a_family_named_with_another_arch(monkeypatch, capsys):
    from csrc_free_kernels.families import BY_NAME
    from ts_moe import compile_cli

    monkeypatch.setattr(compile_cli.subprocess, "call",
                        lambda *a, **k: pytest.fail("a build started"))
    assert BY_NAME["swiglu_sm90"].arch == "sm_90a"
    assert demo_main.main(["compile", "--family", "swiglu_sm90", "--arch", "sm_100a"]) == 2
    assert capsys.readouterr().err == (
        "ts_moe compile: --family swiglu_sm90 is built for sm_90a, not --arch sm_100a (leave "
        "--arch out, or name a family of sm_100a)\n")


def test_compile_builds_every_family_the_records_declare():
    """What ``compile`` builds is each family's checked builds, every family on its arch."""
    from csrc_free_kernels.families import FAMILIES
    from ts_moe import compile_cli

    built = {f.name: [b.name for b in bs] for arch in compile_cli.ARCHES
             for f, bs in compile_cli.builds(arch)}
    assert set(built) == {f.name for f in FAMILIES} and all(built.values())
    assert "route_slots" in built["route_sm90"] and "gemm_decode" in built["gemm_sm90"]
    assert compile_cli.ARCHES == ("sm_90a", "sm_100a")


@pytest.mark.parametrize("tokens", ["0", "-3", "many"])
def test_demo_rejects_bad_token_counts(tokens):
    proc = _demo("--no-compile", "--tokens", tokens)
    assert proc.returncode == 2
    assert "--tokens" in proc.stderr and "positive integer" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("names", ["v4", "v5"])
@pytest.mark.parametrize("shards", [1, 3])
def test_tiny_moe_checkpoint_round_trips(tmp_path, names, shards):
    path = ts_moe.make_tiny_moe_checkpoint(tmp_path / "ckpt", layers=3, hidden=32,
                                           intermediate=48, experts=4, top_k=2, names=names,
                                           shards=shards, seed=5)
    files = list(path.glob("*.safetensors"))
    assert len(files) == 1 if shards == 1 else len(files) >= 3
    assert (path / "model.safetensors.index.json").is_file() == (shards > 1)
    written = {k: v for f in files for k, v in load_file(f).items()}
    assert all(t.dtype == torch.bfloat16 for t in written.values())
    assert len(written) == 3 * (1 + 3 * 4 if names == "v4" else 3)  # nothing but the MoE tensors
    layers = ts_moe.load_mixtral_experts(path, device="cpu")
    assert sorted(layers) == [0, 1, 2]
    for layer, weights in layers.items():
        assert weights["router"].shape == (4, 32)
        assert weights["gate_up_proj"].shape == (4, 96, 32)
        assert weights["down_proj"].shape == (4, 32, 48)
        assert all(t.dtype == torch.bfloat16 for t in weights.values())
        assert 0.01 < weights["gate_up_proj"].float().std() < 0.03  # N(0, 0.02)
        if names == "v4":
            p = f"model.layers.{layer}.block_sparse_moe."
            assert torch.equal(weights["router"], written[p + "gate.weight"])
            for e in range(4):
                w1, w2, w3 = (written[f"{p}experts.{e}.{w}.weight"] for w in ("w1", "w2", "w3"))
                assert torch.equal(weights["gate_up_proj"][e, :48], w1)  # gate rows first
                assert torch.equal(weights["gate_up_proj"][e, 48:], w3)  # then up
                assert torch.equal(weights["down_proj"][e], w2)
        else:
            p = f"model.layers.{layer}.mlp."
            assert torch.equal(weights["router"], written[p + "gate.weight"])
            assert torch.equal(weights["gate_up_proj"], written[p + "experts.gate_up_proj"])
            assert torch.equal(weights["down_proj"], written[p + "experts.down_proj"])
    assert not torch.equal(layers[0]["down_proj"], layers[1]["down_proj"])
    # the same seed gives the same weights in the other naming
    other = ts_moe.make_tiny_moe_checkpoint(tmp_path / "other", layers=3, hidden=32,
                                            intermediate=48, experts=4, top_k=2,
                                            names="v5" if names == "v4" else "v4", seed=5)
    again = ts_moe.load_mixtral_experts(other, layers=[0, 2], device="cpu")
    for layer in (0, 2):
        for name, tensor in again[layer].items():
            assert torch.equal(tensor, layers[layer][name]), (layer, name)
    moe = ts_moe.MoE.from_pretrained(path, 1, device="cpu")
    assert moe.top_k == 2 and torch.equal(moe.down_proj, layers[1]["down_proj"])


def test_tiny_moe_checkpoint_rejects_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="hidden must be a positive multiple of 8"):
        ts_moe.make_tiny_moe_checkpoint(tmp_path, hidden=60)
    with pytest.raises(ValueError, match="names"):
        ts_moe.make_tiny_moe_checkpoint(tmp_path, names="v6")
    with pytest.raises(ValueError, match="top_k = 3 exceeds experts = 2"):
        ts_moe.make_tiny_moe_checkpoint(tmp_path, experts=2, top_k=3)


def test_loader_device_defaults_to_one_that_exists(tmp_path, monkeypatch):
    path = ts_moe.make_tiny_moe_checkpoint(tmp_path, layers=1)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert loaders.resolve_device(None) == torch.device("cpu")
    weights = ts_moe.load_mixtral_experts(path)[0]
    assert weights["gate_up_proj"].device.type == "cpu"
    assert ts_moe.MoE.from_pretrained(path, 0).router.device.type == "cpu"
    for bad in ("cuda", "cuda:0"):
        with pytest.raises(ValueError, match="device 'cuda.*no CUDA GPU"):
            ts_moe.load_mixtral_experts(path, device=bad)
        with pytest.raises(ValueError, match="device"):
            ts_moe.MoE.from_pretrained(path, 0, device=bad)
    with pytest.raises(ValueError, match="device 'gpu0' is not a torch device"):
        ts_moe.load_mixtral_experts(path, device="gpu0")
    for bad, why in (("meta", "holds no values"), ("xpu", "no xpu device"),
                     ("cuda:-1", "not a torch device")):
        with pytest.raises(ValueError, match=f"device '{bad}'.*{why}"):
            ts_moe.load_mixtral_experts(path, device=bad)
    assert loaders.resolve_device(torch.device("cpu")) == torch.device("cpu")


def test_default_device_is_cuda_when_there_is_one(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert loaders.resolve_device(None) == torch.device("cuda")
    assert loaders.resolve_device("cuda:0") == torch.device("cuda:0")
    with pytest.raises(ValueError, match="device 'cuda:1'.*only 1 CUDA GPU"):
        loaders.resolve_device("cuda:1")


def test_device_is_checked_before_any_file_is_read(monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(checkpoint, "ShardFile", lambda *a, **k: pytest.fail("a file was read"))
    with pytest.raises(ValueError, match="device"):
        ts_moe.load_mixtral_experts(tmp_path / "nowhere", device="cuda")


def test_loader_names_a_hub_id_as_not_a_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match="not a local directory.*snapshot_download"):
        ts_moe.load_mixtral_experts("mistralai/Mixtral-8x7B-v0.1", device="cpu")
    with pytest.raises(FileNotFoundError, match="not a local directory"):
        ts_moe.MoE.from_pretrained("Mixtral-8x7B", 0, device="cpu")
    path = ts_moe.make_tiny_moe_checkpoint(tmp_path / "ckpt", layers=1, shards=1)
    with pytest.raises(FileNotFoundError, match="not a local directory.*hf download"):
        ts_moe.load_mixtral_experts(path / "model.safetensors", device="cpu")
    assert list(ts_moe.load_mixtral_experts(path, device="cpu")) == [0]
