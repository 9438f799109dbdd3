"""The Python gRPC floor: the least a lighthouse written on grpc.aio can cost per round.

A one-process ``torchft.LighthouseService`` that does nothing but the unavoidable: parse each
Quorum request, hold it until ``min_replicas`` requesters are waiting, build and serialize one
response for all of them, answer; Heartbeat answers at once. No Raft, no heartbeat table, no
checks, no timeouts, no forwarding; on the nodes' default event loop (uvloop). It is *not* a lighthouse (it never times out, ignores
heartbeats, has no quorum rules); the rounds section runs it beside the real systems (system
``pyfloor``) to show how much of the gap to the Rust server is Python gRPC itself on the
machine at hand, whatever the cluster does on top (docs/design/python-grpc-floor.md).

Run: ``python -m benchmarks.grpc_floor --bind 127.0.0.1:PORT --min_replicas N``.
"""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

from lighthouse_cluster.server.event_loop import DEFAULT_LOOP, LOOPS, run
from lighthouse_cluster.server.gc_thresholds import use_serving_thresholds
from lighthouse_cluster.server.node import SERVER_OPTIONS


async def serve(bind: str, min_replicas: int) -> None:
    import grpc

    from lighthouse_cluster.proto import torchft_pb2 as pb

    empty = pb.LighthouseHeartbeatResponse().SerializeToString()
    waiting: dict[str, tuple[Any, asyncio.Future[bytes]]] = {}

    async def quorum(raw: bytes, context: grpc.aio.ServicerContext) -> bytes:
        nonlocal waiting
        requester = pb.LighthouseQuorumRequest.FromString(raw).requester
        future: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        waiting[requester.replica_id] = (requester, future)
        if len(waiting) >= min_replicas:
            ready, waiting = waiting, {}
            q = pb.Quorum(quorum_id=1, participants=[m for m, _ in sorted(ready.values(), key=lambda x: x[0].replica_id)])
            q.created.GetCurrentTime()
            response = pb.LighthouseQuorumResponse(quorum=q).SerializeToString()
            for _, f in ready.values():
                if not f.done():
                    f.set_result(response)
        return await future

    async def heartbeat(raw: bytes, context: grpc.aio.ServicerContext) -> bytes:
        return empty

    server = grpc.aio.server(options=SERVER_OPTIONS)
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("torchft.LighthouseService", {
        "Quorum": grpc.unary_unary_rpc_method_handler(quorum),
        "Heartbeat": grpc.unary_unary_rpc_method_handler(heartbeat),
    })])
    server.add_insecure_port(bind)
    await server.start()
    await server.wait_for_termination()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bind", required=True)
    p.add_argument("--min_replicas", type=int, required=True)
    p.add_argument("--event-loop", choices=LOOPS, default=DEFAULT_LOOP)
    args = p.parse_args()
    use_serving_thresholds()  # as a node does: the least a tuned grpc.aio lighthouse costs
    run(serve(args.bind, args.min_replicas), args.event_loop)


if __name__ == "__main__":
    main()
