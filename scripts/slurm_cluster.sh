#!/usr/bin/env bash
# A one-node SLURM on this machine, on which tests/test_slurm.py runs scripts/slurm_train.sbatch:
#   bash scripts/slurm_cluster.sh start   # as root: installs Debian's slurmctld, slurmd, slurm-client and
#                                         # munge when missing, starts them, waits until the node is idle
#   bash scripts/slurm_cluster.sh stop    # stops the daemons that `start` started
# The configuration, state and logs live in $SLURM_CLUSTER_DIR (default: slurm-one-node in the temp
# folder); commands find the cluster with SLURM_CONF=$SLURM_CLUSTER_DIR/slurm.conf. The node is this
# machine with all its cores and two GPUs that are not there (/dev/null, /dev/zero), so that jobs can
# ask for GPUs (--gpus-per-node) or not. A requeued job may start again 11 s later (cred_expire=10,
# SLURM's default is 121 s), and the scheduler looks for it every 5 s (sched_interval; default 60 s).
set -euo pipefail

DIR=${SLURM_CLUSTER_DIR:-${TMPDIR:-/tmp}/slurm-one-node}
CONF=$DIR/slurm.conf

start() {
    stop  # what an earlier start left running
    if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v sbatch >/dev/null \
        || ! command -v munged >/dev/null; then
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
            slurmctld slurmd slurm-client munge >/dev/null
    fi
    mkdir -p "$DIR/state" "$DIR/spool"

    # munge: the key is the package's; a munged that answers already (the system's) is used as it is
    if ! munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1; then
        mkdir -p /run/munge
        chown munge:munge /run/munge
        runuser -u munge -- munged
        touch "$DIR/started-munged"
    fi

    local host node
    host=$(hostname -s)
    node=$(slurmd -C | sed -n 1p)  # NodeName=<host> CPUs=... RealMemory=...: this machine as slurmd sees it
    cat > "$CONF" <<EOF
ClusterName=one-node
SlurmctldHost=$host(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=cred_expire=10
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerParameters=bf_interval=5,sched_interval=5
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobRequeue=1
KillWait=10
ReturnToService=2
MpiDefault=none
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd.pid
SlurmctldLogFile=$DIR/slurmctld.log
SlurmdLogFile=$DIR/slurmd.log
GresTypes=gpu
$node NodeAddr=127.0.0.1 Gres=gpu:2 State=UNKNOWN
PartitionName=main Nodes=$host Default=YES MaxTime=INFINITE State=UP
EOF
    cat > "$DIR/gres.conf" <<EOF
NodeName=$host Name=gpu File=/dev/null
NodeName=$host Name=gpu File=/dev/zero
EOF
    export SLURM_CONF=$CONF
    slurmctld -f "$CONF"
    slurmd -f "$CONF"
    local deadline=$((SECONDS + 60)) state=""
    while [ "$SECONDS" -lt "$deadline" ]; do
        state=$(sinfo --noheader --nodes="$host" --format=%T 2>/dev/null || true)
        if [ "$state" = idle ]; then
            echo "SLURM $(sinfo --version | cut -d' ' -f2) is up on $host: export SLURM_CONF=$CONF"
            return 0
        fi
        sleep 0.5
    done
    echo "error: the node $host is not idle 60 s after the start (state: ${state:-no answer});" \
         "see $DIR/slurmctld.log and $DIR/slurmd.log" >&2
    return 1
}

stop() {
    local name pid
    if [ -f "$DIR/slurmctld.pid" ]; then  # no job outlives the cluster
        SLURM_CONF=$CONF scancel --partition=main 2>/dev/null || true
        local deadline=$((SECONDS + 30))
        while [ -n "$(SLURM_CONF=$CONF squeue --noheader 2>/dev/null)" ] && [ "$SECONDS" -lt "$deadline" ]; do
            sleep 0.5
        done
    fi
    for name in slurmd slurmctld; do
        if [ -f "$DIR/$name.pid" ]; then
            pid=$(cat "$DIR/$name.pid")
            kill "$pid" 2>/dev/null || true
            while kill -0 "$pid" 2>/dev/null; do sleep 0.2; done
            rm -f "$DIR/$name.pid"
        fi
    done
    if [ -f "$DIR/started-munged" ]; then
        pid=$(cat /run/munge/munged.pid 2>/dev/null || true)
        if [ -n "$pid" ]; then
            kill "$pid" 2>/dev/null || true
        fi
        rm -f "$DIR/started-munged"
    fi
}

case "${1:-}" in
    start) start ;;
    stop) stop ;;
    *) echo "usage: bash scripts/slurm_cluster.sh start|stop" >&2; exit 2 ;;
esac
