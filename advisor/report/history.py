"""Tuning history out of an Optuna storage, as plain rows for the HTML report.

Reads every study in the storage whose name ends in `-len<L>` (how `advisor tune` names
a bucket's study) and returns one dict per finished trial:
{"bucket": L, "number", "state", "value", "failure", "params", "repeat_of", "applied"}:
`params` are the trial's Optuna parameters ({"<family>": bool, "<family>.config": str,
"cuda_graph": bool}, advisor/search/space.py); `repeat_of` the trial whose plan (and value)
this one repeated, or None; `applied` the number of fusion sites the plan applied (None
when not recorded, e.g. a failed trial).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

_BUCKET = re.compile(r"-len(\d+)$")


def load_history(storage: str) -> list[dict[str, Any]]:
    """`storage`: an Optuna RDB URL or a tune journal file path."""
    import optuna
    from optuna.trial import TrialState

    from advisor.errors import AdvisorError
    from advisor.search.study import TuneOptions, is_rdb_url, open_storage

    if not is_rdb_url(storage) and not Path(storage).is_file():  # opening one creates it
        raise AdvisorError(f"--journal {storage}: no such tune journal (advisor tune writes <out>.journal)")
    store, _ = open_storage(TuneOptions(model="", shapes=(1,), out=Path(storage), dtype=None,
                                        storage=storage))
    rows = []
    for summary in optuna.get_all_study_summaries(store):
        match = _BUCKET.search(summary.study_name)
        if match is None:
            continue
        study = optuna.load_study(study_name=summary.study_name, storage=store)
        for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.FAIL)):
            rows.append({"bucket": int(match.group(1)), "number": t.number, "state": t.state.name,
                         "value": t.value, "failure": t.user_attrs.get("failure"),
                         "params": dict(t.params), "repeat_of": t.user_attrs.get("repeat_of"),
                         "applied": t.user_attrs.get("applied")})
    return sorted(rows, key=lambda r: (r["bucket"], r["number"]))
