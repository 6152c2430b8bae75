#!/usr/bin/env bash
# A one-node Slurm on this machine, for testing the sbatch templates (tests/test_slurm.py). Run as root,
# with Debian's slurm-wlm and munge installed (apt-get install -y slurm-wlm munge).
#
#   launch/local_slurm.sh start DIR   # config, state, logs and a munge key of its own in DIR; waits for the node
#   export SLURM_CONF=DIR/slurm.conf  # then sbatch / squeue / scontrol talk to it
#   launch/local_slurm.sh stop DIR    # stops the three daemons started from DIR (by their pid files)
#
# munged runs on a socket in DIR with its own key, and the daemons listen on their own ports
# (LOCAL_SLURM_PORT, default 16817, and the next one), so a system Slurm or munge is never touched. The node
# offers LOCAL_SLURM_CPUS logical CPUs (default 8; more than the machine has is allowed) and no GPUs.
# MinJobAge=5 keeps `sbatch --wait` polling every 2 s (with a longer one it backs off to 32 s between polls).
set -euo pipefail
cmd=${1:?usage: local_slurm.sh start|stop DIR}
dir=${2:?usage: local_slurm.sh start|stop DIR}
mkdir -p "$dir"
dir=$(cd "$dir" && pwd)
export SLURM_CONF=$dir/slurm.conf

stop() {
  local name pid
  for name in slurmd slurmctld munged; do
    pid=$(cat "$dir/$name.pid" 2>/dev/null) || continue
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -9 "$pid" 2>/dev/null || true
    rm -f "$dir/$name.pid"
  done
}

fail() {
  echo "local_slurm: $1" >&2
  for log in munged slurmctld slurmd; do
    [ -f "$dir/$log.log" ] && { echo "--- $dir/$log.log" >&2; tail -n 20 "$dir/$log.log" >&2; }
  done
  stop
  exit 1
}

if [ "$cmd" = stop ]; then
  stop
  exit 0
fi
[ "$cmd" = start ] || { echo "usage: local_slurm.sh start|stop DIR" >&2; exit 2; }
[ "$(id -u)" = 0 ] || { echo "local_slurm: run as root (slurmd must be)" >&2; exit 1; }
for bin in munged slurmctld slurmd sbatch sinfo; do
  command -v "$bin" >/dev/null || [ -x "/usr/sbin/$bin" ] \
    || { echo "local_slurm: $bin not found: apt-get install -y slurm-wlm munge" >&2; exit 1; }
done
export PATH=$PATH:/usr/sbin
port=${LOCAL_SLURM_PORT:-16817}
node=$(hostname -s)
mkdir -p "$dir/state" "$dir/spool"
chmod 700 "$dir"
[ -f "$dir/munge.key" ] || { head -c 1024 /dev/urandom > "$dir/munge.key"; chmod 600 "$dir/munge.key"; }
cat > "$SLURM_CONF" <<EOF
ClusterName=minrlhf-local
SlurmctldHost=$node(127.0.0.1)
SlurmctldPort=$port
SlurmdPort=$((port + 1))
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$dir/munge.sock
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/slurmctld.log
SlurmdLogFile=$dir/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
SlurmdParameters=config_overrides
ReturnToService=2
KillWait=5
MinJobAge=5
NodeName=$node NodeAddr=127.0.0.1 CPUs=${LOCAL_SLURM_CPUS:-8} State=UNKNOWN
PartitionName=local Nodes=$node Default=YES MaxTime=INFINITE State=UP
EOF
stop  # leftovers of an earlier start from this directory
munged --force --socket="$dir/munge.sock" --key-file="$dir/munge.key" --pid-file="$dir/munged.pid" \
  --log-file="$dir/munged.log" --seed-file="$dir/munged.seed" || fail "munged did not start"
slurmctld -f "$SLURM_CONF" || fail "slurmctld did not start"
slurmd -f "$SLURM_CONF" -N "$node" || fail "slurmd did not start"
for _ in $(seq 120); do  # the node registers within seconds; 60 s at most
  state=$(sinfo -h -n "$node" -o %T 2>/dev/null || true)
  [ "$state" = idle ] && { echo "local_slurm: node $node idle; export SLURM_CONF=$SLURM_CONF"; exit 0; }
  sleep 0.5
done
fail "node $node not idle after 60 s (state: '${state:-none}')"
