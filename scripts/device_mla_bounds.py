"""Issue 5, one device call: what bounds the before policy at 1K and the decode at 32K, measured beside
the decode, the before and the einsum peer the way the mla_padding study times them (its inputs and
rotation, graph replay, many calls per graph).

The before policy (one block walks a request's whole history; ours runs one block per query row) can be
no faster than one SM streaming that history: `each` readers (scripts/mla_read_probe.cu, via
scripts/mla_probe_readers.py) have every block read the whole history by itself, through the block
table into a ring of bulk copies (the decode's data path) or with 16-byte loads over the contiguous
cache. At 32K the split decode can be no faster than the grid streaming the cache and a second kernel
behind it (`ring split 128 +tail`). Prints a table and writes $OUT/bounds.json.
    OUT=dir PYTHONPATH=. python3 scripts/device_mla_bounds.py
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import mla_probe_readers as pr  # noqa: E402 - a sibling script module

from k3lab.ops import mla_before_cuda as mb  # noqa: E402
from k3lab.studies import mla_padding as st  # noqa: E402

out = os.environ.get("OUT", "build/device")
readers = pr.Readers(pr.load())
rows = {}
for name, ctx in (("ctx1k", 1024), ("ctx32k", 32768)):
    case, sets, nbytes = pr.input_sets(name, ctx)
    variants = {
        "after (default)": lambda s: st._plan("after", case, s, 12)(),
        "before (default)": lambda s: st._plan("before", case, s, 12)(),
        "before, direct loads": lambda s: s["before_direct"](),  # planned below: a plan syncs with the host
        "einsum (PyTorch)": lambda s: st._plan("einsum", case, s, 12)(),
        "each: ring, 1 block": readers.ring(1, inter=2),
        "each: ring, 1 block, 1 copy/tile": readers.ring(1, inter=2, cpt=1),
        "each: ring, 12 blocks": readers.ring(12, inter=2),
        "each: ldg, 1 block": readers.ldg_each(1),
        "each: ldg, 12 blocks": readers.ldg_each(12),
        "ring split 128 +tail": readers.ring(128, tail=192),
    }
    for s in sets:
        st._plan("after", case, s, 12)
        assert st._plan("before", case, s, 12).rows_via == "ring"
        s["before_direct"] = mb.plan(s["q"], s["pool"], s["lengths"], block_table=s["table"], ring=False)
    rows[name] = pr.time_rows(name, sets, nbytes, variants, width=34, warmup=5, repeats=40)
    del sets
    torch.cuda.empty_cache()
pr.write(os.path.join(out, "bounds.json"), rows, sms=torch.cuda.get_device_properties(0).multi_processor_count)
