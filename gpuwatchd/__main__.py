"""``python -m gpuwatchd`` runs the command line."""

import sys

from gpuwatchd.cli.entry import main

sys.exit(main())
