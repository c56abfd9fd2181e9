import sys

from piwf.cli import main

sys.exit(main())
