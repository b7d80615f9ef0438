"""tiny (ours, for the CPU demo and tests): its shape and learning rates are model.SIZES["tiny"]."""
size = "tiny"
