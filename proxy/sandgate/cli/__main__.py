"""`python -m sandgate.cli`: how workers, tests and the benchmark start the command."""

import sys

from sandgate.cli import main

sys.exit(main())
