#!/usr/bin/env bash
# Sets up (or checks) a one-node local Slurm cluster on this machine, for the HPC tests and for
# trying the sbatch templates: Debian's slurm-wlm + munge, a generated /etc/slurm/slurm.conf
# (cluster "zooinfer", partition "debug", this host as the only node), munged, slurmctld and
# slurmd started as plain daemons (no systemd needed), and waits until the node is idle.
#
#   sudo bash scripts/slurm/setup_local_slurm.sh
#
# Idempotent: when everything is already up with the same config it returns in well under 2 s.
# When the generated config differs from the one in place, the daemons it started are restarted.
# On failure it prints one line "setup_local_slurm: ERROR: <reason>" on stderr and exits 1.
# Logs: /var/log/slurm/{slurmctld,slurmd}.log, /var/log/munge/munged.log.
set -euo pipefail

readonly PROG="setup_local_slurm"
readonly CONF_DIR=/etc/slurm                 # Debian's slurm-wlm (>= 20.x) reads /etc/slurm/slurm.conf
readonly CONF="$CONF_DIR/slurm.conf"
readonly RUN_DIR=/run/slurm
readonly LOG_DIR=/var/log/slurm
readonly CTLD_PID="$RUN_DIR/slurmctld.pid"
readonly SLURMD_PID="$RUN_DIR/slurmd.pid"
readonly MUNGE_KEY=/etc/munge/munge.key
readonly WAIT_S="${SLURM_SETUP_WAIT_S:-90}"
export PATH="/usr/sbin:/usr/bin:/sbin:/bin:$PATH"
export DEBIAN_FRONTEND=noninteractive
# sinfo/scontrol must talk to this cluster, whatever the caller's environment says.
unset SLURM_CONF SLURM_CLUSTERS

fail() { echo "$PROG: ERROR: $*" >&2; exit 1; }
log() { echo "$PROG: $*" >&2; }

[[ "$(id -u)" -eq 0 ]] || fail "must run as root (it installs packages and starts daemons)"

# One setup at a time (two pytest sessions may start it together).
lock_file=/run/lock/zooinfer-slurm-setup.lock
[[ -d /run/lock && -w /run/lock ]] || lock_file=/tmp/zooinfer-slurm-setup.lock
exec 9>"$lock_file"
flock -w 600 9 || fail "another $PROG is still running (lock held for 10 min)"

host="$(hostname -s)"
[[ -n "$host" ]] || fail "hostname -s is empty"

# --- packages ---------------------------------------------------------------------------------
have_binaries() {
    local b
    for b in munged munge unmunge slurmctld slurmd sbatch srun scontrol sinfo squeue; do
        command -v "$b" >/dev/null 2>&1 || return 1
    done
}

install_packages() {
    command -v apt-get >/dev/null 2>&1 || fail "apt-get not found: install slurm-wlm and munge by hand (Debian/Ubuntu only)"
    local pkgs=(slurm-wlm munge) policy_created=0 out
    # Keep the packages' maintainer scripts from starting services: we start them ourselves.
    if [[ ! -e /usr/sbin/policy-rc.d ]]; then
        printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d && chmod 755 /usr/sbin/policy-rc.d
        policy_created=1
    fi
    log "installing ${pkgs[*]}"
    if ! out="$(apt-get install -y -q --no-install-recommends "${pkgs[@]}" 2>&1)"; then
        log "apt-get install failed, running apt-get update first"
        if ! out="$(apt-get update -q 2>&1 && apt-get install -y -q --no-install-recommends "${pkgs[@]}" 2>&1)"; then
            [[ $policy_created -eq 1 ]] && rm -f /usr/sbin/policy-rc.d
            echo "$out" | tail -n 5 >&2
            fail "apt-get could not install ${pkgs[*]} (see the lines above)"
        fi
    fi
    [[ $policy_created -eq 1 ]] && rm -f /usr/sbin/policy-rc.d
    have_binaries || fail "slurm-wlm/munge installed but a binary is missing (munged, slurmctld, slurmd, sbatch...)"
}

have_binaries || install_packages
getent passwd slurm >/dev/null || fail "user 'slurm' missing (the slurm-wlm package should create it)"
getent passwd munge >/dev/null || fail "user 'munge' missing (the munge package should create it)"

