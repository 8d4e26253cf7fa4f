#!/usr/bin/env bash
# The main job: a local cluster of separate node processes on 127.0.0.1 with throwaway
# certificates in a data directory. Ctrl-C stops it. Arguments go to `p2pshard local-cluster`
# (try --help): e.g. --nodes 5.
source "$(dirname "$0")/_venv.sh"
exec p2pshard local-cluster "$@"
