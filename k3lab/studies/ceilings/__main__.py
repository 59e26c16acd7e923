"""`python -m k3lab.studies.ceilings`: the ceilings probe's command (k3lab.studies.ceilings.measure.main)."""

from .measure import main

if __name__ == "__main__":
    raise SystemExit(main())