# --- hostname must resolve (slurmd finds its NodeName by it; slurmctld listens on it) -----------
if ! getent hosts "$host" >/dev/null 2>&1; then
    log "adding '127.0.0.1 $host' to /etc/hosts"
    echo "127.0.0.1 $host" >>/etc/hosts || fail "cannot write /etc/hosts to make '$host' resolve"
fi

# --- munge ------------------------------------------------------------------------------------
munge_ok() { munge -n 2>/dev/null | unmunge >/dev/null 2>&1; }

pid_alive() {  # pid_alive PIDFILE NAME: the process of that pid file is running and is NAME
    local pid
    [[ -s "$1" ]] || return 1
    pid="$(<"$1")"
    [[ "$pid" =~ ^[0-9]+$ ]] && [[ "$(cat "/proc/$pid/comm" 2>/dev/null)" == "$2" ]]
}

start_munge() {
    if [[ ! -s "$MUNGE_KEY" ]]; then
        log "creating $MUNGE_KEY"
        install -d -o munge -g munge -m 700 /etc/munge
        if command -v mungekey >/dev/null 2>&1; then
            mungekey --create --keyfile="$MUNGE_KEY" --force >/dev/null
        else
            dd if=/dev/urandom of="$MUNGE_KEY" bs=1 count=1024 status=none
        fi
    fi
    chown munge:munge "$MUNGE_KEY" && chmod 400 "$MUNGE_KEY"
    install -d -o munge -g munge -m 755 /run/munge
    install -d -o munge -g munge -m 700 /var/log/munge /var/lib/munge
    log "starting munged"
    # Detached from the caller (setsid, stdio on /dev/null): a caller that captures output must not
    # wait on pipes held open by daemons.
    setsid runuser -u munge -- env -i PATH="$PATH" munged </dev/null >>/var/log/munge/munged.start.log 2>&1 9>&- \
        || setsid runuser -u munge -- env -i PATH="$PATH" munged --force </dev/null >>/var/log/munge/munged.start.log 2>&1 9>&- \
        || fail "munged did not start (see /var/log/munge/munged.log)"
    local i
    for ((i = 0; i < 50; i++)); do munge_ok && return 0; sleep 0.1; done
    fail "munged is running but munge -n | unmunge fails (see /var/log/munge/munged.log)"
}

munge_ok || start_munge

# --- slurm.conf -------------------------------------------------------------------------------
cpus="$(nproc)"
mem_total_mb="$(free -m | awk '/^Mem:/ {print $2}')"
[[ "$mem_total_mb" =~ ^[0-9]+$ ]] || fail "cannot read the memory size from free -m"
# A bit below the total (slurmd drains a node that has less than RealMemory), rounded to 100 MB so
# that the config does not change between runs.
real_mem=$(( mem_total_mb * 90 / 100 / 100 * 100 ))
(( real_mem >= 100 )) || real_mem=$(( mem_total_mb > 1 ? mem_total_mb - 1 : 1 ))

conf_text="$(cat <<EOF
# Generated by scripts/slurm/setup_local_slurm.sh (zoo-infer): a one-node local test cluster.
# Rerun the script after editing it; do not edit this file by hand.
ClusterName=zooinfer
SlurmctldHost=$host
AuthType=auth/munge
CryptoType=crypto/munge
MpiDefault=none
MailProg=/bin/true
SlurmUser=slurm
SlurmdUser=root
SlurmctldPort=6817
SlurmdPort=6818
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldPidFile=$CTLD_PID
SlurmdPidFile=$SLURMD_PID
SlurmctldLogFile=$LOG_DIR/slurmctld.log
SlurmdLogFile=$LOG_DIR/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
# No cgroups, no accounting: processes are tracked by parent pid.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
JobRequeue=1
MinJobAge=300
KillWait=30
InactiveLimit=0
SlurmctldTimeout=120
SlurmdTimeout=300
Waittime=0
NodeName=$host CPUs=$cpus RealMemory=$real_mem State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP
EOF
)"

conf_changed=0
if [[ ! -f "$CONF" ]] || [[ "$(<"$CONF")" != "$conf_text" ]]; then
    conf_changed=1
fi

