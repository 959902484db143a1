"""``python -m lazyckpt.cli``: the ``lazyckpt`` command."""

import sys

from ._main import main

sys.exit(main())
