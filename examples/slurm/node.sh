#!/bin/bash
# One node of the Slurm job: screen the node, then run its agent (srun starts this once per node).
# Environment from dit-64node.sbatch: REPO, BIN, CONFIG, RUN_DIR, NODES, ETCD_ENDPOINT.
set -uo pipefail

BIN=${BIN:-$REPO/.venv/bin}
# The node id is Slurm's node name (unique in the job even when several slurmd share a host);
# peers reach this node at the address Slurm itself uses for it (NodeAddr).
NODE=$SLURMD_NODENAME
ADDR=$(scontrol -o show node "$NODE" | tr ' ' '\n' | sed -n 's/^NodeAddr=//p')
mkdir -p "$RUN_DIR/diag"

# etcd starts on the first node at the same moment: give it a minute before screening.
# A node that cannot reach it is not a bad node: exit 2 (not 93) with the reason.
deadline=$((SECONDS + 60))
until "$BIN/python" -c "from elastic.control.store import EtcdStore; EtcdStore('$ETCD_ENDPOINT', retry_deadline=1).revision()" \
        2>/dev/null; do
    if [ "$SECONDS" -ge "$deadline" ]; then
        echo "node $NODE: etcd at $ETCD_ENDPOINT unreachable for 60 s, not joining" >&2
        exit 2
    fi
    sleep 1
done

# Bad readings planted for this node (faults/diag-<node>.yaml, as chaos' bad_hardware writes
# them) reach this screen as they reach the agent's own screens.
if [ -f "$RUN_DIR/faults/diag-$NODE.yaml" ]; then
    export ELASTIC_DIAG_INJECT="$RUN_DIR/faults/diag-$NODE.yaml"
fi

# Prolog: the burn-in screen. Its exit code is honoured: 0 pass -> join; 1 fail -> leave with
# 93 (the "do not requeue" code elastic-launch uses for excluded nodes); 2 -> the screen itself
# could not run, exit 2. The other nodes do not wait for this one (NODES allows one fewer).
"$BIN/diag" burnin --quick --json "$RUN_DIR/diag/prolog-$NODE.json" --etcd-endpoint "$ETCD_ENDPOINT" --ckpt-dir "$RUN_DIR"
rc=$?
if [ "$rc" -ne 0 ]; then
    echo "node $NODE: diag burnin exited $rc, not joining" >&2
    if [ "$rc" -eq 1 ]; then exit 93; fi
    exit "$rc"
fi

# The agent. exec: srun's signals (scancel, time limit) reach elastic-launch itself.
exec "$BIN/elastic-launch" --nodes "$NODES" --etcd-endpoint "$ETCD_ENDPOINT" --node-id "$NODE" --local-addr "$ADDR" --run-dir "$RUN_DIR" "$CONFIG"
