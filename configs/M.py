"""M (paper Appendix A): its shape and learning rates are config.SIZES["M"]."""
size = "M"
