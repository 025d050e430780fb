#!/bin/sh
# Entrypoint of the sidecar container (tools/Dockerfile): the node's sidecar for the job in
# $OVERLORD_CONFIG. The sidecar checks its host before it starts anything (shared memory
# for the rings, Redis, the sources) and exits with status 2 and what to change;
# extra arguments go to `overlord sidecar` (e.g. --cpus 8).
set -eu
: "${OVERLORD_CONFIG:?set OVERLORD_CONFIG to the job config (YAML or JSON) mounted into the container}"
if [ ! -r "$OVERLORD_CONFIG" ]; then
    echo "overlord-entrypoint: cannot read the job config $OVERLORD_CONFIG; mount it (-v /etc/overlord:/etc/overlord:ro)" >&2
    exit 2
fi
set -- --config "$OVERLORD_CONFIG" ${OVERLORD_NODE:+--node "$OVERLORD_NODE"} \
    ${OVERLORD_METRICS_PORT:+--metrics-port "$OVERLORD_METRICS_PORT"} \
    ${OVERLORD_METRICS_HOST:+--metrics-host "$OVERLORD_METRICS_HOST"} "$@"
exec overlord sidecar "$@"
