"""mHC: H_res by 20 Sinkhorn-Knopp iterations, 4 streams."""
residual = "mhc"
n_streams = 4
sinkhorn_iters = 20
