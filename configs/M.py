"""M (paper Appendix A): its shape and learning rates are model.SIZES["M"]."""
size = "M"
