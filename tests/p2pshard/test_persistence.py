"""Event-sourced entities on the simulated cluster (mock clock), with a shared memory journal.

The entity type ``Room`` keeps its members as events. Its state must survive everything that
ends an incarnation (passivation, hand-off, a node crash, a journal failure), a snapshot must
cut recovery short, and a stale holder of the shard's lease must not be able to write once a
newer holder has recovered the room.
"""

from __future__ import annotations

import logging
import types
from collections.abc import Awaitable, Callable
from typing import Any, ClassVar, cast

import attrs
import msgpack
import pytest
import trio
import trio.testing

from membership import LinkConditions
from membership.transport._wire import decode_value, encode_value
from p2pshard import (
    AskTimeout,
    EntityContext,
    EventSourcedEntity,
    EventTooLarge,
    HashExtractor,
    Journal,
    JournalError,
    JournalFenced,
    MemoryJournal,
    MemoryLeaseBackend,
    Node,
    RemoteEntityError,
    SerializationError,
    ShardingSettings,
    journal_statistics,
    message,
)
from tests._support.sharding_sim import CounterSim, addr, sim_cluster

SHARDS = 10


@message(name="tests.persistence.Joined")
@attrs.frozen
class Joined:
    user: str


@message(name="tests.persistence.RoomState")
@attrs.frozen
class RoomState:
    members: tuple[str, ...] = ()


@message(name="tests.persistence.Join")
@attrs.frozen
class Join:
    user: str


@message(name="tests.persistence.JoinQuietly")
@attrs.frozen
class JoinQuietly:
    """Join, but the handler catches a journal error and answers as if nothing happened."""

    user: str


@message(name="tests.persistence.Members")
@attrs.frozen
class Members:
    pass


@message(name="tests.persistence.Leave")
@attrs.frozen
class Leave:
    pass


@message(name="tests.persistence.PersistBad")
@attrs.frozen
class PersistBad:
    """Persist an event that cannot be stored; the handler answers with the error."""

    kind: str  # "unserializable", "too-large" or "bad-apply"
    catch: bool = True


class NotRegistered:
    pass


@attrs.define
class Recovered:
    node: str
    entity_id: str
    replayed: int
    """Events ``apply_event`` saw before the first command: those after the snapshot."""
    seq: int
    token: int | None


@attrs.define
class Probe:
    """What every Room incarnation did."""

    created: list[tuple[str, str]] = attrs.field(factory=list)
    recovered: list[Recovered] = attrs.field(factory=list)

    def of(self, entity_id: str) -> list[Recovered]:
        return [r for r in self.recovered if r.entity_id == entity_id]


class Room(EventSourcedEntity[RoomState]):
    snapshot_every: ClassVar[int | None] = None

    def __init__(self, ctx: EntityContext, journal: Journal, node: str, probe: Probe) -> None:
        super().__init__(ctx, journal)
        self.node, self.probe = node, probe
        self.applied = 0
        self.first = True
        probe.created.append((node, ctx.entity_id))

    def empty_state(self) -> RoomState:
        return RoomState()

    def apply_event(self, state: RoomState, event: Any) -> RoomState:
        self.applied += 1
        match event:
            case Joined(user="boom"):
                raise ValueError("the event handler refuses 'boom'")
            case Joined(user=user):
                return RoomState((*state.members, user))
        raise TypeError(f"unknown event {event!r}")

    async def handle_command(self, command: Any, ctx: EntityContext) -> object:
        if self.first:
            self.first = False
            self.probe.recovered.append(
                Recovered(
                    self.node, ctx.entity_id, self.applied, self.last_sequence_nr, ctx.lease_token
                )
            )
        match command:
            case Join(user=user):
                await self.persist(Joined(user))
                return self.state.members
            case JoinQuietly(user=user):
                try:
                    await self.persist(Joined(user))
                except JournalError:
                    return "swallowed"
                return self.state.members
            case Members():
                return (self.node, ctx.lease_token, self.state.members)
            case Leave():
                ctx.passivate()
                return "leaving"
            case PersistBad(kind=kind, catch=catch):
                event: object = {
                    "unserializable": [NotRegistered()],
                    "too-large": Joined("x" * 1000),
                    "bad-apply": Joined("boom"),
                }[kind]
                if not catch:
                    await self.persist(event)
                try:
                    await self.persist(event)
                except (SerializationError, ValueError) as exc:
                    return f"{type(exc).__name__}: {exc}"
                return "persisted?"
        return None


