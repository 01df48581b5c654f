#!/usr/bin/env bash
# Install the OpenEnv environment package `openenv-dipg-safety` (modules med_safety_gym, med_safety_eval; the
# server is med_safety_gym.app:app) into the project's venv, for examples/openenv_dipg/config.yaml. Idempotent.
#
#     infra/install_openenv_dipg.sh [path/to/python]      # default: .venv/bin/python of the repository
#
# Why --no-deps: the package requires openenv-core>=0.2.0, which ships the same `openenv/` modules as the
# `openenv==0.4.1` the project pins (pyproject's [envs]: verifiers 0.4.0 needs it); installing openenv-core
# would overwrite them and break verifiers. Its other pins are for its own Docker/Postgres deployment and are
# not imported by the environment server (gunicorn==22.0.0, wsproto==1.0.0, psycopg2-binary). What the server
# does import is installed here only if missing: datasets (its dataset loader), sqlalchemy (database.py),
# pyyaml, requests, numpy, fastapi, uvicorn, pydantic(-settings) -- the project's own dependencies already
# bring them. `pip check` then reports the unmet declared requirements of openenv-dipg-safety (openenv-core,
# the pins); that is expected and is the only thing it may report.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${1:-.venv/bin/python}
VERSION=0.1.67

installed=$("$PY" -m pip show openenv-dipg-safety 2>/dev/null | sed -n 's/^Version: //p' || true)
if [[ "$installed" == "$VERSION" ]]; then
    echo "openenv-dipg-safety $VERSION is installed"
else
    "$PY" -m pip install --no-deps "openenv-dipg-safety==$VERSION"
fi

# The modules its server imports, installed only when missing (normally none is).
missing=()
for pair in datasets:datasets sqlalchemy:sqlalchemy yaml:pyyaml requests:requests numpy:numpy fastapi:fastapi \
            uvicorn:uvicorn pydantic_settings:pydantic-settings websockets:websockets; do
    "$PY" -c "import ${pair%%:*}" 2>/dev/null || missing+=("${pair#*:}")
done
if ((${#missing[@]})); then
    "$PY" -m pip install "${missing[@]}"
fi

# The project's own openenv must be the one that stays (not openenv-core's copy), and verifiers must still import.
if "$PY" -m pip show openenv-core >/dev/null 2>&1; then
    echo "error: openenv-core is installed; it overwrites openenv==0.4.1's modules. Fix: pip uninstall -y" \
         "openenv-core && pip install --force-reinstall --no-deps openenv==0.4.1" >&2
    exit 1
fi
"$PY" -c "import verifiers.v1, openenv.core, med_safety_gym.app" >/dev/null
echo "ok: verifiers.v1, openenv.core and med_safety_gym.app import"

# Expected: only openenv-dipg-safety's declared requirements are unmet (openenv-core, gunicorn/wsproto pins,
# psycopg2-binary); anything else is a real conflict.
check=$("$PY" -m pip check 2>&1 || true)
other=$(grep -v '^openenv-dipg-safety ' <<<"$check" | grep -v '^No broken requirements' || true)
grep '^openenv-dipg-safety ' <<<"$check" | sed 's/^/pip check (expected): /' || true
if [[ -n "$other" ]]; then
    echo "pip check reports other conflicts:" >&2
    echo "$other" >&2
    exit 1
fi
