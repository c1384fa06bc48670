#!/usr/bin/env bash
# A real two-node SLURM cluster on this one machine, in network namespaces of its own: a switch (the bridge), the
# controller (slurmctld; also the submit host, where sbatch, srun, squeue and scancel run) and two compute nodes
# (slurmd), each with its own address on the bridge and its own host name, all sharing the filesystem as cluster
# nodes share NFS.
#
#   tests/cluster/cluster.sh up            install what is missing (Debian's packages), start munge, slurmctld and both
#                                          slurmds, wait until sinfo shows both nodes idle (their logs, and an error, if not)
#   tests/cluster/cluster.sh down          stop everything, remove the namespaces, the hosts files and the config
#   tests/cluster/cluster.sh submit CMD..  run a command on the submit host (sbatch, squeue, scancel, snakemake ...)
#   tests/cluster/cluster.sh status        sinfo and squeue
#   tests/cluster/cluster.sh stop-node N   stop node N's slurmd, as when a node dies: SLURM marks it DOWN within
#                                          SlurmdTimeout, and jobs that need it pend
#   tests/cluster/cluster.sh start-node N  start node N's slurmd again: it returns to service when it registers
#   tests/cluster/cluster.sh cut-link N    take node N's link to the switch down (its eth0, inside its namespace), as
#                                          when a cable or a switch port fails: its processes keep running, unheard
#   tests/cluster/cluster.sh mend-link N   bring it up again: slurmctld hears the node at its next ping
#
# The machine's own network is never touched: the bridge lives in the switch's namespace, and every veth pair is
# created between two of the cluster's namespaces, so the root namespace gains no link, address or route. Names
# resolve through /etc/netns/<namespace>/hosts, which `ip netns exec` mounts over /etc/hosts inside the namespace
# only. Addresses are DFLASH_CLUSTER_NET (default 10.200.7): the controller .1, node N .1N.
#
# The config goes where SLURM's commands look on every node, /etc/slurm/slurm.conf; `up` refuses to replace one it
# did not write. `up` runs `down` first: idempotent, and safe to rerun after a crash. No systemd, no cgroups
# (proctrack/linuxproc, task/none), no accounting database: job states come from slurmctld (squeue), which keeps
# finished jobs for MinJobAge.
set -euo pipefail

DIR=${DFLASH_CLUSTER_DIR:-/tmp/dflash-cluster}
NET=${DFLASH_CLUSTER_NET:-10.200.7}
NODES=2
CPUS=${DFLASH_CLUSTER_CPUS:-$(nproc)} # each node offers the machine's cores: the nodes share them
MEM_MB=${DFLASH_CLUSTER_MEM_MB:-8000}
UP_TIMEOUT=${DFLASH_CLUSTER_UP_TIMEOUT:-60}
SWITCH=dflash-sw
CONTROLLER=dflash-ctl
CONF=/etc/slurm/slurm.conf
CGROUP_CONF=/etc/slurm/cgroup.conf
CONF_TAG="# Written by tests/cluster/cluster.sh"
MUNGED_PID=/run/munge/dflash-cluster-munged.pid # where the munge user may write; only a munged this script started

case "$NET" in 10.200.*) ;; *) echo "cluster: error: DFLASH_CLUSTER_NET=$NET: the cluster's addresses must lie in 10.200.0.0/16" >&2; exit 1 ;; esac

node_name() { echo "dflash-n$1"; }
node_addr() { echo "$NET.1$1"; }
namespaces() { echo "$SWITCH $CONTROLLER"; for i in $(seq 1 "$NODES"); do node_name "$i"; done; }
say() { echo "cluster: $*" >&2; }
die() { echo "cluster: error: $*" >&2; exit 1; }
# A command on the submit host: the controller's namespace, where the controller's address is reachable.
on_submit_host() { ip netns exec "$CONTROLLER" "$@"; }

