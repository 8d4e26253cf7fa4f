"""What ``p2pshard`` uses of crdt's inner workings.

Not a public API: these names may change in any release. They are gathered here so that the
higher package never imports a private module of this one.
"""

from ._store import SCHEMA_VERSION as SCHEMA_VERSION
