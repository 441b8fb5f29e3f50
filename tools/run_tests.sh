#!/usr/bin/env bash
# The test command of the README: installs what the tests need (the CPU build of torch 2.13.0, pinned so pip never
# resolves a multi-GB CUDA build), then runs the suite. Multi-process tests use a pool of gloo ranks on 127.0.0.1 kept
# alive for the session. The tests marked `heavy` (whole programs in other processes: torchrun, fresh interpreters,
# the compile matrix) are left out here and run by CI next (`python3 -m pytest -q -m heavy test`), or by
# `bash tools/run_tests.sh --heavy` (everything).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q torch==2.13.0
python3 -m pip install -q -e '.[test,tools]'
if [[ "${1:-}" == "--heavy" ]]; then
    shift
    exec python3 -m pytest -q test "$@"
fi
exec python3 -m pytest -q -m "not heavy" test "$@"
