# CI's steps, sourced by .ci/run: `step NAME BUDGET_S COMMAND...` runs COMMAND and prints its duration against its
# budget; at exit every step's duration and the total are printed again, and a run whose steps all passed fails
# (exit 1) when a step, or the whole run, took longer than its budget. CI_TOTAL_BUDGET_S sets the whole run's budget.
# The budgets are seconds of the machine they were set on (the quiet 2-core AMD EPYC). On a slower machine a step's
# budget, and the whole run's, are scaled by how much slower it ran Python while they ran (.ci/machine_speed.py
# samples it through the run; CI_SPEED_FACTOR=F fixes the factor), never below the budget itself, the whole run's
# never beyond CI_HARD_LIMIT_S, short of where CI itself stops a run (90 minutes).
ci_started=$SECONDS
TOTAL_BUDGET_S=${CI_TOTAL_BUDGET_S:-2700}  # 45 minutes, the limit this project holds CI to
HARD_LIMIT_S=${CI_HARD_LIMIT_S:-4800}
ci_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
speed_samples=""
if [[ -z "${CI_SPEED_FACTOR:-}" ]]; then
    speed_samples=$(mktemp)
    python3 "$ci_dir/machine_speed.py" sample "$speed_samples" "${CI_SPEED_EVERY_S:-20}" &
    speed_sampler=$!
fi
ci_epoch_started=$(date +%s)
speed_factor() {  # speed_factor SINCE_EPOCH_S: the factor since then (the samples' median), at least 1
    local measured=${CI_SPEED_FACTOR:-}
    [[ -n "$measured" ]] || measured=$(python3 "$ci_dir/machine_speed.py" factor "$speed_samples" "$1")
    awk -v f="$measured" 'BEGIN { printf "%.2f", (f > 1 ? f : 1) }'
}
scaled() {  # scaled BUDGET_S FACTOR [CEILING_S]: the budget on this machine, in whole seconds
    awk -v b="$1" -v f="$2" -v c="${3:-0}" 'BEGIN { s = int(b * f + 0.5); printf "%d", (c > 0 && s > c ? c : s) }'
}
durations=()
over_budget=()
step() {  # step NAME BUDGET_S COMMAND...: runs COMMAND and prints how long it took against its budget; the run stops
    # at the first failing step, and fails at the end when a step took longer than its budget
    local name=$1 base=$2 started=$SECONDS epoch_started factor budget
    epoch_started=$(date +%s)
    shift 2
    echo "[ci] $name (budget $base s on the reference machine) ..."
    "$@"
    local took=$((SECONDS - started))
    factor=$(speed_factor "$epoch_started")
    budget=$(scaled "$base" "$factor")
    durations+=("$name: $took s (budget $budget s = $base s x $factor)")
    echo "[ci] $name: $took s (budget $budget s = $base s x $factor)"
    if ((took > budget)); then over_budget+=("$name took $took s, over its budget of $budget s"); fi
}
summary() {
    local status=$? total=$((SECONDS - ci_started)) factor
    [[ -z "$speed_samples" ]] || kill "$speed_sampler" 2>/dev/null || true
    factor=$(speed_factor "$ci_epoch_started")
    TOTAL_BUDGET_S=$(scaled "$TOTAL_BUDGET_S" "$factor" "$HARD_LIMIT_S")
    if [[ -n "$speed_samples" ]]; then
        echo "[ci] this machine ran Python $factor times as slowly as the reference machine (the median of" \
            "$(wc -l < "$speed_samples") samples, $(python3 "$ci_dir/machine_speed.py" median "$speed_samples") s;" \
            ".ci/machine_speed.py)"
        rm -f "$speed_samples"
    fi
    echo "[ci] durations:"
    for line in "${durations[@]}"; do echo "[ci]   $line"; done
    echo "[ci] total: $total s (budget $TOTAL_BUDGET_S s)"
    if ((total > TOTAL_BUDGET_S)); then over_budget+=("the whole run took $total s, over its budget of $TOTAL_BUDGET_S s"); fi
    for line in "${over_budget[@]}"; do echo "[ci] OVER BUDGET: $line" >&2; done
    if ((status == 0 && ${#over_budget[@]} > 0)); then exit 1; fi
}
trap summary EXIT
