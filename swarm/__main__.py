"""`python -m swarm ...` is the `swarm` command."""

import sys

from swarm.cli import main

sys.exit(main())
