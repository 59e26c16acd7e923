"""`python -m k3lab.studies.serving_run --json F [--form quick|full|brief|capacity] [--cases ...]
[--save-dir D] [--budget-s S]`: the serving runs (k3lab.studies.serving_run.measure.main)."""

from k3lab.studies.serving_run.measure import main

raise SystemExit(main())
