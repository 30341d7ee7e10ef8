# Reference for the startup benchmark: a PyTorch rank that initializes gloo and passes one barrier,
# started with env vars (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) as torchrun would set them.
import resource
import time

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
dist.barrier()
print(f"first_barrier_unix_ns={time.time_ns()}", flush=True)
print(f"peak_rss_kb={resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}", flush=True)
dist.destroy_process_group()
