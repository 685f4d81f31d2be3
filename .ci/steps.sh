# CI's steps, sourced by .ci/run: `step NAME BUDGET_S COMMAND...` runs COMMAND and prints its duration against its
# budget; at exit every step's duration and the total are printed again, and a run whose steps all passed fails
# (exit 1) when a step, or the whole run, took longer than its budget. CI_TOTAL_BUDGET_S sets the whole run's budget.
ci_started=$SECONDS
TOTAL_BUDGET_S=${CI_TOTAL_BUDGET_S:-2700}  # 45 minutes, the limit this project holds CI to (CI itself stops at 90)
durations=()
over_budget=()
step() {  # step NAME BUDGET_S COMMAND...: runs COMMAND and prints how long it took against its budget; the run stops
    # at the first failing step, and fails at the end when a step took longer than its budget
    local name=$1 budget=$2 started=$SECONDS
    shift 2
    echo "[ci] $name (budget $budget s) ..."
    "$@"
    local took=$((SECONDS - started))
    durations+=("$name: $took s (budget $budget s)")
    echo "[ci] $name: $took s (budget $budget s)"
    if ((took > budget)); then over_budget+=("$name took $took s, over its budget of $budget s"); fi
}
summary() {
    local status=$? total=$((SECONDS - ci_started))
    echo "[ci] durations:"
    for line in "${durations[@]}"; do echo "[ci]   $line"; done
    echo "[ci] total: $total s (budget $TOTAL_BUDGET_S s)"
    if ((total > TOTAL_BUDGET_S)); then over_budget+=("the whole run took $total s, over its budget of $TOTAL_BUDGET_S s"); fi
    for line in "${over_budget[@]}"; do echo "[ci] OVER BUDGET: $line" >&2; done
    if ((status == 0 && ${#over_budget[@]} > 0)); then exit 1; fi
}
trap summary EXIT
