#!/bin/bash
# One node of the Slurm job: screen the node, then run its agent (srun starts this once per node).
# Environment from dit-64node.sbatch: REPO, CONFIG, RUN_DIR, ETCD_ENDPOINT.
set -uo pipefail

BIN="$REPO/.venv/bin"
NODE=$(hostname -s)
mkdir -p "$RUN_DIR/diag"

# etcd starts on the first node at the same moment: give it a minute before screening.
for _ in $(seq 60); do
    "$BIN/python" -c "from elastic.control.store import EtcdStore; EtcdStore('$ETCD_ENDPOINT', retry_deadline=1).revision()" \
        2>/dev/null && break
    sleep 1
done

# Prolog: the burn-in screen. Its exit code is honoured: 0 pass -> join; 1 fail -> leave with
# 93 (the "do not requeue" code elastic-launch uses for excluded nodes); 2 -> the screen itself
# could not run, exit 2. The other nodes do not wait for this one (launch.nodes is 63:64).
"$BIN/diag" burnin --quick --json "$RUN_DIR/diag/prolog-$NODE.json" --etcd-endpoint "$ETCD_ENDPOINT" --ckpt-dir "$RUN_DIR"
rc=$?
if [ "$rc" -ne 0 ]; then
    echo "node $NODE: diag burnin exited $rc, not joining" >&2
    if [ "$rc" -eq 1 ]; then exit 93; fi
    exit "$rc"
fi

# The agent: the address peers reach this node at is its own hostname (torchrun --local-addr).
exec "$BIN/elastic-launch" --nodes 63:64 --etcd-endpoint "$ETCD_ENDPOINT" --node-id "$NODE" --local-addr "$(hostname -f)" --run-dir "$RUN_DIR" "$CONFIG"
