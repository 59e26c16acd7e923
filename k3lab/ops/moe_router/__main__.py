"""`python -m k3lab.ops.moe_router bench ...`: see k3lab.ops.moe_router.bench."""

import sys

from k3lab.ops.moe_router.bench import main

sys.exit(main())
