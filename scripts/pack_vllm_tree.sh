#!/usr/bin/env bash
# Pack what scripts/vllm_gpu_check.py needs of vLLM on a GPU machine that has neither vLLM
# nor a network, into .device-vllm/ (ignored by git) for `run`'s carry (64 MiB a call):
#
#   vllm-py.tgz   vLLM 0.33.0's Python tree: its *.py and *.json, no compiled extension
#                 (about 32 MB, 11 MB packed)
#   wheels/       the packages its imports need (.ci/vllm.txt) and xgrammar, without
#                 their dependencies (about 37 MB; most of them a GPU image may have)
#
#   scripts/pack_vllm_tree.sh .venv-vllm/lib/python3.11/site-packages
#
# The argument: the site-packages of an environment with vllm==0.33.0 installed (CI's
# .venv-vllm).  On the machine, after the call that unpacked the project's .device:
#   mkdir -p /tmp/vllm-py && tar -xzf .device-vllm/vllm-py.tgz -C /tmp/vllm-py
#   pip install -q --no-index --no-deps --target /tmp/vllm-py .device-vllm/wheels/*.whl
#   python scripts/vllm_gpu_check.py --vllm-tree /tmp/vllm-py --commit HASH --out $OUT/r.json
set -euo pipefail
cd "$(dirname "$0")/.."
site=${1:?the site-packages of an environment with vllm==0.33.0}
out=.device-vllm
rm -rf "$out" && mkdir -p "$out/wheels"
(cd "$site" && find vllm \( -name '*.py' -o -name '*.json' -o -name py.typed \) \
   -not -path '*/__pycache__/*' -print0 | tar --null -czf - -T -) > "$out/vllm-py.tgz"
pip download -q --no-deps -d "$out/wheels" -r .ci/vllm.txt xgrammar==0.2.8
du -sh "$out/vllm-py.tgz" "$out/wheels" "$out"
