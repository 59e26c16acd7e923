"""The pieces behind `k3lab.profile`, one module per job:

categories     kernel/op name -> category
frame          the kernel frame (one row per execution), kernel_table, counts
torch_trace    torch.profiler (Kineto) Chrome traces: CUDA, ROCm, CPU
rocprofv3      rocprofv3 CSV / JSON / stats files
rocpd          rocpd SQLite databases
legacy         legacy rocprof v1 files
ncu            Nsight Compute command and CSV parser
read           format detection and read_trace
capture        torch.profiler capture, Capture, trace writing
rocprofv3_run  rocprofv3 on a child process
diff           two kernel frames compared: kernels gone, new, changed; time per category; launches
selfcheck      `python -m k3lab.profile`: capture a known workload and check the table
export         HTA per-rank folders with ProfilerStep marks, named ranges (record_function + NVTX/ROCTX)
tools          `k3lab profile --tool torch|ncu|nsys|rocprofv3`: refusals, ncu/nsys readers, child runs
child          `python -m k3lab.profiling.child`: one variant's steps in a child process, marked
roofline       roofline points (bytes, flops, time) from records and the device's ceilings
isa_roofline   what MI355X would need per roofline point, from the gfx950 ISA report (projected)
trend          records over git history and the deterministic-figure regression check

Import the public API from `k3lab.profile`.
"""
