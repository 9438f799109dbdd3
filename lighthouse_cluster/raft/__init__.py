"""Raft replication through pysyncobj: the only package that imports pysyncobj."""
