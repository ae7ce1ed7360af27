"""The parts of benchmarks/gpu_check.py: kernels, decode attention, engine, KV transfer.

Each part is a function `(Context, Deadline) -> list[Row]`; none imports Ray, gRPC, FastAPI or
NIXL at module level (the bare GPU machine has none of them), and each runs on the CPU with
tiny shapes (`--device cpu`), reporting what needs CUDA as SKIP.
"""
