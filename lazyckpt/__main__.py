"""``python -m lazyckpt``: the ``lazyckpt`` command."""

import sys

from .cli import main

sys.exit(main())
