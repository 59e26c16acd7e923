"""`python -m k3lab.studies.serving grid --json F`: the step-time grid (k3lab.studies.serving.measure)."""

from k3lab.studies.serving.measure import main

raise SystemExit(main())
