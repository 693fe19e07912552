"""``python -m hotweights``: the console script."""

import sys

from hotweights.cli import main

sys.exit(main())
