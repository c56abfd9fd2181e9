"""``python -m piwf.worker``: a run's (or a reconcile's) worker process; see ``piwf.worker.main``."""

import os
import sys

from piwf.worker.main import main

code = main()
sys.stdout.flush()
sys.stderr.flush()
os._exit(code)
