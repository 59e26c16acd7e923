"""ncu target (issue 5): a few 32K one-token decodes of the CUDA MLA decode's wgmma form, so that
`ncu -k regex:merge_kernel` can profile the merge kernel on its own (scripts/device_env.sh first).
    ncu -k regex:merge_kernel -c 1 --set full python3 scripts/mla_merge_ncu_target.py
"""
import torch

from k3lab.ops import mla_decode as mla
from k3lab.ops import mla_decode_cuda as mc

torch.manual_seed(0)
L = 32768
q = torch.randn(1, 1, 12, 576, device="cuda").to(torch.bfloat16)
cache = torch.randn(1, L, 576, device="cuda").to(torch.bfloat16)
pool, table = mla.to_paged(cache, 64, seed=3)
lens = torch.tensor([L], dtype=torch.int32, device="cuda")
plan = mc.plan(q, pool, lens, block_table=table, form="wgmma")
for _ in range(3):
    plan()
torch.cuda.synchronize()
print("splits", plan.num_splits, "form", plan.form)
