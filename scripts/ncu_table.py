"""Print an ncu `--csv --page details` export as one line per metric: section, name, value.
   python3 scripts/ncu_table.py ncu.csv"""

import csv
import sys

rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 10]
if rows:
    head = rows[0]
    i_n, i_v, i_s = head.index("Metric Name"), head.index("Metric Value"), head.index("Section Name")
    for r in rows[1:]:
        print(f"{r[i_s][:24]:24s} {r[i_n][:52]:52s} {r[i_v]}")
