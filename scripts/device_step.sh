# Sourced by the device sweeps (scripts/gpu_*.sh): step NAME LIMIT COMMAND... runs the
# command under a time limit, logs it to $out/NAME.log and prints its rc and its last
# ${TAIL:-12} lines. The caller sets $out.
step() {
    local name=$1 limit=$2
    shift 2
    timeout "$limit" "$@" > "$out/$name.log" 2>&1
    echo "== $name: rc $?"
    tail -n "${TAIL:-12}" "$out/$name.log"
}
