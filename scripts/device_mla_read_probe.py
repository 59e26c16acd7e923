"""Issue 5, one device call: the read floor of the MLA decode's cache bytes, measured the way the decode
is (the mla_padding study's inputs and rotation, graph replay, many calls per graph), beside the decode.

Readers (scripts/mla_read_probe.cu via scripts/mla_probe_readers.py): `ldg` streams the contiguous cache
with 16-byte loads; `ring.*` is the decode's own data path without arithmetic (bulk copies into a 5-tile
ring, one block per SM, through the block table); `+tail` adds an empty PDL kernel after the reader,
as the merge follows the decode's split kernel. Prints a table (us and share of the measured copy
bandwidth, k3lab.env.PEAKS) and writes $OUT/read_probe.json.
    OUT=dir PYTHONPATH=. python3 scripts/device_mla_read_probe.py
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import mla_probe_readers as pr  # noqa: E402 - a sibling script module

from k3lab.studies import mla_padding as st  # noqa: E402

out = os.environ.get("OUT", "build/device")
readers = pr.Readers(pr.load())
sms = torch.cuda.get_device_properties(0).multi_processor_count
rows = {}
for name, ctx in (("ctx32k", 32768), ("ctx128k", 131072)):
    case, sets, nbytes = pr.input_sets(name, ctx)
    variants = {
        "decode (after, default)": lambda s: st._plan("after", case, s, 12)(),
        "torch sum (contiguous)": lambda s: s["cache"].view(-1).sum(dtype=torch.float32),
        f"ldg {4 * sms} blocks": readers.ldg(4 * sms),
        f"ldg {2 * sms} blocks": readers.ldg(2 * sms),
        f"ldg {4 * sms} blocks +tail": readers.ldg(4 * sms, tail=192),
        "ring split 128 (decode path)": readers.ring(128),
        f"ring split {sms}": readers.ring(sms),
        "ring split 128, 4 stages": readers.ring(128, stages=4),
        "ring split 128, 1 copy/tile": readers.ring(128, cpt=1),
        f"ring round-robin {sms}": readers.ring(sms, inter=1),
        "ring split 128 +tail": readers.ring(128, tail=192),
    }
    for s in sets:
        st._plan("after", case, s, 12)
    rows[name] = pr.time_rows(name, sets, nbytes, variants, warmup=10, repeats=60)
    del sets
    torch.cuda.empty_cache()
pr.write(os.path.join(out, "read_probe.json"), rows)
