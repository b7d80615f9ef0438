"""CPU demo on the built-in Shakespeare corpus, characters (prepare with:
python prepare_shakespeare.py --tokenizer char). Pair it with configs/tiny.py."""
dataset = "shakespeare_char"
device = "cpu"
dtype = "float32"
compile = False
block_size = 128
batch_size = 16
gradient_accumulation_steps = 1
max_iters = 500
warmup_iters = 50
eval_interval = 100
eval_iters = 20
log_interval = 10
