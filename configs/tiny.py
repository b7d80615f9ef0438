"""tiny: 4 layers, 4 heads, width 128 (ours, for the CPU demo and tests); lr 3e-3, min lr 3e-4 (config.py)."""
size = "tiny"
