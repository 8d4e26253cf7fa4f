"""A chat-room cluster: rooms are sharded, event-sourced entities; every node serves a web page.

Run it with ``scripts/run-chat.sh`` (three node processes) and open one of the printed URLs.
See ``examples/chat/README.md`` for the design, in particular how a message reaches members
connected to other nodes.
"""
