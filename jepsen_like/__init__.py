"""Fault-injection tooling for lighthouse-cluster tests, in the spirit of Jepsen.

* ``jepsen_like.netns``: real network partitions between local node processes with Linux
  network namespaces and nftables/iptables DROP rules (root only; ``netns.available()`` says
  whether this machine can, and if not, why).

The harness lives outside the library: nothing in ``lighthouse_cluster`` imports it.
"""
