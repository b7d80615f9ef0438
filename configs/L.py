"""L: 24 layers, 16 heads, width 1024, ~354M parameters (paper Appendix A)."""
size = "L"
learning_rate = 3e-4
min_lr = 3e-5