class SnapshottingRoom(Room):
    snapshot_every = 5


def room_setup(
    journal: Journal,
    probe: Probe,
    *,
    room: type[Room] = Room,
    settings: ShardingSettings | None = None,
) -> Callable[[int, Node, CounterSim], Awaitable[None]]:
    async def setup(i: int, node: Node, sim: CounterSim) -> None:
        def factory(ctx: EntityContext) -> Room:
            return room(ctx, journal, f"n{i}", probe)

        sim.regions[i] = await node.sharding.start(
            "Room",
            factory,
            extractor=HashExtractor(SHARDS),
            settings=settings or ShardingSettings(entity_restart_backoff=1.0),
        )

    return setup


def stored(journal: MemoryJournal, entity_id: str) -> list[str]:
    events = [decode_value(data) for data in journal.events(f"Room|{entity_id}")]
    return [e.user for e in events if isinstance(e, Joined)]


async def test_state_survives_passivation_and_recovery_replays_the_events(
    autojump_clock: trio.testing.MockClock,
) -> None:
    journal, probe = MemoryJournal(), Probe()
    async with sim_cluster(1, room_setup(journal, probe)) as sim:
        await sim.start(1)
        await sim.all_up([1])
        ref = sim.regions[1].entity_ref("lobby")
        assert await ref.ask(Join("ann"), timeout=10) == ("ann",)
        assert await ref.ask(Join("bob"), timeout=10) == ("ann", "bob")
        assert await ref.ask(Leave(), timeout=10) == "leaving"
        assert await ref.ask(Join("carl"), timeout=10) == ("ann", "bob", "carl")
        first, second = probe.of("lobby")
        assert (first.replayed, first.seq) == (0, 0)
        assert (second.replayed, second.seq) == (2, 2)  # a new incarnation, recovered
        assert len(probe.created) == 2
        assert stored(journal, "lobby") == ["ann", "bob", "carl"]
        other = sim.regions[1].entity_ref("kitchen")  # one stream per entity
        assert await other.ask(Join("dan"), timeout=10) == ("dan",)
        assert stored(journal, "kitchen") == ["dan"]


async def test_a_snapshot_every_n_events_leaves_only_the_tail_to_replay(
    autojump_clock: trio.testing.MockClock,
) -> None:
    journal, probe = MemoryJournal(), Probe()
    async with sim_cluster(2, room_setup(journal, probe, room=SnapshottingRoom)) as sim:
        await sim.start(1)
        await sim.all_up([1])
        ref = sim.regions[1].entity_ref("lobby")
        users = [f"u{n}" for n in range(12)]
        for user in users:
            await ref.ask(Join(user), timeout=10)
        snapshot = journal.snapshot("Room|lobby")
        assert snapshot is not None
        assert snapshot[0] == 10  # at 5 and 10; 11 and 12 come after
        assert decode_value(snapshot[1]) == RoomState(tuple(users[:10]))
        await ref.ask(Leave(), timeout=10)
        assert await ref.ask(Members(), timeout=10) == ("n1", None, tuple(users))
        last = probe.of("lobby")[-1]
        assert (last.replayed, last.seq) == (2, 12)
        assert journal.statistics().snapshots == 2


