#!/usr/bin/env bash
# Runs ringmux on a dedicated Linux box (docs/operators/service.md):
#
#   deploy/launch.sh [--dry-run] [--no-sysctl] [--] [ringmux options...]
#
# 1. Checks the kernel has what ringmux uses: UDP GSO (4.18), UDP GRO (5.0),
#    memfd F_SEAL_FUTURE_WRITE (5.1), pidfd_open (5.3).
# 2. Raises net.core.rmem_max / wmem_max to at least RINGMUX_RCVBUF / RINGMUX_SNDBUF, never
#    lowers them, and prints old -> new. --no-sysctl skips this and only warns.
# 3. Reads the CPU topology from /sys and plans placement: the demux alone on the first physical
#    core (its SMT sibling left idle), one instance per remaining physical core, the demux's NUMA
#    node first; SMT siblings, then sharing, only when more instances are asked for than there are
#    cores. RINGMUX_CPUS (or --cpus) overrides the plan.
# 4. Exports RINGMUX_CPUS, RINGMUX_INSTANCES, RINGMUX_RCVBUF and RINGMUX_SNDBUF, then execs ringmux
#    in the foreground, so a supervisor sees its exit status and its signals reach it directly.
#
# --dry-run prints the same checks, the plan and every setting, and changes nothing. Everything
# this script says goes to stderr. Options after the launch options (or after `--`) go to ringmux
# unchanged; the command line beats the environment, as in ringmux itself. Exit status: ringmux's,
# or 78 (EX_CONFIG) when a check fails before ringmux starts (ringmux.service does not restart
# on 78).
#
# Read by this script only:
#   RINGMUX_BIN    the ringmux binary (default: ringmux on PATH, else <repo>/target/release/ringmux)
#   LAUNCH_KERNEL  kernel release to check instead of `uname -r` (tests)
#   LAUNCH_PROC    where /proc is (default /proc; tests point it at a fake tree)
#   LAUNCH_SYS     where /sys is  (default /sys)
set -euo pipefail

readonly EX_CONFIG=78
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(dirname "$here")
proc=${LAUNCH_PROC:-/proc}
sys=${LAUNCH_SYS:-/sys}

say() { printf '== %s\n' "$*" >&2; }
line() { printf '   %s\n' "$*" >&2; }
warn() { printf '== warning: %s\n' "$*" >&2; }
die() {
  printf '== error: %s\n' "$*" >&2
  exit "$EX_CONFIG"
}

usage() {
  cat <<'EOF'
usage: launch.sh [--dry-run] [--no-sysctl] [--] [ringmux options...]
  --dry-run    print the kernel check, sysctl changes, CPU plan and every setting; change nothing
  --no-sysctl  leave net.core.rmem_max/wmem_max alone (warn when below RINGMUX_RCVBUF/SNDBUF)
  -h, --help   this text; ringmux's own options: launch.sh -- --help
Every other argument goes to ringmux unchanged. See docs/operators/service.md.
EOF
}

