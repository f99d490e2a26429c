"""Session fixtures: real servers started on free loopback ports (see tests/fixtures/)."""

import os

import torch

# Two cores on CI: oversubscribed BLAS threads turn a 5 ms forward into 400 ms.
torch.set_num_threads(1)
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

pytest_plugins = [
    "tests.fixtures.nats",
    "tests.fixtures.mooncake",
    "tests.fixtures.pipeline",
    "tests.fixtures.live",
    "tests.fixtures.otlp",
    "tests.fixtures.sglang",
    "tests.fixtures.vllm",
]
