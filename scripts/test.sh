#!/usr/bin/env bash
# The whole test suite: lint, types, tests. `scripts/test.sh --slow` adds soak and many-seed runs;
# any other arguments go to pytest. The etcd lease tests start their own etcd server: when the
# `etcd` binary is missing it is installed first from Debian's package etcd-server.
source "$(dirname "$0")/_venv.sh"

# Installs etcd-server as root (or through sudo) without leaving its service running: a
# policy-rc.d that answers 101 ("action forbidden") keeps the package's postinst from starting
# it, and where systemd runs the unit is stopped and disabled too. The tests start their own etcd
# on free ports, so an etcd on port 2379 would not be used by them anyway.
install_etcd() {
    if command -v etcd >/dev/null 2>&1 || [ -x /usr/bin/etcd ]; then
        return 0
    fi
    local as_root=()
    if [ "$(id -u)" -ne 0 ]; then
        if ! command -v sudo >/dev/null 2>&1; then
            echo "etcd is not installed and this is neither root nor has sudo: the etcd lease" \
                "tests will fail. Install it as root: apt-get install etcd-server" >&2
            return 0
        fi
        as_root=(sudo)
    fi
    echo "etcd is not installed: installing Debian's etcd-server for the etcd lease tests" >&2
    local policy=/usr/sbin/policy-rc.d ours=""
    if [ ! -e "$policy" ]; then
        "${as_root[@]}" sh -c "printf '#!/bin/sh\nexit 101\n' > $policy && chmod 755 $policy"
        ours=1
    fi
    local apt=("${as_root[@]}" env DEBIAN_FRONTEND=noninteractive RUNLEVEL=1
        apt-get install -y --no-install-recommends etcd-server)
    local status=0
    if ! "${apt[@]}"; then
        # A fresh image has no package lists; fetch them and try once more.
        "${as_root[@]}" apt-get update && "${apt[@]}" || status=$?
    fi
    if [ -n "$ours" ]; then
        "${as_root[@]}" rm -f "$policy"
    fi
    if [ -d /run/systemd/system ] && command -v systemctl >/dev/null 2>&1; then
        "${as_root[@]}" systemctl disable --now etcd.service >/dev/null 2>&1 || true
    fi
    if [ "$status" -ne 0 ]; then
        echo "could not install etcd-server (apt-get failed): the etcd lease tests will fail" >&2
    fi
}

install_etcd
ruff check .
ruff format --check .
mypy
python -m pytest "$@"
