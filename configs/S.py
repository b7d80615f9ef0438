"""S (paper Appendix A): its shape and learning rates are config.SIZES["S"]."""
size = "S"
