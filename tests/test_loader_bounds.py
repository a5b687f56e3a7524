"""One number in a tiny checkpoint cannot make a loader allocate or iterate in proportion
to it: an expert count in a router's header, in config.json or in an index key, or a
size, is checked against what the files hold first.  Each case is refused with a
ValueError naming the file and the field, in well under a second of CPU time and
100 MiB, measured in a subprocess (time.process_time, ru_maxrss) whose address space is
capped, so that a loader that does allocate fails there instead of exhausting the
machine.  CPU time, not wall time: a busy machine stretches the one, not the other."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import ts_moe
from ts_moe.tiny import make_tiny_fp8_checkpoint

HUGE = 10**7
SECONDS, MIB = 0.5, 100

_MEASURE = r"""
import json, resource, sys, time
resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))
import ts_moe
from ts_moe.loaders import load_fp8_experts

LOADERS = {"bf16": ts_moe.load_mixtral_experts, "fp8": load_fp8_experts}
warm, cases = json.loads(sys.argv[1])
for loader, path in warm:  # the code paths paged in, the allocator warm
    LOADERS[loader](path, device="cpu")
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
results = []
for loader, path in cases:
    start = time.process_time()
    try:
        LOADERS[loader](path, device="cpu")
        outcome = "no error"
    except BaseException as exc:
        outcome = f"{type(exc).__name__}: {exc}"
    seconds = time.process_time() - start
    grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024
    results.append([outcome, seconds, grown])
print(json.dumps(results))
"""


def _write(path: Path, state: dict, config: dict | None, index_extra: dict | None = None):
    path.mkdir()
    save_file(state, path / "model.safetensors", metadata={"format": "pt"})
    if config is not None:
        (path / "config.json").write_text(json.dumps(config))
    if index_extra is not None:
        weight_map = {key: "model.safetensors" for key in state} | index_extra
        (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return path


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("src")
    bf16 = ts_moe.make_tiny_moe_checkpoint(root / "bf16", layers=1, experts=4, shards=1)
    fp8 = make_tiny_fp8_checkpoint(root / "fp8", naming="qwen3_moe", scheme="channel", layers=1,
                                   hidden=64, intermediate=32, experts=4, shards=1)
    return {name: (load_file(path / "model.safetensors"),
                   json.loads((path / "config.json").read_text()), path)
            for name, path in (("bf16", bf16), ("fp8", fp8))}


def _cases(sources, root: Path):
    """(loader, checkpoint, what the refusal must name) for each hostile number."""
    bf16, bf16_config, _ = sources["bf16"]
    fp8, fp8_config, _ = sources["fp8"]
    bf16_router = "model.layers.0.block_sparse_moe.gate.weight"
    fp8_router = "model.layers.0.mlp.gate.weight"
    empty_router = torch.empty(HUGE, 0, dtype=torch.bfloat16)  # no bytes for 10**7 rows
    no_count = {k: v for k, v in bf16_config.items() if k != "num_local_experts"}
    fp8_no_count = {k: v for k, v in fp8_config.items() if k != "num_experts"}
    far = {"bf16": "model.layers.0.block_sparse_moe.experts.99999999.w1.weight",
           "fp8": "model.layers.0.mlp.experts.99999999.gate_proj.weight"}
    cases = []

    def case(name, loader, state, config, must, index_extra=None):
        path = _write(root / name, state, config, index_extra)
        cases.append((loader, str(path), must))

    header = r"model\.safetensors: {}: expected a 2-D \(E, H\) router .* got shape \(10000000, 0\)"
    case("bf16-router", "bf16", {bf16_router: empty_router}, None, header.format(bf16_router))
    case("bf16-router-config", "bf16", bf16 | {bf16_router: empty_router},
         bf16_config | {"num_local_experts": HUGE}, header.format(bf16_router))
    case("fp8-router", "fp8", fp8 | {fp8_router: empty_router}, fp8_no_count,
         header.format(fp8_router))
    for field, count in (("num_local_experts", 10**6), ("num_local_experts", HUGE)):
        case(f"bf16-{count}", "bf16", bf16, bf16_config | {field: count},
             rf"config\.json: {field} = {count}, but the router")
    for field, count in (("num_experts", 10**6), ("num_experts", HUGE),
                         ("n_routed_experts", HUGE)):
        case(f"fp8-{field}-{count}", "fp8", fp8, fp8_config | {field: count},
             rf"config\.json: {field} = {count}, but the router")
    for loader, state, configs in (("bf16", bf16, (bf16_config, no_count)),
                                   ("fp8", fp8, (fp8_config, fp8_no_count))):
        for i, config in enumerate(configs):
            case(f"{loader}-far-{i}", loader, state, config,
                 rf"model\.safetensors\.index\.json: key '{far[loader]}' names expert 99999999",
                 {far[loader]: "model.safetensors"})
    case("fp8-hidden", "fp8", fp8, fp8_config | {"hidden_size": 2**40},
         r"config\.json: hidden_size = 1099511627776, but the router")
    return cases


def test_hostile_numbers_are_refused_quickly_and_cheaply(sources, tmp_path):
    cases = _cases(sources, tmp_path)
    warm = [["bf16", str(sources["bf16"][2])], ["fp8", str(sources["fp8"][2])]]
    env = dict(os.environ, PYTHONPATH=str(Path(ts_moe.__file__).parents[1]))
    run = subprocess.run(
        [sys.executable, "-c", _MEASURE, json.dumps([warm, [c[:2] for c in cases]])],
        capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    results = json.loads(run.stdout.splitlines()[-1])
    for (loader, path, must), (outcome, seconds, grown) in zip(cases, results):
        name = Path(path).name
        assert outcome.startswith("ValueError: "), (name, outcome[:300])
        assert path in outcome, (name, outcome[:300])
        assert re.search(must, outcome), (name, outcome[:300])
        assert seconds < SECONDS, (name, seconds)
        assert grown < MIB, (name, grown)
    assert len(results) == len(cases)
    assert (tmp_path / "bf16-router" / "model.safetensors").stat().st_size < 500