# Every variable ringmux reads: NAME|option|flag or value|ringmux's default, shown by the settings
# table. Only what launch.sh decides is exported; ringmux's own defaults stay authoritative.
readonly SETTINGS=(
  "LISTEN|--listen|value|127.0.0.1:4433"
  "TCP|--tcp|value|on"
  "TCP_LISTEN|--tcp-listen|value|--listen's address and port"
  "ALT_SVC|--alt-svc|value|auto"
  "TCP_MAX_CONNECTIONS|--tcp-max-connections|value|4096"
  "TCP_IDLE_TIMEOUT|--tcp-idle-timeout|value|60"
  "REDIRECT_HTTP|--redirect-http|value|none"
  "ACCESS_LOG|--access-log|value|off"
  "INSTANCES|--instances|value|2"
  "FORWARD|--forward|value|shm"
  "METRICS|--metrics|value|127.0.0.1:9433"
  "CONTROL_SOCKET|--control-socket|value|/run/ringmux/control.sock"
  "CERT|--cert|value|self-signed for localhost, 127.0.0.1, ::1"
  "KEY|--key|value|(with the self-signed certificate)"
  "ROOT|--root|value|built-ins only (/hello.txt, /bytes/N)"
  "FILE_CACHE_MB|--file-cache-mb|value|64"
  "CACHE_CONTROL|--cache-control|value|none"
  "KEY_FILE|--key-file|value|fresh keys at every start"
  "CPUS|--cpus|value|no pinning"
  "RING_SLOTS|--ring-slots|value|4096"
  "SLOT_BYTES|--slot-bytes|value|2048"
  "SPIN_US|--spin-us|value|50"
  "SPIN|--spin|value|adaptive"
  "ECN|--ecn|value|on"
  "RECV_BATCH|--recv-batch|value|32"
  "RECV_COALESCE_US|--recv-coalesce-us|value|250"
  "RCVBUF|--rcvbuf|value|33554432"
  "SNDBUF|--sndbuf|value|8388608"
  "GRACE|--grace|value|10"
  "WORKER_BIN|--worker-bin|value|ringmux-worker next to ringmux"
  "WORKER_CMD|--worker-cmd|value|the built-in worker (--worker-bin)"
  "READY_TIMEOUT|--ready-timeout|value|30"
  "SANDBOX|--sandbox|value|on"
  "WORKER_USER|--worker-user|value|nobody with CAP_SETUID+CAP_SETGID (root, the unit), else refused (self: ringmux's own user)"
  "WORKER_READ|--worker-read|value|nothing beyond the program, its libraries and the site roots"
  "WORKER_WRITE|--worker-write|value|nowhere"
  "INITIAL_SHED_AT|--initial-shed-at|value|50"
  "WORKER_MODE|--worker-mode|value|http"
  "NODE_ID|--node-id|value|00"
  "CONFIG_ID|--config-id|value|0"
  "NONCE_LEN|--nonce-len|value|16 - node-id bytes - 1"
  "PLAINTEXT_CIDS|--plaintext-cids|flag|off"
  "CID_LIFETIME|--cid-lifetime|value|0 (no rotation)"
  "RETRY|--retry|value|auto"
  "RETRY_ABOVE|--retry-above|value|1000"
  "PREFIX_BUDGET|--prefix-budget|value|100"
  "PREFIX_V4|--prefix-v4|value|24"
  "PREFIX_V6|--prefix-v6|value|56"
  "MAX_BYTES|--max-bytes|value|67108864"
  "UPSTREAM|--upstream|value|none (serve files and built-ins)"
  "UPSTREAM_TIMEOUT|--upstream-timeout|value|60"
  "IDLE_TIMEOUT|--idle-timeout|value|30"
  "STALL_SECS|--stall-secs|value|5"
)

# Kernel features: version|feature|what ringmux uses it for.
readonly KERNEL_NEEDS=(
  "4.18|UDP GSO (UDP_SEGMENT)|workers send a train of datagrams in one sendmsg"
  "5.0|UDP GRO|the demux receives a train of datagrams per recvmmsg buffer"
  "5.1|memfd F_SEAL_FUTURE_WRITE|workers cannot write into the demux's half of a ring"
  "5.3|pidfd_open|the demux notices a worker's death at once"
)

