"""``python -m p2pshard``: the same as the ``p2pshard`` command."""

import sys

from ._cli import main

sys.exit(main())
