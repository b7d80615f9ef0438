"""KromHC: H_res as the Kronecker product of two 2 x 2 doubly stochastic factors, 4 streams."""
residual = "kromhc"
n_streams = 4
