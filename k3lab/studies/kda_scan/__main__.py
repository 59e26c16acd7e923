"""`python -m k3lab.studies.kda_scan`: the study's grid run (k3lab.studies.kda_scan.main)."""

from k3lab.studies.kda_scan import main

raise SystemExit(main())
