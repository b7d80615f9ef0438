"""The transformers configuration of our GPT: the exported GPTConfig settings of model.py as attributes."""

from transformers import PretrainedConfig


class MHCLiteGPTConfig(PretrainedConfig):
    """The exported model settings of GPTConfig (model.py, export_hf.model_settings) as attributes
    under their own names, whatever they are; block_size is also max_position_embeddings, which
    tells lm-evaluation-harness how much context the model takes."""

    model_type = "mhclite_gpt"
    attribute_map = {"hidden_size": "n_embd", "num_hidden_layers": "n_layer", "num_attention_heads": "n_head",
                     "max_position_embeddings": "block_size"}

    def __init__(self, tie_word_embeddings=True, **settings):
        super().__init__(tie_word_embeddings=tie_word_embeddings, **settings)
