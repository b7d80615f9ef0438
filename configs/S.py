"""S: 6 layers, 8 heads, width 512, ~45M parameters (paper Appendix A); lr 1e-3, min lr 1e-4 (config.py)."""
size = "S"
