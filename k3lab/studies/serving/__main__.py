"""`python -m k3lab.studies.serving grid --json F`: the step-time grid (k3lab.studies.serving.grid)."""

from k3lab.studies.serving.grid import main

raise SystemExit(main())