main() {
  local dry_run=0 no_sysctl=0
  pass=()
  # Launch options are recognised anywhere before `--` (ringmux has none of these names), so
  # `launch.sh --instances 4 --dry-run` is still a dry run and never starts anything.
  while (($#)); do
    case $1 in
      --dry-run) dry_run=1 ;;
      --no-sysctl) no_sysctl=1 ;;
      -h | --help)
        usage
        exit 0
        ;;
      --)
        shift
        pass+=("$@")
        break
        ;;
      *) pass+=("$1") ;;
    esac
    shift
  done

  local bin
  if [[ -n ${RINGMUX_BIN:-} ]]; then
    bin=$RINGMUX_BIN
  else
    bin=$(command -v ringmux) || bin=$repo/target/release/ringmux
  fi

  # A subcommand (`stats`, `help`) or --help/--version is not a server start: no checks.
  local a direct=0
  if ((${#pass[@]})) && [[ ${pass[0]} != -* ]]; then direct=1; fi
  for a in "${pass[@]}"; do
    case $a in -h | --help | -V | --version) direct=1 ;; esac
  done
  if ((direct)); then start "$dry_run" "$bin"; fi

  warn_unknown_variables
  check_kernel
  # Where the four settings launch.sh exports came from, before exporting hides it.
  local key
  declare -gA origin=()
  for key in CPUS INSTANCES RCVBUF SNDBUF; do
    resolve "$key"
    [[ -n $val ]] || src=default # set but empty: launch.sh decides, like unset
    case $src in
      default) origin[$key]="exported by launch.sh" ;;
      cli) origin[$key]="command line ($name), exported" ;;
      *) origin[$key]="environment, exported" ;;
    esac
  done

  resolve RCVBUF
  local rcvbuf=${val:-33554432}
  check_int "$rcvbuf" 1 2147483647 "$name"
  resolve SNDBUF
  local sndbuf=${val:-8388608}
  check_int "$sndbuf" 1 2147483647 "$name"
  say "socket buffers (net.core.*_max caps SO_RCVBUF/SO_SNDBUF unless ringmux runs as root)"
  raise_max net.core.rmem_max "$rcvbuf" RINGMUX_RCVBUF "$dry_run" "$no_sysctl"
  raise_max net.core.wmem_max "$sndbuf" RINGMUX_SNDBUF "$dry_run" "$no_sysctl"
  export RINGMUX_RCVBUF=$rcvbuf RINGMUX_SNDBUF=$sndbuf

  resolve LISTEN
  check_low_port "${val:-127.0.0.1:4433}"

  read_topology
  plan_placement
  print_plan
  export RINGMUX_CPUS=$planned_cpus RINGMUX_INSTANCES=$planned_instances

  print_settings
  check_worker_bin "$bin"
  start "$dry_run" "$bin"
}

# Execs ringmux with the pass-through arguments (or, in a dry run, says it would).
start() {
  local dry_run=$1 bin=$2 cmd
  printf -v cmd '%q ' "$bin" "${pass[@]}"
  if ((dry_run)); then
    [[ -x $bin ]] || warn "ringmux binary $bin not found (set RINGMUX_BIN, put ringmux on PATH, or cargo build --release)"
    say "dry run: would exec ${cmd% }"
    exit 0
  fi
  [[ -x $bin ]] || die "ringmux binary $bin not found: set RINGMUX_BIN, put ringmux on PATH, or cargo build --release"
  say "exec ${cmd% }"
  exec "$bin" "${pass[@]}"
}

