"""The split brain resolver.

Its settings, the downing strategies, and the timing that decides when to act.
"""

from ._settings import SplitBrainResolverSettings as SplitBrainResolverSettings
