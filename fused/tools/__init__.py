"""What exists only for developing the fused kernels, each with its command:

    python -m fused.tools.count_bytes --json fused/tools/kernel_bytes.json   # bytes per token, in the interpreter
    python -m fused.tools.resources                                          # registers, spills, shared memory
    python -m fused.tools.latency                                            # predicted sm_90 times

launches.py records the kernels' launches (the resource check compiles them, python -m
benchmarks.kernels replays them), interpreter.py runs the kernels on CPU in Triton's interpreter, and
tables.py writes Markdown. Nothing here imports benchmarks/, which times the kernels and imports this.
"""
