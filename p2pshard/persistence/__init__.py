"""Event-sourced entities and the journals they persist to.

The journal interface, the in-memory, SQLite and PostgreSQL backends, and the event-sourced
entity base.
"""

from ._event_sourced import EventSourcedEntity as EventSourcedEntity
from ._journal import BatchJournal as BatchJournal
from ._journal import Journal as Journal
from ._journal import JournalSettings as JournalSettings
from ._journal import Recovery as Recovery
from ._journal import SnapshotWrite as SnapshotWrite
from ._journal_stats import JournalStatistics as JournalStatistics
from ._journal_stats import journal_statistics as journal_statistics
from ._memory import AcceptedCall as AcceptedCall
from ._memory import MemoryJournal as MemoryJournal
from ._memory import MemoryJournalStatistics as MemoryJournalStatistics
from ._open import open_journal as open_journal
from ._sqlite import SqliteJournal as SqliteJournal
from ._threads import GroupCommitStatistics as GroupCommitStatistics
