#!/usr/bin/env bash
# Data parallelism across two hosts: rank 0 (the equivalence tests of engine_data_parallel_test) in one network
# namespace, rank 1 (`rlloop worker`) in another, joined by a veth pair, so the ranks reach each other only over
# a network link, as on two machines. Creates and removes the namespaces. Without the rights it skips (exit 77)
# outside CI; under CI=true it skips only when it is on the skip list (tests/skip.sh), and fails otherwise.
# Usage: two_hosts_test.sh RLLOOP_BIN DATA_PARALLEL_TEST_BIN
set -euo pipefail
source "$(dirname "$0")/../skip.sh"
rlloop=$1 test_bin=$2
ns0="rlloop-dp0-$$" ns1="rlloop-dp1-$$"
addr0=10.213.77.1 addr1=10.213.77.2 port=29517

if ! command -v ip >/dev/null || ! ip netns add "$ns0" 2>/dev/null; then
  rlloop_skip engine_data_parallel_two_hosts_test \
    "creating a network namespace needs iproute2 and CAP_NET_ADMIN (run as root, not in an unprivileged container)"
fi
worker_loop=""
cleanup() {
  [[ -n $worker_loop ]] && kill "$worker_loop" 2>/dev/null || true
  ip netns pids "$ns1" 2>/dev/null | xargs -r kill -9 2>/dev/null || true
  ip netns del "$ns0" 2>/dev/null || true
  ip netns del "$ns1" 2>/dev/null || true
}
trap cleanup EXIT
ip netns add "$ns1"
ip link add "veth-$$a" type veth peer name "veth-$$b"
ip link set "veth-$$a" netns "$ns0"
ip link set "veth-$$b" netns "$ns1"
ip -n "$ns0" addr add "$addr0/24" dev "veth-$$a"
ip -n "$ns1" addr add "$addr1/24" dev "veth-$$b"
for ns in "$ns0" "$ns1"; do ip -n "$ns" link set lo up; done
ip -n "$ns0" link set "veth-$$a" up
ip -n "$ns1" link set "veth-$$b" up

# Every two-rank service of the tests forms a new group: rank 1 joins each in turn. `extra` are the worker's own
# flags (the expert-parallel tests' rank 1 needs --expert-parallel, which the rendezvous checks).
run_with_worker() {
  local extra=$1 filter=$2
  ip netns exec "$ns1" bash -c "while true; do '$rlloop' worker --rendezvous $addr0:$port --rank 1 --world-size 2 \
    --threads 1 --device cpu --timeout-s 120 $extra 2>>/dev/null || sleep 0.5; done" &
  worker_loop=$!
  RLLOOP_DP_TEST_RENDEZVOUS="$addr0:$port" ip netns exec "$ns0" "$test_bin" --gtest_filter="$filter"
  kill "$worker_loop" 2>/dev/null || true
  ip netns pids "$ns1" 2>/dev/null | xargs -r kill -9 2>/dev/null || true
  worker_loop=""
}
run_with_worker "" 'DataParallel.*EqualsOneRank:-DataParallel.ExpertParallel*:DataParallel.FullySharded*'
run_with_worker "--shard full" 'DataParallel.FullySharded*EqualsOneRank'
run_with_worker --expert-parallel 'DataParallel.ExpertParallel*EqualsOneRank:-*ActivationCheckpointing*'
run_with_worker "--expert-parallel --activation-checkpointing" 'DataParallel.ExpertParallel*ActivationCheckpointing*'
