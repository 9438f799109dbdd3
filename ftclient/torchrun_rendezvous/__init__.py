"""torchrun's ``--rdzv-backend=lighthouse``: elastic rendezvous on the cluster's replicated
key-value store (issue 34), so the rendezvous survives what the cluster survives.

    torchrun --nnodes=2 --nproc-per-node=1 --rdzv-backend=lighthouse \\
        --rdzv-endpoint=http://a:29510,http://b:29510,http://c:29510 --rdzv-id=job-42 train.py

torch's dynamic rendezvous handler (``torch.distributed.elastic.rendezvous.dynamic_rendezvous``)
does the rendezvous itself; this package gives it what it asks of a backend, all of it kept in
one namespace of the cluster's store, ``(job, --rdzv-id)``:

* ``settings``: ``--rdzv-endpoint`` and ``--rdzv-conf`` read and checked (no I/O);
* ``state_backend``: ``LighthouseRendezvousBackend``, the rendezvous state with its version as
  the compare-and-set token;
* ``kv_store``: ``LighthouseKVStore``, a ``torch.distributed.Store`` on the same namespace (the
  agents' rank assignment, ``MASTER_ADDR``/``MASTER_PORT`` of the workers' store, the exit
  barrier);
* ``handler``: ``create_handler``, torch's own dynamic handler over the two;
* ``entry_point``: ``torchrun_handler_creator``, the ``torchrun.handlers`` entry point named
  ``lighthouse`` (``pyproject.toml``), and the creator it hands torch's registry.

torch is imported by ``kv_store``, ``state_backend`` and ``handler``, never by the lighthouse.
"""
