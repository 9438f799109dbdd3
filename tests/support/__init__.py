"""What the tests share: bounded waits (``waiting``), cluster helpers (``cluster``), trainer
processes and the training harness (``trainer_process``, ``torchft_trainer``, ``liveness_trainer``, ``training``),
the torchft lines (``torchft_lines``, ``torchft_support``), a fake lighthouse node for ftclient's liveness
stream (``fake_watch``), an import blocker (``import_blocker``) and the skip policy (``skips``).

``tests`` is on ``sys.path`` (pyproject's pytest ``pythonpath``), so a test imports
``from support.waiting import wait_for``.
"""
