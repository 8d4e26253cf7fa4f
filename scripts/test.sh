#!/usr/bin/env bash
# The whole test suite: lint, types, the docs site, tests (in three pytest-xdist workers). `scripts/test.sh --slow`
# adds soak and many-seed runs; any other arguments go to pytest (-n 0: one process). The etcd
# lease tests start their own etcd server and the PostgreSQL journal tests their own PostgreSQL,
# the chat example's browser test drives a headless Chromium, and the network-namespace tests (run
# as root) cut links with nftables and build their network with iproute2: when the binaries are
# missing they are installed first from Debian's packages etcd-server, postgresql, chromium (which
# brings a font through fontconfig), nftables and iproute2.
source "$(dirname "$0")/_venv.sh"

# Installs one of Debian's packages as root (or through sudo) for tests that run a real server,
# without leaving the package's own service running: a policy-rc.d that answers 101 ("action
# forbidden") keeps its postinst from starting it, and where systemd runs the unit is stopped
# and disabled too. The tests start their own servers on free ports, so one on the package's
# default port would not be used by them anyway.
#   install_debian_package PACKAGE SERVICE WHAT CHECK...
# installs PACKAGE unless the command CHECK... succeeds; SERVICE is its systemd unit (or "");
# WHAT names the tests that need it, for the messages.
install_debian_package() {
    local package="$1" service="$2" what="$3"
    shift 3
    if "$@" >/dev/null 2>&1; then
        return 0
    fi
    local as_root=()
    if [ "$(id -u)" -ne 0 ]; then
        if ! command -v sudo >/dev/null 2>&1; then
            echo "$package is not installed and this is neither root nor has sudo: the $what" \
                "tests will fail. Install it as root: apt-get install $package" >&2
            return 0
        fi
        as_root=(sudo)
    fi
    echo "$package is not installed: installing Debian's $package for the $what tests" >&2
    local policy=/usr/sbin/policy-rc.d ours=""
    if [ ! -e "$policy" ]; then
        "${as_root[@]}" sh -c "printf '#!/bin/sh\nexit 101\n' > $policy && chmod 755 $policy"
        ours=1
    fi
    local apt=("${as_root[@]}" env DEBIAN_FRONTEND=noninteractive RUNLEVEL=1
        apt-get install -y --no-install-recommends "$package")
    local status=0
    if ! "${apt[@]}"; then
        # A fresh image has no package lists; fetch them and try once more.
        "${as_root[@]}" apt-get update && "${apt[@]}" || status=$?
    fi
    if [ -n "$ours" ]; then
        "${as_root[@]}" rm -f "$policy"
    fi
    if [ -n "$service" ] && [ -d /run/systemd/system ] && command -v systemctl >/dev/null 2>&1; then
        "${as_root[@]}" systemctl disable --now "$service" >/dev/null 2>&1 || true
    fi
    if [ "$status" -ne 0 ]; then
        echo "could not install $package (apt-get failed): the $what tests will fail" >&2
    fi
}

has_etcd() {
    command -v etcd || [ -x /usr/bin/etcd ]
}

has_postgres() {
    compgen -G "/usr/lib/postgresql/*/bin/postgres"
}

has_chromium() {
    [ -x /usr/bin/chromium ]
}

has_nft() {
    command -v nft || [ -x /usr/sbin/nft ]
}

has_dnsmasq() {
    command -v dnsmasq || [ -x /usr/sbin/dnsmasq ]
}

has_ip() {
    command -v ip || [ -x /usr/sbin/ip ] || [ -x /sbin/ip ]
}

# Debian's postgresql creates a cluster "main" on port 5432; where something started it anyway
# (systemd without the unit we disabled, an older postinst), stop it: the tests run their own.
stop_debian_postgres_clusters() {
    command -v pg_lsclusters >/dev/null 2>&1 || return 0
    local as_root=()
    [ "$(id -u)" -eq 0 ] || as_root=(sudo)
    pg_lsclusters --no-header 2>/dev/null | while read -r version cluster _port status _rest; do
        if [ "$status" = online ]; then
            "${as_root[@]}" pg_ctlcluster "$version" "$cluster" stop >/dev/null 2>&1 || true
        fi
    done || true
}

install_debian_package etcd-server etcd.service "etcd lease" has_etcd
if ! has_postgres >/dev/null 2>&1; then
    install_debian_package postgresql postgresql.service "PostgreSQL journal" has_postgres
    stop_debian_postgres_clusters
fi
install_debian_package chromium "" "chat browser" has_chromium
# The network-namespace tier needs root; elsewhere its tests skip, and so nothing is installed.
if [ "$(id -u)" -eq 0 ]; then
    install_debian_package iproute2 "" "network-namespace" has_ip
    install_debian_package nftables nftables.service "network-namespace" has_nft
    # The binary alone (dnsmasq-base, no system service): the DNS bootstrap test's server.
    install_debian_package dnsmasq-base "" "DNS bootstrap" has_dnsmasq
fi
ruff check .
ruff format --check .
mypy
# Docs must build without a warning (broken link, page outside the nav; no --quiet, it hides them).
NO_MKDOCS_2_WARNING=1 mkdocs build --strict
# Three workers on CI's two cores: many tests spend their time waiting on real processes,
# sockets, servers and timeouts, and with two workers a core sat idle about a quarter of the run
# (the last run with two took 810 s of tests for about 1,200 s of CPU; with three, 2026-11-27,
# 619 s for 1,100 s). Pass -n 0 to run in one process, -n 2 for two workers.
# --durations=25 lists the slowest tests of every run, so that CI shows what eats its 15 minutes.
python -m pytest -n 3 --dist worksteal --durations=25 "$@"
