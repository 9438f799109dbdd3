"""Issue 33, item 3: does pysyncobj (and the state machine) belong in a process of its own?

Experiment code, not part of the node. Four ways to run a node, each started by ``variant.py``
in front of the unchanged ``python -m lighthouse_cluster serve ...`` command line:

* ``A``: today's node (pysyncobj's tick thread beside the gRPC event loop, one GIL);
* ``B``: today's node, the Raft tick thread at nice -10 (per-thread priority: same GIL, but the
  kernel runs Raft first when the two cores are short);
* ``C``: the split: the gRPC front end (``remote.RemoteRaftNode`` in place of ``RaftNode``) and a
  Raft process (``raft_proc.py``: ``RaftNode`` + the ``QuorumStateMachine``) over a Unix
  socketpair carrying msgpack frames (``channel.py``): submits and their results, lease probes
  and confirmations, pushed views, and every applied command, which the front end applies to a
  mirror of the state machine;
* ``C2``: ``C`` with the Raft process at nice -10.

Each can run with stall tolerance off (``--no-stall-tolerance``: the extension only counts
stalls). ``measure.py`` runs them side by side; the decision is docs/design/raft-process.md.
"""
