# Sourced by the scripts that run on a leased GPU machine (tools/gpu/session.sh, those in results/reference/gpu/*/):
# $OUT (what comes back), $W (where the run writes as it goes), `elapsed`, unbuffered Python, and the wheels of
# missing packages in .whl/ installed into /tmp/site.
set -u
OUT=${OUT:-/tmp/gpu-out}
W=${WORK:-/tmp/gpu-work}/w
mkdir -p "$W"
START=$(date +%s)
elapsed() { echo $(( $(date +%s) - START )); }
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
