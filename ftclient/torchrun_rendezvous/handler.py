"""The ``lighthouse`` rendezvous handler: what torchrun gets for ``--rdzv-backend=lighthouse``
(through ``entry_point.create_for_torchrun``).

``create_handler`` reads the settings (``settings.read_settings``), checks before any worker
starts that the cluster answers and, for a job other than ``default``, that the job exists, and
returns torch's own ``DynamicRendezvousHandler`` over a ``LighthouseRendezvousBackend`` and a
``LighthouseKVStore`` sharing one ``KVClient``. Its errors are exceptions
(``RendezvousSettingsError``, torch's ``RendezvousConnectionError``, ``RendezvousStateError``).
"""

from __future__ import annotations

from datetime import timedelta
import grpc
from torch.distributed.elastic.rendezvous.api import RendezvousError, RendezvousHandler, RendezvousParameters
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler as create_dynamic_handler

from ftclient.torchrun_rendezvous.kv_store import LighthouseKVStore
from ftclient.torchrun_rendezvous.settings import (RendezvousSettings, RendezvousSettingsError,
                                                   is_default_job, read_settings)
from ftclient.torchrun_rendezvous.state_backend import LighthouseRendezvousBackend
from lighthouse_cluster.client.kv_client import KVClient, KVCluster
from lighthouse_cluster.proto import lighthouse_cluster_pb2 as cpb
from lighthouse_cluster.proto import lighthouse_cluster_pb2_grpc as cpb_grpc
from lighthouse_cluster.tls import channel

JOB_CHECK_TIMEOUT_S = 5.0


def _check_job_exists(settings: RendezvousSettings) -> None:
    """``RendezvousSettingsError`` when no node knows the job and one says so (NOT_FOUND)."""
    answers: list[str] = []
    for address in settings.addresses:
        metadata = (("authorization", f"Bearer {settings.token}"),) if settings.token else ()
        with channel(address, settings.tls) as ch:
            try:
                cpb_grpc.LighthouseClusterStub(ch).GetJob(cpb.JobRequest(name=settings.job),
                                                          timeout=JOB_CHECK_TIMEOUT_S, metadata=metadata)
                return
            except grpc.RpcError as e:
                answers.append(f"{address}: {e.code().name}")
                if e.code() == grpc.StatusCode.NOT_FOUND:
                    continue
    if answers and all(a.endswith("NOT_FOUND") for a in answers):
        raise RendezvousSettingsError(
            f"job {settings.job!r} is not known to the cluster at {', '.join(settings.addresses)}: create it "
            f"(lighthouse-cluster jobs create {settings.job}) or leave --rdzv-conf job= out for the default job")
    # Nodes that did not answer: the reachability check that follows says so.


def create_handler(params: RendezvousParameters) -> RendezvousHandler:
    """torch's ``DynamicRendezvousHandler`` on the cluster's store; see the module docstring."""
    settings = read_settings(params.endpoint, params.run_id, params.config)
    if not is_default_job(settings):
        _check_job_exists(settings)
    cluster = KVCluster(list(settings.addresses), tls=settings.tls, token=settings.token,
                        timeout=settings.kv_timeout_s)
    kv = KVClient(cluster, settings.job, settings.run_id)
    backend = LighthouseRendezvousBackend(kv)
    try:
        backend.get_state()  # the cluster answers, and the key holds a state of ours (or none)
    except RendezvousError:
        cluster.close()
        raise
    store = LighthouseKVStore(kv, timeout=timedelta(seconds=settings.read_timeout_s))
    try:
        return create_dynamic_handler(store, backend, params)
    except (TypeError, ValueError) as e:
        cluster.close()
        raise RendezvousSettingsError(f"--rdzv-conf: {e}") from None
