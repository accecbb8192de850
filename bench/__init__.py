"""Benchmarks: `bash scripts/bench.sh` (or `python -m bench.run`) measures our per-node design against
stock TRL server mode, side by side in one run, each figure against the floor of this machine."""
