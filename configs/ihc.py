"""iHC, the identity-H_res ablation of mHC: H_res = I, h_pre and h_post learned as in mHC, 4 streams."""
residual = "ihc"
n_streams = 4
