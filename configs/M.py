"""M: 12 layers, 12 heads, width 768, ~124M parameters (paper Appendix A); lr 6e-4, min lr 6e-5 (config.py)."""
size = "M"
