"""Bounds on everything the config takes from outside, each with the reason for its value.

NVIDIA's plugin bounds none of these: a config it accepts can still fail later at the kubelet
(a ListAndWatch answer over the kubelet's 4 MiB receive limit) or eat the node's memory. gpuvisor
refuses such input up front with a clear error (docs/compatibility.md). Each bound is
far above any real node's needs, so no working NVIDIA config is refused by it.
"""

from __future__ import annotations

from typing import Final

# The config file. A Kubernetes ConfigMap holds at most 1 MiB, so no deployed file is larger.
MAX_CONFIG_BYTES: Final = 1 << 20
# Values in the file once YAML aliases are expanded (a "billion laughs" file stops here), and
# nesting depth. A config with 1,000 sharing entries has about 6,000 values.
MAX_CONFIG_NODES: Final = 100_000
MAX_CONFIG_DEPTH: Final = 64
# Any one list in the file (sharing entries, device references, resource patterns, ...). A node
# has at most a few dozen GPUs and 7 MIG devices per GPU.
MAX_LIST_ITEMS: Final = 1024
# Any string from a flag, env var or the file (paths included: Linux's PATH_MAX is 4096).
MAX_STRING_LENGTH: Final = 4096
# A resource pattern (`resources.gpus[].pattern`): product names and MIG profiles are short.
MAX_PATTERN_LENGTH: Final = 256
# Replicas of one device: 65,536 replicas of even one GPU already fill the kubelet's 4 MiB
# ListAndWatch message (each device entry takes at least 64 bytes), so no larger count can work.
MAX_REPLICAS: Final = 65_536
# gpuvisor's own numbers: seconds settings and the retry count.
MAX_SECONDS: Final = 365 * 24 * 3600.0
MAX_START_RETRIES: Final = 1000
