"""Benchmarks of lighthouse-cluster side by side with torchft's Rust lighthouse (issue 6).

Sections (each launches the systems it measures and always cleans them up):
``rounds`` (quorum rounds with N simulated replica groups), ``failover`` (leader SIGKILL vs
torchft_lighthouse kill + restart), ``sdk`` (ftclient vs torchft Manager step time), ``recovery``
(live recovery over HTTP, ftclient vs torchft transport), ``footprint`` (idle CPU and memory).
Entry point: the ``bench`` click group in :mod:`lighthouse_cluster.bench.cli`.
"""
