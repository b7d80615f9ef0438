"""FineWeb-Edu sample-10BT (prepare with: python prepare_fineweb_edu.py); evaluation as in the authors' code."""
dataset = "fineweb_edu"
eval_interval = 500
eval_iters = 200
