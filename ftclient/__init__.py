"""ftclient: the trainer SDK (torchft's Manager / ProcessGroup / DDP / Optimizer semantics with
leader discovery over a list of lighthouse endpoints). Under construction; see README.md."""
