"""One lighthouse node: configuration, wiring, the leader's quorum rounds, routing to the leader,
and the adapters that serve it (gRPC services, admin, HTTP, metrics)."""
