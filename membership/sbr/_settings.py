"""The split brain resolver's settings: the strategy and its parameters, and when to act.

See :mod:`membership.sbr._resolver` for how they are used.
"""

from __future__ import annotations

from typing import Any, Literal, TypeAlias

import attrs

from .._member import MemberStatus
from ..transport._errors import ConfigurationError
from ..transport._settings import in_range

S = MemberStatus

StrategyName: TypeAlias = Literal[
    "keep-majority", "static-quorum", "keep-oldest", "down-all", "lease-majority"
]
STRATEGY_NAMES: tuple[StrategyName, ...] = (
    "keep-majority",
    "static-quorum",
    "keep-oldest",
    "down-all",
    "lease-majority",
)
"""Values of :attr:`SplitBrainResolverSettings.active_strategy`."""

MIN_DOWN_ALL_WHEN_UNSTABLE = 4.0
"""Lower bound of the derived ``down_all_when_unstable`` (Akka: 4 s)."""

_MAX_SECONDS = 7 * 24 * 3600.0


# --- settings -------------------------------------------------------------------------------


def _invalid(attribute: attrs.Attribute[Any], value: object, allowed: str) -> ConfigurationError:
    return ConfigurationError(
        f"SplitBrainResolverSettings.{attribute.name} = {value!r} is invalid: must be {allowed}"
    )


def _check_strategy(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if value not in STRATEGY_NAMES:
        raise _invalid(attribute, value, "one of " + ", ".join(map(repr, STRATEGY_NAMES)))


def _check_down_all_when_unstable(
    instance: object, attribute: attrs.Attribute[Any], value: object
) -> None:
    if value in ("on", "off"):
        return
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not 0 < value <= _MAX_SECONDS
    ):
        raise _invalid(attribute, value, f"'on', 'off' or seconds above 0 (up to {_MAX_SECONDS:g})")


def _check_optional_name(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if value is None:
        return
    if not isinstance(value, str) or not value.strip() or value != value.strip():
        raise _invalid(attribute, value, "None or a non-empty name without surrounding spaces")


def _check_quorum_size(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise _invalid(attribute, value, "None or an integer of at least 1")


def _check_bool(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, bool):
        raise _invalid(attribute, value, "True or False")


@attrs.frozen(kw_only=True)
class SplitBrainResolverSettings:
    """How the split brain resolver decides (Akka's ``split-brain-resolver`` section).

    Use the same settings on every node: each side of a partition decides on its own and the
    sides only agree if they apply the same rule.

    Example:
        >>> settings = SplitBrainResolverSettings(active_strategy="static-quorum", quorum_size=3)
        >>> settings.down_all_when_unstable_after  # "on": 3/4 of stable_after, at least 4 s
        15.0
    """

    active_strategy: StrategyName = attrs.field(default="keep-majority", validator=_check_strategy)
    """Which strategy decides (default ``"keep-majority"``): ``"keep-majority"``,
    ``"static-quorum"``, ``"keep-oldest"``, ``"down-all"`` or ``"lease-majority"``."""

    stable_after: float = attrs.field(default=20.0, validator=in_range(0.0, _MAX_SECONDS))
    """Seconds without membership or reachability changes before a decision (default 20, Akka's).
    Shorter removes crashed nodes sooner but may act on a partition that would have healed; keep it
    above the time gossip needs to reach everyone (Akka suggests 7 s for 5 nodes, 10 s for 10, 13 s
    for 20, 17 s for 50, 20 s for 100, 30 s for 1000). It is also the margin before a downed
    side's singletons and shards are started elsewhere."""

    down_all_when_unstable: Literal["on", "off"] | float = attrs.field(
        default="on", validator=_check_down_all_when_unstable
    )
    """Down all members if reachability keeps changing for this many seconds beyond
    ``stable_after``, counted from the first change (default ``"on"``: ``stable_after * 3/4`` but
    at least 4 s; ``"off"`` disables it). See :attr:`down_all_when_unstable_after`."""

    role: str | None = attrs.field(default=None, validator=_check_optional_name)
    """Count only members with this role (default None: all members). Used by keep-majority,
    static-quorum, keep-oldest and lease-majority; down-all ignores it. Members without the role are
    still downed with their side."""

    quorum_size: int | None = attrs.field(default=None, validator=_check_quorum_size)
    """static-quorum: the least number of (role) members a side needs to survive. Required, and at
    least 1, when that strategy is active (default None). Never run more than
    ``quorum_size * 2 - 1`` such members: then a decision downs everyone."""

    down_if_alone: bool = attrs.field(default=True, validator=_check_bool)
    """keep-oldest: if the oldest member is cut off from all others (and there are at least two of
    them) down the oldest and keep the rest (default True)."""

    acquire_lease_delay_for_minority: float = attrs.field(
        default=2.0, validator=in_range(0.0, 3600.0)
    )
    """lease-majority: seconds the minority side waits before trying to take the lease, so the
    majority side usually gets it (default 2)."""

    lease_release_after: float = attrs.field(default=40.0, validator=in_range(0.0, _MAX_SECONDS))
    """lease-majority: seconds to keep holding the lease after the members downed by the decision
    have been removed (default 40, Akka's ``release-after``)."""

    lease_name: str | None = attrs.field(default=None, validator=_check_optional_name)
    """lease-majority: name of the lease (default None: ``"<cluster>-p2pshard-sbr"``, see
    :meth:`lease_name_for`)."""

    def __attrs_post_init__(self) -> None:
        if self.active_strategy == "static-quorum" and self.quorum_size is None:
            raise ConfigurationError(
                "SplitBrainResolverSettings.quorum_size = None is invalid: must be an integer of "
                "at least 1 when active_strategy is 'static-quorum'"
            )

    @property
    def down_all_when_unstable_after(self) -> float | None:
        """Seconds of instability beyond ``stable_after`` before downing all, None when off."""
        value = self.down_all_when_unstable
        if value == "off":
            return None
        if value == "on":
            return max(MIN_DOWN_ALL_WHEN_UNSTABLE, self.stable_after * 3 / 4)
        return float(value)

    def lease_name_for(self, cluster: str) -> str:
        """The lease name lease-majority uses in ``cluster``."""
        return self.lease_name if self.lease_name is not None else f"{cluster}-p2pshard-sbr"
