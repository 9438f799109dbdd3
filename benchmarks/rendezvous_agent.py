"""One simulated torchrun agent: a rendezvous handler and its ``next_rendezvous()``, no workers.

``run_agent`` is the body of one agent process of ``benchmarks/rendezvous.py``. It gets its
handler the way torchrun's ``launch_agent`` does (``RendezvousParameters`` ->
``registry.get_rendezvous_handler``; importing ``torch.distributed.elastic.rendezvous`` registers
the built-in backends and every ``torchrun.handlers`` entry point), says it is ready, waits for the
common start, then creates the handler and joins. It reports, on the results queue, its times on
the host's monotonic clock (``time.monotonic`` is CLOCK_MONOTONIC, one clock for every process of
the host), the CPU its process used from the start to the return, the rank and world size it got
and its handler's class, or the error. It then waits for the run's finish signal before exiting:
the c10d backend's store lives in whichever agent bound the endpoint first, and must outlive every
other agent's rendezvous, as it does under torchrun. Its output (torch's warnings and tracebacks) goes to a log
file of its own, not to the benchmark's console.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class AgentSpec:
    """What every agent of one trial is given."""

    backend: str
    endpoint: str
    run_id: str
    nodes: int                      # min_nodes == max_nodes: the rendezvous completes when all joined
    conf: dict[str, Any]            # rendezvous conf (timeouts), the same for every backend
    start_timeout_s: float          # how long an agent waits for the common start
    finish_timeout_s: float         # how long it waits for the finish signal once it reported
    log_dir: str | None = None      # each agent's stdout and stderr (torch's warnings) go to a file here


def run_agent(index: int, spec: AgentSpec, results: Any, start: Any, finish: Any) -> None:
    """The agent process's body; every outcome, failures included, goes to ``results``."""
    if spec.log_dir is not None:
        fd = os.open(os.path.join(spec.log_dir, f"{spec.run_id}-{index}.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND,
                     0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
    try:
        from torch.distributed.elastic.rendezvous import RendezvousParameters
        from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler
    except Exception as e:  # noqa: BLE001 -- reported to the parent, which records the trial's error
        results.put({"index": index, "error": f"import: {type(e).__name__}: {e}"})
        return
    results.put({"index": index, "ready": True})
    if not start.wait(spec.start_timeout_s):
        results.put({"index": index, "error": f"no start signal within {spec.start_timeout_s:g} s"})
        return
    started = time.monotonic()
    cpu0 = time.process_time()
    try:
        params = RendezvousParameters(backend=spec.backend, endpoint=spec.endpoint, run_id=spec.run_id,
                                      min_nodes=spec.nodes, max_nodes=spec.nodes, **spec.conf)
        handler = get_rendezvous_handler(params)
        created = time.monotonic()
        info = handler.next_rendezvous()
        done = time.monotonic()
        cpu_s = time.process_time() - cpu0
        results.put({"index": index, "started": started, "created": created, "done": done, "cpu_s": cpu_s,
                     "rank": info.rank, "world_size": info.world_size,
                     "handler": f"{type(handler).__module__}.{type(handler).__qualname__}"})
    except Exception as e:  # noqa: BLE001 -- as above
        cause = f" (from {type(e.__cause__).__name__}: {e.__cause__})" if e.__cause__ is not None else ""
        results.put({"index": index, "error": f"{type(e).__name__}: {e}{cause}"[:400],
                     "after_s": round(time.monotonic() - started, 3)})
        return
    finish.wait(spec.finish_timeout_s)
