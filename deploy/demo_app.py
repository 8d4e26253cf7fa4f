"""A small application for the deployment files: ``p2pshard node --app demo_app:setup``.

It starts one entity type, ``Counter`` (each entity counts the messages it got and answers the
count), with shard leases from the node's ``[lease]`` table. Replace it with your own
application's module: any ``async def setup(node)`` that starts its entity types and
singletons will do (see the Operations page of the documentation).
"""

from __future__ import annotations

from p2pshard import EntityContext, HashExtractor, Node, ShardingSettings


class Counter:
    """Counts the messages it receives; an ask answers the count so far."""

    def __init__(self, ctx: EntityContext) -> None:
        self.count = 0

    async def receive(self, msg: object, ctx: EntityContext) -> object:
        """Count ``msg`` and answer the count."""
        self.count += 1
        return self.count


async def setup(node: Node) -> None:
    """Start the ``Counter`` entity type on ``node``, its shards held under leases."""
    await node.sharding.start(
        "Counter",
        Counter,
        extractor=HashExtractor(30),
        settings=ShardingSettings(use_lease=True),
    )
