"""S (paper Appendix A): its shape and learning rates are model.SIZES["S"]."""
size = "S"
