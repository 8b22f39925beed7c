"""``python -m gpuwatchd`` runs the command line."""

import sys

from gpuwatchd.cli import main

sys.exit(main())
