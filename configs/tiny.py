"""tiny: 4 layers, 4 heads, width 128 (ours, for the CPU demo and tests)."""
size = "tiny"
# 3e-3 trains the demo better than 1e-3 (docs/results.md)
learning_rate = 3e-3
min_lr = 3e-4