# resolve NAME: sets `val` to RINGMUX_NAME's effective value (empty: unset or set empty), `src` to
# where it came from (cli, env, default) and `name` to how to call it in a message. The command
# line beats the environment, the last occurrence wins, as in ringmux's clap parser.
resolve() {
  local var=RINGMUX_$1 entry opt kind i
  for entry in "${SETTINGS[@]}"; do
    [[ $entry == "$1|"* ]] && IFS='|' read -r _ opt kind _ <<<"$entry"
  done
  val=${!var-} src=default name=$var
  [[ -z ${!var+set} ]] || src='env'
  for ((i = 0; i < ${#pass[@]}; i++)); do
    case ${pass[i]} in
      "$opt")
        if [[ $kind == flag ]]; then
          val=on
        else
          ((i + 1 < ${#pass[@]})) || die "$opt needs a value"
          i=$((i + 1))
          val=${pass[i]}
        fi
        src=cli name=$opt
        ;;
      "$opt"=*) val=${pass[i]#*=} src=cli name=$opt ;;
    esac
  done
}

# check_int VALUE MIN MAX NAME: dies unless VALUE is a decimal integer in [MIN, MAX].
check_int() {
  if ! [[ $1 =~ ^[0-9]{1,10}$ ]] || ((10#$1 < $2 || 10#$1 > $3)); then
    die "$4=$1 is not valid: expected an integer from $2 to $3"
  fi
}

# A misspelt variable (RINGMUX_INSTANCE) would silently do nothing: say so.
warn_unknown_variables() {
  local v entry known
  for v in $(compgen -e); do
    [[ $v == RINGMUX_* ]] || continue
    known=0
    for entry in "${SETTINGS[@]}" BIN CONTROL_FD; do
      [[ $v == "RINGMUX_${entry%%|*}" ]] && known=1
    done
    ((known)) || warn "$v is not a ringmux setting and is ignored (see docs/operators/service.md)"
  done
}

check_kernel() {
  local release=${LAUNCH_KERNEL:-$(uname -r)} have entry need feature why missing=()
  [[ $release =~ ^([0-9]+)\.([0-9]+) ]] ||
    die "cannot read a version from kernel release '$release' (override with LAUNCH_KERNEL=MAJOR.MINOR)"
  have=$((10#${BASH_REMATCH[1]} * 1000 + 10#${BASH_REMATCH[2]}))
  say "kernel $release${LAUNCH_KERNEL:+ (from LAUNCH_KERNEL)}"
  for entry in "${KERNEL_NEEDS[@]}"; do
    IFS='|' read -r need feature why <<<"$entry"
    if ((have >= ${need%.*} * 1000 + ${need#*.})); then
      line "ok       $feature (>= $need): $why"
    else
      line "MISSING  $feature (>= $need): $why"
      missing+=("$feature (needs $need)")
    fi
  done
  if ((${#missing[@]})); then
    local IFS=,
    die "kernel $release is too old for ringmux; missing:${missing[*]/#/ }. Run Linux 5.3 or later."
  fi
}

# raise_max KEY WANT VARIABLE DRY_RUN NO_SYSCTL: makes sysctl KEY at least WANT, never lower.
raise_max() {
  local key=$1 want=$2 var=$3 dry_run=$4 no_sysctl=$5 file cur
  file=$proc/sys/${key//.//}
  read_file "$file" ""
  cur=$REPLY
  if ! [[ $cur =~ ^[0-9]+$ ]]; then
    warn "cannot read $file; not checking $key against $var=$want"
  elif ((cur >= want)); then
    line "$key $cur >= $var=$want: unchanged"
  elif ((no_sysctl)); then
    warn "$key is $cur, below $var=$want, and --no-sysctl was given: the kernel caps the buffer at $cur unless ringmux runs as root; set $key = $want in /etc/sysctl.d (docs/operators/service.md)"
  elif ((dry_run)); then
    line "$key $cur -> $want (would raise, for $var)"
  else
    if ! (printf '%s\n' "$want" >"$file") 2>/dev/null; then
      die "cannot raise $key from $cur to $want (writing $file needs root): run as root, or pass --no-sysctl and set it in /etc/sysctl.d"
    fi
    read_file "$file" ""
    [[ $REPLY == "$want" ]] || die "wrote $want to $file but it reads back '$REPLY'"
    line "$key $cur -> $want (raised, for $var)"
  fi
}

# A port below net.ipv4.ip_unprivileged_port_start needs root or CAP_NET_BIND_SERVICE. Only a
# warning: ringmux itself may carry the capability as a file capability (setcap).
check_low_port() {
  local listen=$1 port start key value caps=
  port=${listen##*:}
  [[ $port =~ ^[0-9]+$ ]] || return 0
  read_file "$proc/sys/net/ipv4/ip_unprivileged_port_start" 1024
  start=$REPLY
  ((port < start && EUID != 0)) || return 0
  if [[ -r $proc/self/status ]]; then
    while IFS=$':\t ' read -r key value; do
      [[ $key == CapEff ]] && caps=$value
    done <"$proc/self/status"
  fi
  if [[ $caps =~ ^[0-9a-fA-F]+$ ]] && (((16#$caps >> 10) & 1)); then # bit 10: CAP_NET_BIND_SERVICE
    say "port $port < $start: CAP_NET_BIND_SERVICE present"
  else
    warn "listening on $listen needs CAP_NET_BIND_SERVICE (port $port < $start) and this process lacks it: set AmbientCapabilities=CAP_NET_BIND_SERVICE in the unit, run as root, or use a port >= $start"
  fi
}

# read_file FILE DEFAULT: FILE's first line (DEFAULT if missing or empty) in REPLY, no subshell.
read_file() {
  local first=
  if [[ -r $1 ]]; then IFS= read -r first <"$1" || true; fi
  REPLY=${first:-$2}
}

# expand_cpulist LIST: the kernel's cpulist format ("0-3,8,10-11") as the array `expanded`.
expand_cpulist() {
  local part c parts
  expanded=()
  IFS=, read -ra parts <<<"$1"
  for part in "${parts[@]}"; do
    if [[ $part =~ ^([0-9]+)-([0-9]+)$ ]]; then
      for ((c = BASH_REMATCH[1]; c <= BASH_REMATCH[2]; c++)); do expanded+=("$c"); done
    elif [[ $part =~ ^[0-9]+$ ]]; then
      expanded+=("$part")
    else
      return 1
    fi
  done
}

# Fills: cpus (online CPUs this process may run on, ascending), usable[cpu], node_of[cpu],
# pkg_of[cpu], core_of[cpu], sibs_of[cpu] (the kernel's SMT sibling list: one physical core),
# core_keys (physical cores by lowest CPU) and core_members[core] ("cpu cpu ...", usable only).
read_topology() {
  local dir=$sys/devices/system/cpu c t d n l allowed=() online=()
  declare -gA usable=() node_of=() pkg_of=() core_of=() sibs_of=() core_members=()
  cpus=() core_keys=()

  read_file "$dir/online" ""
  expand_cpulist "$REPLY" && online=("${expanded[@]}")
  # The process's affinity (a cgroup cpuset, taskset, CPUAffinity=): pinning outside it fails.
  if [[ -r $proc/self/status ]]; then
    while IFS= read -r l; do
      [[ $l == Cpus_allowed_list:* ]] || continue
      l=${l#*:}
      expand_cpulist "${l//[[:space:]]/}" && allowed=("${expanded[@]}")
    done <"$proc/self/status"
  fi
  if ((${#online[@]} == 0)); then
    warn "cannot read $dir/online; assuming the CPUs this process may use are online"
    online=("${allowed[@]}")
  fi
  ((${#online[@]})) || die "no online CPUs found in $dir/online (set LAUNCH_SYS or RINGMUX_CPUS)"
  if ((${#allowed[@]})); then
    local -A in_allowed=()
    for c in "${allowed[@]}"; do in_allowed[$c]=1; done
    for c in "${online[@]}"; do [[ -n ${in_allowed[$c]:-} ]] && cpus+=("$c"); done
  else
    cpus=("${online[@]}")
  fi
  ((${#cpus[@]})) || die "none of the online CPUs ($(join , "${online[@]}")) is in this process's Cpus_allowed_list"

  for c in "${cpus[@]}"; do
    usable[$c]=1
    t=$dir/cpu$c/topology
    read_file "$t/physical_package_id" 0
    pkg_of[$c]=$REPLY
    read_file "$t/core_id" "$c"
    core_of[$c]=$REPLY
    # core_cpus_list is the current name (5.7+), thread_siblings_list the older one.
    read_file "$t/core_cpus_list" ""
    [[ -n $REPLY ]] || read_file "$t/thread_siblings_list" "$c"
    sibs_of[$c]=$REPLY
    node_of[$c]=0
    if [[ -z ${core_members[$REPLY]:-} ]]; then
      core_keys+=("$REPLY")
      core_members[$REPLY]=$c
    else
      core_members[$REPLY]+=" $c"
    fi
  done
  for d in "$sys"/devices/system/node/node[0-9]*; do
    [[ -r $d/cpulist ]] || continue
    n=${d##*/node}
    read_file "$d/cpulist" ""
    expand_cpulist "$REPLY" || continue
    for c in "${expanded[@]}"; do [[ -n ${usable[$c]:-} ]] && node_of[$c]=$n; done
  done
  nodes=$(printf '%s\n' "${node_of[@]}" | sort -u | wc -l)
  say "cpu topology from $sys: ${#online[@]} online, ${#cpus[@]} usable by this process, ${#core_keys[@]} physical cores, $nodes NUMA node(s)"
}

# Sets plan (demux CPU, then one CPU per instance), planned_cpus, planned_instances and
# plan_source.
plan_placement() {
  local instances='' cpus_list c k m first i n order=() pool=() spare=() demux_spare=()
  resolve INSTANCES
  if [[ -n $val ]]; then
    check_int "$val" 1 255 "$name"
    instances=$((10#$val))
  fi
  local instances_name=$name instances_src=$src
  resolve CPUS
  cpus_list=$val

  if [[ -n $cpus_list ]]; then
    [[ $cpus_list =~ ^[0-9]+(,[0-9]+)*$ ]] ||
      die "$name=$cpus_list is not valid: expected a comma list of CPU numbers, the demux's first (e.g. 0,2,4)"
    IFS=, read -ra m <<<"$cpus_list"
    for c in "${m[@]}"; do
      [[ -n ${usable[$c]:-} ]] ||
        die "$name=$cpus_list: cpu $c is not online or not allowed to this process (usable: $(join , "${cpus[@]}"))"
    done
    ((${#m[@]} >= 2)) || die "$name=$cpus_list: list the demux's CPU, then at least one for the instances"
    n=${instances:-$((${#m[@]} - 1))}
    # ringmux gives instance i the (i mod k)-th CPU after the demux's.
    plan=("${m[0]}")
    for ((i = 0; i < n; i++)); do plan+=("${m[1 + i % (${#m[@]} - 1)]}"); done
    ((${#m[@]} - 1 <= n)) || warn "$name lists ${#m[@]} CPUs but $instances_name=$n uses only the first $((n + 1))"
    ((${#m[@]} - 1 >= n)) || say "note: $n instances on $((${#m[@]} - 1)) listed CPUs: ringmux cycles through them"
    plan_source="$name ($src)"
  else
    # The demux takes the first physical core alone. The other cores, the demux's NUMA node
    # first (its rings live in the demux's memory), then by node, then by lowest CPU.
    local dnode=${node_of[${cpus[0]}]}
    while read -r _ _ _ k; do order+=("$k"); done < <(
      for k in "${core_keys[@]:1}"; do
        first=${core_members[$k]%% *}
        printf '%d %d %d %s\n' "$([[ ${node_of[$first]} == "$dnode" ]] && echo 0 || echo 1)" \
          "${node_of[$first]}" "$first" "$k"
      done | sort -n -k1,1 -k2,2 -k3,3
    )
    for k in "${order[@]}"; do
      read -ra m <<<"${core_members[$k]}"
      pool+=("${m[0]}")
      spare+=("${m[@]:1}")
    done
    read -ra m <<<"${core_members[${core_keys[0]}]}"
    demux_spare=("${m[@]:1}")
    n=${instances:-${#pool[@]}}
    ((n >= 1)) || n=1
    # One instance per free physical core; beyond that, their SMT siblings, then the demux's
    # sibling, then instances share CPUs (never the demux's own CPU unless it is the only one).
    order=("${pool[@]}" "${spare[@]}" "${demux_spare[@]}")
    plan=("${cpus[0]}")
    for ((i = 0; i < n; i++)); do
      if ((${#order[@]})); then plan+=("${order[i % ${#order[@]}]}"); else plan+=("${cpus[0]}"); fi
    done
    if [[ -n $instances ]]; then
      plan_source="planned by launch.sh for $instances_name=$n ($instances_src)"
    else
      plan_source="planned by launch.sh: one instance per free physical core"
    fi
  fi
  planned_cpus=$(join , "${plan[@]}")
  planned_instances=$((${#plan[@]} - 1))
}

# The plan as a table, one row per usable CPU, then what a reader should notice.
print_plan() {
  local c i dcore=${sibs_of[${plan[0]}]} role
  local -A roles=() per_cpu=()
  roles[${plan[0]}]=demux
  for ((i = 1; i < ${#plan[@]}; i++)); do
    c=${plan[i]}
    roles[$c]+="${roles[$c]:+ + }instance $((i - 1))"
    per_cpu[$c]=$((${per_cpu[$c]:-0} + 1))
  done
  say "placement: $plan_source"
  line "$(printf '%4s %5s %8s %5s  %-14s %s' cpu node package core 'smt siblings' role)"
  for c in "${cpus[@]}"; do
    role=${roles[$c]:-}
    if [[ -z $role && ${sibs_of[$c]} == "$dcore" ]]; then
      role="idle (SMT sibling of the demux)"
    fi
    line "$(printf '%4s %5s %8s %5s  %-14s %s' "$c" "${node_of[$c]}" "${pkg_of[$c]}" "${core_of[$c]}" "${sibs_of[$c]}" "${role:-idle}")"
  done
  for ((i = 1; i < ${#plan[@]}; i++)); do
    c=${plan[i]}
    if [[ $c == "${plan[0]}" ]]; then
      say "note: instance $((i - 1)) shares cpu $c with the demux (only one CPU to use)"
    elif [[ ${sibs_of[$c]} == "$dcore" ]]; then
      say "note: instance $((i - 1)) runs on the demux's SMT sibling (cpu $c): they share one physical core"
    fi
  done
  for c in "${cpus[@]}"; do
    ((${per_cpu[$c]:-0} < 2)) || say "note: ${per_cpu[$c]} instances share cpu $c (${roles[$c]}): more instances than CPUs"
  done
  local remote=0
  for ((i = 1; i < ${#plan[@]}; i++)); do
    [[ ${node_of[${plan[i]}]} == "${node_of[${plan[0]}]}" ]] || remote=$((remote + 1))
  done
  ((remote == 0)) ||
    say "note: $remote instance(s) on another NUMA node than the demux (node ${node_of[${plan[0]}]}): their ring reads cross nodes"
}

# Every RINGMUX_* setting with its value and source; then RUST_LOG.
print_settings() {
  local entry key
  say "settings (command line > environment > ringmux default; launch.sh exports CPUS, INSTANCES, RCVBUF, SNDBUF)"
  for entry in "${SETTINGS[@]}"; do
    key=${entry%%|*}
    resolve "$key"
    case $key in
      CPUS | INSTANCES | RCVBUF | SNDBUF)
        local var=RINGMUX_$key
        line "$(printf '%-40s %s' "$var=${!var}" "${origin[$key]}")"
        ;;
      *)
        case $src in
          default) line "$(printf '%-40s %s' "RINGMUX_$key" "unset: ringmux default ${entry##*|}")" ;;
          cli) line "$(printf '%-40s %s' "RINGMUX_$key=$val" "command line ($name)")" ;;
          *) line "$(printf '%-40s %s' "RINGMUX_$key=$val" "environment")" ;;
        esac
        ;;
    esac
  done
  if [[ -n ${RUST_LOG:-} ]]; then
    line "$(printf '%-40s %s' "RUST_LOG=$RUST_LOG" "environment")"
  else
    line "$(printf '%-40s %s' "RUST_LOG" "unset: ringmux default info")"
  fi
}

# ringmux refuses to start without its worker binary; say so before, in a dry run too.
check_worker_bin() {
  local bin=$1 worker
  resolve WORKER_CMD
  [[ -z $val ]] || return 0 # ringmux checks the program of --worker-cmd itself, naming it
  resolve WORKER_BIN
  if [[ -n $val ]]; then
    worker=$val
  else
    # ringmux looks next to its own resolved executable (current_exe), not next to a symlink.
    worker=$(dirname "$(readlink -f "$bin" 2>/dev/null || printf '%s' "$bin")")/ringmux-worker
  fi
  [[ -x $worker ]] || warn "worker binary $worker not found: ringmux will refuse to start (set RINGMUX_WORKER_BIN or install ringmux-worker next to ringmux)"
}

join() {
  local IFS=$1
  shift
  printf '%s' "$*"
}

main "$@"
