"""The pure rules: quorum decisions, the replicated state machine, its msgpack schema, the quorum lease
and torchft's member encoding. No I/O, no clocks, no threads: time and ids come in as arguments."""
