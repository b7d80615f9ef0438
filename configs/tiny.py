"""tiny (ours, for the CPU demo and tests): its shape and learning rates are config.SIZES["tiny"]."""
size = "tiny"
