"""Every measurement in one place, sharing common.py (docs/benchmarks.md says what each measures):

    python bench.py --size M                  # step.py: training steps of the variants side by side
    python -m benchmarks.micro                # one connection module alone, H_res construction alone
    python -m benchmarks.compile_time         # compile seconds, cold and warm cache
    python -m benchmarks.kv_cache             # sampling tokens/s with and without the KV cache
    python -m benchmarks.memory               # memory per GPU by size, parallel mode and checkpointing
    python -m benchmarks.checkpoint_cost      # seconds and bytes of a checkpoint save and load
    python -m benchmarks.gpu_check quick      # on a GPU: the CUDA tests, every connection path, a verdict
"""
