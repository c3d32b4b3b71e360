#!/usr/bin/env bash
# CI check of deploy/launch.sh without the ringmux binaries and without touching the machine:
# dry runs against fake /sys and /proc trees made in a temporary directory (2 CPUs; 2 CPUs that
# are one SMT core; 8 CPUs as 4 SMT pairs on 2 sockets/NUMA nodes with interleaved numbering),
# checking the printed plan and the exported settings; the failure paths (old kernel, bad
# RINGMUX_CPUS, bad instance counts); the sysctl logic against fake /proc/sys files; one real
# start with a stub ringmux (arguments, environment, exit status); and one dry run on this
# machine. Exits non-zero on any mismatch and prints the offending output.
set -euo pipefail
cd "$(dirname "$0")/.."
launch=$PWD/deploy/launch.sh

# The caller's settings must not leak into the expectations.
for v in $(compgen -e); do
  case $v in RINGMUX_* | LAUNCH_* | RUST_LOG) unset "$v" ;; esac
done

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
failures=0 checks=0

# --- fake trees ----------------------------------------------------------------------------

# mk_cpu ROOT CPU PACKAGE CORE SIBLINGS [old]: one CPU's topology; "old" writes only
# thread_siblings_list, as kernels before 5.7 do.
mk_cpu() {
  local d=$1/devices/system/cpu/cpu$2/topology
  mkdir -p "$d"
  echo "$3" >"$d/physical_package_id"
  echo "$4" >"$d/core_id"
  echo "$5" >"$d/thread_siblings_list"
  [[ ${6:-} == old ]] || echo "$5" >"$d/core_cpus_list"
}
mk_node() {
  mkdir -p "$1/devices/system/node/node$2"
  echo "$3" >"$1/devices/system/node/node$2/cpulist"
}
mk_proc() { # mk_proc ROOT RMEM_MAX WMEM_MAX [CPUS_ALLOWED_LIST]
  mkdir -p "$1/sys/net/core" "$1/self"
  echo "$2" >"$1/sys/net/core/rmem_max"
  echo "$3" >"$1/sys/net/core/wmem_max"
  [[ -z ${4:-} ]] || printf 'Name:\tbash\nCpus_allowed_list:\t%s\n' "$4" >"$1/self/status"
}

# 2 CPUs, two cores, one node (older kernel naming).
sys2=$tmp/sys2
mkdir -p "$sys2/devices/system/cpu"
echo 0-1 >"$sys2/devices/system/cpu/online"
mk_cpu "$sys2" 0 0 0 0 old
mk_cpu "$sys2" 1 0 1 1 old
mk_node "$sys2" 0 0-1

# 2 CPUs that are the two threads of one core (a typical 2-vCPU cloud instance).
sys2ht=$tmp/sys2ht
mkdir -p "$sys2ht/devices/system/cpu"
echo 0-1 >"$sys2ht/devices/system/cpu/online"
mk_cpu "$sys2ht" 0 0 0 0-1
mk_cpu "$sys2ht" 1 0 0 0-1

# 8 CPUs: 2 sockets = 2 NUMA nodes, 2 cores each, 2 threads per core, numbered the way many
# two-socket servers do: even CPUs on socket 0, odd on socket 1, thread 2 of CPU c is c+4.
# core_id repeats across sockets, so cores must not be told apart by core_id alone.
sys8=$tmp/sys8
mkdir -p "$sys8/devices/system/cpu"
echo 0-7 >"$sys8/devices/system/cpu/online"
for c in 0 1 2 3 4 5 6 7; do
  mk_cpu "$sys8" "$c" $((c % 2)) $((c % 4 / 2)) "$((c % 4)),$((c % 4 + 4))"
done
mk_node "$sys8" 0 0,2,4,6
mk_node "$sys8" 1 1,3,5,7

proc=$tmp/proc # rmem_max/wmem_max at the kernel's usual defaults
mk_proc "$proc" 212992 212992
proc6=$tmp/proc6 # this process may only use CPUs 0-5
mk_proc "$proc6" 212992 212992 0-5
proc17=$tmp/proc17 # ... only CPUs 1-7: the demux lands on node 1
mk_proc "$proc17" 212992 212992 1-7

