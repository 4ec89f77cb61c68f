"""`python -m ascendserve serve ...`: the `ascendserve` command."""

import sys

from ascendserve.cli.main import main

sys.exit(main())
