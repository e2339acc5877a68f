"""``python -m mpidp``: see :mod:`mpidp.cli`."""

import sys

from .cli import main

sys.exit(main())
