"""Running a cluster on one machine: node processes, `up` and its supervisor, the demo, simulated
replica groups, and the drop-in for torchft's LighthouseServer."""
