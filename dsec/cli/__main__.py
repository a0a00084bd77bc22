"""`python -m dsec.cli ...`: how dsec starts its own parts (dsec.processes.dsec_argv)."""

import sys

from dsec.cli import main

sys.exit(main())
