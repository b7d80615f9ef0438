"""L: 24 layers, 16 heads, width 1024, ~354M parameters (paper Appendix A); lr 3e-4, min lr 3e-5 (config.py)."""
size = "L"
