"""ZeRO-1/2's spliced ranks against each rank's own trace, on fake tensors of this machine's GPU."""
import time

import torch

from zerolens.models.model import PRESETS
from zerolens.predict.peak import predict_peaks, spliced_ranks
from zerolens.strategies import TrainSettings

print(torch.cuda.get_device_name(), torch.__version__)
for name, preset, prec, n, bucket in [("zero2", "gpt-tiny", "bf16", 5, 20000), ("zero1", "case-study", "fp16", 4, 500000),
                                      ("zero2", "gpt-100m", "bf16", 8, 50000000)]:
    s = TrainSettings(precision=prec, world_size=n, micro_batch=2, reduce_bucket_size=bucket)
    t = time.time()
    sp = spliced_ranks(name, PRESETS[preset], s, cuda_capability=torch.cuda.get_device_capability())
    t1 = time.time() - t
    t = time.time()
    own = [predict_peaks(name, PRESETS[preset], s, rank=r, cuda_capability=torch.cuda.get_device_capability())
           for r in range(n)]
    t2 = time.time() - t
    print(name, preset, prec, n, "traced_on", sp[0]["traced_on"], "equal" if sp == own else "DIFFERENT",
          f"splice {t1:.1f}s own {t2:.1f}s")
    for r in range(n):
        if sp[r] != own[r]:
            print(r, {k: (sp[r].get(k), own[r][k]) for k in own[r] if sp[r].get(k) != own[r][k]})