install() {
    local missing=()
    for tool in slurmctld slurmd sbatch munged ip; do command -v "$tool" >/dev/null || missing+=("$tool"); done
    [ ${#missing[@]} -eq 0 ] && return
    say "installing SLURM and munge from Debian's packages (missing: ${missing[*]})"
    command -v apt-get >/dev/null || die "missing ${missing[*]} and no apt-get: install slurmctld slurmd slurm-client munge iproute2"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends slurmctld slurmd slurm-client munge iproute2 >/dev/null
}

write_conf() {
    mkdir -p "$DIR/ctld" "$DIR/log" "$DIR/spool" "$(dirname "$CONF")"
    cat >"$CONF" <<EOF
$CONF_TAG: one controller, $NODES compute nodes in network namespaces.
ClusterName=dflash
SlurmctldHost=$CONTROLLER($NET.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation=$DIR/ctld
SlurmdSpoolDir=$DIR/spool/%n
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd-%n.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd-%n.log
SlurmctldPort=6817
SlurmdPort=6818
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
ReturnToService=2
# As at sites that do not requeue by default: a job is requeued after a node fails only where it asks (sbatch
# --requeue, which the repository's SLURM profile sets).
JobRequeue=0
# A requeued job waits cred_expire before it starts again (120 s by default): shorter here, for the tests' sake.
AuthInfo=cred_expire=30
# A lost node is noticed within SlurmdTimeout; finished jobs stay visible to squeue for MinJobAge.
SlurmdTimeout=30
MinJobAge=3600
KillWait=10
InactiveLimit=0
NodeName=DEFAULT CPUs=$CPUS RealMemory=$MEM_MB State=UNKNOWN
EOF
    for i in $(seq 1 "$NODES"); do
        echo "NodeName=$(node_name "$i") NodeAddr=$(node_addr "$i")" >>"$CONF"
    done
    echo "PartitionName=cpu Nodes=ALL Default=YES MaxTime=INFINITE State=UP" >>"$CONF"
    # slurmd initialises a cgroup plugin even with task/none, and misreads this machine's hybrid v1 layout.
    cat >"$CGROUP_CONF" <<EOF
$CONF_TAG
CgroupPlugin=cgroup/v1
CgroupMountpoint=/sys/fs/cgroup
CgroupAutomount=no
EOF
}

# A namespace on the switch: its eth0 is one end of a veth pair whose other end is a port of the bridge.
plug_into_switch() {
    local ns=$1 addr=$2 name=$3
    ip netns add "$ns"
    ip -n "$ns" link add eth0 type veth peer name "p-$name" netns "$SWITCH"
    ip -n "$SWITCH" link set "p-$name" master br0
    ip -n "$SWITCH" link set "p-$name" up
    ip -n "$ns" addr add "$addr/24" dev eth0
    ip -n "$ns" link set eth0 up
    ip -n "$ns" link set lo up
    mkdir -p "/etc/netns/$ns"
    cp "$DIR/hosts" "/etc/netns/$ns/hosts"
}

start_network() {
    {
        echo "127.0.0.1 localhost"
        echo "$NET.1 $CONTROLLER"
        for i in $(seq 1 "$NODES"); do echo "$(node_addr "$i") $(node_name "$i")"; done
    } >"$DIR/hosts"
    ip netns add "$SWITCH"
    ip -n "$SWITCH" link add br0 type bridge
    ip -n "$SWITCH" link set br0 up
    plug_into_switch "$CONTROLLER" "$NET.1" ctl
    for i in $(seq 1 "$NODES"); do plug_into_switch "$(node_name "$i")" "$(node_addr "$i")" "n$i"; done
}

start_munge() {
    mkdir -p /run/munge
    [ -s /etc/munge/munge.key ] || mungekey --create --keyfile /etc/munge/munge.key
    chown -R munge:munge /run/munge /etc/munge
    chmod 700 /etc/munge && chmod 400 /etc/munge/munge.key
    if ! munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1; then
        # --force: a socket left by a crashed munged. Its socket is a file: every namespace shares it.
        runuser -u munge -- munged --force --pid-file="$MUNGED_PID"
    fi
    munge -n </dev/null | unmunge >/dev/null || die "munge does not authenticate: see /var/log/munge/munged.log"
}

# A daemon in namespace $1 under its own host name $1, as on a real cluster: torchrun's rendezvous host knows itself
# by it, and slurmctld and slurmd check their names against the config.
start_daemon() {
    local ns=$1
    shift
    ip netns exec "$ns" unshare --uts sh -c "hostname $ns && exec $*"
}

wait_idle() {
    local deadline=$((SECONDS + UP_TIMEOUT)) state=""
    while [ $SECONDS -lt $deadline ]; do
        state=$(on_submit_host sinfo -h -N -o '%N %t' 2>/dev/null || true)
        [ "$(grep -cE ' idle$' <<<"$state" || true)" -ge "$NODES" ] && { echo "$state"; return 0; }
        sleep 1
    done
    for log in "$DIR"/log/*.log; do echo "==> $log <==" >&2; tail -n 20 "$log" >&2; done
    die "the nodes were not idle within $UP_TIMEOUT s; sinfo says: ${state:-nothing (is slurmctld up?)}; the daemons' logs are above"
}

# Stop the daemon named $2 whose pid file is $1: only if that pid is still that daemon (a stale file's pid may be
# another process's by now).
stop_pidfile() {
    local file=$1 daemon=$2 pid
    [ -f "$file" ] || return 0
    pid=$(cat "$file" 2>/dev/null || true)
    if [ -n "$pid" ] && [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "$daemon" ]; then
        kill "$pid" 2>/dev/null || true
        for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
        kill -9 "$pid" 2>/dev/null || true
    fi
    rm -f "$file"
}

# A config file this script wrote (or none): the only kind it replaces or removes.
ours() { [ ! -e "$1" ] || head -n 1 "$1" | grep -q "^$CONF_TAG"; }

down() {
    # Every process in the cluster's namespaces (jobs, slurmd, slurmctld), then munged, then the namespaces: deleting
    # a namespace deletes its end of each veth pair, and with it the other end.
    for ns in $(namespaces); do
        if [ -e "/run/netns/$ns" ]; then
            ip netns pids "$ns" 2>/dev/null | xargs -r kill -9 2>/dev/null || true
        fi
    done
    stop_pidfile "$MUNGED_PID" munged
    for ns in $(namespaces); do
        [ -e "/run/netns/$ns" ] && ip netns del "$ns"
        rm -rf "/etc/netns/$ns"
    done
    rm -rf "$DIR/ctld" "$DIR/spool" "$DIR"/*.pid "$DIR/hosts"
    for conf in "$CONF" "$CGROUP_CONF"; do if ours "$conf"; then rm -f "$conf"; fi; done
}

up() {
    [ "$(id -u)" -eq 0 ] || die "the cluster needs root (network namespaces, slurmd)"
    for conf in "$CONF" "$CGROUP_CONF"; do
        ours "$conf" || die "$conf is this machine's own SLURM config, not one this script wrote: it is left alone; run the cluster on a machine without SLURM"
    done
    install
    down
    trap 'say "up failed: stopping what it started (logs kept in $DIR/log)"; down' EXIT
    mkdir -p "$DIR/log"
    rm -f "$DIR"/log/*.log
    write_conf
    start_network
    start_munge
    start_daemon "$CONTROLLER" slurmctld -f "$CONF"
    for i in $(seq 1 "$NODES"); do start_daemon "$(node_name "$i")" slurmd -f "$CONF" -N "$(node_name "$i")"; done
    wait_idle
    trap - EXIT
    say "up: $NODES nodes idle; submit from the controller's namespace: $0 submit sbatch ..."
}

case "${1:-}" in
    up) up ;;
    down) down; say "down" ;;
    submit) shift; on_submit_host "$@" ;;
    status) on_submit_host sinfo -N; on_submit_host squeue ;;
    stop-node) stop_pidfile "$DIR/slurmd-$(node_name "${2:?stop-node N}").pid" slurmd; say "stopped $(node_name "$2")'s slurmd" ;;
    start-node) start_daemon "$(node_name "${2:?start-node N}")" slurmd -f "$CONF" -N "$(node_name "$2")"; say "started $(node_name "$2")'s slurmd" ;;
    cut-link) ip -n "$(node_name "${2:?cut-link N}")" link set eth0 down; say "cut $(node_name "$2")'s link" ;;
    mend-link) ip -n "$(node_name "${2:?mend-link N}")" link set eth0 up; say "mended $(node_name "$2")'s link" ;;
    *) sed -n '2,27p' "$0" | sed 's/^# \{0,1\}//'; exit 2 ;;
esac
