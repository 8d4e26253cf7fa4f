"""The two builds of a real-process rolling upgrade: this source tree, and a next one made from it.

``p2pshard chaos --real --rolling`` (:func:`~p2pshard.testing.run_real_chaos` with a
:class:`Rollout`) replaces the node processes of a running cluster one at a time by processes of
another build, and rolls one back. Until a tagged release that negotiates wire protocol versions
exists, the previous release is this source tree and the next one is this source tree with
``tests/rolling/next_build.patch`` applied (:func:`make_next_build`). The patch is what a next
release typically does to the wire:

- it adds a trailing field with a default (``Heartbeat.sender_protocol``) to the message that
  flows between every two nodes all the time, so the previous build reads heartbeats with a
  field it does not know;
- it adds a message type (``p2pshard.Greeting``, ``@message(since=2)``), sent with every
  heartbeat to every receiver; the transport sends it only over links whose agreed protocol
  version is 2 or later, so only between two nodes of the next build, and holds it back from
  the others (``not_sent_protocol`` in the sender's stats); each node counts those it receives
  (``greetings``);
- it speaks protocol versions 1 to 2 (``CURRENT_PROTOCOL = ProtocolRange(1, 2)``).

The ``app_version`` comes from each node's TOML file: ``1.0.0`` on the previous build, ``1.1.0``
on the next.

A build is a source root put first on the node processes' ``PYTHONPATH`` (the project's own
install is a path entry, which ``PYTHONPATH`` precedes; the dependencies are the same). The
next build is a copy of the packages ``membership``, ``crdt`` and ``p2pshard`` of the tree this
module is imported from, uncommitted changes included, with the patch applied by ``git apply``
(outside any repository: nothing but the copy is touched).

When the patch no longer applies (the code it changes moved on), remake it on a clean checkout::

    git apply --3way tests/rolling/next_build.patch   # then resolve what conflicts, if any
    git diff -- membership crdt p2pshard > /tmp/next_build.patch
    git checkout -- membership crdt p2pshard
    mv /tmp/next_build.patch tests/rolling/next_build.patch

(or make the edits listed above again by hand and take ``git diff`` of them the same way).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import attrs

from membership import ConfigurationError
from membership.internal import CURRENT_PROTOCOL

SOURCE_ROOT = Path(__file__).resolve().parents[2]
"""The source tree this p2pshard is imported from (the directory holding ``p2pshard/``)."""

NEXT_BUILD_PATCH = SOURCE_ROOT / "tests" / "rolling" / "next_build.patch"
"""The patch that makes the next build (see the module docstring)."""

PACKAGES = ("membership", "crdt", "p2pshard")
"""The packages a build holds."""

PREVIOUS_APP_VERSION = "1.0.0"
NEXT_APP_VERSION = "1.1.0"

REGENERATE = (
    "remake it on a clean checkout: `git apply --3way tests/rolling/next_build.patch`, resolve "
    "the conflicts, `git diff -- membership crdt p2pshard > /tmp/next_build.patch`, "
    "`git checkout -- membership crdt p2pshard`, and move /tmp/next_build.patch to "
    "tests/rolling/next_build.patch (see p2pshard/testing/_rolling.py and docs/testing.md)"
)


class PatchDoesNotApply(ConfigurationError):
    """The next build's patch does not apply to this source tree any more.

    The message says how to remake it.
    """


@attrs.frozen
class Build:
    """One build of the node processes of a rolling upgrade.

    Example:
        >>> Build("previous", SOURCE_ROOT, "1.0.0", protocol=1).greets
        False
    """

    name: str
    """What the progress lines and the report call it."""
    root: Path
    """The source root put first on ``PYTHONPATH`` (holds ``membership``, ``crdt``,
    ``p2pshard``)."""
    app_version: str
    """The ``app_version`` its nodes' configurations give."""
    protocol: int
    """The newest wire protocol version it speaks: two builds' nodes must agree on the lower."""
    greets: bool = False
    """Its nodes send each other the next build's ``Greeting`` (and report ``greetings``)."""


@attrs.frozen
class Rollout:
    """A rolling upgrade: every node from ``previous`` to ``next``, then one back."""

    previous: Build
    next: Build


def previous_build() -> Build:
    """This source tree, as the previous release (``app_version`` 1.0.0)."""
    return Build("previous", SOURCE_ROOT, PREVIOUS_APP_VERSION, protocol=CURRENT_PROTOCOL.high)


def make_next_build(
    dest: Path, *, patch: Path = NEXT_BUILD_PATCH, source: Path = SOURCE_ROOT
) -> Build:
    """Copy the packages of ``source`` to ``dest`` and apply ``patch`` there: the next build.

    Raises:
        PatchDoesNotApply: ``patch`` does not apply to the copy; the message says how to remake
            it.
        ConfigurationError: ``patch`` is missing (not a source checkout), ``dest`` is not new or
            empty, or git is not installed.
    """
    if not patch.is_file():
        raise ConfigurationError(
            f"the next build's patch {patch} is missing: a rolling run needs a source checkout "
            "of p2pshard (the patch lives in tests/rolling/)"
        )
    if dest.exists() and any(dest.iterdir()):
        raise ConfigurationError(f"{dest} is not an empty directory: give a new one")
    git = shutil.which("git")
    if git is None:
        raise ConfigurationError("making the next build needs git (to apply the patch)")
    dest.mkdir(parents=True, exist_ok=True)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for package in PACKAGES:
        shutil.copytree(source / package, dest / package, ignore=ignore)
    # Outside any repository: git must not find one above dest and apply there instead.
    env = {**os.environ, "GIT_CEILING_DIRECTORIES": str(dest.resolve().parent)}
    command = [git, "apply", "--whitespace=nowarn", str(patch.resolve())]
    check = subprocess.run(
        [*command[:2], "--check", *command[2:]],
        cwd=dest,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if check.returncode != 0:
        raise PatchDoesNotApply(
            f"the next build's patch {patch} does not apply to this source tree any more "
            f"({check.stderr.strip() or check.stdout.strip()}); {REGENERATE}"
        )
    subprocess.run(command, cwd=dest, env=env, capture_output=True, text=True, check=True)
    return Build("next", dest, NEXT_APP_VERSION, protocol=2, greets=True)


def default_rollout(work_dir: Path) -> Rollout:
    """This tree as the previous build and the patched copy, made in ``work_dir``, as the next."""
    return Rollout(previous_build(), make_next_build(work_dir))
