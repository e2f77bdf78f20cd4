"""Run one tiny adaptation (used by tests/test_adapt.py, in one process or under torchrun)."""
import argparse
import sys

import torch

from sinkbook.training.adapt import AdaptConfig, adapt

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--modality", default="vision")
args = parser.parse_args()
torch.set_num_threads(1)
cfg = AdaptConfig("tiny-llama", modality=args.modality, steps=3, stage1_steps=2, batch_size=4, lr=1e-3,
                  stage1_lr=1e-2, probe_every=10)
run = adapt(cfg, device="cpu", use_cache=False, progress=False, out=args.out)
print("processes", run.history and len(run.history), file=sys.stderr)
