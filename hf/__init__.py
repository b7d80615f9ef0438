"""Hugging Face transformers code for our GPT, copied by export_hf.py into every export folder
beside residuals.py (trust_remote_code): the configuration and the causal-LM model of all four
residual variants. The files import each other relatively, so they run from an export folder."""
