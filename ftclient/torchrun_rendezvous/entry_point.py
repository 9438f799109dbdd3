"""The ``torchrun.handlers`` entry point ``lighthouse`` (``pyproject.toml``).

torch's registry loads every entry point of that group and registers, under its name, what its
zero-argument function returns: ``torchrun_handler_creator`` returns ``create_for_torchrun``, a
creator ``(RendezvousParameters) -> RendezvousHandler``. The registry runs while torch's
rendezvous package is being imported, so this module imports nothing of torch at its top (a
module that did would be loaded half-initialized when it is itself what imported torch's
rendezvous first); the handler is imported when torchrun asks for one.

``create_for_torchrun`` is ``handler.create_handler`` ending the process with one line
(``SystemExit``: exit status 1, no traceback) on a setting or a cluster that cannot work;
torchrun's launcher calls it before it starts any worker.
"""

from __future__ import annotations

from typing import Any, Callable

PREFIX = "torchrun --rdzv-backend=lighthouse: "


def create_for_torchrun(params: Any) -> Any:
    from torch.distributed.elastic.rendezvous.api import RendezvousError

    from ftclient.torchrun_rendezvous.handler import create_handler
    from ftclient.torchrun_rendezvous.settings import RendezvousSettingsError
    from lighthouse_cluster.client.kv_client import KVError

    try:
        return create_handler(params)
    except (RendezvousSettingsError, RendezvousError, KVError) as e:
        raise SystemExit(PREFIX + str(e)) from None


def torchrun_handler_creator() -> Callable[[Any], Any]:
    """What torch registers as the ``lighthouse`` backend's creator."""
    return create_for_torchrun
