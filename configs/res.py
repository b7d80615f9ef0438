"""Plain residual connection (nanoGPT); one stream."""
residual = "res"
