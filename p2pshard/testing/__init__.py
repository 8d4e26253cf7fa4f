"""Test your entity types the way p2pshard tests itself: whole clusters under seeded faults.

``p2pshard.testing`` runs a cluster of real nodes in one trio run, on a simulated network with a
mock clock, so a minute of cluster life under partitions, crashes and pauses takes about a second
and replays exactly from its seed. It records what happened (:class:`History`) and checks the
invariants a sharded application relies on:

- single activation: never two live incarnations of one entity at the same instant;
- every acknowledged message is in its entity's log exactly once, and each sender's messages
  are handled in the order sent;
- after the faults heal, every node agrees on membership and shard homes, every shard answers,
  and the replicas converge;
- at most one instance of a singleton at a time;
- after the faults heal, the running nodes form one cluster, not islands of the same name;
- a node that is not a member (the ``intruder`` fault) changes nothing by what it sends;
- after a rolling upgrade (``ChaosSettings.rollout``), every member record shows the node's
  app version and every link speaks the newest protocol version both nodes' builds share;
- with the chat-like fan-out workload, every member's copy of a room is a prefix of the room's
  log and holds every post the room acknowledged.
- with event-sourced entities on a group-committing memory journal
  (``ChaosSettings.event_sourced``), no append was accepted under a fencing token lower than
  one its stream had seen (:func:`check_journal_calls`), and the logs and copies checked above
  are what the journal stores.

Use :func:`run_chaos` (or ``p2pshard chaos``) for randomized schedules;
:func:`run_real_chaos` (or ``p2pshard chaos --real``) for one schedule against node processes on
127.0.0.1, killed, stopped and cut off for real, their histories merged for the same checkers;
or :func:`simulated_cluster` to write a scenario of your own:

Example:
    >>> import trio, trio.testing
    >>> from membership import deterministic_scheduling
    >>> from p2pshard.testing import History, check_history, simulated_cluster
    >>> async def scenario() -> None:
    ...     history = History()
    ...     async with simulated_cluster(seed=1, history=history) as sim:
    ...         for i in (1, 2, 3):
    ...             await sim.start(i)
    ...         await sim.all_up([1, 2, 3])
    ...         sim.partition(3, [1, 2])
    ...         await trio.sleep(30)
    ...     assert check_history(history) == []
    >>> with deterministic_scheduling(1):
    ...     trio.run(scenario, clock=trio.testing.MockClock(autojump_threshold=0))
    seed=1
"""

from ._chaos import CLASSIC_FAULTS as CLASSIC_FAULTS
from ._chaos import FAULTS as FAULTS
from ._chaos import NEXT_BUILD as NEXT_BUILD
from ._chaos import PREVIOUS_BUILD as PREVIOUS_BUILD
from ._chaos import REALISTIC as REALISTIC
from ._chaos import SEED_LAYOUTS as SEED_LAYOUTS
from ._chaos import WORKLOADS as WORKLOADS
from ._chaos import Build as Build
from ._chaos import ChaosHung as ChaosHung
from ._chaos import ChaosReport as ChaosReport
from ._chaos import ChaosSettings as ChaosSettings
from ._chaos import Rollout as Rollout
from ._chaos import RolloutReport as RolloutReport
from ._chaos import RolloutStep as RolloutStep
from ._chaos import Scenario as Scenario
from ._chaos import ScenarioBody as ScenarioBody
from ._chaos import draw_seed_nodes as draw_seed_nodes
from ._chaos import random_schedule as random_schedule
from ._chaos import rolling_upgrade as rolling_upgrade
from ._chaos import run_chaos as run_chaos
from ._chaos import run_scenario as run_scenario
from ._chaos import run_seeds as run_seeds
from ._chaos import summarize as summarize
from ._checkers import INVARIANTS as INVARIANTS
from ._checkers import Violation as Violation
from ._checkers import check_acknowledged_kept as check_acknowledged_kept
from ._checkers import check_agreement_views as check_agreement_views
from ._checkers import check_builds as check_builds
from ._checkers import check_convergence_digests as check_convergence_digests
from ._checkers import check_fan_out as check_fan_out
from ._checkers import check_history as check_history
from ._checkers import check_journal_calls as check_journal_calls
from ._checkers import check_no_fakes as check_no_fakes
from ._checkers import check_one_cluster as check_one_cluster
from ._checkers import check_sender_order as check_sender_order
from ._checkers import check_single_activation as check_single_activation
from ._checkers import check_single_singleton as check_single_singleton
from ._etcd import EtcdNotInstalled as EtcdNotInstalled
from ._etcd import EtcdServer as EtcdServer
from ._etcd import running_etcd as running_etcd
from ._etcd import start_etcd as start_etcd
from ._fanout import INBOX as INBOX
from ._fanout import ROOM as ROOM
from ._fanout import Deliver as Deliver
from ._fanout import inbox_entity as inbox_entity
from ._fanout import room_entity as room_entity
from ._fanout import room_members as room_members
from ._history import History as History
from ._history import Sent as Sent
from ._history import Span as Span
from ._journal_kit import JOURNAL_CHECKS as JOURNAL_CHECKS
from ._journal_kit import check_journal as check_journal
from ._lease_kit import KIT_LEASE_SETTINGS as KIT_LEASE_SETTINGS
from ._lease_kit import LEASE_CHECKS as LEASE_CHECKS
from ._lease_kit import CutOff as CutOff
from ._lease_kit import check_lease_backend as check_lease_backend
from ._merge import ProcessRun as ProcessRun
from ._merge import merge_histories as merge_histories
from ._ports import free_port as free_port
from ._ports import free_port_block as free_port_block
from ._postgres import PostgresNotInstalled as PostgresNotInstalled
from ._postgres import PostgresServer as PostgresServer
from ._postgres import running_postgres as running_postgres
from ._proxy import FaultProxy as FaultProxy
from ._real import REAL_FAULTS as REAL_FAULTS
from ._real import RealChaosReport as RealChaosReport
from ._real import RealChaosSettings as RealChaosSettings
from ._real import run_real_chaos as run_real_chaos
from ._real import summarize_real as summarize_real
from ._sim import BOUND as BOUND
from ._sim import SIM_LEASES as SIM_LEASES
from ._sim import SIM_LINKS as SIM_LINKS
from ._sim import SimCluster as SimCluster
from ._sim import SkewedClock as SkewedClock
from ._sim import node_address as node_address
from ._sim import node_name as node_name
from ._sim import simulated_cluster as simulated_cluster
from ._sim import simulated_cluster_of as simulated_cluster_of
from ._workload import COUNTER as COUNTER
from ._workload import Add as Add
from ._workload import CounterWorkload as CounterWorkload
from ._workload import Read as Read
from ._workload import Stall as Stall
from ._workload import counter_entity as counter_entity
from ._workload import singleton_probe as singleton_probe
