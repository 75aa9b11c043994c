#!/usr/bin/env bash
# A self-contained Slurm cluster on this one machine, for slurmft's tests: two nodes in the default partition
# (five in a second one), Slurm 22.05 from this Debian 12 machine's own packages, or Slurm 24.11 from a Debian 13
# root file system.
#
#   bash tests/slurm/cluster.sh up      install the Debian packages if missing, start everything,
#                                       wait until n1-n5 are idle (a no-op when already healthy)
#   bash tests/slurm/cluster.sh down    cancel jobs, stop the daemons (by pid file only), kill our
#                                       stray slurmstepd; logs and state stay for a post-mortem
#   bash tests/slurm/cluster.sh env     print `export ...` lines:  eval "$(bash tests/slurm/cluster.sh env)"
#   bash tests/slurm/cluster.sh status  daemons and nodes; exit 0 only when the cluster is healthy
#
# Daemons: munged (private socket), mariadbd + slurmdbd (so sacct works), slurmctld, and five slurmd
# (n1-n5; NodeHostname=localhost, NodeAddr 127.0.0.2, 127.0.0.1, 127.0.0.3, .4, .5), each node with 32 CPUs,
# 128000 MB and 8 fake GPUs (gres File= symlinks to /dev/null). Partitions: `debug` (the default: n1, n2), which
# every test uses unless it names another, and `wide` (n1-n5) for the layouts that need more than two nodes
# (tests/slurm/test_grpo_layout.py: GRPO's server layout at 2+1 and 4+1 nodes). Nothing is written outside the cluster's directory (and, for
# trixie, the root file system cache): clients find the cluster through SLURM_CONF, never
# /etc/slurm/slurm.conf.
#
# Knobs (environment):
#   SLURMFT_CLUSTER_DIR      everything lives here (trixie: in DIR-trixie)          (/tmp/slurmft-cluster)
#   SLURMFT_CLUSTER_PORT     slurmctld port; n1, n2, slurmdbd, mariadb use +1..+4, n3-n5 +5..+7; trixie adds 10
#                            to each, so the two versions run side by side from the same knobs   (16817); refused where
#                            it would overlap the jobs' rendezvous ports 20000-32767 (slurmft/job/rendezvous.py)
#   SLURMFT_CLUSTER_TIMEOUT  seconds to wait for each daemon and for the idle nodes (60)
#   SLURMFT_CLUSTER_SUITE    whose Slurm: bookworm (this Debian 12 machine's packages, Slurm 22.05.8)
#                            or trixie (Debian 13's, Slurm 24.11.5, in a root file system)  (bookworm)
#   SLURMFT_ROOTFS_CACHE     where the trixie root file system is built once and kept   (/var/cache/slurmft)
#   SLURMFT_CLUSTER_KILLWAIT seconds between SIGTERM and SIGKILL (KillWait)              (5)
#   SLURMFT_CLUSTER_STORE_FLAGS  AccountingStoreFlags; empty: the line is left out   (job_comment)
#   SLURMFT_CLUSTER_NODE_LOCAL   a directory each slurmd (and so each node's jobs) sees as its own
#                            private tmpfs, like a node-local disk; empty: none (needs root: unshare -m)
#   SLURMFT_CLUSTER_PRIVATE_DATA PrivateData of slurm.conf and slurmdbd.conf (e.g. jobs: squeue and sacct
#                            show users only their own jobs); empty: the lines are left out        ()
# The last four exist for tests that need a cluster configured otherwise (`slurmft doctor`'s misconfigured
# cluster, tests/slurm/test_slurm_doctor.py; a teammate's view under PrivateData=jobs,
# tests/slurm/test_shared_rundir.py), run as a second instance (own directory and port) so the shared
# cluster stays as it is.
#
# trixie: Debian 13's libc is newer than Debian 12's, so its Slurm cannot be installed beside 22.05. The
# first `up` builds a root file system with mmdebstrap from Debian's packages (59-134 s measured on a
# loaded 2-core machine, 567 MB; later `up`s reuse it and start in about 17 s). Every Slurm and munge
# command, daemons included, runs there through $DIR/bin (first on PATH, see `env`): each name links
# to bin/in-root, which enters a private mount namespace, bind-mounts the host's /tmp, /root, /home,
# /work, /opt, /usr/local (the job's Python and the tests' files, at the same paths) and this checkout,
# and runs the root file system's command by chroot in the caller's working directory. The binds vanish with the last
# process; nothing stays mounted. The job's Python must lie under one of those directories (checked).
# MariaDB is the host's (10.11): Debian 13's slurmdbd 24.11 against its own MariaDB 11.8 stopped at
# start-up with error 5027 (docs/design-notes.md, issue 22). SLURMFT_CLUSTER_NODE_LOCAL is bookworm only.
#
# No systemd: every daemon is started here, in the foreground of its own session, and its pid is
# recorded under run/; `down` kills only those pids (after checking the process name).
set -euo pipefail

