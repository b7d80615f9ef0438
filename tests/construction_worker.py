"""One rank of tests/test_sharded.py's construction tests (run under torchrun): builds the model
of each GPTConfig given (JSON list) on the meta device, shards it and draws its weights with seed 1
(parallelize.materialise), and prints the peak memory of the first as one JSON line, next to its
shard's and the whole model's bytes. With a folder argument, rank 0 saves each model's whole
weights there (<i>.pt) for the test to compare with one process's."""
import json
import os
import resource
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from model import GPT, GPTConfig  # noqa: E402
from parallelize import materialise, parallelize  # noqa: E402


def resident_bytes():
    with open("/proc/self/statm", encoding="utf-8") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def main():
    dist.init_process_group("gloo")
    for i, settings in enumerate(json.loads(sys.argv[1])):
        before = resident_bytes()
        with torch.device("meta"):
            model = GPT(GPTConfig(**settings))
        parallelize(model, torch.device("cpu"), shard=True)
        materialise(model, torch.device("cpu"), seed=1)
        if i == 0:
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before  # ru_maxrss: KiB on Linux
            params = list(model.parameters())
            line = json.dumps(dict(rank=dist.get_rank(), peak=peak, shard=sum(p.to_local().nbytes for p in params),
                                   whole=sum(p.numel() * p.element_size() for p in params),
                                   largest=max(p.numel() * p.element_size() for p in params)))
            # One write with its newline: unbuffered (PYTHONUNBUFFERED), print writes the newline apart,
            # and the other rank's line can land between the two on the shared pipe.
            sys.stdout.write(line + "\n")
            sys.stdout.flush()
        if len(sys.argv) > 2:
            whole = {name: value.full_tensor() if hasattr(value, "full_tensor") else value  # every rank gathers
                     for name, value in model.state_dict().items()}
            if dist.get_rank() == 0:
                torch.save(whole, os.path.join(sys.argv[2], f"{i}.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
