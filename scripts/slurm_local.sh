#!/usr/bin/env bash
# A single-node SLURM cluster with accounting (sacct works) on this machine, for trying `hydra/launcher=slurm`
# (submitit) without a real cluster. Debian/Ubuntu with apt; needs root (re-runs itself through sudo if not root).
# No systemd needed: every daemon is started directly, and everything it makes (configs, munge key, state, spool,
# logs, sockets, pid files, the MariaDB datadir) lives in one scratch folder; `stop` stops only the daemons whose
# pid files are in that folder.
#
#   bash scripts/slurm_local.sh start     # install what is missing, start munged, mariadbd, slurmdbd, slurmctld, slurmd
#   export SLURM_CONF=<scratch>/etc/slurm.conf   # printed by start; clients (sbatch, sinfo, sacct, submitit) need it
#   bash scripts/slurm_local.sh status    # exit 0 when all five daemons run
#   bash scripts/slurm_local.sh stop
#
# Notes:
#   - Jobs still running at `stop` keep running under slurmstepd; the next `start` recovers them from the saved state.
#   - A requeued job (JobRequeue=1, or `scontrol requeue`) gets a BeginTime cred_expire seconds ahead
#     (KVQ_SLURM_CRED_EXPIRE, 30 here against SLURM's 120) and sits PENDING (Reason=BeginTime) until then.
#   - No cgroups (proctrack/linuxproc, task/none, jobacct_gather/none): memory limits are scheduling only, not enforced.
#   - The munge socket sits in the scratch folder: only users who can reach that folder can use the clients.
set -euo pipefail
umask 022

usage() {
  cat <<EOF
usage: $(basename "$0") start|stop|status

  start    install missing Debian packages (slurmctld slurmd slurmdbd slurm-client munge mariadb-server), then
           start munged, mariadbd, slurmdbd, slurmctld and slurmd; a no-op when all run, completes a partial cluster;
           waits for the node to be idle and prints the SLURM_CONF export line for clients
  stop     stop the daemons started by start (by the pid files in the scratch folder)
  status   each daemon: running (pid) or not, and sinfo; exit 0 only when all run

environment:
  KVQ_SLURM_DIR        scratch folder for everything (default: \$HOME/.cache/kvq_lab/slurm)
  KVQ_SLURM_CLUSTER    cluster name (default: kvq; fixed once the cluster has state)
  KVQ_SLURM_PORT_BASE  slurmctld port; slurmd, slurmdbd and MariaDB use the next three (default: 6817)
  KVQ_SLURM_MAXTIME    the partition's MaxTime (default: 2:00:00)
  KVQ_SLURM_TIMEOUT    seconds to wait for each daemon to come up (default: 90)
  KVQ_SLURM_CRED_EXPIRE  seconds a requeued job waits before it runs again (AuthInfo cred_expire; default: 30)
EOF
}

die() { echo "slurm_local: error: $*" >&2; exit 1; }
say() { echo "slurm_local: $*"; }

cmd=${1:-}
case "$cmd" in
  start|stop|status) ;;
  *) usage >&2; exit 2 ;;
