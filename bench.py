"""Side-by-side training-step benchmark of res, hc, mhc and mhclite, as in nanoGPT: python bench.py --help.

    python bench.py --size tiny --device cpu
    python bench.py --size M        # on a GPU: cuda, bf16, compiled, 16 x 1024, with and without recompute

The code is benchmarks/step.py, beside the other benchmarks and the GPU check (docs/benchmarks.md).
"""

from benchmarks.step import main

if __name__ == "__main__":
    main()
