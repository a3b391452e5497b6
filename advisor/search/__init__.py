"""Plan search: Optuna per shape bucket; each plan built, verified and timed in a worker.

`space` (parameters of a plan), `objective` (build → verify → time, failure reasons),
`worker` (isolated processes), `study` (storage, resume, the loop, the recipe). Example::

    from pathlib import Path
    import torch
    from advisor.search import TuneOptions, tune

    result = tune(TuneOptions("examples/tiny_llama.py", (128, 512), Path("recipe.json"),
                              torch.float32, trials=10))
    print(result.recipe.buckets[0].measured)
"""

from advisor.search.objective import FAILURES, TrialFailed
from advisor.search.study import BucketResult, TrialEvent, TuneOptions, TuneResult, tune

__all__ = ["FAILURES", "BucketResult", "TrialEvent", "TrialFailed", "TuneOptions", "TuneResult",
           "tune"]
