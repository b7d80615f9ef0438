"""XL: 48 layers, 25 heads, width 1600, ~1.56B parameters (GPT-2 XL's shape; ours, past the paper).
The learning rate (config.py) continues the paper's rule: GPT-3's for its 1.3B model, min lr / 10."""
size = "XL"