BASE_DIR=${SLURMFT_CLUSTER_DIR:-/tmp/slurmft-cluster}
case $BASE_DIR in /*) ;; *) BASE_DIR=$PWD/$BASE_DIR ;; esac
BASE_PORT=${SLURMFT_CLUSTER_PORT:-16817}
TIMEOUT=${SLURMFT_CLUSTER_TIMEOUT:-60}
SUITE=${SLURMFT_CLUSTER_SUITE:-bookworm}
# Job ids: the two versions' clusters may run jobs at the same time (one pytest worker each), and a job id names
# a job's rendezvous port (slurmft/job/rendezvous.py) and its rank processes (tests/slurm/jobs.py rank_pids), so
# 24.11 numbers its jobs from 6001 (ports 26001 and up; 22.05's from 20001).
case $SUITE in
  bookworm) DIR=$BASE_DIR PORT=$BASE_PORT FIRST_JOB_ID=1 ;;
  trixie) DIR=$BASE_DIR-trixie PORT=$((BASE_PORT + 10)) FIRST_JOB_ID=6001 ;;
  *) echo "SLURMFT_CLUSTER_SUITE must be bookworm or trixie, not $SUITE" >&2; exit 2 ;;
esac
# slurmft's rendezvous ports (MASTER_PORT = 20000 + job id mod 12768: slurmft/job/rendezvous.py PORT_BASE, PORT_SPAN)
# must stay free: a cluster whose daemons listen there makes the job with that id fail with EADDRINUSE
case $PORT in *[!0-9]* | "") echo "SLURMFT_CLUSTER_PORT must be a number, not $BASE_PORT" >&2; exit 2 ;; esac
if [ $((PORT + 7)) -ge 20000 ] && [ "$PORT" -lt 32768 ]; then
  echo "SLURMFT_CLUSTER_PORT: ports $PORT-$((PORT + 7)) overlap slurmft's rendezvous ports 20000-32767 (a job whose" \
    "id maps onto one would fail with EADDRINUSE); choose a port below 19992 or from 32768" >&2
  exit 2
fi
ROOTFS=${SLURMFT_ROOTFS_CACHE:-/var/cache/slurmft}/rootfs-$SUITE
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
KILLWAIT=${SLURMFT_CLUSTER_KILLWAIT:-5}
STORE_FLAGS=${SLURMFT_CLUSTER_STORE_FLAGS-job_comment}
NODE_LOCAL=${SLURMFT_CLUSTER_NODE_LOCAL:-}
PRIVATE_DATA=${SLURMFT_CLUSTER_PRIVATE_DATA:-}
case $PRIVATE_DATA in *[!a-z,]*) echo "SLURMFT_CLUSTER_PRIVATE_DATA: comma-separated lower-case words only" >&2; exit 2 ;; esac
case $NODE_LOCAL in /* | "") ;; *) NODE_LOCAL=$PWD/$NODE_LOCAL ;; esac
# in-root's non-recursive binds would hide the node-local tmpfs from the root file system
if [ -n "$NODE_LOCAL" ] && [ "$SUITE" != bookworm ]; then
  echo "SLURMFT_CLUSTER_NODE_LOCAL works with SLURMFT_CLUSTER_SUITE=bookworm only" >&2
  exit 2
fi

CLUSTER_NAME=slurmft
# n1 and n2 make the default partition; n3-n5 join them in `wide` only (render_slurm_conf).
NODES=(n1 n2 n3 n4 n5)
NODE_CPUS=32
NODE_MEM_MB=128000
NODE_GPUS=8
PACKAGES=(slurmctld slurmd slurm-client munge slurmdbd mariadb-server)
# The trixie root file system: Slurm and munge, and the shared libraries a CPython build (the host's,
# bind-mounted) loads that Debian 13's essential set lacks (libffi.so.8 for ctypes, libnsl.so.2).
ROOTFS_PACKAGES=(slurmctld slurmd slurmdbd slurm-client munge libffi8 libnsl2 libsqlite3-0 libbz2-1.0
                 liblzma5 libssl3t64 zlib1g libgomp1 libstdc++6 procps)
# What bin/ runs in the root file system: Slurm's commands and daemons, and munge (the key and socket
# are shared, but its version should be the root file system's).
ROOTFS_COMMANDS=(sbatch srun salloc squeue sacct sacctmgr scancel scontrol sinfo sstat
                 slurmctld slurmd slurmdbd munged munge unmunge)

CTLD_PORT=$PORT
DBD_PORT=$((PORT + 3))
DB_PORT=$((PORT + 4))
LAST_PORT=$((PORT + 7))
node_port() {  # node_port NODE: n1, n2 on +1, +2 (as before n3-n5 existed), n3-n5 on +5..+7
  case $1 in n1) echo $((PORT + 1)) ;; n2) echo $((PORT + 2)) ;; *) echo $((PORT + 2 + ${1#n})) ;; esac
}
node_addr() {  # node_addr NODE: each node its own loopback address (all of 127.0.0.0/8 is this host)
  # n1 (the first node: rank 0, the rendezvous host) answers on 127.0.0.2, so a test can tell the NodeAddr that
  # slurmft reads from `scontrol` apart from a 127.0.0.1 fallback; n3-n5 on 127.0.0.3-5 (a test tells them apart)
  case $1 in n1) echo 127.0.0.2 ;; n2) echo 127.0.0.1 ;; *) echo "127.0.0.${1#n}" ;; esac
}

ETC=$DIR/etc
RUN=$DIR/run
LOG=$DIR/log
STATE=$DIR/state
MUNGE_DIR=$DIR/munge
DB_DIR=$DIR/db
DEV_DIR=$DIR/fakedev
CONF=$ETC/slurm.conf
BIN=$DIR/bin
MUNGE_SOCKET=$MUNGE_DIR/munge.socket
DB_SOCKET=$DB_DIR/mysql.sock
DB_PASSWORD=slurmft-test-only

# Every daemon: name (also the pid file run/NAME.pid and the log prefix) and process name.
# Stopped in this order (compute side first), started in the reverse one.
DAEMONS=(slurmd-n1:slurmd slurmd-n2:slurmd slurmd-n3:slurmd slurmd-n4:slurmd slurmd-n5:slurmd slurmctld:slurmctld slurmdbd:slurmdbd mariadb:mariadbd munged:munged)

export SLURM_CONF=$CONF
[ "$SUITE" = bookworm ] || export PATH=$BIN:$PATH

START_US=${EPOCHREALTIME/./}
log() {
  local us=$((${EPOCHREALTIME/./} - START_US))
  printf '[cluster +%d.%03ds] %s\n' $((us / 1000000)) $((us / 1000 % 1000)) "$*"
}
warn() { log "$*" >&2; }

show_logs() {  # print the end of every non-empty log; false if there was none
  local f shown=1
  for f in "$LOG"/*; do
    [ -s "$f" ] || continue
    printf '\n----- %s (last 25 lines) -----\n' "$f"
    tail -n 25 "$f"
    shown=0
  done
  return "$shown"
}

die() {  # print the error and every daemon log, stop what was started (logs stay), fail
  warn "ERROR: $*"
  if show_logs >&2; then warn "ERROR: $* (logs above, all of them under $LOG)"; fi
  stop_cluster quiet >&2 || true
  exit 1
}

# ------------------------------------------------------------------------------ processes
running() {  # running PID: true unless gone or a zombie
  local stat
  stat=$(cat "/proc/$1/stat" 2>/dev/null) || return 1
  stat=${stat##*) }
  [ "${stat%% *}" != Z ]
}

daemon_pid() {  # daemon_pid NAME COMM: print the pid from run/NAME.pid if that process runs as COMM
  local f=$RUN/$1.pid pid
  [ -s "$f" ] || return 1
  pid=$(tr -dc 0-9 <"$f")
  [ -n "$pid" ] && running "$pid" && [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "$2" ] || return 1
  echo "$pid"
}

spawn() {  # spawn NAME CMD...: run a foreground daemon in its own session, record its pid
  local name=$1
  shift
  # stdio to a file (never the caller's pipes, or `subprocess.run(capture_output=True)` hangs);
  # fd 9 is our lock and must not be inherited.
  setsid "$@" </dev/null >>"$LOG/$name.out" 2>&1 9>&- &
  echo $! >"$RUN/$name.pid"
}

port_open() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

wait_for() {  # wait_for WHAT NAME CHECK...: poll CHECK; fail if daemon NAME dies or on timeout
  local what=$1 name=$2 deadline=$((SECONDS + TIMEOUT))
  shift 2
  until "$@"; do
    # only the pid here: just after spawn, the process may still be named setsid
    running "$(tr -dc 0-9 <"$RUN/$name.pid")" || die "$name died while waiting for $what"
    [ "$SECONDS" -lt "$deadline" ] || die "timed out after ${TIMEOUT}s waiting for $what"
    sleep 0.1
  done
}

descendants() {  # descendants PID...: print all descendants of the given pids
  local -A children=()
  local p stat ppid queue=("$@") cur
  for p in /proc/[0-9]*; do
    stat=$(cat "$p/stat" 2>/dev/null) || continue
    stat=${stat##*) }
    read -r _ ppid _ <<<"$stat"
    children[$ppid]+="${p#/proc/} "
  done
  while [ ${#queue[@]} -gt 0 ]; do
    cur=${queue[0]}
    queue=("${queue[@]:1}")
    for p in ${children[$cur]:-}; do
      echo "$p"
      queue+=("$p")
    done
  done
}

# ------------------------------------------------------------------------------ packages
ensure_packages() {
  local missing=() p
  for p in "${PACKAGES[@]}"; do
    # shellcheck disable=SC2016  # ${Status} is dpkg-query's, not ours
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'ok installed' || missing+=("$p")
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  [ "$(id -u)" -eq 0 ] || die "missing Debian packages (${missing[*]}) and not root to install them"
  log "installing Debian packages: ${missing[*]}"
  mkdir -p "$DIR"
  local apt_log=$DIR/apt-install.log
  if ! { DEBIAN_FRONTEND=noninteractive apt-get update -q \
         && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}"; } \
       >"$apt_log" 2>&1; then
    tail -n 40 "$apt_log" >&2
    die "apt-get failed installing ${missing[*]} (full log: $apt_log)"
  fi
  log "installed ${missing[*]}"
}

# ------------------------------------------------------------------------------ trixie root file system
ensure_rootfs() {  # build $ROOTFS once (mmdebstrap, Debian's packages); kept for later `up`s
  local want have tmp
  want="$SUITE ${ROOTFS_PACKAGES[*]}"
  have=$(cat "$ROOTFS/etc/slurmft-rootfs" 2>/dev/null || true)
  [ "$have" = "$want" ] && return 0
  [ "$(id -u)" -eq 0 ] || die "the $SUITE root file system needs root (mmdebstrap, chroot, mount)"
  # one build at a time (two clusters' `up` may share the cache); the other one finds it built
  mkdir -p "$(dirname "$ROOTFS")"
  exec 8>"$(dirname "$ROOTFS")/.lock-$SUITE"
  flock -w 900 8 || die "another build holds $(dirname "$ROOTFS")/.lock-$SUITE"
  have=$(cat "$ROOTFS/etc/slurmft-rootfs" 2>/dev/null || true)
  if [ "$have" = "$want" ]; then exec 8>&-; return 0; fi
  if ! command -v mmdebstrap >/dev/null; then
    log "installing mmdebstrap"
    { DEBIAN_FRONTEND=noninteractive apt-get update -q \
      && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends mmdebstrap; } \
      >"$DIR/apt-install.log" 2>&1 || die "apt-get install mmdebstrap failed (log: $DIR/apt-install.log)"
  fi
  # never under a stale one that a process may still have bind mounts in: build beside it
  tmp=$(mktemp -d "$(dirname "$ROOTFS")/.rootfs-$SUITE.XXXXXX")
  log "building the Debian $SUITE root file system in $ROOTFS (mmdebstrap; a few minutes, once)"
  local pkgs=${ROOTFS_PACKAGES[*]}
  if ! mmdebstrap --variant=essential --include="${pkgs// /,}" "$SUITE" "$tmp" \
       http://deb.debian.org/debian >"$DIR/mmdebstrap.log" 2>&1; then
    tail -n 30 "$DIR/mmdebstrap.log" >&2
    rm -rf --one-file-system "$tmp"
    die "mmdebstrap $SUITE failed (log: $DIR/mmdebstrap.log)"
  fi
  cp /etc/hosts "$tmp/etc/hosts"  # NodeHostname=localhost
  echo "$want" >"$tmp/etc/slurmft-rootfs"
  if [ -e "$ROOTFS" ]; then
    grep -q " $ROOTFS/" /proc/mounts && die "something is mounted under the stale $ROOTFS; not replacing it"
    rm -rf --one-file-system "$ROOTFS"
  fi
  mv "$tmp" "$ROOTFS"
  exec 8>&-
  log "built $ROOTFS ($(chroot "$ROOTFS" slurmctld -V))"
}

bind_dirs() {  # the host directories bin/in-root mounts at the same path in the root file system
  local d dirs=()
  for d in /tmp /root /home /work /opt /usr/local; do [ -d "$d" ] && dirs+=("$d"); done
  for d in "$REPO" "$DIR"; do
    case "$d/" in /tmp/* | /root/* | /home/* | /work/* | /opt/* | /usr/local/*) ;; *) dirs+=("$d") ;; esac
  done
  echo "${dirs[*]}"
}

render_in_root() {
  cat <<EOF
#!/bin/sh
# Generated by tests/slurm/cluster.sh: run the command this link is named after in the Debian $SUITE root
# file system $ROOTFS, in the caller's working directory.
name=\${0##*/}
if [ -e /etc/slurmft-rootfs ]; then  # already inside (a job, a daemon): the root file system's command
  for d in /usr/bin /usr/sbin /bin /sbin; do [ -x "\$d/\$name" ] && exec "\$d/\$name" "\$@"; done
  echo "\$name: not in the $SUITE root file system" >&2
  exit 127
