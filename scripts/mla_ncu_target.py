"""ncu target (issue 5): a few one-token decodes of the CUDA MLA decode's wgmma form at CTX positions
(default 32768), from the default build or from a diagnostic build at WG_SO (scripts/build_mla_variants.sh,
e.g. .cache/variants/co.so: one tile loaded, every tile's arithmetic run on it), so that ncu can profile
one kernel on its own (scripts/device_env.sh first):
    ncu -k regex:merge_kernel -c 1 --set full python3 scripts/mla_ncu_target.py
    WG_SO=.cache/variants/co.so CTX=131072 ncu -k regex:wg_kernel -c 1 --section SpeedOfLight python3 scripts/mla_ncu_target.py
Q_LEN=2 or 4: a verification group instead, each token a one-token request (mla_decode_cuda.plan_verify):
    Q_LEN=4 ncu -k regex:wg_kernel -c 1 --metrics dram__bytes_read.sum,lts__t_bytes.sum python3 scripts/mla_ncu_target.py
"""
import ctypes
import os

import torch

from k3lab.ops import mla_decode as mla
from k3lab.ops import mla_decode_cuda as mc

if os.environ.get("WG_SO"):  # a diagnostic build, bound as scripts/device_mla_wgmma.py binds its variants
    lib = ctypes.CDLL(os.environ["WG_SO"])
    bound = mc.bind(lib)
    mc._library = lambda: bound
torch.manual_seed(0)
L = int(os.environ.get("CTX", "32768"))
T = int(os.environ.get("Q_LEN", "1"))
q = torch.randn(1, T, 12, 576, device="cuda").to(torch.bfloat16)
cache = torch.randn(1, L, 576, device="cuda").to(torch.bfloat16)
pool, table = mla.to_paged(cache, 64, seed=3)
lens = torch.tensor([L], dtype=torch.int32, device="cuda")
if T == 1:
    plan = mc.plan(q, pool, lens, block_table=table, form="wgmma")
else:
    plan = mc.plan_verify(q, pool, lens, block_table=table, form="wgmma")
for _ in range(3):
    plan()
torch.cuda.synchronize()
print("splits", plan.num_splits, "form", plan.form, "build", os.environ.get("WG_SO", "default"))
