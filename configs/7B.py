"""7B: 32 layers, 32 heads, width 4096, ~6.7B parameters (GPT-3 6.7B's shape; ours, past the paper).
Its weights, gradients and AdamW state (16 bytes a parameter) do not fit one 80 GB GPU: train it with
--parallel=fsdp. The learning rate (config.py) is GPT-3's for this shape, min lr / 10."""
size = "7B"