fi
# A private mount namespace: the binds end with the last process that uses them.
exec unshare --mount --propagation private /bin/sh -c '
  for d in $(bind_dirs); do mount --bind "\$d" "$ROOTFS\$d" || exit 126; done
  mount --bind /proc "$ROOTFS/proc" && mount --bind /sys "$ROOTFS/sys" && mount --rbind /dev "$ROOTFS/dev" || exit 126
  exec chroot "$ROOTFS" /bin/sh -c "cd \"\\\$0\" 2>/dev/null || cd /; exec \"\\\$@\"" "\$@"
' in-root "\$PWD" "$BIN/\$name" "\$@"
EOF
}

check_python() {  # the job's Python (the one on PATH) must be visible in the root file system
  local py d
  py=$(readlink -f "$(command -v python3 || command -v python || echo /nonexistent)")
  for d in $(bind_dirs); do
    case $py in "$d"/*) return 0 ;; esac
  done
  die "the job's Python ($py) is outside what bin/in-root binds into $ROOTFS ($(bind_dirs)): use a Python under one of them (a venv, pyenv)"
}

install_bin() {  # $DIR/bin: in-root and one link per command it runs there
  local c d
  for d in $(bind_dirs); do mkdir -p "$ROOTFS$d"; done
  rm -rf "$BIN"
  mkdir -p "$BIN"
  render_in_root >"$BIN/in-root"
  chmod 755 "$BIN/in-root"
  for c in "${ROOTFS_COMMANDS[@]}"; do ln -s in-root "$BIN/$c"; done
}

# ------------------------------------------------------------------------------ configuration
render_slurm_conf() {
  local node
  cat <<EOF
# Generated by tests/slurm/cluster.sh; rewritten by every fresh 'up'.
ClusterName=$CLUSTER_NAME
FirstJobId=$FIRST_JOB_ID
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# cred_expire=10: a requeued job restarts after ~12 s instead of ~2.5 min
AuthInfo=socket=$MUNGE_SOCKET,cred_expire=10
MailProg=/bin/true
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/%n
SlurmctldPidFile=$RUN/slurmctld.pid
SlurmdPidFile=$RUN/slurmd-%n.pid
SlurmctldLogFile=$LOG/slurmctld.log
SlurmdLogFile=$LOG/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SwitchType=switch/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=2,sched_interval=2
# Lets each slurmd claim the CPUs, memory and GPUs below, whatever this machine has.
SlurmdParameters=config_overrides
ReturnToService=2
GresTypes=gpu
MinJobAge=300
KillWait=$KILLWAIT
InactiveLimit=0
Waittime=0
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=127.0.0.1
AccountingStoragePort=$DBD_PORT
# With auth/munge this names the munge socket that slurmctld uses to reach slurmdbd.
AccountingStoragePass=$MUNGE_SOCKET
JobAcctGatherType=jobacct_gather/linux
JobCompType=jobcomp/none
EOF
  if [ -n "$STORE_FLAGS" ]; then
    echo "# slurmft tags every job with --comment=slurmft:<run id>; keep it in accounting too"
    echo "AccountingStoreFlags=$STORE_FLAGS"
  fi
  if [ -n "$PRIVATE_DATA" ]; then
    echo "PrivateData=$PRIVATE_DATA"
  fi
  for node in "${NODES[@]}"; do
    echo "NodeName=$node NodeHostname=localhost NodeAddr=$(node_addr "$node") Port=$(node_port "$node")" \
      "CPUs=$NODE_CPUS RealMemory=$NODE_MEM_MB Gres=gpu:$NODE_GPUS State=UNKNOWN"
  done
  echo "PartitionName=debug Nodes=n[1-2] Default=YES MaxTime=INFINITE State=UP"
  # not the default: a job lands on n3-n5 only when it asks for this partition, so every other test sees
  # the two nodes of `debug` alone (and its jobs never wait behind a wide one)
  echo "PartitionName=wide Nodes=n[1-5] Default=NO MaxTime=INFINITE State=UP"
}

render_gres_conf() {
  # slurmd drops GPUs without File=, and a count-only gres drains the node: point File= at
  # symlinks to /dev/null (a character device).
  echo "AutoDetect=off"
  echo "NodeName=n[1-5] Name=gpu File=$DEV_DIR/nvidia[0-$((NODE_GPUS - 1))]"
}

render_cgroup_conf() {
  # slurmd 24.11 with proctrack/linuxproc alone still starts the cgroup plugin and stops with "Unable
  # to initialize cgroup plugin" in a chroot; 22.05 reads no cgroup.conf with this configuration.
  echo "CgroupPlugin=disabled"
}

render_slurmdbd_conf() {
  cat <<EOF
AuthType=auth/munge
AuthInfo=socket=$MUNGE_SOCKET
DbdHost=localhost
DbdAddr=127.0.0.1
DbdPort=$DBD_PORT
SlurmUser=root
DebugLevel=info
LogFile=$LOG/slurmdbd.log
PidFile=$RUN/slurmdbd.pid
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$DB_PORT
StorageUser=slurm
StoragePass=$DB_PASSWORD
StorageLoc=slurm_acct_db
EOF
  # sacct asks slurmdbd, which reads its own PrivateData: without this line sacct shows every user's jobs
  if [ -n "$PRIVATE_DATA" ]; then
    echo "PrivateData=$PRIVATE_DATA"
  fi
}

config_current() {  # the files on disk are what this script would write now
  [ "$(cat "$ETC/node-local" 2>/dev/null)" = "$NODE_LOCAL" ] \
    && cmp -s "$CONF" <(render_slurm_conf) \
    && cmp -s "$ETC/gres.conf" <(render_gres_conf) \
    && cmp -s "$ETC/slurmdbd.conf" <(render_slurmdbd_conf) \
    && { [ "$SUITE" = bookworm ] || { cmp -s "$ETC/cgroup.conf" <(render_cgroup_conf) \
                                      && cmp -s "$BIN/in-root" <(render_in_root); }; }
}

# ------------------------------------------------------------------------------ health
# one line per node (sinfo -N prints n1 and n2 once per partition)
node_states() { timeout 10 sinfo -h -N -o '%N %T' 2>/dev/null | sort -u; }

nodes_idle() {
  [ "$(node_states)" = "$(printf '%s idle\n' "${NODES[@]}" | sort)" ]
}

nodes_usable() {  # every node up and responding (running jobs allowed; 24.11's "planned": kept for a pending job)
  local states
  states=$(node_states)
  [ "$(grep -cE '^n[0-9]+ (idle|mixed|allocated|completing|planned)$' <<<"$states")" = ${#NODES[@]} ]
}

healthy() {
  local d
  [ -f "$CONF" ] && config_current || return 1
  for d in "${DAEMONS[@]}"; do daemon_pid "${d%%:*}" "${d#*:}" >/dev/null || return 1; done
  timeout 10 scontrol ping 2>/dev/null | grep -q 'is UP' || return 1
  nodes_usable
}

# Readiness checks for wait_for.
munge_ok() { munge -S "$MUNGE_SOCKET" -n 2>/dev/null | unmunge -S "$MUNGE_SOCKET" >/dev/null 2>&1; }
db_ok() { mariadb --no-defaults -S "$DB_SOCKET" -e 'SELECT 1' >/dev/null 2>&1; }
ctld_ok() { port_open "$CTLD_PORT" && timeout 5 scontrol ping 2>/dev/null | grep -q 'is UP'; }
registered() { timeout 10 sacctmgr -n -P list cluster format=Cluster 2>/dev/null | grep -qx "$CLUSTER_NAME"; }
all_idle() {  # the last node's slurmd is watched by wait_for, the others here
  local node
  for node in "${NODES[@]}"; do
    running "$(tr -dc 0-9 <"$RUN/slurmd-$node.pid")" || die "slurmd-$node died"
  done
  nodes_idle
}

# ------------------------------------------------------------------------------ down
stop_daemon() {  # stop_daemon NAME COMM [quiet]
  local pid i
  if ! pid=$(daemon_pid "$1" "$2"); then
    rm -f "$RUN/$1.pid"
    return 0
  fi
  kill -TERM "$pid" 2>/dev/null || true
  for ((i = 0; i < 150; i++)); do running "$pid" || break; sleep 0.1; done
  if running "$pid"; then
    warn "$1 (pid $pid) ignored SIGTERM for 15 s; sending SIGKILL"
    kill -KILL "$pid" 2>/dev/null || true
  fi
  [ "${3:-}" = quiet ] || log "stopped $1 (pid $pid)"
  rm -f "$RUN/$1.pid"
}

stop_cluster() {  # stop_cluster [quiet]
  local quiet=${1:-} ids i d p pids=() strays=()
  [ -d "$RUN" ] || return 0
  # 1. cancel jobs while slurmctld still runs, so their processes end the normal way
  if daemon_pid slurmctld slurmctld >/dev/null && [ -f "$CONF" ]; then
    ids=$(timeout 10 squeue -h -o %A 2>/dev/null | tr '\n' ' ' || true)
    if [ -n "${ids// /}" ]; then
      [ "$quiet" = quiet ] || log "cancelling jobs: $ids"
      # shellcheck disable=SC2086  # one word per job id
      timeout 10 scancel $ids 2>/dev/null || true
      for ((i = 0; i < 100; i++)); do
        [ -z "$(timeout 10 squeue -h -o %A 2>/dev/null || true)" ] && break
        sleep 0.2
      done
    fi
  fi
  # 2. daemons, compute side first
  for d in "${DAEMONS[@]}"; do stop_daemon "${d%%:*}" "${d#*:}" "$quiet"; done
  # 3. slurmstepd left over from this cluster (they inherit our SLURM_CONF from slurmd), and
  #    whatever runs under them
  for p in /proc/[0-9]*; do
    [ "$(cat "$p/comm" 2>/dev/null)" = slurmstepd ] || continue
    if tr '\0' '\n' 2>/dev/null <"$p/environ" | grep -qxF "SLURM_CONF=$CONF"; then
      strays+=("${p#/proc/}")
    fi
  done
  if [ ${#strays[@]} -gt 0 ]; then
    mapfile -t pids < <(descendants "${strays[@]}")
    warn "killing stray slurmstepd ${strays[*]} and their ${#pids[@]} descendants"
    kill -KILL "${strays[@]}" "${pids[@]}" 2>/dev/null || true
  fi
}

# ------------------------------------------------------------------------------ up
start_cluster() {
  local node i d port
  # clean slate: stop leftovers of an earlier run (by pid file), wipe state, config and logs
  stop_cluster quiet
  rm -rf "$ETC" "$RUN" "$LOG" "$STATE" "$MUNGE_DIR" "$DB_DIR" "$DEV_DIR"
  mkdir -p "$ETC" "$RUN" "$LOG" "$STATE/ctld" "$MUNGE_DIR" "$DB_DIR" "$DEV_DIR"
  for node in "${NODES[@]}"; do mkdir -p "$STATE/$node"; done
  chmod 755 "$DIR" "$MUNGE_DIR"  # munged wants a socket directory nobody else may write to
  for port in $(seq "$CTLD_PORT" "$LAST_PORT"); do
    # a port in use a moment may be a local run's rendezvous (slurmft's free_port draws from 10000-19999, these
    # ports among them: CI76 met one at a second cluster's start): wait for it a while before giving up
    i=0
    while port_open "$port" && [ $i -lt 60 ]; do
      [ $i -eq 0 ] && log "port $port on 127.0.0.1 is in use; waiting up to 60 s for it to be released"
      sleep 1
      i=$((i + 1))
    done
    port_open "$port" && die "port $port on 127.0.0.1 is already in use (another cluster? set SLURMFT_CLUSTER_PORT)"
  done

  # config
  render_slurm_conf >"$CONF"
  render_gres_conf >"$ETC/gres.conf"
  render_slurmdbd_conf >"$ETC/slurmdbd.conf"
  if [ "$SUITE" != bookworm ]; then
    render_cgroup_conf >"$ETC/cgroup.conf"
    check_python
    install_bin
    # the wrappers work (mounts, chroot): fail here, with the reason, rather than in every command
    "$BIN/srun" --version >/dev/null 2>&1 || die "$BIN/srun does not run in $ROOTFS"
  fi
  echo "$NODE_LOCAL" >"$ETC/node-local"
  chmod 600 "$ETC/slurmdbd.conf"  # slurmdbd refuses a readable one
  for ((i = 0; i < NODE_GPUS; i++)); do ln -s /dev/null "$DEV_DIR/nvidia$i"; done

  # munged, on a private socket with a fresh key
  head -c 1024 /dev/urandom >"$MUNGE_DIR/munge.key"
  chmod 400 "$MUNGE_DIR/munge.key"
  spawn munged munged --foreground --socket="$MUNGE_SOCKET" --key-file="$MUNGE_DIR/munge.key" \
    --log-file="$LOG/munged.log" --seed-file="$MUNGE_DIR/munged.seed" --pid-file="$RUN/munged.daemon.pid"
  wait_for "munged" munged munge_ok
  log "munged up"

  # MariaDB (only slurmdbd uses it) on 127.0.0.1:$DB_PORT; --no-defaults ignores /etc/mysql
  mariadb-install-db --no-defaults --user=root --datadir="$DB_DIR/data" --skip-test-db --force \
    --auth-root-authentication-method=socket >"$LOG/mariadb-install.log" 2>&1 \
    || die "mariadb-install-db failed"
  spawn mariadb mariadbd --no-defaults --user=root --datadir="$DB_DIR/data" --socket="$DB_SOCKET" \
    --pid-file="$RUN/mariadb.daemon.pid" --bind-address=127.0.0.1 --port="$DB_PORT" \
    --log-error="$LOG/mariadb.err" --skip-name-resolve --innodb-buffer-pool-size=64M \
    --innodb-lock-wait-timeout=900 --innodb-flush-log-at-trx-commit=0 --skip-innodb-doublewrite
  wait_for "mariadbd" mariadb db_ok
  mariadb --no-defaults -S "$DB_SOCKET" -e "
    CREATE USER 'slurm'@'127.0.0.1' IDENTIFIED BY '$DB_PASSWORD';
    GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';
    FLUSH PRIVILEGES;" || die "could not create the slurm database user"
  log "mariadbd up (127.0.0.1:$DB_PORT)"

  # slurmdbd reads slurmdbd.conf from the directory of $SLURM_CONF
  spawn slurmdbd slurmdbd -D
  wait_for "slurmdbd on port $DBD_PORT" slurmdbd port_open "$DBD_PORT"
  log "slurmdbd up (127.0.0.1:$DBD_PORT)"

  spawn slurmctld slurmctld -D -f "$CONF"
  wait_for "slurmctld on port $CTLD_PORT" slurmctld ctld_ok
  log "slurmctld up (127.0.0.1:$CTLD_PORT)"

  for node in "${NODES[@]}"; do
    if [ -n "$NODE_LOCAL" ]; then
      # its own mount namespace with a private tmpfs on NODE_LOCAL: what this node's jobs write there,
      # no other node (and not the login side) sees; `exec` keeps the pid slurmd's
      mkdir -p "$NODE_LOCAL"
      # shellcheck disable=SC2016  # $1..$3 are the inner shell's
      spawn "slurmd-$node" unshare -m --propagation private sh -c \
        'mount -t tmpfs -o size=64m slurmft-node-local "$1" && exec slurmd -D -f "$2" -N "$3"' sh \
        "$NODE_LOCAL" "$CONF" "$node"
    else
      spawn "slurmd-$node" slurmd -D -f "$CONF" -N "$node"
    fi
  done
  wait_for "${NODES[*]} to be idle" "slurmd-${NODES[-1]}" all_idle
  log "slurmd $(for node in "${NODES[@]}"; do printf '%s (:%s) ' "$node" "$(node_port "$node")"; done)idle"

  # sacct answers only once slurmctld has registered the cluster with slurmdbd
  wait_for "the cluster to register with slurmdbd" slurmctld registered
  log "accounting ready"
}

cmd_up() {
  log "cluster dir $DIR, ports $CTLD_PORT-$LAST_PORT"
  if healthy; then
    log "already up and healthy; nothing to do"
    cmd_env_hint
    return 0
  fi
  ensure_packages
  [ "$SUITE" = bookworm ] || ensure_rootfs
  start_cluster
  log "cluster ready: $(timeout 10 sinfo -h -N -o '%N:%T:%c cpus:%m MB:%G' | sort -u | tr '\n' ' ')"
  cmd_env_hint
}

cmd_env_hint() {
  local suite=""
  [ "$SUITE" = bookworm ] || suite="SLURMFT_CLUSTER_SUITE=$SUITE "
  log "use it with:  eval \"\$(${suite}bash ${BASH_SOURCE[0]} env)\""
}

cmd_down() {
  if [ ! -d "$RUN" ]; then
    log "nothing to stop under $DIR"
    return 0
  fi
  stop_cluster
  log "down (logs kept under $LOG)"
}

cmd_env() {
  printf 'export SLURM_CONF=%q\n' "$CONF"
  printf 'export SLURMFT_CLUSTER_DIR=%q\n' "$BASE_DIR"
  printf 'export SLURMFT_CLUSTER_PORT=%q\n' "$BASE_PORT"
  if [ "$SUITE" != bookworm ]; then
    printf 'export SLURMFT_CLUSTER_SUITE=%q\n' "$SUITE"
    printf 'export PATH=%q\n' "$PATH"  # $BIN first: Slurm's commands are the root file system's
  fi
}

cmd_status() {
  local d pid
  echo "cluster dir: $DIR   SLURM_CONF=$CONF   ports: $CTLD_PORT-$LAST_PORT"
  for d in "${DAEMONS[@]}"; do
    if pid=$(daemon_pid "${d%%:*}" "${d#*:}"); then
      printf '  %-10s running (pid %s)\n' "${d%%:*}" "$pid"
    else
      printf '  %-10s stopped\n' "${d%%:*}"
    fi
  done
  if daemon_pid slurmctld slurmctld >/dev/null; then
    timeout 10 sinfo -N -o '%N %P %T %c %m %G' 2>&1 | sed 's/^/  /' || true
  fi
  if healthy; then
    echo "healthy"
  else
    echo "not healthy"
    return 1
  fi
}

usage() {
  echo "usage: bash $0 up|down|env|status" >&2
  exit 2
}

main() {
  [ $# -eq 1 ] || usage
  case $1 in
    up | down)
      mkdir -p "$DIR"
      exec 9>"$DIR/.lock"
      flock -w 600 9 || { warn "another 'up' or 'down' holds $DIR/.lock"; exit 1; }
      "cmd_$1"
      ;;
    env) cmd_env ;;
    status) cmd_status ;;
    *) usage ;;
  esac
}

main "$@"
