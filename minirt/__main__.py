"""``python -m minirt`` is the ``minirt`` command."""

import sys

from .cli import main

sys.exit(main())
