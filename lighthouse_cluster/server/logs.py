"""Logging set-up for node processes: plain text or one JSON object per line."""

from __future__ import annotations

import json
import logging
import sys
import time


class JsonFormatter(logging.Formatter):
    """One JSON object per record: time, level, logger, message (and exception text)."""

    def __init__(self, node_id: str | None = None) -> None:
        super().__init__()
        self.node_id = node_id

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        if self.node_id:
            entry["node"] = self.node_id
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def configure_logging(level: str = "info", fmt: str = "text", node_id: str | None = None) -> None:
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter(node_id))
    else:
        prefix = f"[{node_id}] " if node_id else ""
        handler.setFormatter(logging.Formatter(f"%(asctime)s %(levelname)s {prefix}%(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # pysyncobj logs every reconnect attempt at warning level; keep it for debug runs.
    logging.getLogger("pysyncobj").setLevel(max(logging.ERROR, root.level))
