"""Block classes: the features a new block's prior is chosen by.

All features are known when the block is first written (causal):

* ``tail``   - the request's last block (usually partial: the next turn
  extends it, so its key changes and it is almost never read again);
* ``cont``   - the request continues an earlier conversation (its second
  block was seen before / turn > 1 / it has a parent request);
* ``span``   - how many new (never seen) blocks the request adds, log-bucketed
  (0-1, 2-4, 5-16, >16): long pasted documents behave unlike short turns.

feature class = tail * 8 + cont * 4 + span, 16 classes; crossed with the
access stage (1st, 2nd, 3rd, 4th+ access) into 64 prior classes. The stage
carries the evidence of past successes: blocks read twice behave unlike
blocks read once (measured on the Mooncake trace: P(read again) rises from
0.24 after one read to 0.42 after two and 0.50 after three). Engines that
know segment types or tenants can extend the features; priors are fitted per
class online.
"""

from __future__ import annotations

N_FEATURE_CLASSES = 16
N_STAGES = 4
N_CLASSES = N_FEATURE_CLASSES * N_STAGES


def span_bucket(new_blocks: int) -> int:
    return 0 if new_blocks <= 1 else 1 if new_blocks <= 4 else 2 if new_blocks <= 16 else 3


def block_class(tail: bool, cont: bool, new_blocks: int) -> int:
    return int(tail) * 8 + int(cont) * 4 + span_bucket(new_blocks)
