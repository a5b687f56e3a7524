"""ts_moe's vLLM plugin (ts_moe.integrations.vllm) as vLLM loads it: through the
``vllm.general_plugins`` entry point of the installed package, in a fresh process each
(vLLM's registries are the process's): a no-op unless TS_MOE_VLLM=1; opted in, it
registers once however often it is called, says in vLLM's log what it took over, and each
MoE layer vLLM then builds is ts_moe's or, declined, vLLM's own choice with the reason
said once; a registration another plugin holds stays that plugin's."""

import json
import os
import subprocess
import sys
import textwrap
from importlib.metadata import entry_points
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM 0.33 is not installed: CI's vLLM environment "
                                   "runs these tests (.ci/run)")

REPO = Path(__file__).resolve().parent.parent

# a vLLM process: its plugins loaded as vLLM loads them, vLLM's log captured, then what
# the registries hold and, opted in, the methods of the MoE layers it builds
PROCESS = textwrap.dedent("""
    import json, sys, torch
    import ts_moe
    from tests.vllm_helpers import log_of, vllm_process
    from vllm.plugins import load_general_plugins
    from vllm.model_executor.custom_op import op_registry_oot
    from vllm.model_executor.layers.quantization import get_quantization_config
    from vllm.model_executor.layers.quantization.fp8 import Fp8Config

    found = {}
    with log_of("vllm.ts_moe") as log:
        if sys.argv[1] == "other-plugin":  # another plugin holds the unquantized method
            from vllm.model_executor.layers.fused_moe import UnquantizedFusedMoEMethod
            @UnquantizedFusedMoEMethod.register_oot
            class OtherMethod(UnquantizedFusedMoEMethod):
                pass
        load_general_plugins()
        if sys.argv[1] == "twice":
            from ts_moe.integrations.vllm import register
            register()
            register()
        oot = op_registry_oot.get("UnquantizedFusedMoEMethod")
        found["unquantized"] = oot and oot.__qualname__
        fp8 = get_quantization_config("fp8")
        found["fp8"] = "vLLM's" if fp8 is Fp8Config else fp8.__qualname__
        found["methods_imported"] = "ts_moe.integrations.vllm_methods" in sys.modules
        if sys.argv[1] == "layers":
            import itertools
            from vllm.model_executor.models.mixtral import MixtralMoE
            index = itertools.count()
            def layer(hidden, inter, quant=None):
                moe = MixtralMoE(num_experts=4, top_k=2, hidden_size=hidden,
                                 intermediate_size=inter, params_dtype=torch.bfloat16,
                                 quant_config=quant, prefix=f"layers.{next(index)}.moe")
                method = moe.experts.routed_experts.quant_method
                return [type(method).__name__, getattr(method.experts_cls, "__name__", None)]
            fp8 = get_quantization_config("fp8")
            block = fp8.from_config({"quant_method": "fp8", "activation_scheme": "dynamic",
                                     "weight_block_size": [128, 128]})
            per_tensor = fp8.from_config({"quant_method": "fp8", "activation_scheme": "dynamic"})
            with vllm_process():
                with ts_moe.settings.override(reference=True):  # ts_moe serves the CPU
                    found["bf16"] = layer(256, 512)
                    found["block_fp8"] = layer(256, 512, block)
                    found["unaligned"] = [layer(256, 100), layer(256, 100)]
                    found["per_tensor_fp8"] = layer(256, 512, per_tensor)
                found["cpu"] = layer(256, 512)  # no ts_moe kernels here, no reference forced
    found["log"] = log
    print(json.dumps(found))
""")


def vllm_process(case: str, opted_in: bool) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TS_MOE_VLLM"}
    if opted_in:
        env["TS_MOE_VLLM"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    proc = subprocess.run([sys.executable, "-c", PROCESS, case], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_the_entry_point_is_the_installed_packages_register():
    (plugin,) = [p for p in entry_points(group="vllm.general_plugins") if p.name == "ts_moe"]
    assert plugin.value == "ts_moe.integrations.vllm:register"
    from ts_moe.integrations import vllm as module
    assert plugin.load() is module.register


def test_opted_in_beside_another_vllm_release_the_plugin_says_so(monkeypatch):
    import vllm

    import ts_moe
    from ts_moe.integrations.vllm import register

    monkeypatch.setattr(vllm, "__version__", "0.34.0")
    with ts_moe.settings.override(vllm=True):
        with pytest.raises(RuntimeError, match=r"written for vLLM 0\.33\.x .* vLLM 0\.34\.0 is "
                                               r"installed; install vllm==0\.33\.0 or unset"):
            register()
    with ts_moe.settings.override(vllm=False):
        register()  # off: a no-op, whatever vLLM is installed


def test_not_opted_in_the_plugin_registers_nothing():
    found = vllm_process("once", opted_in=False)
    assert found == {"unquantized": None, "fp8": "vLLM's", "methods_imported": False,
                     "log": []}


@pytest.mark.parametrize("case", ["once", "twice"])
def test_opted_in_the_plugin_registers_once_and_says_so(case):
    found = vllm_process(case, opted_in=True)
    assert found["unquantized"] == "TsMoeUnquantizedMethod"
    assert found["fp8"] == "TsMoeFp8Config"
    took = [m for m in found["log"] if "took over" in m]
    assert len(took) == 1, found["log"]
    assert "UnquantizedFusedMoEMethod" in took[0] and "'fp8' quantization config" in took[0]


def test_another_plugins_registration_stays_its_own():
    found = vllm_process("other-plugin", opted_in=True)
    assert found["unquantized"] == "OtherMethod"
    assert found["fp8"] == "TsMoeFp8Config"
    assert any("leaves vLLM's UnquantizedFusedMoEMethod to OtherMethod" in m
               for m in found["log"]), found["log"]


def test_each_layer_is_ts_moes_or_vllms_with_the_reason_said_once():
    found = vllm_process("layers", opted_in=True)
    assert found["bf16"] == ["TsMoeUnquantizedMethod", "TsMoeExperts"]
    assert found["block_fp8"] == ["TsMoeFp8MoEMethod", "TsMoeFp8Experts"]
    # declined: vLLM's own choice stays (on this CPU, vLLM's CPU experts)
    for declined in (*found["unaligned"], found["cpu"]):
        assert declined[0] == "TsMoeUnquantizedMethod"
        assert declined[1] != "TsMoeExperts"
    assert found["per_tensor_fp8"][0] == "TsMoeFp8MoEMethod"
    assert found["per_tensor_fp8"][1] != "TsMoeFp8Experts"
    log = found["log"]
    served = [m for m in log if m.startswith("ts_moe serves")]
    assert any("bf16/fp16 MoE layers of 4 experts, hidden size 256, intermediate size 512"
               in m for m in served), log
    assert any("block FP8" in m and "TsMoeFp8Experts" in m for m in served), log
    unaligned = [m for m in log if "intermediate_size = 100 must be a multiple of 8" in m]
    assert len(unaligned) == 1, log  # two such layers, one line
    assert "ts_moe declines bf16/fp16 MoE layers" in unaligned[0]
    assert any("FP8 weights scaled per tensor" in m for m in log), log
    assert any("current device cpu" in m for m in log), log
