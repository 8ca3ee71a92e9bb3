"""``python -m kvtier.engine.cli``: the ``kvtier`` command."""

import sys

from .main import main

sys.exit(main())
