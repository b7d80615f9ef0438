"""The paper as it was run: the authors' training code (FFTYYY/mhc-lite at ea19775), function for
function, where it differs from the paper as written. Compose after a residual config:
    python train.py configs/owt.py configs/M.py configs/mhclite.py configs/authors.py
authors.py implements them; docs/faithfulness.md lists where each is in their code and its effect."""
final_norm = "per_stream"  # their ln_f runs on every stream before the sum
rms_eps = 0.0  # their RMSNorm is F.normalize(x) * sqrt(D): no epsilon
sinkhorn_order = "rows_then_cols"  # mhc: their Sinkhorn runs on the transposed matrix
init_stream = "drawn"  # their randrange; here seeded with the run's seed
connection_weight_decay = "authors"  # every >= 2-D parameter in their layout
h_res_dtype = "autocast"  # mhclite: their permutation einsum runs in bf16 under autocast
mixing_dtype = "autocast"  # their projection, dynamic coefficients and mixing einsum round to bf16 under autocast
