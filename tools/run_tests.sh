#!/usr/bin/env bash
# The test command of the README: installs what the tests need (the CPU build of torch 2.13.0, pinned so pip never
# resolves a multi-GB CUDA build), then runs the whole suite. Multi-process tests use a pool of gloo ranks on
# 127.0.0.1 kept alive for the session.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q torch==2.13.0
python3 -m pip install -q -e '.[test,tools]'
exec python3 -m pytest -q test "$@"
