#!/bin/bash
# Sourced by the sbatch scripts here: one standalone `rankwatch collector serve`
# for the whole job, on the batch script's node (the allocation's first), and
# RANKWATCH_COLLECTOR / RANKWATCH_TOKEN exported for every task of the job.
#
# It ignores SIGTERM: scancel and a time limit send SIGTERM to every process of
# the job, the batch script's included, and the launchers still hand in their
# last reports during Slurm's grace period (KillWait, 30 s by default). The
# script stops it (SIGINT) when the job step is done; SIGKILL ends it at the
# latest, with the rest of the job.
RANKWATCH_COLLECTOR_PORT=${RANKWATCH_COLLECTOR_PORT:-8765}
export RANKWATCH_TOKEN=${RANKWATCH_TOKEN:-$(python3 -c 'import secrets; print(secrets.token_urlsafe(32))')}
# The address Slurm reaches this node by (NodeAddr), which every node can use.
RANKWATCH_COLLECTOR_HOST=$(scontrol show node -o "$SLURMD_NODENAME" | sed -n 's/.* NodeAddr=\([^ ]*\).*/\1/p')
RANKWATCH_COLLECTOR_HOST=${RANKWATCH_COLLECTOR_HOST:-$(hostname)}
export RANKWATCH_COLLECTOR="http://${RANKWATCH_COLLECTOR_HOST}:${RANKWATCH_COLLECTOR_PORT}"
(trap '' TERM; exec rankwatch collector serve --host 0.0.0.0 --port "$RANKWATCH_COLLECTOR_PORT" \
    --data-dir "${RANKWATCH_COLLECTOR_DIR:-rankwatch-collector}") &
RANKWATCH_COLLECTOR_PID=$!
trap 'status=$?; kill -INT $RANKWATCH_COLLECTOR_PID 2>/dev/null; wait $RANKWATCH_COLLECTOR_PID 2>/dev/null; exit $status' EXIT
python3 - <<PY
import time, urllib.request
deadline = time.time() + 60
while True:
    try:
        urllib.request.urlopen("$RANKWATCH_COLLECTOR/healthz", timeout=2).close()
        break
    except OSError:
        if time.time() > deadline:
            raise SystemExit("rankwatch collector did not start at $RANKWATCH_COLLECTOR")
        time.sleep(0.2)
PY
