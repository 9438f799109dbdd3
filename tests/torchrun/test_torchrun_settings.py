"""``--rdzv-endpoint``, ``--rdzv-id`` and ``--rdzv-conf`` of ``torchrun --rdzv-backend=lighthouse``
(``ftclient.torchrun_rendezvous.settings``): what is accepted, and the one-line errors for what
cannot work. No processes, no network; torchrun's own runs are in test_torchrun_rendezvous.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from ftclient.torchrun_rendezvous.settings import (DEFAULT_KV_TIMEOUT_S, DEFAULT_READ_TIMEOUT_S,
                                                   RendezvousSettingsError, read_settings)
from lighthouse_cluster.tls import ClientTLS

NODES = "http://10.0.0.1:29510,http://10.0.0.2:29510,http://10.0.0.3:29510"


def test_the_node_list_and_defaults() -> None:
    s = read_settings(NODES, "job-42", {"timeout": 900, "last_call_timeout": "5"}, environ={})
    assert s.addresses == ("10.0.0.1:29510", "10.0.0.2:29510", "10.0.0.3:29510")
    assert (s.job, s.run_id, s.namespace) == ("default", "job-42", "default/job-42")
    assert s.tls is None and s.token is None
    assert (s.read_timeout_s, s.kv_timeout_s) == (DEFAULT_READ_TIMEOUT_S, DEFAULT_KV_TIMEOUT_S)


def test_one_name_and_bare_addresses_work_too() -> None:
    assert read_settings("lighthouse.ns.svc:29510", "r", {}, environ={}).addresses == ("lighthouse.ns.svc:29510",)
    assert read_settings("10.0.0.1:1 10.0.0.2:1", "r", {}, environ={}).addresses == ("10.0.0.1:1", "10.0.0.2:1")


def test_the_job_comes_from_the_conf_then_the_environment_then_the_url() -> None:
    assert read_settings(NODES + "?job=url-job", "r", {}, environ={}).job == "url-job"
    assert read_settings(NODES + "?job=url-job", "r", {}, environ={"LIGHTHOUSE_JOB": "env-job"}).job == "env-job"
    assert read_settings(NODES, "r", {"job": "conf-job"}, environ={"LIGHTHOUSE_JOB": "env-job"}).job == "conf-job"


def test_tls_and_token_files(tmp_path: Path) -> None:
    (tmp_path / "ca.pem").write_bytes(b"CA")
    (tmp_path / "token").write_text("secret-token\n")
    s = read_settings("https://a:1,https://b:1", "r", {"tls_ca": str(tmp_path / "ca.pem"),
                                                        "token_file": str(tmp_path / "token")}, environ={})
    assert s.tls == ClientTLS(root_ca=b"CA") and s.token == "secret-token"
    # https:// with nothing configured: the system's roots.
    assert read_settings("https://a:1", "r", {}, environ={}).tls == ClientTLS()
    assert read_settings("http://a:1", "r", {"read_timeout": "2.5", "kv_timeout": "7"}, environ={}).read_timeout_s == 2.5


@pytest.mark.parametrize(("endpoint", "run_id", "conf", "message"), [
    ("", "r", {}, "--rdzv-endpoint is empty: give the cluster's nodes, e.g. http://"),
    ("http://[::1:29510", "r", {}, "--rdzv-endpoint 'http://[::1:29510': "),
    ("ftp://a:1", "r", {}, "--rdzv-endpoint 'ftp://a:1': "),
    ("http://a:1?job=x,http://b:1?job=y", "r", {}, "--rdzv-endpoint "),
    (NODES, "", {}, "--rdzv-id '': the run id is empty"),
    (NODES, "no/slashes", {}, "--rdzv-id 'no/slashes': run id"),
    (NODES, "r", {"job": "bad job!"}, "the rendezvous job: the job argument: job name 'bad job!'"),
    (NODES, "r", {"is_host": "1"}, "--rdzv-conf is_host: not a setting of the lighthouse backend (its keys: job,"),
    (NODES, "r", {"tls_cert": "/x/cert.pem"}, "--rdzv-conf tls_ca/tls_cert/tls_key: a client certificate needs both"),
    (NODES, "r", {"tls_ca": "/nonexistent/ca.pem"}, "--rdzv-conf tls_ca/tls_cert/tls_key: cannot read TLS CA"),
    (NODES, "r", {"token_file": "/nonexistent/token"}, "--rdzv-conf token_file=/nonexistent/token: cannot read it"),
    (NODES, "r", {"read_timeout": "soon"}, "--rdzv-conf read_timeout='soon': not a number of seconds"),
    (NODES, "r", {"kv_timeout": "0"}, "--rdzv-conf kv_timeout='0': must be a positive number of seconds"),
])
def test_bad_settings_are_one_line_errors(endpoint: str, run_id: str, conf: dict, message: str) -> None:
    with pytest.raises(RendezvousSettingsError) as e:
        read_settings(endpoint, run_id, conf, environ={})
    text = str(e.value)
    assert text.startswith(message), text
    assert "\n" not in text


def test_an_empty_token_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / "token").write_text("\n")
    with pytest.raises(RendezvousSettingsError, match="must hold one token on one line"):
        read_settings(NODES, "r", {"token_file": str(tmp_path / "token")}, environ={})


@pytest.mark.integration  # a fresh interpreter: the import order is the point
@pytest.mark.parametrize("first", ["ftclient.torchrun_rendezvous.handler", "ftclient.torchrun_rendezvous.kv_store",
                                   "torch.distributed.elastic.rendezvous"])
def test_the_entry_point_registers_lighthouse_whatever_was_imported_first(first: str) -> None:
    """torch's registry loads the ``torchrun.handlers`` entry points while its rendezvous package is
    being imported; when that import came from our own handler module, an entry point living in
    it was loaded half-initialized and ``lighthouse`` was never registered."""
    import subprocess
    import sys

    code = (f"import {first}\n"
            "from torch.distributed.elastic.rendezvous import rendezvous_handler_registry as r\n"
            "from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler\n"
            "print('lighthouse' in r._registry)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "True", out.stdout + out.stderr[-2000:]
