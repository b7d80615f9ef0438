"""7B (ours, past the paper: GPT-3 6.7B's shape): its shape and learning rates are model.SIZES["7B"].
Its weights, gradients and AdamW state (16 bytes a parameter) do not fit one 80 GB GPU: train it with
--parallel=fsdp."""
size = "7B"
