"""The mechanisms a ``RaftHost`` (``raft/host.py``) runs, one ``Extension`` per module.

``durable_sync`` (nothing acknowledged or counted before it is on disk), ``adaptive_tick`` (the
tick thread sleeps until its next deadline), ``idle_acks`` (an idle leader's heartbeats
acknowledged a few times a second), ``fast_election`` (one election per failover, the vote
refusal the quorum lease rests on), ``stall_tolerance`` (a stalled tick thread deposes no live
leader), ``quiescence`` (an idle cluster heartbeats slowly) and ``lease_probes`` (a leader
confirms its leadership with an acknowledged heartbeat). ``signals``: what one extension
publishes for another. ``raft/composed_node.py`` puts them in order.
"""
