"""``python -m jepsen_like``: see ``jepsen_like.cli``."""

from .cli import main

main()
