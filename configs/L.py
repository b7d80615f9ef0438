"""L (paper Appendix A): its shape and learning rates are config.SIZES["L"]."""
size = "L"
