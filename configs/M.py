"""M: 12 layers, 12 heads, width 768, ~124M parameters (paper Appendix A)."""
size = "M"
learning_rate = 6e-4
min_lr = 6e-5
