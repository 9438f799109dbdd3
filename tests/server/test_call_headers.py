"""How a call's job and forwarding node are read from its metadata (``grpc_services``): one pass
for a Quorum call, the same answers as reading each header by itself."""

from __future__ import annotations

import pytest

from lighthouse_cluster.core.jobs import DEFAULT_JOB, JOB_HEADER
from lighthouse_cluster.server.grpc_services import call_job, quorum_call_headers
from lighthouse_cluster.server.forwarding import FORWARDED_HEADER


class _Context:
    """What the header readers use of a ``grpc.aio.ServicerContext``; counts the reads."""

    def __init__(self, metadata: tuple[tuple[str, str | bytes], ...] | None) -> None:
        self.metadata = metadata
        self.reads = 0

    def invocation_metadata(self):  # type: ignore[no-untyped-def]
        self.reads += 1
        return self.metadata


@pytest.mark.parametrize("metadata, port_job, expected", [
    (None, None, (DEFAULT_JOB, None)),
    ((), None, (DEFAULT_JOB, None)),
    (((JOB_HEADER, "llama"),), None, ("llama", None)),
    (((JOB_HEADER, b"llama"),), None, ("llama", None)),
    (((JOB_HEADER, ""),), None, (DEFAULT_JOB, None)),
    (((JOB_HEADER, "first"), (JOB_HEADER, "second")), None, ("first", None)),
    (((FORWARDED_HEADER, "n2"), (JOB_HEADER, "llama")), None, ("llama", "n2")),
    (((FORWARDED_HEADER, "n2"), (FORWARDED_HEADER, "n3")), None, (DEFAULT_JOB, "n2")),
    (((JOB_HEADER, "other"), (FORWARDED_HEADER, b"n3")), "port-job", ("port-job", "n3")),
    ((("user-agent", "grpc-python"), (JOB_HEADER, "llama")), None, ("llama", None)),
])
def test_one_pass_reads_what_each_header_alone_reads(metadata, port_job, expected) -> None:  # type: ignore[no-untyped-def]
    context = _Context(metadata)
    assert quorum_call_headers(context, port_job) == expected  # type: ignore[arg-type]
    assert context.reads == 1
    forwarded = next((v if isinstance(v, str) else v.decode() for k, v in metadata or () if k == FORWARDED_HEADER), None)
    assert (call_job(_Context(metadata), port_job), forwarded) == expected  # type: ignore[arg-type]
