"""L (paper Appendix A): its shape and learning rates are model.SIZES["L"]."""
size = "L"
