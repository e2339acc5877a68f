"""``python -m mpidp``: see :mod:`mpidp.cli.main`."""

import sys

from .cli.main import main

sys.exit(main())
