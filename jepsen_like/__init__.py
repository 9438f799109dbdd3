"""Fault-injection tooling for lighthouse-cluster tests, in the spirit of Jepsen.

``python -m jepsen_like run | check DIR | replay DIR`` (``cli``). A test is data: a history of
operations (``history``) and a schedule of faults (``schedule``); checkers are pure functions
of the history (``checkers``, ``stats``, ``timeline``, ``known_bugs``). Doing it:

* ``cluster``: node processes (``LocalCluster``) behind a network backend, process faults;
* ``network``: picks the backend by name: ``netns`` (namespaces + DROP rules, root;
  ``netns.available()`` says whether this machine can) or ``proxy`` (a TCP proxy per link);
  ``clock``: libfaketime clock-rate skew (``clock.available()``; a run without it goes on
  without clock faults);
* ``clients``: simulated replica groups (in-process, or a process each when a schedule kills
  them); ``monitor``: Status polls and Raft journal tailing;
  ``journal``: committed logs replayed through the state machine; ``nemesis``: one fault now;
* ``runner``: a run end to end; ``pbt``: the hypothesis state machine of faults.

The harness lives outside the library: nothing in ``lighthouse_cluster`` imports it.
"""
