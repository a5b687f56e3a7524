"""Benchmark harness for the ts_moe ops: suites of cases, backends side by side.

Modules: ``cases`` (model shapes, routing, flop and byte counts), ``backends``
(grouped-GEMM backends and the reference), ``moe_layer`` (the layer suite and
its backend registry), ``training`` (the training suite: each GEMM's forward,
dA and dW, the layer's forward + backward, with peak memory), ``timing``
(events, rotation, graphs, NVTX), ``roofs``
(HBM and GEMM roofs), ``runner`` (check then time), ``report`` (JSON,
tables, RESULTS.md, plots).  Entry point: ``python -m bench``.
"""
