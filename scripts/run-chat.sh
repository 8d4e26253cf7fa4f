#!/usr/bin/env bash
# The chat-room example: a local cluster of chat node processes on 127.0.0.1 (TLS with throwaway
# certificates, SQLite journal and lease file in ./chat-data), each serving the chat page on its
# cluster port + 1000. Prints the URLs; Ctrl-C stops it. Options: --nodes 5, --base-port 27520,
# --dir chat-data, --log-level WARNING (see examples/chat/README.md).
source "$(dirname "$0")/_venv.sh"
exec python -m examples.chat.cluster "$@"