# A stand-in for ringmux: prints its arguments and the RINGMUX_* environment it got.
stub=$tmp/bin/ringmux
mkdir -p "$tmp/bin"
cat >"$stub" <<'EOF'
#!/usr/bin/env bash
printf 'stub args:'
for a in "$@"; do printf ' [%s]' "$a"; done
echo
env | grep '^RINGMUX_' | sort | sed 's/^/stub env: /'
exit "${STUB_EXIT:-0}"
EOF
chmod +x "$stub"
cp "$stub" "$tmp/bin/ringmux-worker"

# --- helpers -------------------------------------------------------------------------------

# run NAME [VAR=VALUE...] -- [launch.sh arguments...]: runs launch.sh with a clean environment
# plus the assignments; output in $out, exit status in $status.
run() {
  local envs=()
  name=$1
  shift
  while [[ $1 != -- ]]; do
    envs+=("$1")
    shift
  done
  shift
  set +e
  out=$(env RINGMUX_BIN="$stub" LAUNCH_KERNEL=6.1.0 "${envs[@]}" "$launch" "$@" 2>&1)
  status=$?
  set -e
  echo "== $name"
}
bad() {
  failures=$((failures + 1))
  printf '   FAIL (%s): %s\n' "$name" "$*"
  printf '%s\n' "$out" | sed 's/^/   | /'
}
want_status() {
  checks=$((checks + 1))
  [[ $status == "$1" ]] || bad "exit status $status, expected $1"
}
want() { # want REGEX: some output line matches
  checks=$((checks + 1))
  grep -Eq -- "$1" <<<"$out" || bad "no line matches /$1/"
}
want_not() {
  checks=$((checks + 1))
  ! grep -Eq -- "$1" <<<"$out" || bad "a line matches /$1/"
}
want_file() { # want_file PATH CONTENT
  checks=$((checks + 1))
  [[ $(<"$1") == "$2" ]] || bad "$1 holds $(<"$1"), expected $2"
}
# want_plan CPUS INSTANCES: the exported placement.
want_plan() {
  want "^   RINGMUX_CPUS=$1 "
  want "^   RINGMUX_INSTANCES=$2 "
}
# want_role CPU ROLE: the plan table's row for CPU ends in ROLE.
want_role() { want "^ +$1 +[0-9]+ +[-0-9]+ +[0-9]+ +[-0-9,]+ +$2\$"; }

# --- placement -----------------------------------------------------------------------------

run "2 CPUs: demux on cpu0, one instance on cpu1" LAUNCH_SYS="$sys2" LAUNCH_PROC="$proc" -- --dry-run
want_status 0
want_plan 0,1 1
want_role 0 demux
want_role 1 "instance 0"
want "^== dry run: would exec $stub\$"
want_not "warning"

run "2 CPUs, --instances 2: the instances share cpu1, and it says so" \
  LAUNCH_SYS="$sys2" LAUNCH_PROC="$proc" -- --dry-run --instances 2
want_status 0
want_plan 0,1,1 2
want_role 1 "instance 0 \+ instance 1"
want "^== note: 2 instances share cpu 1"
want "would exec $stub --instances 2\$"

run "2 CPUs on one SMT core: the instance takes the demux's sibling" LAUNCH_SYS="$sys2ht" LAUNCH_PROC="$proc" -- --dry-run
want_status 0
want_plan 0,1 1
want "^== note: instance 0 runs on the demux's SMT sibling \(cpu 1\)"

run "8 CPUs: demux alone on a core, its node's core first, then node 1" LAUNCH_SYS="$sys8" LAUNCH_PROC="$proc" -- --dry-run
want_status 0
want "8 online, 8 usable by this process, 4 physical cores, 2 NUMA node"
want_plan 0,2,1,3 3
want_role 0 demux
want_role 4 "idle \(SMT sibling of the demux\)"
want_role 2 "instance 0"
want_role 1 "instance 1"
want_role 3 "instance 2"
want_role 5 idle
want "^== note: 2 instance\(s\) on another NUMA node than the demux"

