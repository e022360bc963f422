"""Block classes: the features a new block's prior is chosen by.

All features are known when the block is first written (causal):

* ``tail``   - the request's last block (usually partial: the next turn
  extends it, so its key changes and it is almost never read again);
* ``cont``   - the request continues an earlier conversation (its second
  block was seen before / turn > 1 / it has a parent request);
* ``span``   - how many new (never seen) blocks the request adds, log-bucketed
  (0-1, 2-4, 5-16, >16): long pasted documents behave unlike short turns.

feature class = tail * 8 + cont * 4 + span, 16 classes; crossed with the
access stage into 96 prior classes. The stage is the block's access count
so far, exact to 3 and in octaves beyond (1, 2, 3, 4-7, 8-15, 16+): it
carries the evidence of past successes (on the Mooncake trace P(read
again) rises from 0.24 after one read to 0.42 after two and 0.50 after
three), and the octaves tell a block read 20 times from one read 4 times,
the frequency that popularity-skewed workloads reward (a Zipf family:
0.41 -> 0.52 of the LRU-Belady gap when stages stopped saturating at the
4th access). Engines that know segment types or tenants can extend the
features; priors are fitted per class online.
"""

from __future__ import annotations

import numpy as np

N_FEATURE_CLASSES = 16
N_STAGES = 6
N_CLASSES = N_FEATURE_CLASSES * N_STAGES
MAX_COUNT = 255  # access counts saturate here (one uint8 a block)
# stage of an access count (index 0: no access yet, stage 0 like the first access)
STAGE_OF_COUNT: list[int] = [0, 0, 1, 2] + [3] * 4 + [4] * 8 + [5] * (MAX_COUNT + 1 - 16)
STAGE_OF_COUNT_ARRAY = np.asarray(STAGE_OF_COUNT, dtype=np.int64)


def span_bucket(new_blocks: int) -> int:
    return 0 if new_blocks <= 1 else 1 if new_blocks <= 4 else 2 if new_blocks <= 16 else 3


def block_class(tail: bool, cont: bool, new_blocks: int) -> int:
    return int(tail) * 8 + int(cont) * 4 + span_bucket(new_blocks)