async def test_a_journal_failure_fails_the_ask_and_the_next_message_recovers(
    autojump_clock: trio.testing.MockClock,
) -> None:
    journal, probe = MemoryJournal(), Probe()
    async with sim_cluster(3, room_setup(journal, probe)) as sim:
        await sim.start(1)
        await sim.all_up([1])
        ref = sim.regions[1].entity_ref("lobby")
        assert await ref.ask(Join("ann"), timeout=10) == ("ann",)

        journal.fail_next(1, reason="disk full")
        with pytest.raises(RemoteEntityError) as caught:
            await ref.ask(Join("bob"), timeout=10)
        assert caught.value.error_type == "p2pshard._errors.JournalError"
        assert "journal of 'Room|lobby': storage failed: disk full" in caught.value.error_text
        # The next message goes to a fresh incarnation (after the restart backoff), which
        # recovers from the journal: bob was never stored, nothing half-applied survives.
        assert await ref.ask(Members(), timeout=10) == ("n1", None, ("ann",))
        assert len(probe.of("lobby")) == 2

        # A handler that swallows the error does not save the incarnation or the ask.
        journal.fail_next(1)
        with pytest.raises(RemoteEntityError, match="JournalError"):
            await ref.ask(JoinQuietly("carl"), timeout=10)
        assert await ref.ask(Join("dora"), timeout=10) == ("ann", "dora")
        assert len(probe.of("lobby")) == 3

        # Another writer appends behind the entity's back: its next persist conflicts, and the
        # incarnation after it sees the other writer's event.
        await journal.append("Room|lobby", 3, [encode_value(Joined("eve"))], token=None)
        with pytest.raises(RemoteEntityError) as conflict:
            await ref.ask(Join("fred"), timeout=10)
        assert conflict.value.error_type == "p2pshard._errors.JournalConflict"
        assert await ref.ask(Join("fred"), timeout=10) == ("ann", "dora", "eve", "fred")
        assert stored(journal, "lobby") == ["ann", "dora", "eve", "fred"]
        # Counted by the entities: the test's own append behind their back is not.
        appends = journal_statistics(journal)
        assert appends.append_failures == {"fenced": 0, "conflict": 1, "error": 2}
        # ann, bob (failed), carl (failed), dora, fred (conflict), fred
        assert (appends.appends, appends.events, appends.append_seconds.count) == (6, 3, 3)


async def test_events_that_cannot_be_stored_write_nothing_and_the_incarnation_goes_on(
    autojump_clock: trio.testing.MockClock,
) -> None:
    journal, probe = MemoryJournal(max_event_size=200), Probe()
    async with sim_cluster(4, room_setup(journal, probe)) as sim:
        await sim.start(1)
        await sim.all_up([1])
        ref = sim.regions[1].entity_ref("lobby")
        await ref.ask(Join("ann"), timeout=10)
        answer = await ref.ask(PersistBad("unserializable"), timeout=10)
        assert isinstance(answer, str)
        assert answer.startswith("SerializationError: cannot encode a value of type builtins.list")
        assert "NotRegistered is not serializable" in answer
        answer = await ref.ask(PersistBad("too-large"), timeout=10)
        assert isinstance(answer, str)
        assert answer.startswith(f"{EventTooLarge.__name__}: event 2 of 'Room|lobby' encodes to")
        answer = await ref.ask(PersistBad("bad-apply"), timeout=10)
        assert answer == "ValueError: the event handler refuses 'boom'"
        assert await ref.ask(Join("bob"), timeout=10) == ("ann", "bob")
        assert stored(journal, "lobby") == ["ann", "bob"]
        assert len(probe.of("lobby")) == 1  # the same incarnation throughout
        # Not caught by the handler, the error fails the ask like any other exception.
        with pytest.raises(RemoteEntityError, match="NotRegistered is not serializable"):
            await ref.ask(PersistBad("unserializable", catch=False), timeout=10)
        assert await ref.ask(Members(), timeout=10) == ("n1", None, ("ann", "bob"))
        assert stored(journal, "lobby") == ["ann", "bob"]


