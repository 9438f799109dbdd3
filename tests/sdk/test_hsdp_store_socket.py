"""``examples/train_hsdp.py``'s replica-group store: the launcher binds the port before any rank
starts and hands rank 0 the socket, so nothing can take the port in between.

It once picked the port by binding port 0, closing and passing the number on; in a full suite run
another process's outgoing connection took that port first and rank 0 failed with EADDRINUSE
(CI, ``test_a_recovery_that_fails_on_one_rank_is_applied_on_no_rank``)."""

from __future__ import annotations

import errno
import importlib.util
import socket
import sys
from datetime import timedelta
from pathlib import Path
from types import ModuleType

import pytest
import torch.distributed as dist

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_hsdp.py"


@pytest.fixture(scope="module")
def train_hsdp() -> ModuleType:
    spec = importlib.util.spec_from_file_location("train_hsdp_example", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_the_store_port_stays_held_until_the_store_listens_on_it(train_hsdp: ModuleType) -> None:
    held = train_hsdp.store_socket()
    port = held.getsockname()[1]
    try:
        for host in ("127.0.0.1", "0.0.0.0"):
            with socket.socket() as other, pytest.raises(OSError) as taken:
                other.bind((host, port))
            assert taken.value.errno == errno.EADDRINUSE
    except BaseException:
        held.close()
        raise
    # The store owns the fd from here: it closes it when it is destroyed (so the socket object lets
    # it go; closing both closed the number twice, and the second close hit a file another test
    # of this worker had opened since).
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                          master_listen_fd=held.detach(), timeout=timedelta(seconds=10))
    client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))
    client.set("from", "a rank")
    assert store.get("from") == b"a rank"
