"""What the tests share: bounded waits (``waiting``), cluster helpers (``cluster``), trainer
processes and the training harness (``trainer_process``, ``torchft_trainer``, ``training``), the torchft lines (``torchft_lines``,
``torchft_support``), an import blocker (``import_blocker``) and the skip policy (``skips``).

``tests`` is on ``sys.path`` (pyproject's pytest ``pythonpath``), so a test imports
``from support.waiting import wait_for``.
"""
