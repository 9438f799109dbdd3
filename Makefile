# The commands README.md names.
.PHONY: up test protos check-protos

up:
	python3 -m pip install -e . && lighthouse-cluster up --min_replicas 1 --demo

test:
	python3 -m pip install -e '.[test,dev,interop,examples,bench]' && python3 -m pytest -n 3

protos:
	python3 scripts/gen_protos.py

check-protos:
	python3 scripts/gen_protos.py --check
