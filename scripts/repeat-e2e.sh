#!/usr/bin/env bash
# The e2e tests run back to back, ROUNDS times each, and the resume test RESUME_ROUNDS times in
# all: one line per run (round, test, outcome, seconds) in $LOG. A flaky test shows as a failed
# line; nothing is retried.
set -u
cd "$(dirname "$0")/.."
ROUNDS=${ROUNDS:-3} RESUME_ROUNDS=${RESUME_ROUNDS:-10} LOG=${LOG:-repeat-e2e.log}
RESUME="tests/e2e/test_resume.py::test_a_run_killed_outright_resumes_learns_like_a_clean_one_and_keeps_tracking"
mapfile -t TESTS < <(.venv/bin/python -m pytest --collect-only -q tests/e2e | grep '::')
one() {  # round, test id
    local start=$SECONDS outcome=passed
    .venv/bin/python -m pytest -q -p no:cacheprovider "$2" >"$LOG.last" 2>&1 || { outcome=FAILED; cp "$LOG.last" "$LOG.fail.$1.$(basename "${2%%::*}" .py)"; }
    echo "$1 $2 $outcome $((SECONDS - start))" | tee -a "$LOG"
}
for round in $(seq "$ROUNDS"); do
    for t in "${TESTS[@]}"; do one "$round" "$t"; done
done
for round in $(seq $((ROUNDS + 1)) "$RESUME_ROUNDS"); do one "$round" "$RESUME"; done
echo "failed: $(grep -c FAILED "$LOG") of $(wc -l <"$LOG") runs"
