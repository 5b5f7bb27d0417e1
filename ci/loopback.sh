#!/bin/sh
# Run a command in a fresh network namespace whose only interface is loopback.
#
# Ray 2.60 binds the machine's routable address even when told 127.0.0.1; with no other
# interface up it falls back to 127.0.0.1, so nothing a test starts is reachable from (or
# sends to) anything but this machine. The Makefile uses this when LOOPBACK_ONLY=1.
# Package installs must run outside: the namespace has no route to the registries.
set -eu
if [ "$#" -eq 0 ]; then
  echo "usage: ci/loopback.sh COMMAND [ARGS...]" >&2
  exit 2
fi
export GLOO_SOCKET_IFNAME=lo
exec unshare --net sh -c 'ip link set lo up && exec "$@"' loopback "$@"
