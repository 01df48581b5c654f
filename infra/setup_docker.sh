#!/usr/bin/env bash
# Idempotent: make a Docker engine answer on a fresh Debian bookworm machine (run as root).
#   - installs docker.io, debootstrap and bubblewrap if missing
#   - starts dockerd in the background (log: $DOCKERD_LOG) if no engine answers
#   - waits until `docker info` works, or fails with a clear message after $DOCKER_WAIT_S seconds
set -euo pipefail

DOCKERD_LOG="${DOCKERD_LOG:-/var/log/dockerd.log}"
DOCKER_WAIT_S="${DOCKER_WAIT_S:-60}"

log() { echo "[setup_docker] $*" >&2; }

if [[ "$(id -u)" != 0 ]]; then
  log "must run as root (it installs packages and starts dockerd); try: sudo bash $0"
  exit 2
fi

missing=()
command -v dockerd >/dev/null 2>&1 || missing+=(docker.io)
command -v debootstrap >/dev/null 2>&1 || missing+=(debootstrap)
command -v bwrap >/dev/null 2>&1 || missing+=(bubblewrap)
if ((${#missing[@]})); then
  log "installing: ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -q
  apt-get install -y -q --no-install-recommends "${missing[@]}"
else
  log "docker.io, debootstrap and bubblewrap already installed"
fi

if docker info >/dev/null 2>&1; then
  log "a Docker engine already answers"
  exit 0
fi

if pgrep -x dockerd >/dev/null 2>&1; then
  log "dockerd is running but does not answer yet; waiting"
else
  log "starting dockerd in the background (log: $DOCKERD_LOG)"
  mkdir -p "$(dirname "$DOCKERD_LOG")"
  nohup dockerd >>"$DOCKERD_LOG" 2>&1 </dev/null &
  disown || true
fi

for ((i = 0; i < DOCKER_WAIT_S; i++)); do
  if docker info >/dev/null 2>&1; then
    log "Docker engine ready after ${i}s ($(docker version --format '{{.Server.Version}}' 2>/dev/null || echo '?'))"
    exit 0
  fi
  sleep 1
done
log "ERROR: no Docker engine answered within ${DOCKER_WAIT_S}s; last lines of $DOCKERD_LOG:"
tail -n 30 "$DOCKERD_LOG" >&2 || true
exit 1
