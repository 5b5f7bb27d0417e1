#!/bin/sh
# Run a command in a network namespace whose only interface is loopback.
#
# Ray 2.60 binds the machine's routable address even when told 127.0.0.1; with no other
# interface up it falls back to 127.0.0.1, so nothing a test starts is reachable from (or
# sends to) anything but this machine. The Makefile uses this when LOOPBACK_ONLY=1.
# Package installs must run outside: the namespace has no route to the registries.
#
# Already inside such a namespace (only `lo`), the command runs right here instead of in a
# new one: every `unshare -n` is a separate network, so an S3 server started by `make s3-up`
# and the jobs that use it are only reachable from each other under one wrapper.
set -eu
if [ "$#" -eq 0 ]; then
  echo "usage: ci/loopback.sh COMMAND [ARGS...]" >&2
  exit 2
fi
export GLOO_SOCKET_IFNAME=lo
# /proc/net/dev lists this process's namespace (/sys/class/net would show the host's).
interfaces=$(tail -n +3 /proc/net/dev | cut -d: -f1 | tr -d ' ' | sort | tr '\n' ' ')
if [ "$interfaces" = "lo " ]; then
  ip link set lo up 2>/dev/null || true
  exec "$@"
fi
exec unshare --net sh -c 'ip link set lo up && exec "$@"' loopback "$@"