run "8 CPUs, RINGMUX_INSTANCES=5: SMT siblings of the instance cores, node 0 first" \
  LAUNCH_SYS="$sys8" LAUNCH_PROC="$proc" RINGMUX_INSTANCES=5 -- --dry-run
want_status 0
want_plan 0,2,1,3,6,5 5
want_role 4 "idle \(SMT sibling of the demux\)"

run "8 CPUs, --instances=7 before --dry-run: the demux's sibling last, still a dry run" \
  LAUNCH_SYS="$sys8" LAUNCH_PROC="$proc" -- --instances=7 --dry-run
want_status 0
want_plan 0,2,1,3,6,5,7,4 7
want "^== note: instance 6 runs on the demux's SMT sibling \(cpu 4\)"
want_not "stub args"

run "8 CPUs, affinity 0-5: CPUs 6 and 7 are never used" LAUNCH_SYS="$sys8" LAUNCH_PROC="$proc6" -- --dry-run --instances 5
want_status 0
want "8 online, 6 usable by this process, 4 physical cores"
want_plan 0,2,1,3,5,4 5

run "8 CPUs, affinity 1-7: the demux on node 1, so node 1's core comes first" \
  LAUNCH_SYS="$sys8" LAUNCH_PROC="$proc17" -- --dry-run
want_status 0
want_plan 1,3,2,4 3
want_role 5 "idle \(SMT sibling of the demux\)"

run "RINGMUX_CPUS overrides the plan" LAUNCH_SYS="$sys8" LAUNCH_PROC="$proc" RINGMUX_CPUS=3,5,7 -- --dry-run
want_status 0
want_plan 3,5,7 2
want "^== placement: RINGMUX_CPUS \(env\)"
want_role 3 demux

run "--cpus beats RINGMUX_CPUS" LAUNCH_SYS="$sys8" LAUNCH_PROC="$proc" RINGMUX_CPUS=3,5,7 -- --dry-run --cpus 1,2
want_status 0
want_plan 1,2 1

run "RINGMUX_CPUS with more instances than CPUs: ringmux cycles" \
  LAUNCH_SYS="$sys8" LAUNCH_PROC="$proc" RINGMUX_CPUS=0,1,2 RINGMUX_INSTANCES=3 -- --dry-run
want_status 0
want_plan 0,1,2,1 3

# --- refusals (exit 78: the unit does not restart) -----------------------------------------

run "RINGMUX_CPUS naming an offline CPU" LAUNCH_SYS="$sys8" LAUNCH_PROC="$proc" RINGMUX_CPUS=0,9 -- --dry-run
want_status 78
want "^== error: RINGMUX_CPUS=0,9: cpu 9 is not online"

run "RINGMUX_CPUS outside this process's affinity" LAUNCH_SYS="$sys8" LAUNCH_PROC="$proc6" -- --dry-run --cpus=0,7
want_status 78
want "^== error: --cpus=0,7: cpu 7 is not online or not allowed"

run "RINGMUX_CPUS not a list" LAUNCH_SYS="$sys8" LAUNCH_PROC="$proc" RINGMUX_CPUS=0-3 -- --dry-run
want_status 78
want "^== error: RINGMUX_CPUS=0-3 is not valid"

for n in 0 256 two; do
  run "RINGMUX_INSTANCES=$n" LAUNCH_SYS="$sys8" LAUNCH_PROC="$proc" RINGMUX_INSTANCES=$n -- --dry-run
  want_status 78
  want "^== error: RINGMUX_INSTANCES=$n is not valid: expected an integer from 1 to 255"
done

run "--instances without a value" LAUNCH_SYS="$sys8" LAUNCH_PROC="$proc" -- --dry-run --instances
want_status 78
want "^== error: --instances needs a value"

run "kernel 5.2: no pidfd_open" LAUNCH_SYS="$sys8" LAUNCH_PROC="$proc" LAUNCH_KERNEL=5.2.21 -- --dry-run
want_status 78
want "^   MISSING  pidfd_open \(>= 5.3\)"
want "^   ok       memfd F_SEAL_FUTURE_WRITE"
want "^== error: kernel 5.2.21 is too old for ringmux; missing: pidfd_open \(needs 5.3\)"

