#!/usr/bin/env bash
# One node of a gyre job on SLURM: gyre.sbatch runs this once per node (`srun --ntasks-per-node=1`).
# Node 0 runs `gyre run` (the scheduler, the proxy, the rollout driver and the trajectory service) and
# makes the run token; every other node runs `gyre node`, which starts the cells `gyre run` gives it
# (cell i on node 1 + i mod (nodes - 1)); they stop once `gyre run` ends (it writes nodes/stop). Everything it needs comes from SLURM's variables and:
#   GYRE_CONFIG   the run config (a path every node sees)
#   GYRE_JOB_DIR  a directory every node sees: token, nodes/ (the agents' rendezvous), run/ (out_dir)
#   GYRE          the gyre command (default: gyre); GYRE_XFER likewise (default: gyre-xfer)
#   GYRE_HOST     this node's address (default: the first of `hostname -i`)
# Further arguments go to `gyre run` as SECTION.KEY=VALUE overrides.
set -euo pipefail
: "${SLURM_NODEID:?run by srun (or set SLURM_NODEID)}" "${SLURM_NNODES:?run by srun (or set SLURM_NNODES)}"
: "${GYRE_CONFIG:?the run config}" "${GYRE_JOB_DIR:?a directory every node sees}"
GYRE=${GYRE:-gyre}
GYRE_XFER=${GYRE_XFER:-gyre-xfer}
HOST=${GYRE_HOST:-$(hostname -i | awk '{print $1}')}
TOKEN="$GYRE_JOB_DIR/token"
NODES="$GYRE_JOB_DIR/nodes"

if [ "$SLURM_NODEID" = 0 ]; then
  mkdir -p "$NODES"
  (umask 077 && $GYRE_XFER token > "$TOKEN.new")
  [ -s "$TOKEN.new" ] || { echo "node 0: $GYRE_XFER token printed no token" >&2; exit 1; }
  mv "$TOKEN.new" "$TOKEN"
  GYRE_TOKEN=$(cat "$TOKEN")
  export GYRE_TOKEN
  exec $GYRE run "$GYRE_CONFIG" run.out_dir="$GYRE_JOB_DIR/run" run.nodes_dir="$NODES" \
    run.node_agents=$((SLURM_NNODES - 1)) run.bind_host="$HOST" "$@"
fi

for _ in $(seq 600); do  # node 0 makes the token first
  [ -s "$TOKEN" ] && break
  sleep 0.5
done
[ -s "$TOKEN" ] || { echo "node $SLURM_NODEID: no token at $TOKEN after 300 s" >&2; exit 1; }
exec $GYRE node "$NODES" --node-id "$SLURM_NODEID" --host "$HOST" --token-file "$TOKEN"
