"""S: 6 layers, 8 heads, width 512, ~45M parameters (paper Appendix A)."""
size = "S"
learning_rate = 1e-3
min_lr = 1e-4
