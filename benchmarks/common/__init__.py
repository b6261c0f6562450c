"""Helpers the benchmark scripts share: reading a server's Prometheus metrics, and plotting.

Imported as ``common`` by the scripts in ``benchmarks/`` (run as ``python benchmarks/X.py``,
which puts ``benchmarks/`` first on ``sys.path``); not part of the ``splitserve`` package.
"""
