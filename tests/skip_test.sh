#!/usr/bin/env bash
# tests/skip.sh's rule, each case in a child shell: a test that cannot run skips (77) outside CI; under CI=true it
# skips only when named in RLLOOP_SKIP_TESTS or tests/skip_list.txt, and fails (1) otherwise; under `set -euo
# pipefail`, as the test scripts that source it run.
set -uo pipefail
skip_sh="$(cd "$(dirname "$0")" && pwd)/skip.sh"
failures=0
expect() {
  local want=$1 name=$2
  shift 2
  local got
  env -u CI -u RLLOOP_SKIP_TESTS "$@" bash -euo pipefail -c "source '$skip_sh'; rlloop_skip $name 'no rights here'" >/dev/null 2>&1
  got=$?
  if [[ $got != "$want" ]]; then
    echo "FAIL: rlloop_skip $name with $* exited $got, expected $want"
    failures=$((failures + 1))
  fi
}
expect 77 some_test
expect 77 some_test CI=false
expect 1 some_test CI=true
expect 1 some_test CI=true RLLOOP_SKIP_TESTS=other_test,some_test_2
expect 77 some_test CI=true RLLOOP_SKIP_TESTS=other_test,some_test
expect 77 some_test CI=true "RLLOOP_SKIP_TESTS=other_test some_test"
# Every name on the checked-in list is a ctest name followed by why.
while read -r name reason; do
  [[ -z $name || $name == \#* ]] && continue
  expect 77 "$name" CI=true
  [[ -n $reason ]] || { echo "FAIL: tests/skip_list.txt names $name without saying why"; failures=$((failures + 1)); }
done <"$(dirname "$skip_sh")/skip_list.txt"
[[ $failures == 0 ]] && echo "skip_test: the skip rule holds" || exit 1
