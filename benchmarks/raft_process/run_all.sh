#!/bin/sh
# The measurement sequence of docs/design/raft-process.md, one run at a time, from the checkout root:
#   sh benchmarks/raft_process/run_all.sh [STOP_AT_UTC, default 08:05]
# Every run is appended to benchmarks/raft_process/results/runs.jsonl; then
#   python3 -m benchmarks.raft_process.measure summary > benchmarks/raft_process/results/summary.json
set -u
STOP=${1:-08:05}
M="python3 -m benchmarks.raft_process.measure"
$M rounds   --variants A,B,C,C2 --ns 1024,2048 --repeats 1 --duration 30 --stop-at "$STOP"
$M failover --variants A,B,C,C2 --n 8 --kills 5 --stop-at "$STOP"
$M idle     --variants A,B,C,C2 --seconds 30 --stop-at "$STOP"
$M rounds   --variants A,B,C,C2 --ns 1024,2048 --repeats 1 --duration 30 --stop-at "$STOP"
$M rounds   --variants A-nost,C-nost --ns 2048,1024 --repeats 1 --duration 30 --stop-at "$STOP"
$M failover --variants A,B,C,C2 --n 64 --kills 5 --stop-at "$STOP"
$M rounds   --variants A,B,C,C2 --ns 2048,1024 --repeats 1 --duration 30 --stop-at "$STOP"
$M rounds   --variants A-nost,C-nost --ns 2048 --repeats 1 --duration 30 --stop-at "$STOP"
$M summary > benchmarks/raft_process/results/summary.json