async def test_state_survives_hand_off_and_a_crash_and_remembered_rooms_come_back(
    autojump_clock: trio.testing.MockClock,
) -> None:
    journal, probe = MemoryJournal(), Probe()
    settings = ShardingSettings(remember_entities=True, entity_restart_backoff=1.0)
    async with sim_cluster(5, room_setup(journal, probe, settings=settings)) as sim:
        await sim.start_up([1, 2, 3, 4])
        ref = sim.regions[4].entity_ref("lobby")
        for user in ("ann", "bob"):
            await ref.ask(Join(user), timeout=30)
        answer = await ref.ask(Members(), timeout=30)
        assert isinstance(answer, tuple)
        owner, _, members = answer
        assert members == ("ann", "bob")

        leaver = int(owner[1:])
        sender = next(i for i in (4, 3) if i != leaver)
        await sim.graceful_leave(leaver)  # hand-off: the room moves with its state
        ref = sim.regions[sender].entity_ref("lobby")
        assert await ref.ask(Join("carl"), timeout=60) == ("ann", "bob", "carl")
        answer = await ref.ask(Members(), timeout=30)
        assert isinstance(answer, tuple)
        moved = answer[0]
        assert moved != owner

        crashed = int(moved[1:])
        survivors = [i for i in (1, 2, 3, 4) if i not in (leaver, crashed)]
        created_before = len(probe.created)
        sim.crash(crashed)
        # remember_entities: the room is started again on a survivor without a message...
        with trio.fail_after(120):
            while not any(  # noqa: ASYNC110 - polls the probe on the mock clock
                node != moved and entity == "lobby"
                for node, entity in probe.created[created_before:]
            ):
                await trio.sleep(0.5)
        # ...and reads its journal with its first message.
        ref = sim.regions[survivors[-1]].entity_ref("lobby")
        answer = await ref.ask(Members(), timeout=60)
        assert isinstance(answer, tuple)
        assert answer[0] not in (owner, moved)
        assert answer[2] == ("ann", "bob", "carl")
        assert stored(journal, "lobby") == ["ann", "bob", "carl"]