node_state() { sinfo -h -N -n "$host" -o '%T' 2>/dev/null | head -n 1; }
ctld_up() { scontrol ping 2>/dev/null | grep -q 'is UP'; }

# --- fast path: same config, daemons running, node usable ---------------------------------------
if [[ $conf_changed -eq 0 ]] && pid_alive "$CTLD_PID" slurmctld && pid_alive "$SLURMD_PID" slurmd && ctld_up; then
    case "$(node_state)" in
        idle|mixed|allocated|completing)
            echo "$PROG: slurm already up: node $host $(node_state), partition debug"
            exit 0 ;;
    esac
fi

# --- (re)start the daemons ----------------------------------------------------------------------
stop_daemon() {  # stop_daemon PIDFILE NAME: stops only the process recorded in our pid file
    local pid i
    pid_alive "$1" "$2" || return 0
    pid="$(<"$1")"
    log "stopping $2 (pid $pid)"
    kill -TERM "$pid" 2>/dev/null || true
    for ((i = 0; i < 100; i++)); do pid_alive "$1" "$2" || return 0; sleep 0.1; done
    kill -KILL "$pid" 2>/dev/null || true
    sleep 0.2
}

if [[ $conf_changed -eq 1 ]]; then
    if [[ -f "$CONF" ]]; then
        cp -p "$CONF" "$CONF.bak"
        log "slurm.conf changed (previous one kept as $CONF.bak)"
    fi
    stop_daemon "$SLURMD_PID" slurmd
    stop_daemon "$CTLD_PID" slurmctld
    install -d -m 755 "$CONF_DIR"
    printf '%s\n' "$conf_text" >"$CONF.tmp" && chmod 644 "$CONF.tmp" && mv -f "$CONF.tmp" "$CONF"
fi

install -d -o slurm -g slurm -m 755 "$RUN_DIR" "$LOG_DIR"
install -d -o slurm -g slurm -m 700 /var/spool/slurmctld
install -d -o root -g root -m 755 /var/spool/slurmd

start_daemon() {  # start_daemon NAME: detached, clean environment, config given explicitly
    log "starting $1"
    setsid env -i PATH="$PATH" "$1" -f "$CONF" </dev/null >>"$LOG_DIR/$1.start.log" 2>&1 9>&- \
        || fail "$1 did not start: $(tail -n 1 "$LOG_DIR/$1.log" 2>/dev/null || tail -n 1 "$LOG_DIR/$1.start.log")"
}

if ! pid_alive "$CTLD_PID" slurmctld; then start_daemon slurmctld; fi
for ((i = 0; i < WAIT_S * 5; i++)); do ctld_up && break; sleep 0.2; done
ctld_up || fail "slurmctld does not answer scontrol ping after ${WAIT_S}s (see $LOG_DIR/slurmctld.log: $(tail -n 1 "$LOG_DIR/slurmctld.log" 2>/dev/null))"

if ! pid_alive "$SLURMD_PID" slurmd; then start_daemon slurmd; fi

resumed=0
state=""
for ((i = 0; i < WAIT_S * 5; i++)); do
    pid_alive "$SLURMD_PID" slurmd || { sleep 0.2; pid_alive "$SLURMD_PID" slurmd \
        || fail "slurmd exited: $(tail -n 1 "$LOG_DIR/slurmd.log" 2>/dev/null)"; }
    state="$(node_state)"
    case "$state" in
        idle|mixed|allocated|completing) break ;;
        down*|drain*|fail*|inval*)
            # Down from an earlier run, or drained by a restart: put it back in service (once a second).
            if (( resumed % 5 == 0 )); then
                scontrol update nodename="$host" state=resume >/dev/null 2>&1 || true
            fi
            resumed=$((resumed + 1)) ;;
    esac
    sleep 0.2
done
case "$state" in
    idle|mixed|allocated|completing) ;;
    *) fail "node $host is '${state:-missing}' after ${WAIT_S}s (reason: $(sinfo -h -R -n "$host" -o '%E' 2>/dev/null | head -n 1); see $LOG_DIR/slurmd.log)" ;;
esac
echo "$PROG: slurm up: node $host $state ($cpus CPUs, RealMemory=$real_mem MB), partition debug, config $CONF"