esac
[ $# -le 1 ] || { usage >&2; exit 2; }

DIR=${KVQ_SLURM_DIR:-$HOME/.cache/kvq_lab/slurm}
case "$DIR" in /*) ;; *) DIR=$PWD/$DIR ;; esac
case "$DIR" in *[[:space:]]*) die "KVQ_SLURM_DIR must not contain whitespace: '$DIR'" ;; esac
CLUSTER=${KVQ_SLURM_CLUSTER:-kvq}
PORT_BASE=${KVQ_SLURM_PORT_BASE:-6817}
MAXTIME=${KVQ_SLURM_MAXTIME:-2:00:00}
TIMEOUT=${KVQ_SLURM_TIMEOUT:-90}
CRED_EXPIRE=${KVQ_SLURM_CRED_EXPIRE:-30}
[[ $CRED_EXPIRE =~ ^[0-9]+$ ]] || die "KVQ_SLURM_CRED_EXPIRE must be a number of seconds, got '$CRED_EXPIRE'"
[[ $PORT_BASE =~ ^[0-9]+$ ]] || die "KVQ_SLURM_PORT_BASE must be a number, got '$PORT_BASE'"
[[ $TIMEOUT =~ ^[0-9]+$ ]] || die "KVQ_SLURM_TIMEOUT must be a number of seconds, got '$TIMEOUT'"
CTLD_PORT=$PORT_BASE
SLURMD_PORT=$((PORT_BASE + 1))
DBD_PORT=$((PORT_BASE + 2))
DB_PORT=$((PORT_BASE + 3))

# start and stop need root; status only reads pid files and /proc.
if [ "$cmd" != status ] && [ "$(id -u)" -ne 0 ]; then
  command -v sudo >/dev/null 2>&1 || die "'$cmd' needs root, and sudo is not installed"
  exec sudo env KVQ_SLURM_DIR="$DIR" KVQ_SLURM_CLUSTER="$CLUSTER" KVQ_SLURM_PORT_BASE="$PORT_BASE" \
    KVQ_SLURM_MAXTIME="$MAXTIME" KVQ_SLURM_TIMEOUT="$TIMEOUT" KVQ_SLURM_CRED_EXPIRE="$CRED_EXPIRE" bash "$0" "$cmd"
fi

ETC=$DIR/etc RUN=$DIR/run LOG=$DIR/log
SLURM_CONF_FILE=$ETC/slurm.conf
DBD_CONF=$ETC/slurmdbd.conf
MY_CNF=$ETC/my.cnf
MUNGE_KEY=$ETC/munge.key
MUNGE_SOCKET=$RUN/munge/munge.socket
DB_DATADIR=$DIR/mariadb
DB_RUN=$RUN/mysqld
NODE=$(hostname -s)
export SLURM_CONF=$SLURM_CONF_FILE

DAEMONS=(munged mariadbd slurmdbd slurmctld slurmd)
pidfile_of() {
  case "$1" in
    munged) echo "$RUN/munge/munged.pid" ;;
    mariadbd) echo "$DB_RUN/mariadbd.pid" ;;
    *) echo "$RUN/$1.pid" ;;
  esac
}
logfile_of() { echo "$LOG/$1.log"; }

# Prints the daemon's pid and succeeds when its pid file names a live process of that program.
running_pid() {
  local pf pid comm
  pf=$(pidfile_of "$1")
  [ -r "$pf" ] || return 1
  pid=$(tr -dc '0-9' <"$pf")
  [ -n "$pid" ] && [ -r "/proc/$pid/comm" ] || return 1
  comm=$(cat "/proc/$pid/comm" 2>/dev/null) || return 1
  [ "$comm" = "$1" ] || return 1
  echo "$pid"
}

# Waits until "$2..." succeeds, for at most TIMEOUT seconds; fails early when daemon $1 has died.
wait_for() {
  local name=$1 i
  shift
  for ((i = 0; i < TIMEOUT; i++)); do
    if "$@" >/dev/null 2>&1; then return 0; fi
    running_pid "$name" >/dev/null || { sleep 1; running_pid "$name" >/dev/null ||
      die "$name exited during startup; read $(logfile_of "$name")"; }
    sleep 1
  done
  die "$name not ready after ${TIMEOUT}s; read $(logfile_of "$name")"
}

port_in_use() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
check_port_free() {
  if port_in_use "$2"; then
    die "port $2 (for $1) is already in use by another program; pick other ports with KVQ_SLURM_PORT_BASE"
  fi
}

# Replaces $1 by stdin only when the content differs (running daemons keep reading the same file).
write_file() {
  local tmp
  tmp=$(mktemp "$1.XXXXXX")
  cat >"$tmp"
  if [ -f "$1" ] && cmp -s "$tmp" "$1"; then rm -f "$tmp"; else mv -f "$tmp" "$1"; fi
}

lock() {
  mkdir -p "$DIR"
  # fd 9 holds the lock; every daemon is started with 9>&- so that it does not inherit (and hold) it
  exec 9>"$DIR/.lock"
  flock -w 300 9 || die "another start/stop on $DIR still holds $DIR/.lock after 300s"
}

# --------------------------------------------------------------------------------------------------- packages
PACKAGES=(slurmctld slurmd slurmdbd slurm-client munge mariadb-server)
install_packages() {
  local missing=() p policy_made=0
  for p in "${PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  command -v apt-get >/dev/null 2>&1 || die "missing packages (${missing[*]}) and no apt-get to install them"
  mkdir -p "$LOG"
  say "installing ${missing[*]} (log: $LOG/apt.log)"
  # Keep the packages' own services from starting (they would use the system-wide configs): a policy-rc.d that
  # denies every start, only when the system has none, removed again afterwards.
  if [ ! -e /usr/sbin/policy-rc.d ]; then
    printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d
    chmod 755 /usr/sbin/policy-rc.d
    policy_made=1
  fi
  local rc=0
  {
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      -o Dpkg::Options::=--force-confdef -o Dpkg::Options::=--force-confold "${missing[@]}" ||
      { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        -o Dpkg::Options::=--force-confdef -o Dpkg::Options::=--force-confold "${missing[@]}"; }
  } >"$LOG/apt.log" 2>&1 || rc=$?
  [ $policy_made -eq 1 ] && rm -f /usr/sbin/policy-rc.d
  [ $rc -eq 0 ] || die "apt-get install ${missing[*]} failed (exit $rc); read $LOG/apt.log"
}

# --------------------------------------------------------------------------------------------------- configs
# Runs mariadbd as the mysql user when that user can reach the scratch folder; a folder under a private home
# (e.g. /root, mode 0700) cannot be reached, and then mariadbd runs as root instead.
DB_USER=
pick_db_user() {
  DB_USER=root
  if getent passwd mysql >/dev/null; then
    chown mysql:mysql "$DB_DATADIR" "$DB_RUN"
    if runuser -u mysql -- test -w "$DB_DATADIR" -a -w "$DB_RUN" 2>/dev/null; then
      DB_USER=mysql
      return
    fi
  fi
  chown root:root "$DB_DATADIR" "$DB_RUN"
}

write_configs() {
  mkdir -p "$ETC" "$LOG" "$RUN/munge" "$DB_RUN" "$DB_DATADIR" "$DIR/state/slurmctld" "$DIR/spool/slurmd"
  chmod 0700 "$ETC"
  chmod 0755 "$RUN/munge"

  if [ ! -s "$MUNGE_KEY" ]; then
    if command -v mungekey >/dev/null 2>&1; then
      mungekey --create --keyfile="$MUNGE_KEY" --force
    else
      dd if=/dev/urandom of="$MUNGE_KEY" bs=1024 count=1 status=none
    fi
  fi
  chown root:root "$MUNGE_KEY"
  chmod 0400 "$MUNGE_KEY"

  if [ ! -s "$ETC/db.pass" ]; then
    (umask 077 && head -c 24 /dev/urandom | base64 | tr -dc 'A-Za-z0-9' >"$ETC/db.pass")
  fi
  DB_PASS=$(cat "$ETC/db.pass")

  local cpus mem_mb defmem
  cpus=$(nproc)
  mem_mb=$(awk '/^MemTotal:/ {printf "%d", $2 / 1024 * 0.8}' /proc/meminfo)
  defmem=$((mem_mb / cpus))

  write_file "$MY_CNF" <<EOF
# MariaDB for slurmdbd only (written by scripts/slurm_local.sh)
[client]
socket=$DB_RUN/mysqld.sock

[mysqld]
datadir=$DB_DATADIR
socket=$DB_RUN/mysqld.sock
pid-file=$DB_RUN/mariadbd.pid
log-error=$(logfile_of mariadbd)
port=$DB_PORT
bind-address=127.0.0.1
skip-name-resolve
# slurmdbd logs "Database settings not recommended values: innodb_buffer_pool_size" (it wants GBs): harmless here
innodb_buffer_pool_size=256M
innodb_log_file_size=64M
innodb_lock_wait_timeout=900
EOF
  chmod 0644 "$MY_CNF"

  write_file "$DBD_CONF" <<EOF
# slurmdbd.conf (written by scripts/slurm_local.sh)
AuthType=auth/munge
AuthInfo=socket=$MUNGE_SOCKET
DbdHost=localhost
DbdAddr=127.0.0.1
DbdPort=$DBD_PORT
SlurmUser=root
LogFile=$(logfile_of slurmdbd)
PidFile=$(pidfile_of slurmdbd)
DebugLevel=info
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$DB_PORT
StorageUser=slurm
StoragePass=$DB_PASS
StorageLoc=slurm_acct_db
EOF
  chown root:root "$DBD_CONF"
  chmod 0600 "$DBD_CONF"

  write_file "$SLURM_CONF_FILE" <<EOF
# slurm.conf: one node, no cgroups, accounting through slurmdbd (written by scripts/slurm_local.sh)
ClusterName=$CLUSTER
SlurmctldHost=$NODE(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
# clients and daemons find the scratch munged through AuthInfo; sacct/sacctmgr's connection to slurmdbd only
# through AccountingStoragePass (it ignores AuthInfo's socket). cred_expire also sets how long a requeued job
# waits before it may start again (SLURM's default, 120 s, made every requeue test wait 2-3 minutes)
AuthInfo=socket=$MUNGE_SOCKET,cred_expire=$CRED_EXPIRE
CredType=cred/munge
StateSaveLocation=$DIR/state/slurmctld
SlurmdSpoolDir=$DIR/spool/slurmd
SlurmctldPidFile=$(pidfile_of slurmctld)
SlurmdPidFile=$(pidfile_of slurmd)
SlurmctldLogFile=$(logfile_of slurmctld)
SlurmdLogFile=$(logfile_of slurmd)
SlurmctldDebug=info
SlurmdDebug=info
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
# a job without --mem gets this per CPU (instead of the whole node's memory, which would serialise all jobs)
DefMemPerCPU=$defmem
ReturnToService=2
MinJobAge=60
KillWait=30
InactiveLimit=0
SlurmctldTimeout=120
SlurmdTimeout=300
# requeued jobs (node failure, preemption, scontrol requeue) wait for a BeginTime cred_expire (+ up to a minute
# of scheduling) ahead before rerunning
JobRequeue=1
MailProg=/bin/true
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
AccountingStoragePort=$DBD_PORT
AccountingStoragePass=$MUNGE_SOCKET
NodeName=$NODE NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$mem_mb State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=$MAXTIME State=UP
EOF
  chmod 0644 "$SLURM_CONF_FILE"
}

# --------------------------------------------------------------------------------------------------- daemons
start_munged() {
  # munged refuses a socket that other users cannot reach (e.g. under /root, mode 0700) unless forced; clients of
  # other users could not reach it anyway, root's clients and the daemons can.
  local force=()
  runuser -u nobody -- test -x "$RUN/munge" 2>/dev/null || force=(--force)
  munged "${force[@]}" 9>&- --socket="$MUNGE_SOCKET" --key-file="$MUNGE_KEY" --pid-file="$(pidfile_of munged)" \
    --log-file="$(logfile_of munged)" --seed-file="$RUN/munge/munged.seed" ||
    die "munged failed to start; read $(logfile_of munged)"
  wait_for munged bash -c "munge -n -S '$MUNGE_SOCKET' | unmunge -S '$MUNGE_SOCKET'"
}

db_sql() { mariadb --defaults-file="$MY_CNF" -u root -N -B -e "$1"; }

start_mariadbd() {
  check_port_free mariadbd "$DB_PORT"
  if [ ! -d "$DB_DATADIR/mysql" ]; then
    say "initialising the MariaDB datadir $DB_DATADIR"
    mariadb-install-db 9>&- --defaults-file="$MY_CNF" --user="$DB_USER" --skip-test-db \
      --auth-root-authentication-method=socket >>"$LOG/mariadb-install-db.log" 2>&1 ||
      die "mariadb-install-db failed; read $LOG/mariadb-install-db.log"
  fi
  rm -f "$DB_RUN/mysqld.sock"
  setsid mariadbd --defaults-file="$MY_CNF" --user="$DB_USER" </dev/null 9>&- >>"$(logfile_of mariadbd)" 2>&1 &
  # mariadbd writes its pid file itself, a moment after it starts
  local i
  for ((i = 0; i < TIMEOUT; i++)); do
    running_pid mariadbd >/dev/null && break
    kill -0 $! 2>/dev/null || die "mariadbd exited during startup; read $(logfile_of mariadbd)"
    sleep 1
  done
  wait_for mariadbd mariadb-admin --defaults-file="$MY_CNF" -u root ping
}

setup_db() {
  db_sql "CREATE DATABASE IF NOT EXISTS slurm_acct_db;
    CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED BY '$DB_PASS';
    CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY '$DB_PASS';
    ALTER USER 'slurm'@'localhost' IDENTIFIED BY '$DB_PASS';
    ALTER USER 'slurm'@'127.0.0.1' IDENTIFIED BY '$DB_PASS';
    GRANT ALL PRIVILEGES ON slurm_acct_db.* TO 'slurm'@'localhost';
    GRANT ALL PRIVILEGES ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';" ||
    die "could not create the slurm_acct_db database and its user; read $(logfile_of mariadbd)"
}

start_slurmdbd() {
  check_port_free slurmdbd "$DBD_PORT"
  slurmdbd 9>&- || die "slurmdbd failed to start; read $(logfile_of slurmdbd)"
  wait_for slurmdbd sacctmgr -n -P list cluster format=cluster
}

add_cluster() {
  if ! sacctmgr -n -P list cluster format=cluster 2>/dev/null | grep -qx "$CLUSTER"; then
    sacctmgr -i add cluster "$CLUSTER" >/dev/null ||
      die "sacctmgr add cluster $CLUSTER failed; read $(logfile_of slurmdbd)"
    say "added cluster $CLUSTER to the accounting database"
  fi
}

start_slurmctld() {
  check_port_free slurmctld "$CTLD_PORT"
  slurmctld -i -f "$SLURM_CONF_FILE" 9>&- || die "slurmctld failed to start; read $(logfile_of slurmctld)"
  wait_for slurmctld scontrol ping
}

start_slurmd() {
  check_port_free slurmd "$SLURMD_PORT"
  slurmd -f "$SLURM_CONF_FILE" 9>&- || die "slurmd failed to start; read $(logfile_of slurmd)"
}

node_state() { sinfo -h -n "$NODE" -o %T 2>/dev/null | head -n1; }

wait_node_idle() {
  local i state=
  for ((i = 0; i < TIMEOUT; i++)); do
    state=$(node_state) || true
    case "$state" in
      idle | mixed | allocated | completing) say "node $NODE is $state"; return 0 ;;
    esac
    running_pid slurmd >/dev/null || { sleep 1; running_pid slurmd >/dev/null ||
      die "slurmd exited during startup; read $(logfile_of slurmd)"; }
    sleep 1
  done
  die "node $NODE not idle after ${TIMEOUT}s (state: ${state:-unknown}); read $(logfile_of slurmd) and $(logfile_of slurmctld)"
}

do_start() {
  local d pid up=0
  for d in "${DAEMONS[@]}"; do running_pid "$d" >/dev/null && up=$((up + 1)); done
  if [ $up -eq ${#DAEMONS[@]} ]; then
    say "already running (all ${#DAEMONS[@]} daemons, scratch folder $DIR); nothing to do"
    echo "export SLURM_CONF=$SLURM_CONF_FILE"
    return 0
  fi
  install_packages
  write_configs
  pick_db_user
  for d in "${DAEMONS[@]}"; do
    [ "$d" = slurmctld ] && add_cluster
    if pid=$(running_pid "$d"); then
      say "$d already running (pid $pid)"
      continue
    fi
    say "starting $d (log: $(logfile_of "$d"))"
    "start_$d"
    case "$d" in
      mariadbd) setup_db ;;
    esac
  done
  wait_node_idle
  say "cluster $CLUSTER is up; for clients (sbatch, sinfo, sacct, submitit):"
  echo "export SLURM_CONF=$SLURM_CONF_FILE"
}

stop_daemon() {
  local name=$1 pid i
  pid=$(running_pid "$name") || { rm -f "$(pidfile_of "$name")"; return 1; }
  kill -TERM "$pid" 2>/dev/null || true
  for ((i = 0; i < 60; i++)); do
    [ -d "/proc/$pid" ] || { say "stopped $name (pid $pid)"; rm -f "$(pidfile_of "$name")"; return 0; }
    sleep 1
  done
  kill -KILL "$pid" 2>/dev/null || true
  say "killed $name (pid $pid): it did not stop within 60s after SIGTERM"
  rm -f "$(pidfile_of "$name")"
}

do_stop() {
  local i stopped=0
  for ((i = ${#DAEMONS[@]} - 1; i >= 0; i--)); do
    stop_daemon "${DAEMONS[$i]}" && stopped=$((stopped + 1))
  done
  [ $stopped -gt 0 ] || say "nothing running (scratch folder $DIR)"
}

do_status() {
  local d pid up=0
  for d in "${DAEMONS[@]}"; do
    if pid=$(running_pid "$d"); then
      printf '%-10s running (pid %s)\n' "$d" "$pid"
      up=$((up + 1))
    else
      printf '%-10s not running\n' "$d"
    fi
  done
  echo "scratch folder: $DIR"
  if running_pid slurmctld >/dev/null; then
    echo "export SLURM_CONF=$SLURM_CONF_FILE"
    sinfo || true
  fi
  [ $up -eq ${#DAEMONS[@]} ]
}

case "$cmd" in
  start) lock; do_start ;;
  stop) lock; do_stop ;;
  status) do_status ;;
esac