async def test_a_stale_lease_holder_is_fenced_off_and_no_acknowledged_event_is_lost(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The owner of the room's shard is paused (its links and lease calls hang) while one of its
    appends is on its way to the journal. It loses the lease; another node takes the shard over
    with a larger token and recovers the room, which raises the fence. When the old append
    finally arrives it is refused; the new holder's writes all went through."""
    journal, probe, leases = MemoryJournal(), Probe(), MemoryLeaseBackend()
    settings = ShardingSettings(
        use_lease=True, lease_retry_interval=1.0, entity_restart_backoff=1.0
    )
    conditions = LinkConditions(delay_min=0.001, delay_max=0.005)
    setup = room_setup(journal, probe, settings=settings)
    async with sim_cluster(6, setup, conditions=conditions) as sim:
        sim.lease_backend = leases
        await sim.start_up([1, 2, 3])
        for user in ("ann", "bob"):
            await sim.regions[3].entity_ref("lobby").ask(Join(user), timeout=30)
        first = await sim.regions[3].entity_ref("lobby").ask(Members(), timeout=30)
        assert isinstance(first, tuple)
        owner_name, token, _ = first
        assert isinstance(owner_name, str)
        assert isinstance(token, int)
        owner = int(owner_name[1:])
        others = [i for i in (1, 2, 3) if i != owner]

        # The owner's next append travels slowly; then the owner stops answering anyone.
        journal.delay_token(token, 300.0)
        await sim.regions[owner].entity_ref("lobby").tell(Join("stale"))
        await trio.sleep(0.5)
        assert journal.statistics().in_flight == 1
        paused_at = trio.current_time()
        held = LinkConditions(delay_min=60.0, delay_max=60.0)
        for j in others:
            sim.net.set_link(addr(owner), addr(j), held)
            sim.net.set_link(addr(j), addr(owner), held)
        leases.pause(str(sim.nodes[owner].address), paused_at + 60.0)

        # The others down the owner and take the shard over with a larger token.
        ref = sim.regions[others[0]].entity_ref("lobby")
        with trio.fail_after(200):
            while True:
                try:
                    answer = await ref.ask(Members(), timeout=5)
                except AskTimeout:
                    continue
                assert isinstance(answer, tuple)
                if answer[0] != owner_name:
                    break
        new_owner, new_token, members = answer
        assert new_token > token
        assert members == ("ann", "bob")  # the stale append has not arrived
        assert journal.fence("Room|lobby") == new_token
        assert await ref.ask(Join("dora"), timeout=30) == ("ann", "bob", "dora")

        # The stale append arrives now, and is refused.
        await trio.sleep_until(paused_at + 301.0)
        assert stored(journal, "lobby") == ["ann", "bob", "dora"]
        statistics = journal.statistics()
        assert (statistics.fenced, statistics.in_flight) == (1, 0)
        # The entities' counts: four appends (ann, bob, stale, dora), three stored. The stale
        # one's writer was stopped with its lease before the refusal came: no entity saw it, so
        # it is neither a success nor a failure there (the journal's own count has it).
        appends = journal_statistics(journal)
        assert appends.append_failures == {"fenced": 0, "conflict": 0, "error": 0}
        assert (appends.appends, appends.events) == (4, 3)
        assert appends.append_seconds.count == 3
        assert await ref.ask(Members(), timeout=30) == (
            new_owner,
            new_token,
            ("ann", "bob", "dora"),
        )
        recovered = probe.of("lobby")
        # The old holder's incarnation, then the new holder's (passivated while idle and
        # recovered again for the last question): never the old token after the take-over.
        assert recovered[0].token == token
        assert {r.token for r in recovered[1:]} == {new_token}


async def test_a_stored_event_this_process_cannot_read_fails_recovery_naming_it(
    autojump_clock: trio.testing.MockClock,
) -> None:
    journal, probe = MemoryJournal(), Probe()
    # A registered object (extension 1) of a class no process here registered.
    gone = msgpack.ExtType(1, msgpack.packb(["tests.persistence.Gone", 1]))
    unknown = b"\x01" + msgpack.packb(gone)
    await journal.append("Room|attic", 1, [encode_value(Joined("ann"))], token=None)
    await journal.append("Room|attic", 2, [unknown], token=None)
    await journal.append("Room|cellar", 1, [b"\x07not our format"], token=None)
    async with sim_cluster(7, room_setup(journal, probe)) as sim:
        await sim.start(1)
        await sim.all_up([1])
        with pytest.raises(RemoteEntityError) as caught:
            await sim.regions[1].entity_ref("attic").ask(Members(), timeout=10)
        assert caught.value.error_type == "p2pshard._errors.JournalError"
        assert "journal of 'Room|attic': event 2 cannot be read" in caught.value.error_text
        with pytest.raises(RemoteEntityError, match="format version 7; this process reads 1"):
            await sim.regions[1].entity_ref("cellar").ask(Members(), timeout=10)
        assert probe.recovered == []  # no command ran on a half-read state


async def test_an_append_a_newer_lease_holder_fenced_off_is_counted_as_fenced() -> None:
    """A holder that is still running when the newer holder raises the fence (not stopped with
    its lease) gets JournalFenced for its next append: counted as a fenced append."""
    journal, probe = MemoryJournal(), Probe()
    ctx = cast(
        EntityContext,
        types.SimpleNamespace(
            type_name="Room",
            entity_id="lobby",
            lease_token=1,
            logger=logging.getLogger("test"),
            passivate=lambda: None,
        ),
    )
    room = Room(ctx, journal, "n1", probe)
    assert await room.receive(Join("ann"), ctx) == ("ann",)
    await journal.recover("Room|lobby", 2)  # a newer holder recovers the room
    with pytest.raises(JournalFenced):
        await room.receive(Join("bob"), ctx)
    appends = journal_statistics(journal)
    assert appends.append_failures == {"fenced": 1, "conflict": 0, "error": 0}
    assert (appends.appends, appends.events, appends.append_seconds.count) == (2, 1, 1)
    assert journal_statistics(MemoryJournal()).appends == 0  # counted per journal
