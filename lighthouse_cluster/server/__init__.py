"""One lighthouse node: configuration, wiring (``node``), the leader's quorum rounds
(``coordinator``), routing to the leader (``routing`` decides, ``forwarding`` carries), the
persisted member table, and the adapters that serve it (gRPC services, admin, HTTP, metrics), each
depending on a ``Protocol`` of what it uses rather than on the node."""
