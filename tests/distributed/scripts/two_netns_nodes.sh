#!/bin/bash
# Two torchrun nodes in two network namespaces joined by a veth pair, nothing shared but the
# link: run as `unshare -rn bash two_netns_nodes.sh PYTHON SCRIPT ROOT [script args...]`.
# Node 0 runs in this namespace (10.9.0.1, va), node 1 in a nested one (10.9.0.2, vb); each
# node's logs go to ROOT/log<node>.txt; prints "rc <node0> <node1>".
set -e
PYTHON=$1; SCRIPT=$2; ROOT=$3; shift 3
TORCHRUN="$(dirname "$PYTHON")/torchrun"
ip link set lo up
unshare -n sleep 600 &
PEER=$!
sleep 0.3
ip link add va type veth peer name vb netns $PEER
ip addr add 10.9.0.1/24 dev va
ip link set va up
nsenter -t $PEER -n sh -c "ip link set lo up; ip addr add 10.9.0.2/24 dev vb; ip link set vb up"
COMMON="--nnodes=2 --nproc-per-node=1 --max-restarts=2 --rdzv-backend=c10d --rdzv-endpoint=10.9.0.1:29511"
export OMP_NUM_THREADS=1 TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
set +e
GLOO_SOCKET_IFNAME=va "$TORCHRUN" $COMMON --rdzv-conf=is_host=1 --local-addr=10.9.0.1 \
    "$SCRIPT" "$ROOT/run" "$ROOT/out.pt" "$@" > "$ROOT/log0.txt" 2>&1 &
NODE0=$!
nsenter -t $PEER -n env GLOO_SOCKET_IFNAME=vb "$TORCHRUN" $COMMON --rdzv-conf=is_host=0 \
    --local-addr=10.9.0.2 "$SCRIPT" "$ROOT/run" "$ROOT/out.pt" "$@" > "$ROOT/log1.txt" 2>&1 &
NODE1=$!
wait $NODE0; RC0=$?
wait $NODE1; RC1=$?
kill $PEER
echo "rc $RC0 $RC1"
