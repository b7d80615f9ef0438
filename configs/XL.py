"""XL (ours, past the paper: GPT-2 XL's shape): its shape and learning rates are model.SIZES["XL"]."""
size = "XL"
