"""The transformers configuration of our GPT: the GPTConfig settings of model.py as attributes."""

from transformers import PretrainedConfig


class MHCLiteGPTConfig(PretrainedConfig):
    """GPTConfig's settings (model.py) under their own names; block_size is also
    max_position_embeddings, which tells lm-evaluation-harness how much context the model takes."""

    model_type = "mhclite_gpt"
    attribute_map = {"hidden_size": "n_embd", "num_hidden_layers": "n_layer", "num_attention_heads": "n_head",
                     "max_position_embeddings": "block_size"}

    def __init__(self, block_size=1024, vocab_size=50304, n_layer=12, n_head=12, n_embd=768, bias=False,
                 residual="res", n_streams=4, mhclite_perms=None, mhclite_perm_sampling="uniform", perm_seed=0,
                 sinkhorn_iters=20, stream_dtype="float32", final_norm="after_sum", rms_eps=1e-6,
                 sinkhorn_order="cols_then_rows", h_res_dtype="float32", mixing_dtype="float32",
                 tie_word_embeddings=True, **kwargs):
        self.block_size, self.vocab_size = block_size, vocab_size
        self.n_layer, self.n_head, self.n_embd, self.bias = n_layer, n_head, n_embd, bias
        self.residual, self.n_streams = residual, n_streams
        self.mhclite_perms, self.mhclite_perm_sampling, self.perm_seed = mhclite_perms, mhclite_perm_sampling, perm_seed
        self.sinkhorn_iters, self.sinkhorn_order = sinkhorn_iters, sinkhorn_order
        self.stream_dtype, self.final_norm, self.rms_eps = stream_dtype, final_norm, rms_eps
        self.h_res_dtype, self.mixing_dtype = h_res_dtype, mixing_dtype
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)
