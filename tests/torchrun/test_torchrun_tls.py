"""torchrun's lighthouse backend against a cluster that requires TLS with client certificates:
the ``--rdzv-conf`` TLS keys (``tls_ca``, ``tls_cert``, ``tls_key``) reach every call, a one-node
rendezvous completes through torch's own registry, and without the client certificate the
creator ends in one line before any worker would start."""

from __future__ import annotations

from pathlib import Path

import pytest
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

from lighthouse_cluster.tls import generate_pki

pytestmark = pytest.mark.integration


def test_a_rendezvous_over_mutual_tls_and_a_one_line_refusal_without_the_certificate(make_cluster,
                                                                                     tmp_path: Path) -> None:
    pki = generate_pki(tmp_path / "pki")
    cluster = make_cluster(pki=pki, mutual_tls=True, election_timeout_ms=150)
    cluster.wait_for_stable_leader(timeout=30)
    nodes = ",".join(f"https://{a}" for a in cluster.client_addresses)
    conf = {"tls_ca": str(pki.ca_cert), "tls_cert": str(pki.client_cert), "tls_key": str(pki.client_key),
            "last_call_timeout": 1, "join_timeout": 30}
    handler = get_rendezvous_handler(RendezvousParameters(
        backend="lighthouse", endpoint=nodes, run_id="tls-run", min_nodes=1, max_nodes=1, local_addr="127.0.0.1",
        **conf))
    try:
        info = handler.next_rendezvous()
        assert (info.rank, info.world_size) == (0, 1)
    finally:
        handler.shutdown()

    without_cert = {**{k: v for k, v in conf.items() if k not in ("tls_cert", "tls_key")}, "kv_timeout": 3}
    with pytest.raises(SystemExit) as refused:
        get_rendezvous_handler(RendezvousParameters(backend="lighthouse", endpoint=nodes, run_id="tls-run-2",
                                                    min_nodes=1, max_nodes=1, **without_cert))
    message = str(refused.value)
    assert message.startswith("torchrun --rdzv-backend=lighthouse: ") and "\n" not in message, message
