"""Peak-memory breakdown: zero3 vs fsdp2 on TinyGPT (medium), from CUDA memory history."""
import copy, gc, os, sys, collections
from datetime import timedelta
import torch, torch.distributed as dist
from torch.distributed.fsdp import fully_shard
import shardline as sl
from shardline.examples.train import Config, TinyGPT

local = int(os.environ["LOCAL_RANK"]); torch.cuda.set_device(local); dev = torch.device("cuda", local)
group = sl.init(backend="nccl"); rank, world = group.rank, group.world_size
store = dist.TCPStore("127.0.0.1", int(os.environ["TORCH_PORT"]), world, rank == 0, timedelta(seconds=60))
dist.init_process_group("nccl", store=store, rank=rank, world_size=world)
torch.manual_seed(0)
cfg = Config(d_model=1024, num_layers=8, num_heads=16, seq_len=512)
base = TinyGPT(cfg)
b = torch.randint(0, 256, (8, 513), generator=torch.Generator().manual_seed(rank)).to(dev)

def analyse(name, snap):
    # replay alloc/free events to find the peak and what is alive then
    live = {}; cur = 0; peak = 0; peak_live = None
    for ev in snap["device_traces"][local]:
        a = ev["action"]
        if a == "alloc":
            live[ev["addr"]] = ev; cur += ev["size"]
            if cur > peak: peak = cur; peak_live = dict(live)
        elif a in ("free_completed",):
            e = live.pop(ev["addr"], None)
            if e is not None: cur -= e["size"]
    groups = collections.Counter()
    for e in peak_live.values():
        frames = e.get("frames", [])
        key = next((f"{f['filename'].split('/')[-1]}:{f['line']} {f['name']}" for f in frames
                    if any(t in f["filename"] for t in ("shardline/", "fsdp/", "optim/", "memprof"))), None)
        if key is None:
            key = next((f"{f['filename'].split('/')[-1]}:{f['line']} {f['name']}" for f in frames
                        if f["filename"].endswith(".py")), "?")
        groups[key] += e["size"]
    print(f"== {name}: peak (replayed) {peak/2**20:.1f} MiB, max_allocated {torch.cuda.max_memory_allocated()/2**20:.1f}")
    for k, v in groups.most_common(14):
        print(f"   {v/2**20:9.1f} MiB  {k}")

for name in ("zero3", "zero3-u32", "fsdp2"):
    model = copy.deepcopy(base).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if name == "fsdp2":
        for blk in model.blocks: fully_shard(blk)
        fully_shard(model); opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    else:
        model, opt = sl.distribute(model, opt, strategy="zero3", group=group, unit_mb=32 if "u32" in name else 1.0)
    for _ in range(2):
        opt.zero_grad(); model(b[:, :-1], b[:, 1:]).backward(); opt.step()
    torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats()
    torch.cuda.memory._record_memory_history(max_entries=200000)
    for _ in range(2):
        opt.zero_grad(); model(b[:, :-1], b[:, 1:]).backward(); opt.step()
    torch.cuda.synchronize()
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    if rank == 0: analyse(name, snap)
    del model, opt; gc.collect(); torch.cuda.empty_cache()
dist.destroy_process_group(); sl.shutdown()
