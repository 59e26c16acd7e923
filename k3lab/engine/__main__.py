"""`python -m k3lab.engine bench ...`: see k3lab.engine.bench."""

import sys

from k3lab.engine.bench import main

sys.exit(main())
