#!/usr/bin/env bash
# DEPRECATED: use `python3 benchmarks/first_contact.py` (benchmarks/README.md, "First contact").
# Kept for one release as a thin wrapper so that commands and notes naming it still work. The old
# script could not return anything on the lent GPU machine: its `pip install` lines abort under
# `set -e` without a registry, it wrote to benchmarks/results/ instead of $OUT, pytest stopped at
# "Unknown config option" without pytest-asyncio, it called `python` where `python3` holds torch,
# and all its benchmarks shared one process, so the first exception lost the rest.
#
#   bash benchmarks/gpu_check.sh [first_contact.py options]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
echo "gpu_check.sh is deprecated and runs benchmarks/first_contact.py; call that directly" >&2
exec "${PYTHON:-python3}" "$ROOT/benchmarks/first_contact.py" "$@"
