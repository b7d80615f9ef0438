"""The scripts beside the paper's code; a package so that bench.py and fused/ can import bench_common."""
