"""``python -m piwf.chaos``: see ``piwf.chaos.harness``."""

import sys

from piwf.chaos.harness import main

sys.exit(main())
