"""tiny: 4 layers, 4 heads, width 128 (ours, for the CPU demo and tests)."""
size = "tiny"
learning_rate = 1e-3
min_lr = 1e-4