run "kernel 4.19: everything after UDP GSO missing" LAUNCH_SYS="$sys8" LAUNCH_PROC="$proc" LAUNCH_KERNEL=4.19.0-26-amd64 -- --dry-run
want_status 78
want "missing: UDP GRO \(needs 5.0\), memfd F_SEAL_FUTURE_WRITE \(needs 5.1\), pidfd_open \(needs 5.3\)"

run "unreadable kernel release" LAUNCH_SYS="$sys8" LAUNCH_PROC="$proc" LAUNCH_KERNEL=unknown -- --dry-run
want_status 78
want "cannot read a version from kernel release 'unknown'"

run "a misspelt variable is reported" LAUNCH_SYS="$sys2" LAUNCH_PROC="$proc" RINGMUX_INSTANCE=4 -- --dry-run
want_status 0
want "^== warning: RINGMUX_INSTANCE is not a ringmux setting"

# --- sysctl --------------------------------------------------------------------------------

run "dry run: says what it would raise, changes nothing" LAUNCH_SYS="$sys2" LAUNCH_PROC="$proc" -- --dry-run
want "^   net.core.rmem_max 212992 -> 33554432 \(would raise, for RINGMUX_RCVBUF\)"
want "^   net.core.wmem_max 212992 -> 8388608 \(would raise, for RINGMUX_SNDBUF\)"
want_file "$proc/sys/net/core/rmem_max" 212992
want_file "$proc/sys/net/core/wmem_max" 212992

run "--no-sysctl: warns, changes nothing" LAUNCH_SYS="$sys2" LAUNCH_PROC="$proc" RINGMUX_RCVBUF=1048576 -- --no-sysctl --dry-run
want_status 0
want "^== warning: net.core.rmem_max is 212992, below RINGMUX_RCVBUF=1048576, and --no-sysctl"
want_file "$proc/sys/net/core/rmem_max" 212992

# --- a real start, with the stub as ringmux ------------------------------------------------

procrun=$tmp/procrun # wmem_max already above RINGMUX_SNDBUF: must not be lowered
mk_proc "$procrun" 212992 16777216
run "start: raises rmem_max only, exports the plan, execs ringmux with the arguments" \
  LAUNCH_SYS="$sys8" LAUNCH_PROC="$procrun" -- --listen '[::]:4433' --retry always --root '/srv/a dir'
want_status 0
want "^   net.core.rmem_max 212992 -> 33554432 \(raised, for RINGMUX_RCVBUF\)"
want "^   net.core.wmem_max 16777216 >= RINGMUX_SNDBUF=8388608: unchanged"
want_file "$procrun/sys/net/core/rmem_max" 33554432
want_file "$procrun/sys/net/core/wmem_max" 16777216
want "^stub args: \[--listen\] \[\[::\]:4433\] \[--retry\] \[always\] \[--root\] \[/srv/a dir\]\$"
want "^stub env: RINGMUX_CPUS=0,2,1,3\$"
want "^stub env: RINGMUX_INSTANCES=3\$"
want "^stub env: RINGMUX_RCVBUF=33554432\$"
want "^stub env: RINGMUX_SNDBUF=8388608\$"

run "start: ringmux's exit status is launch.sh's" LAUNCH_SYS="$sys2" LAUNCH_PROC="$procrun" STUB_EXIT=3 -- --no-sysctl
want_status 3
want "^stub args:\$"

run "start: a subcommand goes straight through, no checks" LAUNCH_KERNEL=3.10.0 -- stats --metrics 127.0.0.1:9433
want_status 0
want "^stub args: \[stats\] \[--metrics\] \[127.0.0.1:9433\]\$"
want_not "kernel"

run "start: after --, --dry-run belongs to ringmux" LAUNCH_SYS="$sys2" LAUNCH_PROC="$procrun" -- --no-sysctl -- --dry-run
want "^stub args: \[--dry-run\]\$"

