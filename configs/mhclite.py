"""mHC-lite: H_res as a convex combination of all 4! = 24 permutation matrices, 4 streams."""
residual = "mhclite"
n_streams = 4
