"""OpenWebText (prepare with: python prepare_openwebtext.py); evaluation as in the authors' code."""
dataset = "openwebtext"
eval_interval = 500
eval_iters = 200