run "start: reload goes straight through, as the unit's ExecReload= runs it" LAUNCH_KERNEL=3.10.0 -- reload
want_status 0
want "^stub args: \[reload\]\$"

# --- the systemd unit ------------------------------------------------------------------------

unit="$PWD/deploy/ringmux.service"
name="unit: systemctl reload runs ringmux reload on the unit's control socket"
echo "== $name"
out=$(cat "$unit")
status=0
want "^ExecReload=/opt/ringmux/bin/ringmux reload\$"
want "^RuntimeDirectory=ringmux\$"
want "^Environment=RINGMUX_CONTROL_SOCKET=/run/ringmux/control.sock\$"
name="unit: workers run as a user of their own, which ringmux may switch to"
echo "== $name"
want "^User=ringmux\$"
want "^Environment=RINGMUX_WORKER_USER=ringmux-worker\$"
want "^AmbientCapabilities=CAP_NET_BIND_SERVICE CAP_SETUID CAP_SETGID\$"
want "^CapabilityBoundingSet=CAP_NET_BIND_SERVICE CAP_SETUID CAP_SETGID\$"
want "^#   useradd .*ringmux\$"
want "^#     --user-group ringmux-worker\$"
name="unit: no bound on reloads' drains; systemd's stop timeout outlasts ExecStop='s wait and the cut (CUT_WAIT 3 s)"
echo "== $name"
grace=$(sed -n 's/^ExecStop=.*timeout \([0-9][0-9]*\) tail .*$/\1/p' "$unit")
stop=$(sed -n 's/^TimeoutStopSec=\([0-9][0-9]*\)s$/\1/p' "$unit")
checks=$((checks + 1))
if grep -q '^Environment=RINGMUX_GRACE=' "$unit"; then
  bad "the unit bounds drains (RINGMUX_GRACE): every reload would cut what lasts longer"
elif [[ -z $grace || -z $stop ]]; then
  bad "the unit's ExecStop= waits no number of seconds before the cut, or it sets no TimeoutStopSec (seconds)"
elif ((stop < grace + 3 + 10)); then
  bad "TimeoutStopSec=${stop}s leaves less than 10 s past ExecStop='s wait of ${grace}s plus the 3 s cut"
fi
# The reload line's binary takes the subcommand and the variable the unit sets.
ringmux_bin="$PWD/target/release/ringmux"
[[ -x $ringmux_bin ]] || ringmux_bin="$PWD/target/debug/ringmux"
if [[ -x $ringmux_bin ]]; then
  name="unit: the ExecReload= command is one ringmux knows"
  echo "== $name"
  set +e
  out=$(RINGMUX_CONTROL_SOCKET=/nonexistent/control.sock "$ringmux_bin" reload 2>&1)
  status=$?
  set -e
  want_status 1
  want "connecting to /nonexistent/control.sock"
  name="unit: ringmux upgrade, as the unit's comment gives it, reaches the same socket"
  echo "== $name"
  set +e
  out=$(RINGMUX_CONTROL_SOCKET=/nonexistent/control.sock "$ringmux_bin" upgrade 2>&1)
  status=$?
  set -e
  want_status 1
  want "connecting to /nonexistent/control.sock"
  name="the built binary answers an upgrade's check"
  echo "== $name"
  set +e
  out=$("$ringmux_bin" upgrade-check 2>&1)
  status=$?
  set -e
  want_status 0
  want "^ringmux-upgrade state-format=[0-9]+ protocol=[0-9]+ ring-layout=[0-9]+\$"
else
  echo "== unit: no ringmux binary built yet: the ExecReload= command is not run"
fi

# --- this machine --------------------------------------------------------------------------

echo "== this machine: deploy/launch.sh --dry-run"
set +e
out=$("$launch" --dry-run 2>&1)
status=$?
set -e
name="this machine"
printf '%s\n' "$out" | sed 's/^/   | /'
want_status 0
want "^   RINGMUX_CPUS=[0-9]+(,[0-9]+)+ "
want "^== dry run: would exec "

if ((failures)); then
  echo "check-launch: $failures of $checks checks failed"
  exit 1
fi
echo "check-launch: all $checks checks passed"
