#!/usr/bin/env bash
# The set-up half of the README's test command (`tools/test-setup.sh && pytest`): on a fresh machine
# (Python, pip and gcc only) install everything the tests need for this checkout.
set -euo pipefail
cd "$(dirname "$0")/.."

# Debian's Chromium for the browser tests of the HTML report (driven by playwright, no download).
if ! command -v chromium >/dev/null 2>&1; then
    SUDO=""
    if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
    export DEBIAN_FRONTEND=noninteractive
    $SUDO apt-get install -y -q chromium >/dev/null \
        || { $SUDO apt-get update -q >/dev/null && $SUDO apt-get install -y -q chromium >/dev/null; }
fi

python -m pip install -q --upgrade pip
# Editable: the tests and the doctests run on this checkout's diag/ (tests/conftest.py refuses an
# installed copy); the editable finder maps diag.fixtures to fixtures/ as the wheel does.
python -m pip install -q -e ".[test]"
# HQQ and GPTQ weight-only recipes: onnxruntime's code for them imports torch. Only a CPU wheel that
# pip finds without an index (this project's CI machines carry one on disk) is installed, then its
# small dependencies; elsewhere the HQQ/GPTQ tests skip with their reason and no CUDA build downloads.
if python -m pip install -q --no-index --no-deps "torch==2.13.0" 2>/dev/null; then
    python -m pip install -q "torch==2.13.0"
else
    echo "no local torch wheel: the HQQ/GPTQ tests will skip (they say why)"
fi
