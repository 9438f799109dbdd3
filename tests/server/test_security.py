"""Security against real node processes on loopback: the admin token on every mutating call,
TLS and mutual TLS on the client ports (node-to-node forwarding included), the Raft secret
keeping strangers out of the cluster, and no secret or token in logs or status output.

Certificates are generated at runtime (``tls.generate_pki``, with ``cryptography``); no key is
committed.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Iterator

import grpc
import pytest

from support.cluster import cli, quorum_call, started_cluster
from support.waiting import wait_for
from ftclient.lighthouse_client import LighthouseClient
from lighthouse_cluster.server.admin import BAD_TOKEN_MESSAGE, NO_TOKEN_MESSAGE
from lighthouse_cluster.local.cluster import LocalCluster
from lighthouse_cluster.proto import lighthouse_cluster_pb2 as cpb
from lighthouse_cluster.proto import lighthouse_cluster_pb2_grpc as cpb_grpc
from lighthouse_cluster.client.admin_client import query_status
from lighthouse_cluster.tls import ClientTLS, PKIFiles, channel, generate_pki

pytestmark = pytest.mark.integration

TOKEN = "tok-3b9d51a0e2c4f7"
SECRET = "raft-secret-5e8a0c21d7"

MUTATING = [
    ("AddMember", cpb.AddMemberRequest(node=cpb.NodeInfo(id="n9", raft_address="127.0.0.1:1",
                                                         client_address="127.0.0.1:2"))),
    ("RemoveMember", cpb.RemoveMemberRequest(node_id="n3")),
    ("TransferLeader", cpb.TransferLeaderRequest()),
    ("SaveSnapshot", cpb.SnapshotRequest()),
    ("RestoreSnapshot", cpb.Snapshot(state=b"")),
]


def admin_call(address: str, method: str, request: Any, metadata: tuple = (), tls: ClientTLS | None = None) -> Any:
    with channel(address, tls) as ch:
        return getattr(cpb_grpc.LighthouseAdminStub(ch), method)(request, timeout=5, metadata=metadata)


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """3 plaintext nodes with the admin token and secret above; n3 starts later with the wrong
    secret (see test_a_node_without_the_secret_cannot_join). Exec'd, not forked: a test reads
    their command lines."""
    with started_cluster(tmp_path_factory.mktemp("plain"), admin_token=TOKEN, secret=SECRET,
                         election_timeout_ms=150, fork_nodes=False) as c:
        yield c


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> PKIFiles:
    return generate_pki(tmp_path_factory.mktemp("pki"))


def leader_address(cluster: LocalCluster) -> str:
    return cluster.client_addresses[cluster.wait_for_leader(timeout=10)]


# -- the admin token -----------------------------------------------------------------------------


@pytest.mark.parametrize("method, request_", MUTATING, ids=[m for m, _ in MUTATING])
def test_mutating_admin_calls_without_or_with_a_wrong_token_are_refused(plain: LocalCluster, method: str,
                                                                         request_: Any) -> None:
    address = leader_address(plain)
    for metadata in ((), (("authorization", "Bearer wrong-token"),), (("authorization", TOKEN),)):
        with pytest.raises(grpc.RpcError) as info:
            admin_call(address, method, request_, metadata)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert info.value.details() == BAD_TOKEN_MESSAGE


def test_the_right_token_is_accepted_and_reads_need_none(plain: LocalCluster) -> None:
    address = leader_address(plain)
    snap = admin_call(address, "SaveSnapshot", cpb.SnapshotRequest(), (("authorization", f"Bearer {TOKEN}"),))
    assert snap.state and snap.leader_id
    members = admin_call(address, "ListMembers", cpb.MembersRequest())
    assert len(members.members) == 3
    res = cli("transfer-leader", env={"LIGHTHOUSE_CLUSTER_ENDPOINTS": plain.endpoints,
                                      "LIGHTHOUSE_CLUSTER_ADMIN_TOKEN": "not-the-token"})
    assert res.returncode == 1 and "UNAUTHENTICATED" in res.stderr
    assert "not-the-token" not in res.stdout + res.stderr


# -- the Raft secret -----------------------------------------------------------------------------


def test_a_node_without_the_secret_cannot_join(plain: LocalCluster) -> None:
    """n3 with a wrong secret, then with none (--insecure): it never learns the leader and
    commits nothing (its commit index stays at pysyncobj's initial entry) while n1 and n2 keep
    committing quorums."""
    for wrong in ("not-the-raft-secret", None):
        plain.kill(2)
        shutil.rmtree(plain.members[2].data_dir)  # a stranger: nothing learned from the cluster
        plain.node_secrets[2] = wrong
        plain.start_node(2)
        wait_for("n3 answering", lambda: plain.status(2) is not None, 15, context=plain)
        leader = plain.wait_for_leader(timeout=10, among=[0, 1])
        for step in range(3):
            quorum_call(plain.client_addresses[leader], "secret-test", step=step)
        committed = max(plain.status(i).commit_index for i in (0, 1))
        wait_for("n1 and n2 committing", lambda: min(plain.status(i).commit_index for i in (0, 1)) >= committed,
                 5, context=plain)
        st = plain.status(2)
        # 1 is pysyncobj's own initial no-op entry: nothing of the cluster's log arrived.
        assert st.commit_index <= 1 and st.leader_id == "" and st.role != cpb.LEADER and not st.has_quorum
        assert committed > 1 and plain.status(leader).has_quorum
        assert not st.ready and not any(p.connected for p in st.peers)
        assert "not-the-raft-secret" not in plain.members[2].log_path.read_text()
    plain.kill(2)
    del plain.node_secrets[2]
    plain.start_node(2)
    wait_for("n3 joining with the right secret",
             lambda: (st := plain.status(2)) is not None and st.leader_id != "" and st.commit_index > 0, 15,
             context=plain)


def test_no_secret_or_token_in_logs_status_or_process_list(plain: LocalCluster, tmp_path: Path) -> None:
    leader = plain.wait_for_leader(timeout=10)
    # Refused and accepted admin calls both get logged; neither may log what was presented.
    with pytest.raises(grpc.RpcError):
        admin_call(plain.client_addresses[leader], "TransferLeader", cpb.TransferLeaderRequest(),
                   (("authorization", "Bearer " + TOKEN + "x"),))
    res = cli("snapshot", "save", str(tmp_path / "s.json"), env={"LIGHTHOUSE_CLUSTER_ENDPOINTS": plain.endpoints,
                                                                   "LIGHTHOUSE_CLUSTER_ADMIN_TOKEN": TOKEN})
    assert res.returncode == 0, res.stderr
    outputs = [res.stdout, res.stderr]
    for args in (["status", "-o", "json"], ["status"], ["health", "-o", "json"], ["members", "list", "-o", "json"]):
        r = cli(*args, env={"LIGHTHOUSE_CLUSTER_ENDPOINTS": plain.endpoints})
        outputs += [r.stdout, r.stderr]
    outputs += [str(plain.status(i)) for i in range(3)]
    outputs += [m.log_path.read_text() for m in plain.members]
    for m in plain.members:
        outputs.append(Path(f"/proc/{m.process.pid}/cmdline").read_bytes().decode(errors="replace"))
    text = "\n".join(outputs)
    assert "refused transfer-leader" in text  # the refusal was logged ...
    assert SECRET not in text and TOKEN not in text  # ... without the token or the secret


# -- TLS -----------------------------------------------------------------------------------------


def test_tls_port_refuses_plaintext_and_serves_clients_trusting_the_ca(make_cluster, pki: PKIFiles) -> None:
    """One TLS node without an admin token: TLS only; admin calls disabled."""
    c = make_cluster(nodes=1, pki=pki)
    address = c.client_addresses[0]
    tls = pki.client_tls(with_cert=False)
    wait_for("the TLS node serving", lambda: (st := query_status(address, 1.0, tls)) is not None and st.serving, 15,
             context=c)
    assert query_status(address, 1.0) is None  # a plaintext client gets nowhere
    with pytest.raises(grpc.RpcError) as info:
        quorum_call(address, "plain", timeout=2)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    with pytest.raises(grpc.RpcError):  # TLS without our CA: the certificate is not trusted
        quorum_call(address, "untrusting", timeout=2, tls=ClientTLS())
    q = quorum_call(address, "trusting", tls=tls)  # the first quorum: neither refused call reached the node
    assert (q.quorum_id, [m.replica_id for m in q.participants]) == (1, ["trusting"])
    assert query_status(address, 1.0, tls).tls
    with pytest.raises(grpc.RpcError) as info:
        admin_call(address, "TransferLeader", cpb.TransferLeaderRequest(), (("authorization", "Bearer x"),), tls=tls)
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED and info.value.details() == NO_TOKEN_MESSAGE
    # The CLI: https:// endpoints and the CA from the environment.
    env = {"LIGHTHOUSE_CLUSTER_ENDPOINTS": f"https://{address}", "LIGHTHOUSE_CLUSTER_TLS_CA": str(pki.ca_cert)}
    assert cli("health", env=env).returncode == 0
    res = cli("status", env={"LIGHTHOUSE_CLUSTER_ENDPOINTS": f"http://{address}"})
    assert res.returncode == 1 and "no node answered" in res.stderr


def test_mutual_tls_cluster_requires_client_certificates(make_cluster, pki: PKIFiles, monkeypatch) -> None:
    """3 nodes requiring client certificates: followers forward to the leader over mTLS."""
    c = make_cluster(pki=pki, mutual_tls=True, admin_token=TOKEN)
    leader = c.wait_for_leader(timeout=20)
    assert c.wait_for_followers(leader, timeout=10)
    follower = c.client_addresses[(leader + 1) % 3]
    with_cert, without_cert = pki.client_tls(with_cert=True), pki.client_tls(with_cert=False)
    with pytest.raises(grpc.RpcError) as info:
        quorum_call(follower, "no-cert", timeout=2, tls=without_cert)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert query_status(follower, 1.0, without_cert) is None
    assert query_status(follower, 1.0) is None
    # Forwarded by a follower to the leader: the node-to-node channel presents the node's cert.
    q = quorum_call(follower, "with-cert", tls=with_cert)
    assert (q.quorum_id, [m.replica_id for m in q.participants]) == (1, ["with-cert"])
    env = {"LIGHTHOUSE_CLUSTER_ENDPOINTS": c.endpoints, "LIGHTHOUSE_CLUSTER_TLS_CA": str(pki.ca_cert),
           "LIGHTHOUSE_CLUSTER_ADMIN_TOKEN": TOKEN}
    assert c.endpoints.startswith("https://")
    res = cli("members", "list", "-o", "json", env=env)
    assert res.returncode == 1 and "require a client certificate" in res.stderr  # no client certificate
    env.update({"LIGHTHOUSE_CLUSTER_TLS_CLIENT_CERT": str(pki.client_cert),
                "LIGHTHOUSE_CLUSTER_TLS_CLIENT_KEY": str(pki.client_key)})
    assert len(json.loads(cli("members", "list", "-o", "json", env=env).stdout)["members"]) == 3
    res = cli("transfer-leader", "-o", "json", env=env)
    assert res.returncode == 0, res.stderr
    assert cli("health", env=env).returncode == 0 or wait_for(
        "healthy after the transfer", lambda: cli("health", env=env).returncode == 0, 10, context=c)
    # ftclient: https:// endpoints and the TLS variables, as a trainer would set them.
    for k in ("LIGHTHOUSE_CLUSTER_TLS_CA", "LIGHTHOUSE_CLUSTER_TLS_CLIENT_CERT", "LIGHTHOUSE_CLUSTER_TLS_CLIENT_KEY"):
        monkeypatch.setenv(k, env[k])
    with LighthouseClient(c.endpoints, connect_timeout=10) as client:
        assert client.describe().startswith("https://")
        q = client.quorum("ftclient-over-mtls", timeout=10)
        # A new member set after "with-cert"'s quorum: a new quorum id.
        assert (q.quorum_id, [m.replica_id for m in q.participants]) == (2, ["ftclient-over-mtls"])
        leader = c.leader_index()
        assert client.target is not None and client.target.address == c.client_addresses[leader]
