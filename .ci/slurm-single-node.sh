#!/usr/bin/env bash
# Start a one-node SLURM cluster on this machine (slurmctld + slurmd on localhost, munge auth), for tests/test_sweep.py.
# Debian/Ubuntu, as root, with or without systemd (the daemons are started directly, not as services): installs
# slurm-wlm and munge if missing, writes /etc/slurm/slurm.conf, (re)starts the daemons with a clean job state and waits
# until the node is idle. Stop it with: .ci/slurm-single-node.sh stop
set -euo pipefail
stop_slurm() {
  for pidfile in /run/slurmd.pid /run/slurmctld.pid; do
    [ -f "$pidfile" ] && kill "$(cat "$pidfile")" 2>/dev/null || true
  done
  for _ in $(seq 50); do pgrep -x slurmctld >/dev/null || pgrep -x slurmd >/dev/null || break; sleep 0.2; done
  rm -f /run/slurmd.pid /run/slurmctld.pid
}
if [ "${1:-}" = stop ]; then
  stop_slurm
  [ -f /run/munge/munged.pid ] && kill "$(cat /run/munge/munged.pid)" 2>/dev/null || true
  exit 0
fi
[ "$(id -u)" = 0 ] || { echo "error: $0 must run as root (it installs and starts system daemons)" >&2; exit 1; }
if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v munged >/dev/null; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y -qq --no-install-recommends slurm-wlm munge >/dev/null \
    || { apt-get update -qq && apt-get install -y -qq --no-install-recommends slurm-wlm munge >/dev/null; }
fi
host=$(hostname -s)
cpus=$(nproc)
mem_mb=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 - 512 ))
mkdir -p /etc/slurm /var/spool/slurmctld /var/spool/slurmd /var/log/slurm /run/munge /var/lib/munge /var/log/munge
# 127.0.0.1 as every address: the machine's own name need not resolve (containers).
# AuthInfo cred_expire: SLURM holds a requeued job back for the job credential's lifetime plus 1 s (default 120 s);
# 5 s, the least SLURM accepts, is ample for a step to launch on one node. sched_interval, bf_interval: the scheduler
# looks at pending jobs every second (default: 60 and 30 s), so a requeued job starts as soon as it may.
cat > /etc/slurm/slurm.conf <<CONF
ClusterName=ci
SlurmctldHost=$host(127.0.0.1)
SlurmUser=root
AuthType=auth/munge
AuthInfo=cred_expire=5
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=1,bf_interval=1
ReturnToService=2
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
NodeName=$host NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$mem_mb State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
CONF
[ -f /etc/munge/munge.key ] || dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key 2>/dev/null
chown -R munge:munge /etc/munge /run/munge /var/lib/munge /var/log/munge
chmod 400 /etc/munge/munge.key
fail() {
  echo "error: $1; the end of the logs:" >&2
  tail -n 20 /var/log/munge/munged.log /var/log/slurm/slurmctld.log /var/log/slurm/slurmd.log >&2 || true
  exit 1
}
pgrep -x munged >/dev/null || runuser -u munge -- munged || fail "munged did not start"
stop_slurm # a running cluster keeps its old slurm.conf: restart it with this one
slurmctld -c || fail "slurmctld did not start" # -c: no jobs or node states left over from an earlier cluster
slurmd || fail "slurmd did not start"
for _ in $(seq 60); do
  sinfo -h -o %T 2>/dev/null | grep -qx idle && { sinfo; exit 0; }
  sleep 0.5
done
fail "the SLURM node did not become idle in 30 s"
