"""``python -m p2pshard``: the same as the ``p2pshard`` command."""

import sys

from .cli._main import main

sys.exit(main())
