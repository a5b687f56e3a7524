"""Benchmark harness for the ts_moe ops: suites of cases, backends side by side.

A repository tool, not installed with the package: run it from a checkout,
``python -m bench`` (``python -m bench --help``).

Modules: ``cases`` (model shapes, routing, flop and byte counts), ``backends``
(grouped-GEMM backends and the reference), ``moe_layer`` (the layer suite and
its backend registry), ``moe_block`` (the whole block, router to output),
``training`` (the training suite: each GEMM's forward, dA and dW, the layer's
forward + backward, with peak memory), ``timing`` (events, rotation, graphs,
NVTX), ``roofs`` (HBM and GEMM roofs), ``runner`` (the suite registry; check
then time), ``report`` (JSON, tables, a run's markdown, plots), ``provenance``
(commit, host, GPU, versions of a run), ``pages`` (bench/RESULTS.md and the
README's status, from the committed runs), ``targets`` (the targets of a run).
"""
