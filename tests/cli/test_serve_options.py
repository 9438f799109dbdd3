"""`serve`'s options are declared once: each click option of ``serve`` (but the few ``serve``
keeps for itself) is a ``ServeOptions`` field of the same name and default, and reaches the
node's ``NodeConfig`` through ``build_node_config``."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest

from lighthouse_cluster.cli.serve import serve
from lighthouse_cluster.server.config import ConfigError, ServeOptions, build_node_config

# What `serve` consumes itself rather than handing to the node (``--config`` is read by click).
SERVE_OWN = {"config", "secret_file", "event_loop", "log_level", "log_format"}
PEERS = ("n1=127.0.0.1:7001,127.0.0.1:8001", "n2=127.0.0.1:7002,127.0.0.1:8002",
         "n3=127.0.0.1:7003,127.0.0.1:8003")


def test_every_node_option_is_a_serve_options_field_of_the_same_name() -> None:
    names = {p.name for p in serve.params if p.name not in SERVE_OWN}
    assert names == {f.name for f in dataclasses.fields(ServeOptions)}


def test_the_click_defaults_are_the_serve_options_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [n for n in os.environ if n.startswith("LIGHTHOUSE_CLUSTER_")]:
        monkeypatch.delenv(name)
    args = ["--node-id", "n1", "--min_replicas", "1"] + [a for p in PEERS for a in ("--peer", p)]
    with serve.make_context("serve", args) as ctx:
        given = {k: v for k, v in ctx.params.items() if k not in SERVE_OWN}
    required = {"node_id": "n1", "min_replicas": 1, "peers": PEERS}
    assert given == dataclasses.asdict(ServeOptions(**required))


def test_build_node_config_takes_serve_options_or_its_fields(tmp_path: Path) -> None:
    options = ServeOptions(node_id="n2", peers=PEERS, insecure=True, min_replicas=2, data_dir=tmp_path,
                           quorum_tick_ms=50, join=True, job_port_process_nice=3, auto_create_jobs=1)
    config = build_node_config(options)
    assert config == build_node_config(**dataclasses.asdict(options))
    # copied as given
    assert (config.node_id, config.data_dir, config.quorum_tick_ms, config.join,
            config.job_port_process_nice) == ("n2", tmp_path, 50, True, 3)
    # derived
    assert config.client_bind == "[::]:8002" and config.options.min_replicas == 2
    assert config.auto_create_jobs is True and config.secret is None and config.quorum_lease_ms == 150
    with pytest.raises(TypeError):
        build_node_config(**dataclasses.asdict(options), no_such_option=1)
    with pytest.raises(ConfigError, match="no cluster secret"):
        build_node_config(dataclasses.replace(options, insecure=False))
