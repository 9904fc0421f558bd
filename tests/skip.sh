# Sourced by test scripts (bash): rlloop_skip NAME REASON ends the script for a test that cannot run here. Outside
# CI it is skipped (exit 77, ctest's SKIP_RETURN_CODE); under CI=true only when NAME is on the explicit skip list
# (tests/skip_list.txt, or RLLOOP_SKIP_TESTS: names separated by spaces or commas), and a failure (exit 1)
# otherwise, so that a check CI cannot run is a decision someone wrote down, not a silent skip.
rlloop_skip() {
  local name=$1 reason=$2
  local list="${BASH_SOURCE[0]%/*}/skip_list.txt"
  if [[ ${CI:-} != true ]]; then
    echo "SKIP $name: $reason"
    exit 77
  fi
  local listed="" entry requested
  requested=${RLLOOP_SKIP_TESTS:-}
  for entry in ${requested//,/ }; do
    if [[ $entry == "$name" ]]; then listed="RLLOOP_SKIP_TESTS"; fi
  done
  if [[ -z $listed && -f $list ]] && grep -v '^#' "$list" | awk '{print $1}' | grep -qx -- "$name"; then
    listed=$list
  fi
  if [[ -n $listed ]]; then
    echo "SKIP $name (CI=true, on the skip list: $listed): $reason"
    exit 77
  fi
  echo "FAIL $name: $reason; under CI=true a test skips only when it is on the skip list (tests/skip_list.txt or" \
       "RLLOOP_SKIP_TESTS='$name')" >&2
  exit 1
}
