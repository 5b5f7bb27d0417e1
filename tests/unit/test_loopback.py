"""ci/loopback.sh: a fresh loopback-only network namespace, but never a nested one, so an S3
server and the jobs that use it (started under one wrapper) can reach each other."""

from __future__ import annotations

import os
import subprocess

from conftest import REPO

LOOPBACK = str(REPO / "ci" / "loopback.sh")


def test_nested_wrapper_shares_the_namespace():
    script = f"readlink /proc/self/ns/net; {LOOPBACK} readlink /proc/self/ns/net; " \
             f"{LOOPBACK} cat /proc/net/dev"  # fmt: skip
    out = subprocess.run([LOOPBACK, "sh", "-c", script], capture_output=True, text=True,
                         check=True).stdout.splitlines()  # fmt: skip
    outer, nested = out[0], out[1]
    assert outer.startswith("net:[") and nested == outer
    interfaces = [line.split(":")[0].strip() for line in out[4:]]
    assert interfaces == ["lo"]


def test_wrapper_from_a_full_namespace_makes_a_new_one():
    here = os.readlink("/proc/self/ns/net")
    inside = subprocess.run([LOOPBACK, "readlink", "/proc/self/ns/net"], capture_output=True,
                            text=True, check=True).stdout.strip()  # fmt: skip
    with open("/proc/net/dev") as f:
        only_lo_here = [line.split(":")[0].strip() for line in f.readlines()[2:]] == ["lo"]
    assert (inside == here) == only_lo_here
